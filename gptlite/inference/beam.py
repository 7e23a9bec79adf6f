"""Beam search on the KV cache: the deterministic decoder of the most likely continuations, step for step the
algorithm of Hugging Face's `generate(num_beams=N, do_sample=False)`, so the same model gives the same tokens.

Each prompt keeps `num_beams` running beams, which are rows of one KV cache. At every step:
1. Every beam's next-token log-probabilities are added to its score (the sum of its tokens' log-probabilities);
   the best K = max(2, 1 + number of stop tokens) x num_beams (beam, token) candidates of each prompt are kept,
   so that num_beams of them always continue.
2. Candidates that end (a stop token, or max_new_tokens reached) among the first num_beams become finished
   hypotheses with score = sum of log-probabilities / generated length ** length_penalty (the length counts the
   new tokens, the stop token included, as transformers does); each prompt keeps its num_beams best.
3. The best num_beams candidates that did not end are the next running beams: the cache rows are reordered to
   follow their parents (an in-place index_select of every layer's keys and values, never a recompute).
A prompt is done when it holds num_beams finished hypotheses and (early_stopping=False, transformers'
default heuristic) its best running beam, at its current length, cannot beat the worst of them, or
(early_stopping=True) at once, or (early_stopping="never") when no length could. The first step expands the
first beam only (the others start at -1e9), as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gptlite.inference.kvcache import start_decoding
from gptlite.inference.sampling import mask_vocab

if TYPE_CHECKING:
    from gptlite.inference.kvcache import KVCache
    from gptlite.inference.sampling import GenerationOptions
    from gptlite.model.network import Transformer

NEG = -1.0e9  # the score of a slot or candidate that must not be chosen (transformers uses the same value)


@torch.no_grad()
def beam_search(
    model: Transformer,
    rows: list[list[int]],
    max_new_tokens: int,
    options: GenerationOptions,
) -> list[list[int]]:
    """The num_return_sequences best continuations (new tokens only, best first, the stop token kept) of each of
    the checked prompt `rows`, consecutively: len(rows) * num_return_sequences lists, by beam search with the checked
    `options` (num_beams beams; length_penalty, early_stopping, stop_tokens, extend_context, compile). Ids from
    `vocab_limit` on never continue a beam."""
    B = len(rows)
    N = options.num_beams
    length_penalty = options.length_penalty
    early_stopping = options.early_stopping
    model, step, cache, logits = start(model, rows, max_new_tokens, N, options.extend_context, options.compile)
    device = cache.visible.device
    stops = torch.tensor(sorted(set(options.stop_tokens)), dtype=torch.long, device=device)
    K = max(2, 1 + len(stops)) * N
    first_n = torch.arange(K, device=device) < N  # (K,) the candidates that may finish
    running = torch.zeros(B, N, device=device)  # the running beams' scores
    running[:, 1:] = NEG
    tokens = torch.zeros(B, N, 0, dtype=torch.long, device=device)  # (B, N, step) their new tokens
    finished = Finished(B, N, max_new_tokens, device)
    try:
        for i in range(max_new_tokens):
            logits = mask_vocab(logits.float(), options.vocab_limit)
            V = logits.size(-1)
            scores = (F.log_softmax(logits, dim=-1).view(B, N, V) + running[..., None]).view(B, N * V)
            top, index = scores.topk(K)  # (B, K), best first
            parent, token = index // V, index % V
            candidates = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, i)), token[..., None]], dim=2)
            ends = torch.isin(token, stops) | (i + 1 == max_new_tokens)  # (B, K)
            finished.add(top / (i + 1) ** length_penalty, candidates, ends & first_n, early_stopping)

            # the running beams: the best num_beams candidates that did not end
            alive = top + ends.float() * NEG
            best = alive.topk(N).indices  # (B, N)
            running = alive.gather(1, best)
            tokens = candidates.gather(1, best[..., None].expand(-1, -1, i + 1))
            parents = parent.gather(1, best)  # (B, N)

            # can the best running beam still beat the worst finished hypothesis? (transformers' heuristic)
            length = max_new_tokens if early_stopping == "never" and length_penalty > 0 else i + 1
            finished.update_improvable(running[:, 0] / length**length_penalty)
            if not finished.improvable.any() or bool(ends.all()) or (early_stopping is True and finished.full.all()):
                break
            cache.reorder((parents + torch.arange(B, device=device)[:, None] * N).flatten())  # (B*N,) rows' parents
            cache.prepare(1, full_span=options.compile)
            logits = step(model, tokens[:, :, -1].reshape(-1, 1).contiguous(), cache)  # (B*N, V)
    finally:
        cache.busy = False
    n = options.num_return_sequences
    out = finished.tokens[:, :n].reshape(B * n, -1).tolist()
    return [[t for t in row if t >= 0] for row in out]


def start(
    model: Transformer, rows: list[list[int]], max_new_tokens: int, num_beams: int, extend_context: bool, compile: bool
) -> tuple[Transformer, Callable, KVCache, torch.Tensor]:
    """Check the lengths, prefill the prompts once and give every beam a copy of its prompt's cache rows: (the model
    as decoding runs it, the decode step, the cache, the first logits (B * num_beams, V))."""
    config = model.config
    max_len = max(len(r) for r in rows) + max_new_tokens - 1  # the last token is never fed back
    if max_len > config.block_size and not extend_context:
        raise ValueError(
            f"beam search keeps every beam's whole context: the longest prompt plus max_new_tokens - 1 = {max_len} "
            f"is more than block_size={config.block_size}; shorten them"
            + (" or pass extend_context=True" if model.pos_emb.can_extend else "")
        )
    if extend_context:
        if not model.pos_emb.can_extend:
            raise ValueError(
                f"extend_context=True needs pos_emb='sinusoidal' or 'rope'; this model's {config.pos_emb} "
                f"positions stop at block_size={config.block_size}"
            )
        model.pos_emb.extend(max_len)
    return start_decoding(model, rows, num_beams, max_len, compile)


class Finished:
    """Each prompt's finished hypotheses: the num_beams best scores (B, N), best first, their new tokens
    (B, N, max_new_tokens) with -1 past their end, which slots hold one (B, N), and whether the set may still change
    (B,)."""

    def __init__(self, B: int, N: int, max_new_tokens: int, device: torch.device):
        self.scores = torch.full((B, N), NEG, device=device)
        self.tokens = torch.full((B, N, max_new_tokens), -1, dtype=torch.long, device=device)
        self.is_done = torch.zeros(B, N, dtype=torch.bool, device=device)
        self.improvable = torch.ones(B, dtype=torch.bool, device=device)

    @property
    def full(self) -> torch.Tensor:
        """(B,) whether a prompt holds num_beams hypotheses."""
        return self.is_done.all(1)

    def add(self, scores: torch.Tensor, candidates: torch.Tensor, may_end: torch.Tensor, early_stopping) -> None:
        """Candidates (B, K, step) with their length-penalised scores (B, K) join where `may_end` (B, K) says they
        ended among the first num_beams, unless the prompt can no longer improve (or is full, early_stopping=True)."""
        N, L = self.scores.size(1), self.tokens.size(2)
        closed = self.full & (early_stopping is True)
        new = torch.where(may_end & (self.improvable & ~closed)[:, None], scores, NEG)  # (B, K)
        padded = F.pad(candidates, (0, L - candidates.size(2)), value=-1)  # (B, K, L)
        keep = torch.cat([self.scores, new], dim=1).topk(N).indices  # (B, N)
        self.scores = torch.cat([self.scores, new], dim=1).gather(1, keep)
        self.tokens = torch.cat([self.tokens, padded], dim=1).gather(1, keep[..., None].expand(-1, -1, L))
        self.is_done = torch.cat([self.is_done, new > NEG], dim=1).gather(1, keep)

    def update_improvable(self, best_running: torch.Tensor) -> None:
        """A prompt stays improvable while its best running beam's score (B,), at the length that counts, beats the
        worst finished hypothesis (or a slot is still empty)."""
        worst = torch.where(self.is_done, self.scores.min(1, keepdim=True).values, NEG)  # (B, N)
        self.improvable &= (best_running[:, None] > worst).any(1)
