"""`AttentionCache`: what the model reads from a KV cache during generation. It stands in a module of its own, below
both the model (gptlite.model.network, which reads it) and the caches (gptlite.inference.kvcache's KVCache, the server's
gptlite.serve.rows.RowCache, which implement it), so that neither imports the other."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionCache(Protocol):
    """What the model reads from a cache during generation (gptlite.model.network's attention and `GPT.hidden`): the
    positions of the next call's tokens, the mask of what each of them may attend to, and `update`, which
    stores one layer's new keys and values and hands back everything the call attends over. Who sets these up
    between calls (a `prepare` method, in both of gptlite's caches) is the cache's own business: `KVCache`
    prefills and decodes a fixed batch, the server's RowCache runs every request in a row of its own."""

    pos: torch.Tensor  # (B, T) the next call's tokens' positions
    mask: torch.Tensor | None  # (B, 1, T, S) True where a query may attend to a key; None: every key

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v (B, KV, T, D); return the keys and values the call attends over (B, KV, S, D)."""
        ...

    def previous_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Store the call's tokens idx (B, T); return the token before each one in its row (B, T), -1 for a row's
        first (position 0). Only a model with a bigram embedding (GPTConfig.bigram_vocab) asks."""
        ...
