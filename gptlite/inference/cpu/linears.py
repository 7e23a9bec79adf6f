"""The kernels a linear layer of eager CPU decoding may run through, each an nn.Module on the layer's own weight (or a
copy of it in another layout): per-thread weight slabs (`SlabLinear`, one row), oneDNN on a prepacked weight
(`PackedLinear`), plain `F.linear` (`PlainLinear`, MKL) and gptlite's compiled kernel (`NativeLinear`,
gptlite.inference.cpu.native). gptlite.inference.cpu.decode measures which one streams each shape's weights fastest
on the CPU at hand and builds the model's decode view from them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.inference.cpu import native


class SlabLinear(nn.Module):
    """An nn.Linear for eager CPU decoding of one row: a matrix-vector product, bound by streaming the weight
    from memory. The weight is cut into one contiguous slab of output rows per thread and run as a batched
    matmul, so that each thread streams its own slab from start to end. Layers wider than they are deep
    (q/k/v, the feed-forward input, the head: N > K) keep their slabs transposed, (K, N/P) each, and multiply
    the row into them; the others multiply each slab (N/P, K) by the row. On a 2-core AVX2 CPU this streamed
    the weights faster than oneDNN on a prepacked weight (`PackedLinear`) at every GPT-2-124M shape, close to a
    plain sum over the same bytes (figures: docs/benchmarks.md). Several rows (a prompt) go through F.linear.
    `parts` is the number of slabs (default: torch's threads)."""

    def __init__(self, linear: nn.Linear, parts: int | None = None):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
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


class PlainLinear(nn.Module):
    """An nn.Linear through F.linear (MKL's GEMM, or its matrix-vector product at one row), as the model runs it:
    the measured choice where it streams the weights fastest."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class NativeLinear(nn.Module):
    """An nn.Linear through gptlite's compiled kernel (`native.float_linear`): each thread reads its contiguous share
    of the weight's rows once, in streams prefetched ahead, and multiplies up to `native.max_rows()` rows of the input
    into each weight row while that row is in the cache. More rows (a prompt) go through F.linear, PyTorch's GEMM,
    which reads the weight once however many rows there are. Only for layers whose input width `native.fits`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > native.max_rows() * x.size(-1):
            return F.linear(x, self.weight, self.bias)
        return native.float_linear(x, self.weight, self.bias)  # (..., N)
