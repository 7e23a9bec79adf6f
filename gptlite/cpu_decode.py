"""The CPU fast path of eager decoding: large linear layers run as per-thread weight slabs (one row) or through
oneDNN on prepacked weights (a batch), in a view of the model that shares everything else (`packed_for_cpu`)."""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from gptlite.model import GPT


class SlabLinear(nn.Module):
    """An nn.Linear for eager CPU decoding of one row: a matrix-vector product, bound by streaming the weight
    from memory. The weight is cut into one contiguous slab of output rows per thread and run as a batched
    matmul, so that each thread streams its own slab from start to end. Layers wider than they are deep
    (q/k/v, the feed-forward input, the head: N > K) keep their slabs transposed, (K, N/P) each, and multiply
    the row into them; the others multiply each slab (N/P, K) by the row. On a 2-core AVX2 CPU this streamed
    the weights faster than oneDNN on a prepacked weight (`PackedLinear`) at every GPT-2-124M shape, close to a
    plain sum over the same bytes (figures: docs/benchmarks.md). Several rows (a prompt) go through F.linear."""

    def __init__(self, linear: nn.Linear, parts: int | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        weight = linear.weight.detach()
        N, K = weight.shape
        parts = parts or torch.get_num_threads()
        rows = -(-N // parts)  # output rows per slab; the last slab is padded with zeros
        if rows * parts != N:
            weight = torch.cat([weight, weight.new_zeros(rows * parts - N, K)])
        self.transposed = N > K
        slabs = weight.view(parts, rows, K)  # a view of the layer's own weight when nothing is padded
        self.slabs = slabs.transpose(1, 2).contiguous() if self.transposed else slabs  # (P, K, N/P) or (P, N/P, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K = x.size(-1)
        if x.numel() != K:
            return F.linear(x, self.weight, self.bias)
        row = x.reshape(1, 1, K).expand(len(self.slabs), 1, K)  # (P, 1, K)
        if self.transposed:
            y = torch.bmm(row, self.slabs)  # (P, 1, N/P)
        else:
            y = torch.bmm(self.slabs, row.transpose(1, 2))  # (P, N/P, 1)
        y = y.reshape(-1)[: self.weight.size(0)].view(*x.shape[:-1], -1)  # (..., N)
        return y if self.bias is None else y + self.bias


class PackedLinear(nn.Module):
    """An nn.Linear for eager CPU decoding of a batch: its float32 weight packed once into oneDNN's blocked
    layout, and the matmul run by oneDNN. At a few rows oneDNN on a prepacked weight streams the weights
    faster than `F.linear` does (figures: docs/generation.md)."""

    def __init__(self, linear: nn.Linear, rows: int):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)  # a copy, (N, K)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N)


PACK_MIN_WEIGHTS = 1 << 18  # smaller layers (the char model's) decode faster as they are: per-call overhead
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its weights' state, layout, view)


def packed_for_cpu(model: GPT, rows: int) -> GPT:
    """The model as eager decoding on the CPU runs it: a view that shares every module and tensor except the
    nn.Linear layers of at least PACK_MIN_WEIGHTS weights, which become `SlabLinear`s for one row and
    `PackedLinear`s for a batch; smaller layers are bound by per-call overhead, and are left as they are. The
    view is kept for the next call (the slabs and packed copies cost up to as much memory as the linear
    weights) and made again when the weights or the thread count change. Other devices and dtypes, and
    builds without oneDNN, get the model itself."""
    weight = model.tok_emb.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    layout = (1 if rows == 1 else 8, torch.get_num_threads())
    state = (model.training, *((p.data_ptr(), p._version) for p in model.parameters()))
    kept = _packed.get(model)
    if kept is not None and kept[:2] == (state, layout):
        return kept[2]

    def packs(module: nn.Module) -> bool:
        # exactly nn.Linear: a LoRA layer (a subclass) packed as one would lose its adapters
        return type(module) is nn.Linear and module.weight.numel() >= PACK_MIN_WEIGHTS

    def view(module: nn.Module) -> nn.Module:
        if packs(module):
            return SlabLinear(module) if rows == 1 else PackedLinear(module, layout[0])
        if not any(packs(m) for m in module.modules()):
            return module  # shared as it is
        clone = copy.copy(module)  # the same parameters and buffers; its own table of submodules
        clone._modules = {name: view(child) for name, child in module._modules.items()}
        return clone

    if not any(packs(m) for m in model.modules()):
        return model
    _packed[model] = (state, layout, view(model))
    return _packed[model][2]
