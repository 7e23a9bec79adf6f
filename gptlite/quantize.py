"""Weight-only int8 quantization for inference: every matrix of the model as int8 with one scale per output row.

`quantize(model, "int8")` replaces, in place, each block's linear layers and the tied embedding / output head
with int8 copies: W ~= scale[:, None] * Q, Q = round(W / scale) in [-127, 127], scale = max|W[row]| / 127
(symmetric, per output channel, as in gpt-fast and torchao's int8 weight-only scheme). Activations, norms,
biases and positions stay in the model's floating dtype, and the matmul runs in that dtype on the
dequantized weight: `linear(x, Q) * scale`, which equals `linear(x, scale * Q)` because the scale belongs to
the output row. Weights take a quarter of their float32 bytes, which is what a batch-1 decode step is bound
by; the speed comes with `compile=True`, where torch.compile fuses the int8-to-float conversion into the
matrix-vector product, so only int8 bytes move (eager, the conversion is a separate pass over the weight).

A quantized model is for generation and evaluation only: its int8 weights are buffers, not parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.config import QUANTIZE_CHOICES

if TYPE_CHECKING:
    from gptlite.model import GPT

MODES = tuple(mode for mode in QUANTIZE_CHOICES if mode)  # ("int8",): declared with --quantize's choices


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> (Q (N, K) int8, scale (N,) in weight's dtype), weight ~= scale[:, None] * Q."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale.to(weight.dtype)


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with a per-output-row scale: y = (x Q^T) * scale + bias."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.register_buffer("bias", None if bias is None else bias.detach())  # (N,) or None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_rows(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)  # (..., N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, int8"


class Int8Embedding(nn.Module):
    """The token embedding as an int8 table: a row is looked up and dequantized. With a tied head the table is the
    output head's (weight tying survives quantization: `head` is that Int8Linear, not registered twice); an untied
    embedding owns its table."""

    def __init__(self, head: Int8Linear, owned: bool = False):
        super().__init__()
        if owned:
            self.table = head  # registered: moves and saves with the model
        else:
            self.head = [head]  # a plain list: the table belongs to the head

    def _table(self) -> Int8Linear:
        return self.table if "table" in self._modules else self.head[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        table = self._table()
        return table.weight[idx].to(table.scale.dtype) * table.scale[idx, None]  # (..., C)

    @property
    def weight(self) -> torch.Tensor:
        """The scales: their dtype and device are the model's, what new KV caches and generators take."""
        return self._table().scale


def check_mode(mode: str) -> None:
    """ValueError unless mode is a quantization this module does ("" = none)."""
    if mode not in ("", *MODES):
        raise ValueError(f"quantize={mode!r} is not supported; use {' or '.join(map(repr, MODES))}, or leave it out")


def quantize(model: GPT, mode: str = "int8") -> GPT:
    """Quantize model's weights in place (see the module docstring) and return it, in eval mode."""
    check_mode(mode)
    if not mode:
        return model
    if isinstance(model.lm_head, Int8Linear):
        return model.eval()  # already quantized
    for block in model.blocks:
        for parent in (block.attn, block.ffn):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear.from_linear(child))
    tied = model.lm_head.weight is model.tok_emb.weight
    embedding = model.tok_emb.weight
    model.lm_head = Int8Linear.from_linear(model.lm_head)
    model.tok_emb = (
        Int8Embedding(model.lm_head) if tied else Int8Embedding(Int8Linear(*quantize_rows(embedding), None), owned=True)
    )  # (V, C) rows as a head's
    return model.eval().requires_grad_(False)
