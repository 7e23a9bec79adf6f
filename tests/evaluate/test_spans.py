"""Scoring spans (gptlite.evaluate.spans) against the plain definition: rows packed over their shared first tokens,
batched and padded, give each row's summed cross-entropy and greedy check as its own full forward does, on every
architecture."""

import random

import pytest
import torch
import torch.nn.functional as F

from gptlite.evaluate.spans import Row, pack, score_spans
from tests.conftest import DEVICE, tiny_model

V, T = 97, 32  # tiny_model's vocabulary and block_size


def rows_sharing_a_prefix(rng: random.Random) -> tuple[list[Row], list[list[int]]]:
    """Groups of rows like an item's options: a shared prefix, then tails of their own; among them a row equal to
    another, a row that is a prefix of another, a row of block_size + 1 tokens, and a group of one."""
    rows, groups = [], []
    for _ in range(5):
        prefix = [rng.randrange(V) for _ in range(rng.randrange(1, 20))]
        tails = [[rng.randrange(V) for _ in range(rng.randrange(1, 8))] for _ in range(rng.randrange(1, 4))]
        group = []
        for tail in tails:
            tokens = prefix + tail
            group.append(len(rows))
            rows.append(Row(tokens, rng.randrange(1, len(tokens)), len(tokens)))
        groups.append(group)
    prefix = [rng.randrange(V) for _ in range(T - 3)]
    extra = [
        Row(prefix + [1, 2, 3, 4], T - 5, T + 1),
        Row(prefix + [1, 2, 3, 4], T - 3, T + 1),
        Row(prefix + [1, 2], 5, T - 1),
    ]
    groups.append(list(range(len(rows), len(rows) + len(extra))))
    rows += extra
    return rows, groups


def reference(model, row: Row) -> tuple[float, bool]:
    """The row alone, every position through the head."""
    with torch.no_grad():
        logits = model(torch.tensor([row.tokens[:-1]], device=DEVICE))[0][0]  # (len - 1, V)
    span = logits[row.start - 1 : row.end - 1]
    target = torch.tensor(row.tokens[row.start : row.end], device=DEVICE)
    return F.cross_entropy(span, target, reduction="sum").item(), bool((span.argmax(-1) == target).all())


@pytest.mark.device
def test_packed_batched_spans_equal_each_row_alone(variant):
    model = tiny_model(**variant)
    rows, groups = rows_sharing_a_prefix(random.Random(0))
    expected = [reference(model, row) for row in rows]
    for batch_tokens, grouped in [(1, groups), (T, None), (10_000, groups)]:  # one per forward, a few, all at once
        loss, count, greedy = score_spans(model, rows, V, batch_tokens, grouped)
        torch.testing.assert_close(torch.tensor(loss), torch.tensor([e[0] for e in expected]), atol=1e-4, rtol=1e-5)
        assert count == [r.end - r.start for r in rows]
        assert greedy == [e[1] for e in expected]


def test_packing_shares_the_prefix_and_computes_equal_rows_once():
    a, b = Row([5, 6, 7, 8, 9], 3, 5), Row([5, 6, 7, 1, 2, 3], 3, 6)
    packed = pack([a, b, a])
    assert packed.tokens == [5, 6, 7, 8, 1, 2] and packed.pos == [0, 1, 2, 3, 3, 4]  # the last tokens are never input
    assert packed.branch == [-1, -1, -1, 0, 1, 1] and packed.index == [[0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 1, 2, 3]]
    model = tiny_model()
    loss, _, _ = score_spans(model, [a, b, a], V, groups=[[0, 1, 2]])
    assert loss[0] == loss[2]  # equal options tie exactly: the first of them wins, as in nanochat


def test_a_model_with_conv_layers_scores_each_row_alone_as_its_own_forward():
    """A conv layer's state reads a sequence in order, so such a model's rows go unpacked (groups are ignored)."""
    model = tiny_model(n_layer=3, layer_types="conv,full_attention,conv", pos_emb="rope", norm="rmsnorm")
    rows, groups = rows_sharing_a_prefix(random.Random(0))
    expected = [reference(model, row) for row in rows]
    loss, count, greedy = score_spans(model, rows, V, T, groups)
    torch.testing.assert_close(torch.tensor(loss), torch.tensor([e[0] for e in expected]), atol=1e-4, rtol=1e-5)
    assert count == [r.end - r.start for r in rows]
    assert greedy == [e[1] for e in expected]
