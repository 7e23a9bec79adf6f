"""`AttentionCache`: what the model reads from a decode cache during generation, every layer's state across calls
(an attention layer's keys and values, a convolution's last inputs, a recurrent matrix), and `StateSpec`, the shape of
one such state. It stands in a module of its own, below both the model (gptlite.model.network, which reads it) and the
caches (gptlite.inference.kvcache's KVCache, the server's gptlite.serve.rows.RowCache, which implement it), so that
neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class StateSpec:
    """One tensor a layer keeps per row across calls, besides attention's keys and values: its shape for one row, and
    its dtype (None: the weights'). A layer class says what it keeps (its `state_spec`); the caches allocate it, a
    buffer of (rows, *shape), zeros where a row begins."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


@runtime_checkable
class AttentionCache(Protocol):
    """What the model reads from a cache during generation (gptlite.model.network's layers and `GPT.hidden`): the
    positions of the next call's tokens, which of them are their row's own (not padding), the mask of what each may
    attend to, and each layer's state: `update` stores an attention layer's new keys and values and hands back
    everything the call attends over (the attention cache, kept as fast as it was); `read_state` and `write_state` hand
    any other layer the tensors its `state_spec` names (a convolution's last inputs, a recurrent matrix), one per row.

    A state is a row's, at the end of what the row has been fed: it is valid only there, so caches move it with the row
    (beam search's reorder, the server's rows moving), start it at zeros where a row begins, and the server's prefix
    cache keeps a snapshot only where a stored prefix ends exactly where a row's state was (gptlite.serve.prefix).
    Padding never enters a state: a layer zeroes its padded inputs (`real`), as transformers does
    (`apply_mask_to_padding_states`), and keeps the state at each row's last real token, so a padded row computes what
    it would alone (left padding in KVCache's batches, right padding in the server's prefills).

    Who sets these up between calls (a `prepare` method, in both of gptlite's caches) is the cache's own business:
    `KVCache` prefills and decodes a fixed batch, the server's RowCache runs every request in a row of its own."""

    pos: torch.Tensor  # (B, T) the next call's tokens' positions
    mask: torch.Tensor | None  # (B, 1, T, S) True where a query may attend to a key; None: every key
    real: torch.Tensor | None  # (B, T) True where a token is its row's own, False for padding; None: every token

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer's new k, v (B, KV, T, D); return the keys and values the call attends over (B, KV, S, D)."""
        ...

    def read_state(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's state before this call, for the call's rows: each name of its `state_spec` -> (B, *shape), zeros
        for a row this call begins. The tensors may be views of the cache's own buffers, which `write_state` then
        overwrites: a layer computes from them before it writes its new state."""
        ...

    def write_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """Store layer's state after this call (each name -> (B, *shape)), at each row's last real token."""
        ...

    def previous_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Store the call's tokens idx (B, T); return the token before each one in its row (B, T), -1 for a row's
        first (position 0). Only a model with a bigram embedding (GPTConfig.bigram_vocab) asks."""
        ...
