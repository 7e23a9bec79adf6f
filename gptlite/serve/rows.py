"""RowCache: the keys and values of every layer, and every other layer's state, for `rows` requests at once, each row
at its own length.

A request owns one row from its prefill to its last token. Decoding feeds the newest token of rows 0..n-1
(the engine keeps the running rows first, so a step costs the running rows, not every row); each row writes
its keys and values at its own length, attends over its own slots only, and counts positions from its own
first token. It is a `gptlite.inference.kvcache.AttentionCache`, the interface the model reads every cache through
(`update`, `mask`, `pos`, `real`, `read_state` and `write_state`), and its buffers come from
`gptlite.inference.kvcache.kv_buffers` and `state_buffers`, as KVCache's do. A layer's state other than keys and values
(a convolution's last inputs) is a row's, at the row's end: it starts at zeros where a row begins, moves with the row,
and the prefix cache snapshots it only at a block that ends exactly there (`read_states`, `write_states`).
A step of one token per row also offers the CPU's one-call steps (gptlite.inference.cpu.blocks: a block's whole decode
step in one compiled call) what they write and read themselves (`decode_buffers`), each row at its own slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gptlite.inference.kvcache import kv_buffers, state_buffers, state_tensors

if TYPE_CHECKING:
    from gptlite.config import GPTConfig


class RowCache:
    """Per-layer keys and values (rows, KV, max_len, D), written in place; `prepare` sets up the next call."""

    def __init__(
        self,
        config: GPTConfig,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        always_mask: bool = False,
    ):
        self.always_mask = always_mask  # a mask even where none is needed (a compiled step then has one graph less)
        self.k, self.v = kv_buffers(config, rows, max_len, dtype, device)  # (R, KV, L, D) each
        self.states = state_buffers(config, rows, dtype, device)  # per layer: name -> (R, *shape)
        self.attends = sorted(config.attention_layer_ids)  # the layers whose keys and values a span holds
        self.tokens = torch.zeros(rows, max_len, dtype=torch.long, device=device)  # (R, L) (bigram_vocab)
        self.rows = rows
        self.max_len = max_len
        self.device = torch.device(device)
        self.span = 0  # S: slots the next call attends over
        self.selected = slice(0, 0)  # the rows the next call runs
        self.row_ids = torch.zeros(0, 1, dtype=torch.long)  # (n, 1) their indices
        self.slots = torch.zeros(0, 0, dtype=torch.long)  # (n, T) where their tokens go
        self.pos = self.slots  # (n, T) the tokens' positions: a row's first token is at slot 0, position 0
        self.mask: torch.Tensor | None = None  # (n, 1, T, S) True where a query may see a key
        self.decode_slot: int | None = None  # a step of one token per row: the last of its rows' slots (S - 1)
        self.decode_slots = torch.zeros(0, dtype=torch.long)  # (n,) each row's slot in such a step
        self.real: torch.Tensor | None = None  # (n, T) False where a token is right padding; None: none is

    @property
    def stateful(self) -> bool:
        """Whether some layer keeps a state besides keys and values (what the prefix cache must snapshot)."""
        return bool(state_tensors(self.states))

    def prepare(self, first: int, lengths: list[int], T: int, real: list[int] | None = None) -> None:
        """The next forward call feeds T tokens to each of rows first..first+n-1 (n = len(lengths)), whose
        caches hold lengths[i] tokens; row i's tokens go to slots lengths[i]..lengths[i]+T-1, its first real[i] its
        own and the rest right padding (None: all T). A row of length 0 begins: its state starts at zeros."""
        n = len(lengths)
        assert first + n <= self.rows and max(lengths) + T <= self.max_len, "RowCache overflow"
        lens = torch.tensor(lengths, device=self.device)  # (n,)
        self.selected = slice(first, first + n)
        self.row_ids = torch.arange(first, first + n, device=self.device)[:, None]  # (n, 1)
        self.slots = lens[:, None] + torch.arange(T, device=self.device)  # (n, T)
        self.pos = self.slots
        self.span = max(lengths) + T
        self.real = None
        if real is not None and min(real) < T:
            self.real = torch.arange(T, device=self.device)[None, :] < torch.tensor(real, device=self.device)[:, None]
        beginning = [first + i for i, length in enumerate(lengths) if length == 0]
        if beginning:
            for tensor in state_tensors(self.states):
                tensor[beginning] = 0
        self.prepare_one_call(lens, T)
        if n == 1 and T == 1 and not self.always_mask:  # one query that sees every slot up to its own
            self.mask = None
            return
        keys = torch.arange(self.span, device=self.device)  # (S,)
        self.mask = (keys[None, None, :] <= self.slots[:, :, None])[:, None]  # (n, 1, T, S): causal, own slots only

    def prepare_one_call(self, lens: torch.Tensor, T: int) -> None:
        """What a one-call step reads (`decode_buffers`) where the next call feeds one token to each row of lengths
        `lens` (n,): none where it feeds more (a prompt)."""
        self.decode_slot = self.span - 1 if T == 1 else None
        self.decode_slots = lens

    def decode_buffers(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None, torch.Tensor | None]:
        """What a decode step of one token per row (after a `prepare` that set `decode_slot`) reads and writes in
        layer `layer`, for a step that writes the token's keys and values itself instead of calling `update` (the
        CPU's one-call steps, gptlite.inference.cpu.blocks), as gptlite.inference.cpu.native's CacheSlot holds them:
        the prepared rows' keys and values (n, KV, max_len, D), the last row's slot, the span, no mask (each row
        sees every slot of its own up to its token's), and each row's slot (n,)."""
        keys = self.k[layer][self.selected]  # (n, KV, max_len, D): rows of a contiguous buffer, contiguous
        values = self.v[layer][self.selected]
        return keys, values, self.decode_slot, self.span, None, self.decode_slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer's k, v (n, H, T, D) at the prepared slots; return its keys and values (n, H, S, D)."""
        self.k[layer][self.row_ids, :, self.slots] = k.transpose(1, 2)  # indexed as (n, T, H, D)
        self.v[layer][self.row_ids, :, self.slots] = v.transpose(1, 2)
        return self.k[layer][self.selected, :, : self.span], self.v[layer][self.selected, :, : self.span]

    def read_state(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's state before this call, for the prepared rows (name -> (n, *shape))."""
        return {name: tensor[self.selected] for name, tensor in self.states[layer].items()}

    def write_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """Store layer's state after this call for the prepared rows (name -> (n, *shape))."""
        for name, tensor in state.items():
            self.states[layer][name][self.selected] = tensor

    def read_states(self, row: int) -> list[torch.Tensor]:
        """A copy of a row's state in every layer that keeps one (gptlite.inference.kvcache.state_tensors' order),
        valid at the row's end only: what the prefix cache snapshots."""
        return [tensor[row].clone() for tensor in state_tensors(self.states)]

    def write_states(self, row: int, snapshot: list[torch.Tensor]) -> None:
        """Put a snapshot that `read_states` gave back into a row."""
        for tensor, saved in zip(state_tensors(self.states), snapshot, strict=True):
            tensor[row] = saved

    def previous_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Write idx (n, T) at the prepared slots; each token's previous one in its row (n, T), -1 at slot 0."""
        self.tokens[self.row_ids, self.slots] = idx
        before = self.tokens[self.row_ids, (self.slots - 1).clamp_min(0)]  # (n, T)
        return torch.where(self.slots == 0, -1, before)

    def read_span(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of every attention layer's keys and values in slots start..end-1 of a row: (2 * layers, KV,
        end - start, D), the keys' layers first (gptlite.serve.prefix keeps such spans)."""
        return torch.stack([buffer[row, :, start:end] for buffer in self.attention_buffers()])

    def write_span(self, row: int, start: int, spans: list[torch.Tensor], tokens: list[int]) -> None:
        """Write spans that `read_span` gave, one after another, into a row from slot `start` on, and the tokens they
        were computed for (what the slots after them pair with, with a bigram embedding)."""
        self.tokens[row, start : start + len(tokens)] = torch.tensor(tokens, device=self.device)
        for span in spans:
            end = start + span.size(2)
            for buffer, layer in zip(self.attention_buffers(), span, strict=True):
                buffer[row, :, start:end] = layer
            start = end

    def attention_buffers(self) -> list[torch.Tensor]:
        """The keys' buffers of the layers that attend, then their values'."""
        return [self.k[i] for i in self.attends] + [self.v[i] for i in self.attends]

    def move(self, src: int, dst: int, length: int) -> None:
        """Row dst takes a copy of the first `length` slots of row src, and its state (valid at its end: `length` is
        src's length): a running row moves into a freed one (the engine keeps its running rows first), or the n copies
        of one prompt share its prefill."""
        for buffer in self.attention_buffers():
            buffer[dst, :, :length] = buffer[src, :, :length]
        for tensor in state_tensors(self.states):
            tensor[dst] = tensor[src]
        self.tokens[dst, :length] = self.tokens[src, :length]
