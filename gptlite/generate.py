"""Autoregressive generation: the KV cache, sampling (temperature, top-k, top-p) and the decode loop.

The prompt is run through the model once (prefill), filling a preallocated per-layer KV cache; each
later step feeds only the newest token. Context policy past `block_size`: when the cache is full, the
oldest tokens are dropped, the most recent `SLIDE_KEEP` fraction of the window is prefilled again (at
positions 0..), and decoding continues against the cache. This costs one prefill every
`block_size - keep` tokens instead of nanoGPT's full recompute at every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gptlite.model import GPT

SLIDE_KEEP = 0.75  # fraction of block_size kept when the window slides


class KVCache:
    """Keys and values of one attention layer, preallocated for `max_len` positions and written in place.
    The buffers are created on the first update, with that call's batch size, heads, dtype and device."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, T, D) at positions start..start+T-1; return keys and values 0..start+T-1."""
        B, H, T, D = k.shape
        if self.k is None or self.k.shape[0] != B or self.k.dtype != k.dtype or self.k.device != k.device:
            self.k = k.new_empty(B, H, self.max_len, D)  # (B, H, max_len, D)
            self.v = v.new_empty(B, H, self.max_len, D)
        end = start + T
        assert end <= self.max_len, f"KV cache overflow: {end} > {self.max_len}"
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, H, S, D)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from logits (B, V) -> (B,). temperature=0 is greedy (argmax);
    top_k keeps the k most likely tokens; top_p keeps the smallest set whose probability reaches p."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1, or None for no limit")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1], or None for no limit")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


@torch.no_grad()
def generate_tokens(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), max_new_tokens times, for the prompt idx (B, T)."""
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"prompt must have shape (B, T) with T >= 1, got {tuple(idx.shape)}")
    block_size = model.config.block_size
    keep = max(1, int(block_size * SLIDE_KEEP))
    caches = model.new_caches()
    context = idx[:, -block_size:]  # a prompt longer than the window keeps its end
    logits = model.step(context, caches, 0)  # (B, V)
    pos = context.size(1)  # tokens in the cache
    history = [context]
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        yield nxt
        if i == max_new_tokens - 1:
            break
        history.append(nxt[:, None])
        if pos == block_size:  # the window is full: keep the newest `keep` tokens and prefill them
            recent = torch.cat(history, dim=1)[:, -keep:]  # (B, keep)
            history = [recent]
            logits = model.step(recent, caches, 0)
            pos = keep
        else:
            logits = model.step(nxt[:, None], caches, pos)
            pos += 1


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Prompt idx (B, T) -> prompt plus max_new_tokens new tokens, (B, T + max_new_tokens)."""
    new = list(generate_tokens(model, idx, max_new_tokens, temperature, top_k, top_p, generator))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx.clone()
