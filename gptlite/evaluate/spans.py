"""Scoring a span of each of many token sequences: its summed cross-entropy, and whether the model predicts every
token of it greedily. CORE's options and continuations (gptlite.evaluate.core) and lm-eval's log-likelihood requests
(gptlite.evaluate.lm_harness) are such spans.

Sequences go through the model longest first, right-padded into batches of a token budget: causal attention lets
padding after a sequence change nothing before it, and no padded position is scored. Only the positions that predict
a span's token go through the output head (a few of a sequence's positions, each a vocab_size-wide row of logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlite.model import GPT

BATCH_TOKENS = 8192  # padded tokens per forward: rows x the longest row
HEAD_CHUNK = 4096  # scored positions per output-head call: their float32 logits are HEAD_CHUNK x vocab


@dataclass
class Row:
    """One sequence to score, of at most block_size + 1 tokens (its last token is never input), and its span
    tokens[start:end], each token predicted from those before it (start >= 1)."""

    tokens: list[int]
    start: int
    end: int


@torch.no_grad()
def score_spans(
    model: GPT, rows: list[Row], vocab: int, batch_tokens: int = BATCH_TOKENS
) -> tuple[list[float], list[int], list[bool]]:
    """For each row: the summed cross-entropy of its span's tokens in nats, their number, and whether each is the
    greedy prediction, over the first `vocab` ids (the tokenizer's, where the model's vocabulary is padded past it).
    As many rows per forward as fit in batch_tokens padded tokens."""
    device = model.tok_emb.weight.device
    loss = torch.zeros(len(rows), device=device)  # (R,) summed cross-entropy of each row's span
    count = torch.zeros(len(rows), dtype=torch.long, device=device)  # (R,) its tokens
    wrong = torch.zeros(len(rows), dtype=torch.long, device=device)  # (R,) those that are not the greedy prediction
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r].tokens))
    first = 0
    while first < len(order):
        width = len(rows[order[first]].tokens)
        batch = order[first : first + max(1, batch_tokens // width)]
        first += len(batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)  # (B, L) right-padded with id 0
        scored = torch.zeros(len(batch), width - 1, dtype=torch.bool)  # (B, L-1) position p predicts token p+1
        for j, r in enumerate(batch):
            row = rows[r]
            assert 1 <= row.start and row.end <= len(row.tokens) <= model.config.block_size + 1, (row.start, row.end)
            tokens[j, : len(row.tokens)] = torch.tensor(row.tokens)
            scored[j, row.start - 1 : row.end - 1] = True
        if not scored.any():
            continue
        tokens, scored = tokens.to(device), scored.to(device)
        hidden = model.hidden(tokens[:, :-1])[scored]  # (N, C): only the positions that predict a span's token
        targets = tokens[:, 1:][scored]  # (N,)
        owner = torch.tensor(batch, device=device)[scored.nonzero()[:, 0]]  # (N,) each position's row
        for a in range(0, len(targets), HEAD_CHUNK):
            logits = model.lm_head(hidden[a : a + HEAD_CHUNK])[:, :vocab].float()  # (n, vocab)
            target, rows_of = targets[a : a + HEAD_CHUNK], owner[a : a + HEAD_CHUNK]
            loss.index_add_(0, rows_of, F.cross_entropy(logits, target, reduction="none"))
            count.index_add_(0, rows_of, torch.ones_like(target))
            wrong.index_add_(0, rows_of, (logits.argmax(-1) != target).long())
    return loss.tolist(), count.tolist(), (wrong == 0).tolist()
