"""Scoring a span of each of many token sequences: its summed cross-entropy, and whether the model predicts every
token of it greedily. CORE's options and continuations (gptlite.evaluate.core) and lm-eval's log-likelihood requests
(gptlite.evaluate.lm_harness) are such spans.

Three things make it fast, none of which changes a figure:
- Sequences that share their first tokens (an item's options after its few-shot examples and question) go through
  the model as one packed sequence: the shared tokens once, then each sequence's own tokens, which attend to the
  shared ones and to their own (a tree-shaped causal mask; each token keeps its position in its own sequence). A
  multiple-choice item of k options costs about one prompt, not k.
- Packed sequences of many items go through the model together, longest first, right-padded to a token budget;
  padding attends only to padding and the shared tokens, and nothing attends to it or scores it.
- Only the positions that predict a span's token go through the output head.
The forward runs without a KV cache: a `TreeMask` hands the model each token's position and the mask, as a cache
(gptlite.inference.kvcache.AttentionCache) would. A model with layers that keep a state (a convolution's: GPTConfig's
layer_types) reads a sequence in order, which a tree of branches is not: its rows go through the model unpacked, each
alone, and still many per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlite.model.network import Transformer

BATCH_TOKENS = 8192  # padded tokens per forward: packed sequences x the longest
HEAD_CHUNK = 4096  # scored positions per output-head call: their float32 logits are HEAD_CHUNK x vocab


@dataclass
class Row:
    """One sequence to score, of at most block_size + 1 tokens (its last token is never input), and its span
    tokens[start:end], each token predicted from those before it (start >= 1)."""

    tokens: list[int]
    start: int
    end: int


class TreeMask:
    """What the model reads from a cache (gptlite.inference.kvcache.AttentionCache), for a forward without one: each
    token's position and the mask of what it attends to; each layer's keys and values are attended over as computed."""

    def __init__(self, pos: torch.Tensor, mask: torch.Tensor, prev: torch.Tensor):
        self.pos = pos  # (B, L)
        self.mask = mask  # (B, 1, L, L)
        self.prev = prev  # (B, L) each token's previous one in its own row, -1 for the first

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def previous_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return self.prev


@dataclass
class Packed:
    """Rows that share their first tokens, as one sequence: those tokens once, then each distinct row's own tokens but
    its last. `branch` says whose each token is (-1: shared); `index[r][p]` is where row r's position p went; `prev`
    is each token's previous one in its own row (-1 for the first), what a bigram embedding pairs it with."""

    tokens: list[int]
    pos: list[int]
    branch: list[int]
    index: list[list[int]]
    prev: list[int]


def pack(rows: list[Row]) -> Packed:
    """The rows as one packed sequence (see Packed)."""
    n = min(len(r.tokens) for r in rows)
    shared = next((k for k in range(n) if any(r.tokens[k] != rows[0].tokens[k] for r in rows)), n)
    shared = min(shared, max(len(r.tokens) for r in rows) - 1)  # a row's last token is never input
    tokens = rows[0].tokens[:shared]
    pos = list(range(shared))
    branch = [-1] * shared
    prev = [tokens[p - 1] if p else -1 for p in range(shared)]
    index = []
    seen = {}  # a row's tokens -> its index; equal rows are computed once, and so tie exactly
    for b, row in enumerate(rows):
        if tuple(row.tokens) not in seen:
            own = row.tokens[shared:-1]
            start = list(range(min(shared, len(row.tokens) - 1)))
            seen[tuple(row.tokens)] = start + list(range(len(tokens), len(tokens) + len(own)))
            tokens += own
            pos += range(shared, shared + len(own))
            branch += [b] * len(own)
            prev += [row.tokens[p - 1] if p else -1 for p in range(shared, shared + len(own))]
        index.append(seen[tuple(row.tokens)])
    return Packed(tokens, pos, branch, index, prev)


@torch.no_grad()
def score_spans(
    model: Transformer,
    rows: list[Row],
    vocab: int,
    batch_tokens: int = BATCH_TOKENS,
    groups: list[list[int]] | None = None,
) -> tuple[list[float], list[int], list[bool]]:
    """For each row: the summed cross-entropy of its span's tokens in nats, their number, and whether each is the
    greedy prediction, over the first `vocab` ids (the tokenizer's, where the model's vocabulary is padded past it).
    `groups` lists rows that may share their first tokens (an item's options; default: each row alone), each group
    packed into one sequence (see the module docstring). As many packed sequences per forward as fit in batch_tokens
    padded tokens."""
    device = model.tok_emb.weight.device
    stateful = len(model.config.attention_layer_ids) < model.config.n_layer  # no tree: each row alone, in order
    groups = [[r] for r in range(len(rows))] if groups is None or stateful else groups
    packs = [pack([rows[r] for r in group]) for group in groups]
    loss = torch.zeros(len(rows), device=device)  # (R,) summed cross-entropy of each row's span
    count = torch.zeros(len(rows), dtype=torch.long, device=device)  # (R,) its tokens
    wrong = torch.zeros(len(rows), dtype=torch.long, device=device)  # (R,) those that are not the greedy prediction
    order = sorted(range(len(packs)), key=lambda g: -len(packs[g].tokens))
    first = 0
    while first < len(order):
        width = len(packs[order[first]].tokens)
        batch = order[first : first + max(1, batch_tokens // width)]
        first += len(batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)  # (B, L) right-padded with id 0
        pos = torch.zeros(len(batch), width, dtype=torch.long)  # (B, L) each token's position in its own row
        branch = torch.full((len(batch), width), -2, dtype=torch.long)  # (B, L) -1 shared, -2 padding, else its row
        prev = torch.full((len(batch), width), -1, dtype=torch.long)  # (B, L) each token's previous one in its row
        # each scored position: (sequence, packed index), its row, its target
        where = []
        owner = []
        targets = []
        for j, g in enumerate(batch):
            p = packs[g]
            tokens[j, : len(p.tokens)] = torch.tensor(p.tokens)
            pos[j, : len(p.tokens)] = torch.tensor(p.pos)
            branch[j, : len(p.tokens)] = torch.tensor(p.branch)
            prev[j, : len(p.tokens)] = torch.tensor(p.prev)
            for r, index in zip(groups[g], p.index, strict=True):
                row = rows[r]
                assert 1 <= row.start and row.end <= len(row.tokens) <= model.config.block_size + 1, (
                    row.start,
                    row.end,
                )
                where += [(j, index[q]) for q in range(row.start - 1, row.end - 1)]  # position q predicts token q + 1
                owner += [r] * (row.end - row.start)
                targets += row.tokens[row.start : row.end]
        if not targets:
            continue
        keys = torch.arange(width)
        causal = keys[None, :] <= keys[:, None]  # (L, L)
        # a token sees the shared tokens and its own row's before it; padding sees padding and the shared tokens
        visible = (branch[:, None, :] == -1) | (branch[:, None, :] == branch[:, :, None])  # (B, L, L)
        cache = TreeMask(pos.to(device), (causal & visible)[:, None].to(device), prev.to(device))
        # a lone row's positions are 0..L-1 and its mask causal, a forward's own; its right padding comes after it
        hidden = model.hidden(tokens.to(device), None if stateful else cache)  # (B, L, C)
        at = torch.tensor(where, device=device)  # (N, 2)
        hidden = hidden[at[:, 0], at[:, 1]]  # (N, C): only the positions that predict a span's token
        targets = torch.tensor(targets, device=device)  # (N,)
        owner = torch.tensor(owner, device=device)  # (N,)
        for a in range(0, len(targets), HEAD_CHUNK):
            logits = model.head(hidden[a : a + HEAD_CHUNK])[:, :vocab].float()  # (n, vocab)
            target = targets[a : a + HEAD_CHUNK]
            rows_of = owner[a : a + HEAD_CHUNK]
            loss.index_add_(0, rows_of, F.cross_entropy(logits, target, reduction="none"))
            count.index_add_(0, rows_of, torch.ones_like(target))
            wrong.index_add_(0, rows_of, (logits.argmax(-1) != target).long())
    return loss.tolist(), count.tolist(), (wrong == 0).tolist()
