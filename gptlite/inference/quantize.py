"""Weight-only quantization for inference: int8 with one scale per output row (the vocabulary's tables: per group
of 32 inputs), int4 with one scale per group of input columns.

`quantize(model, "int8")` replaces, in place, each block's linear layers with int8 copies: W ~= scale[:, None] * Q,
Q = round(W / scale) in [-127, 127], scale = max|W[row]| / 127 (symmetric, per output channel, as in gpt-fast and
torchao's int8 weight-only scheme). The vocabulary's tables (the tied embedding / output head, an untied
embedding) take one scale per group of TABLE_GROUP_SIZE = 32 weights of a row instead (Int8GroupLinear): q8_0's
blocks, each scale a float16 number, so that they export to q8_0 bit for bit. A table's row is one token's
embedding, whose few large dimensions left the rest of a row with a handful of int8 steps under one scale: with
per-row tables, a trained run's greedy text parted from its float32 text far sooner than llama.cpp's q8_0 did
from its f32, with these groups no sooner (figures: docs/generation.md).

`quantize(model, "int4", group_size=32)` stores each group of `group_size` consecutive weights of a row as 4-bit
codes with one scale: W ~= d * (q - 8), q in [0, 15], d = m / -8 where m is the group's weight of largest
magnitude, sign kept: llama.cpp's q4_0 rule (whose blocks are 32 wide), so that a group-32 model exports to a q4_0
GGUF file bit for bit (gptlite.hf.gguf). The scale is rounded to bfloat16 first (what the kernel reads at bfloat16
activations; a bfloat16 number is exact in q4_0's float16 where it lies in float16's normal range) and the codes are
rounded against that rounded scale. The token embedding stays int8 (a lookup reads one row of a table; the int4
kernel multiplies by its table and cannot read a row out of it), and so does a layer whose shape the int4 kernel
does not take (output rows not a multiple of 16, input columns not a multiple of the group): a warning line names
those layers, and `quantized_as` / `layer_types` record what was done (evaluate's JSON writes them).

The matmul runs on the packed low-bit weight itself, never on a dequantized float copy, through PyTorch's CPU kernels
(as gpt-fast and torchao call them): `torch.ops.aten._weight_int8pack_mm` (int8 weight, per-row scale; not the grouped
tables) and `torch.ops.aten._weight_int4pack_mm_for_cpu` (int4 codes in its own packed layout, made from the layer's
codes when one of its ways first runs, per-group scales). Both take float32 or bfloat16 activations. int8 has one more
way, where gptlite's compiled kernels could be built (gptlite.inference.cpu.native): its `int8_linear`, float32
activations times the int8 weight converted in registers, each weight streamed from memory once, with a scale per row or
per group (the grouped tables' only way besides the dequantized weight); PyTorch's int8 kernel is bound by its
arithmetic at one row, this one by memory. And int8, int4 and the grouped tables have one more compiled way, INT8_DOT
("int8_dot", native.int8_dot_linear and int4_dot_linear), as llama.cpp's q8_0 and q4_0 multiply: the activations
quantized to int8 per block of 32 (one scale each), each block's products with the weight's codes summed exactly in
integers (AVX-512 VNNI, AVX2), then scaled; the int4 codes are kept in the layout that kernel reads
(native.pack_nibbles). So, as for the float32 kernels of gptlite.inference.cpu.decode, the way of each layer shape is
measured on the CPU at hand, for one row (decoding) and for a batch, and kept in the choices file of
gptlite.inference.cpu.choices (a prompt of more than NATIVE_MAX_ROWS rows never takes the compiled float32-activation
kernel, which reads each weight again for every 8 rows: it takes the dequantized way, a GEMM). A measurement chooses the
speed, and the numbers only as far as INT8_DOT goes: the ways compete only among those that compute in the model's own
activation dtype (float32 for a float32 model, bfloat16 for a bfloat16 one) or, for a float32 model, its activations
quantized to int8 (INT8_DOT). What a layer multiplies (int8 activations or the dtype's) is chosen once, by the
measurement at one row; a batch's measurement chooses only among the ways that multiply the same
(`QuantizedLinear.choose`), and INT8_DOT takes any number of rows, a prompt's too, each row's blocks quantized on their
own: so a row alone and in a batch decode the same numbers (bit for bit through INT8_DOT, up to the dtype's rounding
otherwise), while a machine without the compiled kernels multiplies float32 activations, apart from INT8_DOT's numbers
by the activations' quantization. bfloat16 activations on a float32 model (on an Intel Xeon with AMX, several times
faster; their accuracy cost and the figures are in docs/generation.md) are the user's to ask for:
GPTLITE_QUANT_KERNEL=bfloat16, or a bfloat16 model. The ways are chosen when the model is prepared for decoding
(`choose_ways`), never inside a compiled step.
GPTLITE_QUANT_KERNEL=float32|bfloat16|dequantize|native|int8_dot forces one way for every layer that has it (dequantize
and native, int8 only; dequantize is the old path, F.linear on the weight converted to the activations' dtype and times
the scale, what other devices run). Layers smaller than choices.PACK_MIN_WEIGHTS are not measured: they run the kernel
at the activations' dtype (int4; float32 for other than bfloat16) or the dequantized path (int8).

A quantized model is for generation and evaluation only: its low-bit weights are buffers, not parameters. int4
runs on the CPU only (its kernels are CPU ones); int8 runs anywhere.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.config import QUANTIZE_CHOICES
from gptlite.inference.cpu import native
from gptlite.inference.cpu.choices import COLD_BYTES, PACK_MIN_WEIGHTS, remembered_choice, time_in_turns

if TYPE_CHECKING:
    from gptlite.model.network import Transformer

MODES = tuple(mode for mode in QUANTIZE_CHOICES if mode)  # ("int8", "int4"): declared with --quantize's choices
INT4_GROUP_SIZES = (32, 64, 128)  # 32 is q4_0's block
TABLE_GROUP_SIZE = 32  # the int8 vocabulary tables' groups (Int8GroupLinear): q8_0's block
# the int8 tables' dequantizing way converts this many weights at a time: 2 MiB of float32, within a core's L2 cache
CHUNK_WEIGHTS = 1 << 19
INT4_ROW_MULTIPLE = 16  # the int4 kernel packs output rows in blocks of 16
# _weight_int8pack_mm reads past its operands (a segmentation fault, torch 2.13 on an Intel Xeon) on several rows of
# an input width that is not a multiple of 16: such layers take the dequantized way
INT8PACK_MULTIPLE = 16
FORCE_ENV = "GPTLITE_QUANT_KERNEL"
# the compiled int8 kernel reads each weight once per 8 rows (matvec.cpp's kTile); for GPT-2 124M's matrices on the
# 2-core Intel Xeon it took 35 ms at 16 rows against the dequantized way's 118, but 259 ms at 64 rows against 197
# and 1,078 ms at 256 against 419: past NATIVE_MAX_ROWS rows (a prompt) the layer multiplies the dequantized way
NATIVE_MAX_ROWS = 16
ACTIVATIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the dtype each way computes in; the others (dequantize, chunks) compute in the activations' own dtype
# the int8 x int8 way (gptlite.inference.cpu.native's int8_dot_linear, int4_dot_linear): a float32 model's activations
# quantized to int8 per block of 32, multiplied in integer arithmetic, as llama.cpp's q8_0 and q4_0 do
INT8_DOT = "int8_dot"
WAY_DTYPES = {**ACTIVATIONS, "native": torch.float32, INT8_DOT: torch.float32}
FORCEABLE = (*ACTIVATIONS, "dequantize", "native", INT8_DOT)
ROW_BUCKETS = (1, 8)  # the row counts a way is chosen for: one row (decoding one sequence) and a batch


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> (Q (N, K) int8, scale (N,) in weight's dtype), weight ~= scale[:, None] * Q."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale.to(weight.dtype)


def quantize_int8_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> (Q (N, K) int8, scale (N, K / group_size) in weight's dtype, each a float16 number),
    weight ~= scale * Q group by group: q8_0's rule, scale = max|W[group]| / 127 rounded to float16 (q8_0 stores
    it so), then the codes rounded against that rounded scale, so that q8_0 holds the same codes and scales (a
    group whose scale is below float16's smallest number becomes zeros, as in q8_0)."""
    N, K = weight.shape
    groups = weight.detach().float().reshape(N, K // group_size, group_size)  # (N, G, g)
    scale = (groups.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).to(weight.dtype).float()  # (N, G, 1)
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = torch.round(groups * inverse).clamp(-127, 127).to(torch.int8)  # (N, G, g)
    return q.reshape(N, K), scale.squeeze(2).to(weight.dtype)


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> (q (N, K) int32 codes in [0, 15], d (N, K / group_size) float32, each a bfloat16
    number), weight ~= d * (q - 8) group by group: q4_0's rule (the module docstring)."""
    N, K = weight.shape
    groups = weight.detach().float().reshape(N, K // group_size, group_size)  # (N, G, g)
    index = groups.abs().argmax(dim=2, keepdim=True)  # the largest magnitude, its sign kept
    d = (groups.gather(2, index) / -8).to(torch.bfloat16).float()  # (N, G, 1)
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(groups * inverse + 8).clamp(0, 15).to(torch.int32)  # (N, G, g)
    return q.reshape(N, K), d.squeeze(2)


def forced_kernel() -> str:
    """GPTLITE_QUANT_KERNEL's way, or "" to measure."""
    forced = os.environ.get(FORCE_ENV, "")
    if forced and forced not in FORCEABLE:
        raise ValueError(
            f"{FORCE_ENV}={forced!r}: choose float32, bfloat16, dequantize, native or {INT8_DOT}, "
            "or unset it to measure"
        )
    return forced


def way_inputs(way: str, dtype: torch.dtype) -> str:
    """What a way multiplies the weight by at `dtype` activations: "int8" (the activations quantized, INT8_DOT) or
    the dtype the way computes in."""
    return "int8" if way == INT8_DOT else str(WAY_DTYPES.get(way, dtype)).removeprefix("torch.")


def row_bucket(rows: int) -> int:
    """The row count a measurement stands for: one row (decoding one sequence) or a batch (measured at 8)."""
    return ROW_BUCKETS[0] if rows == 1 else ROW_BUCKETS[1]


def choose_ways(model: Transformer) -> None:
    """Each quantized layer's way for one row and for a batch, chosen now, in the model's activation dtype (its
    embedding's): called where the model is prepared for decoding (gptlite.inference.kvcache's compiled step, the
    server's engine), so that the choices file is read, or the ways measured, before a compile and never inside a
    compiled step."""
    dtype = model.tok_emb.weight.dtype
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for rows in ROW_BUCKETS:
                module.way(rows, dtype)


class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear share: the bias, the per-row-count choice of kernel, and the forward that
    flattens the input to the 2-D rows the kernels take."""

    kind = ""
    default_small = ""  # the way of layers too small to measure, and the one another must beat
    ways: tuple[str, ...] = ()  # PyTorch's ways, the last one what other devices run
    compiled_ways: tuple[str, ...] = ()  # gptlite.inference.cpu.native's, on the CPU where it could be built

    def __init__(self, bias: torch.Tensor | None, out_features: int, in_features: int):
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach())  # (N,) or None
        self.out_features = out_features
        self.in_features = in_features
        # (row bucket, activation dtype) -> chosen way, looked up once per layer, bucket and dtype
        self._ways: dict[tuple[int, torch.dtype], str] = {}
        self._scales: dict[torch.dtype, torch.Tensor] = {}  # the scales in each activation dtype the kernel takes

    def way(self, rows: int, dtype: torch.dtype = torch.float32) -> str:
        """How this layer multiplies `rows` rows of `dtype` activations: forced, small (not measured), off the CPU, or
        measured among the ways that compute in `dtype` (`ways_in`). So a measured choice decides the speed, never
        the numbers: a row alone and a batch compute in one dtype, the model's, whichever way each measured fastest.
        Chosen once per row bucket and dtype, before a compile (`choose_ways`); inside a compiled region nothing
        reads the choices file, and a layer not chosen yet takes its default way."""
        key = (row_bucket(rows), dtype)
        if key not in self._ways:
            if torch.compiler.is_compiling():
                return self.default_way(dtype)
            self._ways[key] = self.choose(*key)
        return self._ways[key]

    def default_way(self, dtype: torch.dtype) -> str:
        """The way of a layer too small to measure, at `dtype` activations, and the one another must beat."""
        return self.default_small

    def ways_in(self, dtype: torch.dtype) -> tuple[str, ...]:
        """The available ways that compute in `dtype`: the candidates a measurement chooses among."""
        return tuple(way for way in self.available_ways(self.in_features) if WAY_DTYPES.get(way, dtype) == dtype)

    def choose(self, bucket: int, dtype: torch.dtype) -> str:
        forced = forced_kernel()
        if self.device_type() != "cpu":
            return forced if forced in self.ways else self.ways[-1]
        if forced in (*self.ways, *self.compiled_ways):
            names = self.available_ways(self.in_features, compiled=forced in self.compiled_ways)
            if forced not in names:
                raise ValueError(
                    f"{FORCE_ENV}={forced} cannot run a {self.out_features}x{self.in_features} {self.kind} layer here "
                    f"({self.why_not(forced)}); choose one of {', '.join(names)}, or unset it to measure"
                )
            return forced
        default = self.default_way(dtype)
        names = self.ways_in(dtype)
        if bucket != ROW_BUCKETS[0]:
            # a batch multiplies what one row does (int8 activations or the dtype's), so that a row decodes the same
            # numbers alone and batched: the measurement at one row chose what, this one chooses only how fast
            inputs = way_inputs(self.way(ROW_BUCKETS[0], dtype), dtype)
            names = tuple(way for way in names if way_inputs(way, dtype) == inputs)
            default = default if default in names else names[0]
        if self.out_features * self.in_features < PACK_MIN_WEIGHTS or len(names) < 2:
            return default
        activations = str(dtype).removeprefix("torch.")
        key = f"{self.kind} {self.out_features}x{self.in_features}, {bucket} rows, {activations} activations"
        shape = (self.out_features, self.in_features)
        return remembered_choice(key, names, default, partial(self.measure, shape, bucket, names, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1))  # (M, K)
        way = self.way(rows.size(0), rows.dtype)
        return self.multiply(rows, way, self.bias).to(x.dtype).view(*x.shape[:-1], self.out_features)  # (..., N)

    def scales(self, dtype: torch.dtype) -> torch.Tensor:
        """The layer's scales in `dtype`, converted once (a model moved to another device converts again)."""
        scales = self.scale_tensor()
        kept = self._scales.get(dtype)
        if kept is None or kept.device != scales.device:
            kept = scales.to(dtype)
            self._scales[dtype] = kept
        return kept

    def _apply(self, fn, recurse=True):
        self._scales = {}  # moved or converted: the converted scales are made again from the new ones
        self._ways = {}  # and the ways chosen again: another device runs another way
        return super()._apply(fn, recurse)

    def device_type(self) -> str:
        return self.scale_tensor().device.type

    def scale_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def multiply(self, rows: torch.Tensor, way: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rows (M, K) times the weight, plus `bias` (N,) where given: (M, N)."""
        raise NotImplementedError

    @classmethod
    def measure(
        cls,
        shape: tuple[int, int],
        bucket: int,
        names: tuple[str, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, float]:
        """Seconds a call of each way (`names`, default every available one) takes on `bucket` rows of `dtype`
        activations and random weights of `shape`, each call reading a weight the caches have lost (copies spanning
        choices.COLD_BYTES, as the float32 kernels are measured)."""
        N, K = shape
        copies = max(2, min(64, -(-COLD_BYTES // max(1, cls.bytes_per_weight(N, K)))))
        layers = [cls.random(N, K) for _ in range(copies)]
        x = torch.randn(bucket, K, dtype=dtype)
        names = cls.available_ways(K) if names is None else names
        calls = {way: [partial(layer.multiply, x, way) for layer in layers] for way in names}
        return time_in_turns(calls)

    @classmethod
    def available_ways(cls, in_features: int, compiled: bool = True) -> tuple[str, ...]:
        """The ways this kind of layer can multiply on the CPU here (with `compiled`, gptlite.inference.cpu.native's
        among them, which builds them on the first call)."""
        return cls.ways

    def why_not(self, way: str) -> str:
        """Why `way` is not among this layer's available ways."""
        return ""

    @staticmethod
    def bytes_per_weight(N: int, K: int) -> int:
        raise NotImplementedError

    @classmethod
    def random(cls, N: int, K: int) -> QuantizedLinear:
        raise NotImplementedError


def compiled_ways_for(cls: type[QuantizedLinear], in_features: int, compiled: bool = True) -> tuple[str, ...]:
    """`cls`'s compiled ways (gptlite.inference.cpu.native's) that take a layer of `in_features` inputs here, none
    without `compiled` or where the kernels could not be built: "native" an input width of whole vectors
    (`native.fits`), INT8_DOT of whole activation blocks (`native.block()`)."""
    if not compiled or not cls.compiled_ways or not native.fits(in_features) or not native.load():
        return ()
    return tuple(way for way in cls.compiled_ways if way != INT8_DOT or in_features % native.block() == 0)


def compiled_why_not(way: str, in_features: int) -> str:
    """Why the compiled `way` cannot run a layer of `in_features` inputs here."""
    why = native.why_not(in_features)
    if not why and way == INT8_DOT and in_features % native.block() != 0:
        return f"its input width {in_features} is not a multiple of {native.block()}"
    return why


class Int8Linear(QuantizedLinear):
    """A linear layer whose weight is int8 with a per-output-row scale: y = (x Q^T) * scale + bias."""

    kind = "int8"
    default_small = "dequantize"
    ways = ("bfloat16", "float32", "dequantize")  # dequantize last: what other devices run
    compiled_ways = ("native", INT8_DOT)

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(bias, *weight.shape)
        self.register_buffer("weight", weight)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_rows(linear.weight), linear.bias)

    @classmethod
    def random(cls, N: int, K: int) -> Int8Linear:
        return cls(torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N) / 127, None)

    @staticmethod
    def bytes_per_weight(N: int, K: int) -> int:
        return N * K

    def scale_tensor(self) -> torch.Tensor:
        return self.scale

    @classmethod
    def available_ways(cls, in_features: int, compiled: bool = True) -> tuple[str, ...]:
        """PyTorch's ways (its int8 kernel only where the input width is a multiple of 16), and gptlite's compiled
        kernel (float32 activations) where it was built and takes the layer's input width
        (gptlite.inference.cpu.native)."""
        ways = cls.ways if in_features % INT8PACK_MULTIPLE == 0 else ("dequantize",)
        return (*compiled_ways_for(cls, in_features, compiled), *ways)

    def why_not(self, way: str) -> str:
        if way in self.compiled_ways:
            return compiled_why_not(way, self.in_features)
        return (
            f"PyTorch's int8 kernel crashes on batches of rows {self.in_features} wide, not a multiple of "
            f"{INT8PACK_MULTIPLE}"
        )

    def multiply(self, rows: torch.Tensor, way: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if way == "native" and rows.size(0) > NATIVE_MAX_ROWS:  # a prompt: a GEMM that reads the weight once
            way = "dequantize"
        if way == "native":
            return self.multiply_natively(rows, bias)
        if way == INT8_DOT:
            return self.multiply_by_int8(rows, bias)
        if way == "dequantize":
            y = F.linear(rows, self.weight.to(rows.dtype)) * self.scale.to(rows.dtype)  # (M, N)
        else:
            dtype = ACTIVATIONS[way]
            y = torch.ops.aten._weight_int8pack_mm(rows.to(dtype), self.weight, self.scales(dtype))  # (M, N)
        return y if bias is None else y + bias

    def multiply_natively(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows (M, K) through gptlite's compiled kernel, in float32, whatever the layer's scales (per row or per
        group); the kernel adds the bias as it writes each output: (M, N)."""
        x = rows.to(torch.float32).contiguous()
        bias = None if bias is None else bias.to(torch.float32)
        return native.int8_linear(x, self.weight, self.scales(torch.float32), bias)

    def multiply_by_int8(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows (M, K) quantized to int8 per block and multiplied in integer arithmetic (native.int8_dot_linear),
        whatever M: a prompt's rows too, so that a row's numbers never depend on how many others share the call:
        (M, N) float32."""
        x = rows.to(torch.float32).contiguous()
        bias = None if bias is None else bias.to(torch.float32)
        return native.int8_dot_linear(x, self.weight, self.scales(torch.float32), bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight this layer multiplies by, in `dtype` (float32: exact)."""
        return self.scale.to(dtype)[:, None] * self.weight.to(dtype)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The weight's rows `idx` (...,) dequantized, in the scales' dtype: (..., K), a table's lookup."""
        return self.weight[idx].to(self.scale.dtype) * self.scale[idx, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8GroupLinear(Int8Linear):
    """An int8 linear layer with one scale per group of `group_size` consecutive inputs of a row, q8_0's blocks:
    y = x W^T + bias, W[n, k] = Q[n, k] * scale[n, k // group_size], scale (N, K / group_size).

    What the vocabulary's tables are quantized as (the tied embedding and output head, an untied embedding): a
    row of such a table is one token's embedding, and a few of the embedding's dimensions run several times larger
    than the rest, so one scale per row left the rest with a handful of int8 steps (the module docstring).
    PyTorch's int8 kernel takes one scale per row, so the ways are gptlite's compiled kernel
    (gptlite.inference.cpu.native, which takes group scales) and the dequantized weight."""

    kind = "int8 grouped"
    ways = ("chunks", "dequantize")  # dequantize last: what other devices run

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, scale, bias)
        self.group_size = self.in_features // scale.size(1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = TABLE_GROUP_SIZE) -> Int8GroupLinear:
        return cls(*quantize_int8_groups(linear.weight, group_size), linear.bias)

    @classmethod
    def random(cls, N: int, K: int) -> Int8GroupLinear:
        groups = K // TABLE_GROUP_SIZE if K % TABLE_GROUP_SIZE == 0 else 1
        return cls(torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N, groups) / 127, None)

    @classmethod
    def available_ways(cls, in_features: int, compiled: bool = True) -> tuple[str, ...]:
        """gptlite's compiled kernel where it was built and takes the layer's input width, and the dequantized
        weight (in chunks of rows, or whole)."""
        return (*compiled_ways_for(cls, in_features, compiled), *cls.ways)

    def why_not(self, way: str) -> str:
        if way in self.compiled_ways:
            return compiled_why_not(way, self.in_features)
        return "PyTorch's int8 kernel takes one scale per row, and this layer has one per group of inputs"

    def multiply(self, rows: torch.Tensor, way: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if way == "native" and rows.size(0) <= NATIVE_MAX_ROWS:
            return self.multiply_natively(rows, bias)
        if way == INT8_DOT:
            return self.multiply_by_int8(rows, bias)
        if way == "dequantize":
            return F.linear(rows, self.dequantized(rows.dtype), bias)  # (M, N)
        return self.multiply_in_chunks(rows, bias)  # chunks, or a prompt past the compiled kernel's rows

    def multiply_in_chunks(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows (M, K) times the weight dequantized CHUNK_WEIGHTS weights at a time into one buffer that stays in
        the cache, each chunk's outputs a GEMM: on the CPU, the whole dequantized weight (the vocabulary's table:
        150 MB of float32 for GPT-2) is fresh memory written and read again at every call, many times slower."""
        N = self.out_features
        K = self.in_features
        step = max(1, CHUNK_WEIGHTS // K)  # rows a chunk
        out = rows.new_empty(rows.size(0), N)  # (M, N)
        buffer = rows.new_empty(step, K // self.group_size, self.group_size)  # (step, G, g)
        for start in range(0, N, step):
            end = min(N, start + step)
            chunk = buffer[: end - start]
            chunk.copy_(self.weight[start:end].view(chunk.shape))  # int8 -> the activations' dtype
            chunk.mul_(self.scale[start:end, :, None])
            torch.mm(rows, chunk.view(-1, K).t(), out=out[:, start:end])  # (M, end - start)
        return out if bias is None else out + bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N = self.out_features
        groups = self.weight.view(N, -1, self.group_size).to(dtype)  # (N, G, g)
        return (groups * self.scale.to(dtype)[:, :, None]).view(N, self.in_features)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        groups = self.weight[idx].view(*idx.shape, -1, self.group_size).to(self.scale.dtype)  # (..., G, g)
        return (groups * self.scale[idx][..., None]).view(*idx.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Int4Linear(QuantizedLinear):
    """A linear layer whose weight is 4-bit codes in groups of `group_size` with one scale each (q4_0's rule, the
    module docstring): `nibbles` (N, K / 2) uint8, two codes a byte in the order gptlite's compiled kernel reads
    (native.pack_nibbles: q4_0's), and `scale` (N, K / group_size) float32. PyTorch's int4 kernel takes its own packed
    layout and scales (`torch_operands`), made from these the first time one of its ways multiplies."""

    kind = "int4"
    default_small = "float32"
    ways = ("bfloat16", "float32")
    compiled_ways = (INT8_DOT,)

    def default_way(self, dtype: torch.dtype) -> str:
        """The kernel at the activations' own dtype where it takes it, else at float32."""
        return "bfloat16" if dtype == torch.bfloat16 else self.default_small

    def __init__(
        self,
        nibbles: torch.Tensor,
        scale: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        in_features: int,
    ):
        super().__init__(bias, nibbles.size(0), in_features)
        self.group_size = group_size
        self.register_buffer("nibbles", nibbles)  # (N, K / 2) uint8
        self.register_buffer("scale", scale)  # (N, K / group_size) float32
        self._torch_layout: dict[str, torch.Tensor] = {}  # PyTorch's packed codes and its (G, N, 2) scales

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> Int4Linear:
        q, d = quantize_groups(weight, group_size)  # (N, K), (N, G)
        return cls(native.pack_nibbles(q), d.contiguous(), group_size, bias, weight.size(1))

    @classmethod
    def random(cls, N: int, K: int) -> Int4Linear:
        return cls.from_weight(torch.randn(N, K), None, INT4_GROUP_SIZES[0])

    @staticmethod
    def fits(weight: torch.Tensor, group_size: int) -> bool:
        """Whether the int4 kernels take this (N, K) weight in groups of `group_size` (PyTorch's packs output rows in
        blocks of 16)."""
        N, K = weight.shape
        return N % INT4_ROW_MULTIPLE == 0 and K % group_size == 0

    @staticmethod
    def bytes_per_weight(N: int, K: int) -> int:
        return N * K // 2

    def scale_tensor(self) -> torch.Tensor:
        return self.scale

    @classmethod
    def available_ways(cls, in_features: int, compiled: bool = True) -> tuple[str, ...]:
        """gptlite's int8 x int4 kernel where it was built (its groups are whole activation blocks), and PyTorch's."""
        return (*compiled_ways_for(cls, in_features, compiled), *cls.ways)

    def why_not(self, way: str) -> str:
        return compiled_why_not(way, self.in_features)

    def _apply(self, fn, recurse=True):
        self._torch_layout = {}  # moved or converted: PyTorch's layout is made again from the new codes
        return super()._apply(fn, recurse)

    def torch_operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """PyTorch's int4 kernel's operands: the codes in its packed layout (N, K / 2) and the scales with zeros of
        0 (K / group_size, N, 2) in `dtype` (it computes (q - 8) * scale + zero), made once."""
        key = str(dtype)
        if "packed" not in self._torch_layout:
            codes = native.unpack_nibbles(self.nibbles).to(torch.int32)  # (N, K)
            self._torch_layout["packed"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        if key not in self._torch_layout:
            d = self.scale.t()  # (G, N)
            self._torch_layout[key] = torch.stack([d, torch.zeros_like(d)], dim=2).to(dtype).contiguous()
        return self._torch_layout["packed"], self._torch_layout[key]

    def multiply(self, rows: torch.Tensor, way: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if way == INT8_DOT:
            x = rows.to(torch.float32).contiguous()
            bias = None if bias is None else bias.to(torch.float32)
            return native.int4_dot_linear(x, self.nibbles, self.scale, bias)  # (M, N)
        dtype = ACTIVATIONS[way]
        packed, scales_and_zeros = self.torch_operands(dtype)
        # the kernel takes a contiguous input only: a batch's last positions, x[:, -1], are a strided view
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(dtype).contiguous(), packed, self.group_size, scales_and_zeros
        )
        return y if bias is None else y + bias  # (M, N)

    def dequantized(self) -> torch.Tensor:
        """The (N, K) float32 weight this layer multiplies by: each code less 8 times its group's scale (exact)."""
        N = self.out_features
        codes = native.unpack_nibbles(self.nibbles).view(N, -1, self.group_size).float() - 8  # (N, G, g)
        return (codes * self.scale[:, :, None]).view(N, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group_size={self.group_size}"


class Int8Embedding(nn.Module):
    """The token embedding as an int8 table: a row is looked up and dequantized. With a tied int8 head the table is
    the output head's (weight tying survives quantization: `head` is that Int8Linear, not registered twice); an
    untied embedding, or one tied to an int4 head, owns its table."""

    def __init__(self, head: Int8Linear, owned: bool = False):
        super().__init__()
        if owned:
            self.table = head  # registered: moves and saves with the model
        else:
            self.head = [head]  # a plain list: the table belongs to the head

    def _table(self) -> Int8Linear:
        return self.table if "table" in self._modules else self.head[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._table().rows(idx)  # (..., C)

    @property
    def weight(self) -> torch.Tensor:
        """The scales: their dtype and device are the model's, what new KV caches and generators take."""
        return self._table().scale


def check_mode(mode: str, group_size: int = INT4_GROUP_SIZES[0]) -> None:
    """ValueError unless mode is a quantization this module does ("" = none) with a group size it takes."""
    if mode not in ("", *MODES):
        raise ValueError(f"quantize={mode!r} is not supported; use {' or '.join(map(repr, MODES))}, or leave it out")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise ValueError(f"quantize='int4' with group_size={group_size}: use one of {sizes} (32 is q4_0's)")


def is_quantized(model: Transformer) -> bool:
    return isinstance(model.lm_head, QuantizedLinear)


def quantize(model: Transformer, mode: str = "int8", group_size: int = INT4_GROUP_SIZES[0]) -> Transformer:
    """Quantize model's weights in place (see the module docstring) and return it, in eval mode."""
    check_mode(mode, group_size)
    if not mode:
        return model
    if model.config.n_experts:
        raise ValueError(
            f"quantize={mode!r} quantizes linear layers, and this model's experts are n_experts="
            f"{model.config.n_experts} matrices stacked in one weight, which it does not; leave --quantize out"
        )
    if is_quantized(model):
        return model.eval()  # already quantized
    if mode == "int4" and model.lm_head.weight.device.type != "cpu":
        raise ValueError(
            f"quantize='int4' runs on the CPU (PyTorch's int4 kernel is a CPU one); the model is on "
            f"{model.lm_head.weight.device.type}: use int8 there, or bfloat16 weights"
        )
    float_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))  # float32's
    make = int8_rows if mode == "int8" else partial(int4_or_int8, group_size=group_size)
    for block in model.blocks:
        for parent in (block.attn, block.ffn):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight, child.bias))
    tied = model.lm_head.weight is model.tok_emb.weight
    embedding = model.tok_emb.weight
    make_head = int8_table if mode == "int8" else partial(int4_or_int8, group_size=group_size, int8=int8_table)
    model.lm_head = make_head(model.lm_head.weight, model.lm_head.bias)
    if tied and isinstance(model.lm_head, Int8Linear):
        model.tok_emb = Int8Embedding(model.lm_head)
    else:
        model.tok_emb = Int8Embedding(int8_table(embedding), owned=True)  # (V, C) rows
    if mode == "int4":
        say_what_stayed_int8(model, group_size)
    if model.lm_head.scale_tensor().device.type == "cpu":
        say_when_slower(mode, float_bytes, last_level_cache_bytes())
    return model.eval().requires_grad_(False)


def say_when_slower(mode: str, float_bytes: int, cache_bytes: int | None) -> None:
    """One warning line where quantizing makes decoding slower on this CPU: a model whose float32 matrices
    (`float_bytes`) fit in the CPU's last-level cache (`cache_bytes`) streams no weights from memory for
    quantization to save, and its kernels' extra work per weight and per call costs more than float32's."""
    if cache_bytes is None or float_bytes > cache_bytes:
        return
    warnings.warn(
        f"gptlite: {mode} decodes this model slower than float32 on this CPU: its float32 matrices "
        f"({float_bytes / 2**20:.1f} MiB) fit in the CPU's {cache_bytes / 2**20:.0f} MiB cache, so there is no memory "
        f"traffic to save; quantize models larger than the cache (leave --quantize out for this one)",
        stacklevel=3,
    )


def last_level_cache_bytes() -> int | None:
    """The size of this CPU's largest data (or unified) cache, as Linux lists the first core's caches under
    /sys/devices/system/cpu/cpu0/cache; None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()  # e.g. "32768K"
            kind = (index / "type").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        digits, unit = (size[:-1], units[size[-1]]) if size[-1:] in units else (size, 1)
        if kind != "Instruction" and digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def matrices(model: Transformer) -> dict[str, QuantizedLinear]:
    """The quantized model's matrices by name: the blocks' and the output head (not the embedding's own table)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear) and not name.startswith("tok_emb.")
    }


def layer_types(model: Transformer) -> dict[str, int]:
    """How many of the model's matrices each type holds, e.g. {"int4": 6, "int8": 1}: what was done, which int4 does
    only where its kernel takes the shape (empty for a model not quantized)."""
    types: dict[str, int] = {}
    for layer in matrices(model).values():
        kind = "int4" if isinstance(layer, Int4Linear) else "int8"
        types[kind] = types.get(kind, 0) + 1
    return dict(sorted(types.items()))


def quantized_as(model: Transformer) -> str:
    """The types the model's matrices are, as a record states them: "int8", "int4", "int4+int8" (int4 where its kernel
    takes the shape, int8 elsewhere), or "" for a model not quantized."""
    return "+".join(layer_types(model))


def say_what_stayed_int8(model: Transformer, group_size: int) -> None:
    """One warning line naming the matrices int4's kernel could not take, which stayed int8, and why."""
    kept = {name: layer for name, layer in matrices(model).items() if not isinstance(layer, Int4Linear)}
    if not kept:
        return
    shapes = {}  # one entry per role: blocks.*.attn.qkv stands for every block's
    for name, layer in kept.items():
        role = re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        shapes.setdefault(role, f"{role} {layer.out_features}x{layer.in_features}")
    warnings.warn(
        f"gptlite: int4 needs output widths that are multiples of {INT4_ROW_MULTIPLE} and input widths that are "
        f"multiples of its group size {group_size}; {len(kept)} of {len(matrices(model))} layers are int8 "
        f"({', '.join(shapes.values())})",
        stacklevel=3,
    )


def int8_rows(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """A block's matrix in int8, one scale per output row."""
    return Int8Linear(*quantize_rows(weight), bias)


def int8_table(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """A vocabulary table (an output head, an embedding) in int8: one scale per group of TABLE_GROUP_SIZE weights
    (Int8GroupLinear, q8_0's blocks) where its width is a multiple of it, else one per row."""
    if weight.size(1) % TABLE_GROUP_SIZE == 0:
        return Int8GroupLinear(*quantize_int8_groups(weight, TABLE_GROUP_SIZE), bias)
    return int8_rows(weight, bias)


def int4_or_int8(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    int8: Callable[[torch.Tensor, torch.Tensor | None], Int8Linear] = int8_rows,
) -> QuantizedLinear:
    """The layer in int4 where the int4 kernel takes its shape, else in int8 (made by `int8`)."""
    if Int4Linear.fits(weight, group_size):
        return Int4Linear.from_weight(weight, bias, group_size)
    return int8(weight, bias)


def gguf_type_of(model: Transformer) -> str:
    """The GGUF type a quantized model's weights are ("q8_0" for int8, "q4_0" for int4 in groups of 32; "" for int4
    in other groups, which llama.cpp has no type for)."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not layers:
        return "q8_0"
    return "q4_0" if all(layer.group_size == 32 for layer in layers) else ""


def dequantized_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The float32 state dict of the float model a quantized one multiplies by, under the float model's names: each
    quantized layer's `weight` dequantized (its other buffers left out), and a tied model's embedding the head's
    weight, as in the float model (with an int4 head, the int4 weights: llama.cpp's file holds one table for both)."""
    state = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedLinear):
            state[f"{prefix}weight"] = module.dequantized()
            if module.bias is not None:
                state[f"{prefix}bias"] = module.bias
        elif not isinstance(module, Int8Embedding):
            state.update({f"{prefix}{key}": value for key, value in module.named_parameters(recurse=False)})
            state.update({f"{prefix}{key}": value for key, value in module.named_buffers(recurse=False)})
    state = {k: v for k, v in state.items() if not k.startswith("tok_emb.table.")}
    if model.config.tie_embeddings:
        state["tok_emb.weight"] = state["lm_head.weight"]
    else:
        state["tok_emb.weight"] = model.tok_emb.table.dequantized()
    return state
