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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gptlite.generate import _prefill, _static_cache, compiled_decode_step, decode_step, packed_for_cpu

if TYPE_CHECKING:
    from gptlite.model import GPT

NEG = -1.0e9  # the score of a slot or candidate that must not be chosen (transformers uses the same value)


@torch.no_grad()
def beam_search(
    model: GPT,
    rows: list[list[int]],
    max_new_tokens: int,
    num_beams: int,
    *,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    stop_tokens: list[int] = (),
    num_return_sequences: int = 1,
    extend_context: bool = False,
    compile: bool = False,
) -> list[list[int]]:
    """The num_return_sequences best continuations (new tokens only, best first, the stop token kept) of each of
    the checked prompt `rows`, consecutively: len(rows) * num_return_sequences lists."""
    config, B, N = model.config, len(rows), num_beams
    stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long)
    K = max(2, 1 + len(stops)) * N
    max_len = max(len(r) for r in rows) + max_new_tokens - 1  # the last token is never fed back
    if max_len > config.block_size and not extend_context:
        raise ValueError(
            f"beam search keeps every beam's whole context: the longest prompt plus max_new_tokens - 1 = {max_len} "
            f"is more than block_size={config.block_size}; shorten them"
            + (" or pass extend_context=True" if model.pos_emb.can_extend else ""))
    if extend_context:
        if not model.pos_emb.can_extend:
            raise ValueError(f"extend_context=True needs pos_emb='sinusoidal' or 'rope'; this model's {config.pos_emb} "
                             f"positions stop at block_size={config.block_size}")
        model.pos_emb.extend(max_len)
    step = compiled_decode_step(model) if compile else decode_step
    if not compile:
        model = packed_for_cpu(model, B * N)

    cache = model.new_cache(B, max_len)
    device = cache.visible.device
    logits = _prefill(model, cache, rows).repeat_interleave(N, dim=0)  # (B*N, V)
    cache.repeat_rows(N)
    if compile:
        cache = _static_cache(model, cache)
    stops = stops.to(device)
    first_n = torch.arange(K, device=device) < N  # (K,) the candidates that may finish
    running = torch.zeros(B, N, device=device)  # the running beams' scores
    running[:, 1:] = NEG
    tokens = torch.zeros(B, N, 0, dtype=torch.long, device=device)  # (B, N, step) their new tokens
    done_scores = torch.full((B, N), NEG, device=device)  # the finished hypotheses, best first
    done_tokens = torch.full((B, N, max_new_tokens), -1, dtype=torch.long, device=device)  # -1 past their end
    is_done = torch.zeros(B, N, dtype=torch.bool, device=device)  # which slots hold a hypothesis
    improvable = torch.ones(B, dtype=torch.bool, device=device)  # may a prompt's finished set still change
    try:
        for i in range(max_new_tokens):
            V = logits.size(-1)
            scores = (F.log_softmax(logits.float(), dim=-1).view(B, N, V) + running[..., None]).view(B, N * V)
            top, index = scores.topk(K)  # (B, K), best first
            parent, token = index // V, index % V
            candidates = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, i)), token[..., None]], dim=2)
            ends = torch.isin(token, stops) | (i + 1 == max_new_tokens)  # (B, K)

            # finished hypotheses: the first num_beams candidates that end, while the prompt can still improve
            full = is_done.all(1) & (early_stopping is True)
            new = torch.where(ends & first_n & (improvable & ~full)[:, None], top / (i + 1) ** length_penalty, NEG)
            padded = F.pad(candidates, (0, max_new_tokens - i - 1), value=-1)  # (B, K, max_new_tokens)
            keep = torch.cat([done_scores, new], dim=1).topk(N).indices  # (B, N)
            done_scores = torch.cat([done_scores, new], dim=1).gather(1, keep)
            done_tokens = torch.cat([done_tokens, padded], dim=1).gather(1, keep[..., None].expand(-1, -1, max_new_tokens))
            is_done = torch.cat([is_done, new > NEG], dim=1).gather(1, keep)

            # the running beams: the best num_beams candidates that did not end
            alive = top + ends.float() * NEG
            best = alive.topk(N).indices  # (B, N)
            running, tokens = alive.gather(1, best), candidates.gather(1, best[..., None].expand(-1, -1, i + 1))
            parents = parent.gather(1, best)  # (B, N)

            # can the best running beam still beat the worst finished hypothesis? (transformers' heuristic)
            length = max_new_tokens if early_stopping == "never" and length_penalty > 0 else i + 1
            worst = torch.where(is_done, done_scores.min(1, keepdim=True).values, NEG)  # (B, N)
            improvable &= (running[:, :1] / length**length_penalty > worst).any(1)
            if not improvable.any() or bool(ends.all()) or (early_stopping is True and bool(is_done.all())):
                break
            rows_of_parents = (parents + torch.arange(B, device=device)[:, None] * N).flatten()  # (B*N,)
            cache.reorder(rows_of_parents)
            cache.prepare(1, full_span=compile)
            logits = step(model, tokens[:, :, -1].reshape(-1, 1).contiguous(), cache)  # (B*N, V)
    finally:
        cache.busy = False
    out = done_tokens[:, :num_return_sequences].reshape(B * num_return_sequences, -1).tolist()
    return [[t for t in row if t >= 0] for row in out]
