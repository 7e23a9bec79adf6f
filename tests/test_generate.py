"""Generation against a full recompute, and the sampling controls against their definitions."""

import pytest
import torch

from gptlite.generate import SLIDE_KEEP, generate, generate_tokens, sample_next
from tests.conftest import tiny_model


def greedy_by_full_recompute(model, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The reference: every step runs the whole window through model.forward, no cache. The window
    follows the documented policy: when it holds block_size tokens, it keeps the newest SLIDE_KEEP part."""
    block = model.config.block_size
    keep = int(block * SLIDE_KEEP)
    out = idx.clone()
    start = max(0, idx.size(1) - block)
    for _ in range(max_new_tokens):
        if out.size(1) - start > block:
            start = out.size(1) - keep
        logits, _ = model(out[:, start:])
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


@pytest.mark.parametrize("prompt_len,new", [(1, 10), (7, 20), (5, 70)])
def test_cached_greedy_equals_full_recompute(pos_emb, prompt_len, new):
    """(5, 70) crosses block_size=32 twice, exercising the sliding window."""
    model = tiny_model(pos_emb=pos_emb)
    torch.manual_seed(1)
    idx = torch.randint(0, 97, (3, prompt_len))
    cached = model.generate(idx, new, temperature=0)
    assert cached.shape == (3, prompt_len + new)
    assert torch.equal(cached[:, :prompt_len], idx)
    assert torch.equal(cached, greedy_by_full_recompute(model, idx, new))


def test_prompt_longer_than_block_size(pos_emb):
    model = tiny_model(pos_emb=pos_emb)
    idx = torch.randint(0, 97, (2, 45))
    out = generate(model, idx, 12, temperature=0)
    assert out.shape == (2, 57)
    assert torch.equal(out, greedy_by_full_recompute(model, idx, 12))


def test_cache_chunked_prefill_equals_forward(pos_emb):
    """Feeding a sequence in chunks through the cache gives the logits of one full forward pass."""
    model = tiny_model(pos_emb=pos_emb)
    idx = torch.randint(0, 97, (2, 20))
    full, _ = model(idx)
    caches = model.new_caches()
    for a, b in [(0, 6), (6, 7), (7, 15), (15, 20)]:
        logits = model.step(idx[:, a:b], caches, a)
        torch.testing.assert_close(logits, full[:, b - 1], atol=1e-5, rtol=1e-5)


def test_top_k_1_equals_greedy():
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 4))
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(idx, 15, temperature=1.0, top_k=1, generator=g)
    assert torch.equal(sampled, model.generate(idx, 15, temperature=0))


def test_same_seed_same_samples_and_different_seed_differs():
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 4))
    runs = [model.generate(idx, 30, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_generate_tokens_streams_one_token_per_row():
    model = tiny_model()
    idx = torch.randint(0, 97, (3, 4))
    tokens = list(generate_tokens(model, idx, 5, temperature=0))
    assert len(tokens) == 5 and all(t.shape == (3,) for t in tokens)
    assert torch.equal(torch.stack(tokens, 1), model.generate(idx, 5, temperature=0)[:, 4:])


def test_untouched_distribution_with_top_p_1_and_no_top_k():
    """top_p=1 and top_k=None sample from softmax(logits / T) exactly: same draws as torch.multinomial."""
    logits = torch.randn(4, 50)
    expected = torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=torch.Generator().manual_seed(3)).squeeze(-1)
    for kw in ({}, {"top_p": 1.0}, {"top_k": None, "top_p": None}, {"top_k": 50}):
        got = sample_next(logits, 0.7, generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(got, expected), kw


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen_k, seen_p = set(), set()
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        seen_k.add(sample_next(logits, 1.0, top_k=2, generator=g).item())
        # top_p=0.8: 0.5 + 0.3 reaches 0.8, so exactly tokens 0 and 1 are kept
        seen_p.add(sample_next(logits, 1.0, top_p=0.8, generator=g).item())
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}
    # a tiny top_p always keeps the most likely token
    assert sample_next(logits, 1.0, top_p=1e-6, generator=g).item() == 0


def test_sampling_argument_errors():
    logits = torch.randn(1, 10)
    with pytest.raises(ValueError, match="temperature=-1"):
        sample_next(logits, -1)
    with pytest.raises(ValueError, match="top_k=0"):
        sample_next(logits, 1.0, top_k=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        sample_next(logits, 1.0, top_p=1.5)
    with pytest.raises(ValueError, match="prompt must have shape"):
        next(generate_tokens(tiny_model(), torch.zeros(1, 0, dtype=torch.long), 3))
