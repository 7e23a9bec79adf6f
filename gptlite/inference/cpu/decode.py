"""The CPU fast path of eager decoding: each large linear layer runs through the kernel that measured fastest for its
shape on this CPU, in a view of the model that shares everything else (`packed_for_cpu`).

The kernels (gptlite.inference.cpu.linears): per-thread weight slabs (`SlabLinear`, one row), oneDNN on a prepacked
weight (`PackedLinear`), plain `F.linear` (MKL), and gptlite's compiled kernel (`NativeLinear`,
gptlite.inference.cpu.native: each thread streams its share of the weight once for all the rows), where it could be
built on this machine. Which one streams a layer's weights fastest depends on the CPU: on a 2-core AMD EPYC with AVX2
the slabs led at one row and oneDNN at a batch, and on an Intel Xeon with AVX-512 and AMX the slab path made batch-1
decode slower than Hugging Face's plain linear layers. So the choice is measured, not assumed: the first time a shape
and row count meet a CPU, each kernel runs it a few times on a random weight of that shape, and the fastest replaces the
default (the compiled kernel; without it, slabs at one row and oneDNN at a batch) where it was at least 10% faster (a
closer call is within what other work on the machine can shift); the choice is kept per machine
(gptlite.inference.cpu.choices), so that later processes start without measuring. The candidates are part of the kept
choice's name, so that a kernel that becomes available (the compiled one, once a compiler is installed) is measured
then.

Where the compiled kernels are loaded, a decode step's attention (the token's keys and values written into the
cache, and its heads attending over it) runs in one call of theirs too, and where each matrix of a block takes the
compiled kernel, the block's whole decode step does (gptlite.inference.cpu.blocks: `NativeAttention`, `NativeBlock`,
wrappers around the view's copies of the model's modules, chosen by the modules' types).

The view is built from outside the model: the model's modules are shared or copied, never changed (no module changes
its class), and every parameter and buffer of the view is the model's own (gptlite.inference.cpu.direct).

GPTLITE_CPU_LINEAR=slab|packed|linear|native forces one kernel for every layer (to compare them, or when a
measurement went wrong); deleting the choices file measures again.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from gptlite.device import huge_pages
from gptlite.inference.cpu import native
from gptlite.inference.cpu.blocks import one_call_step, one_call_variant
from gptlite.inference.cpu.choices import COLD_BYTES, PACK_MIN_WEIGHTS, remembered_choice, time_in_turns
from gptlite.inference.cpu.direct import copied, hook_state, made
from gptlite.inference.cpu.linears import NativeLinear, PackedLinear, PlainLinear, SlabLinear
from gptlite.model.network import LayerNorm, RMSNorm

if TYPE_CHECKING:
    from gptlite.model.network import Transformer

KERNELS = ("slab", "packed", "linear", "native")
DEFAULT = {True: "slab", False: "packed"}  # the kernels that led on the AVX2 machine, at one row and at a batch
FORCE_ENV = "GPTLITE_CPU_LINEAR"
# the norms: called at every layer, their state their parameters and fixed settings, so worth copying to call directly
COPIED = (LayerNorm, RMSNorm)


def make_kernel(name: str, linear: nn.Linear, rows: int, direct: bool = False) -> nn.Module:
    """`linear` as kernel `name` for `rows` rows at a time (1: one row decoding); with `direct`, called directly, as
    the view's own modules are (gptlite.inference.cpu.direct)."""
    kernel = {"slab": SlabLinear, "packed": PackedLinear, "native": NativeLinear}.get(name, PlainLinear)
    arguments = (linear, rows) if kernel is PackedLinear else (linear,)
    return made(kernel, *arguments) if direct else kernel(*arguments)


def available_kernels(shape: tuple[int, int], rows: int) -> tuple[str, ...]:
    """The kernels that can run a layer of weight `shape` (N, K) at `rows` rows here: the slabs at one row only,
    the compiled kernel where it was built (gptlite.inference.cpu.native) and takes the layer's input width."""
    names = [name for name in KERNELS if name != "slab" or rows == 1]
    if not (native.fits(shape[1]) and native.load()):
        names.remove("native")
    return tuple(names)


def measure(shape: tuple[int, int], rows: int, rounds: int = 5) -> dict[str, float]:
    """Seconds a call of each kernel takes on `rows` rows of a random (N, K) float32 weight, as decoding calls it: a
    model's weights are far larger than the CPU's caches, so each layer's weight comes from memory. So each kernel
    gets copies of the weight spanning COLD_BYTES and calls them in turn, each call reading a weight the caches have
    since lost (`time_in_turns`). Each kernel `available_kernels` names is measured. For GPT-2-124M's five
    shapes, one row and eight, this takes a few seconds."""
    N, K = shape
    copies = max(2, min(64, -(-COLD_BYTES // (N * K * 4))))  # the smallest layers packed (1 MiB) span 64 MiB
    names = available_kernels(shape, rows)
    kernels = {n: [] for n in names}
    for _ in range(copies):
        linear = nn.Linear(K, N, bias=False)
        with torch.no_grad():
            linear.weight.normal_(0.0, 0.02)
        for name in names:
            kernels[name].append(make_kernel(name, linear, rows))
    x = torch.randn(rows, K)
    return time_in_turns({name: [partial(kernel, x) for kernel in each] for name, each in kernels.items()}, rounds)


def choose_kernel(shape: tuple[int, int], rows: int) -> str:
    """The kernel for a linear layer of weight `shape` (N, K) at `rows` rows: forced by GPTLITE_CPU_LINEAR, kept
    from an earlier measurement on this machine, or measured now and kept."""
    forced = os.environ.get(FORCE_ENV)
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"{FORCE_ENV}={forced!r}: choose one of {', '.join(KERNELS)}, or unset it to measure")
        if forced == "native" and forced not in available_kernels(shape, rows):
            raise ValueError(
                f"{FORCE_ENV}=native: gptlite's compiled kernel cannot run a {shape[0]}x{shape[1]} layer here "
                f"({native.why_not(shape[1])}); choose slab, packed or linear, or unset it to measure"
            )
        return "linear" if forced == "slab" and rows != 1 else forced
    key = f"{shape[0]}x{shape[1]}, {rows} rows"
    names = available_kernels(shape, rows)
    return remembered_choice(key, names, default_kernel(names, rows), lambda: measure(shape, rows))


def default_kernel(names: Sequence[str], rows: int) -> str:
    """The kernel another must beat by the margin: the compiled one where it is among `names` (on the Intel Xeon, in
    whole decoding loops, it streamed the weights as fast as the fastest of PyTorch's and faster than the slabs,
    which each kernel timed alone hid), else the one that led on the AVX2 machine."""
    return "native" if "native" in names else DEFAULT[rows == 1]


_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its weights' state, layout, view)


def packed_for_cpu(model: Transformer, rows: int) -> Transformer:
    """The model as eager decoding on the CPU runs it: a view that shares every module and tensor except the nn.Linear
    layers of at least PACK_MIN_WEIGHTS weights, which become the kernel measured fastest for their shape at one row, or
    at a batch (measured at 8 rows); smaller layers are bound by per-call overhead, and are left as they are. Where
    gptlite's compiled kernels are loaded, the attention layers that can (`one_call_variant`) are wrapped in
    gptlite.inference.cpu.blocks' NativeAttention (a decode step's attention in one call), quantized models' too, and
    the blocks that can and whose four matrices all took the compiled kernel in NativeBlock (a block's decode step in
    one call). The modules the view makes or copies (the ones above, the modules that hold them, and the norms, COPIED)
    are called directly (gptlite.inference.cpu.direct); the model's own are never changed. The view is kept for the next
    call (the slabs and packed copies cost up to as much memory as the linear weights) and made again when the weights,
    the hooks or the thread count change. Each time, the weights are first backed by huge pages where Linux can
    (gptlite.device.huge_pages). Other devices and dtypes, and builds without oneDNN, get the model itself."""
    weight = model.tok_emb.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    layout = (1 if rows == 1 else 8, torch.get_num_threads())
    state = (model.training, hook_state(model), *((p.data_ptr(), p._version) for p in model.parameters()))
    kept = _packed.get(model)
    if kept is not None and kept[:2] == (state, layout):
        return kept[2]

    huge_pages([*model.parameters(), *model.buffers()])
    compiled = native.load()

    def packs(module: nn.Module) -> bool:
        # exactly nn.Linear: a LoRA layer (a subclass) packed as one would lose its adapters
        return type(module) is nn.Linear and module.weight.numel() >= PACK_MIN_WEIGHTS

    def runs_in_one_call(module: nn.Module) -> type[nn.Module] | None:
        return one_call_variant(module) if compiled else None

    def changes(module: nn.Module) -> bool:
        copies = isinstance(module, COPIED)  # called at every layer: worth calling directly
        return copies or any(packs(m) or runs_in_one_call(m) is not None for m in module.modules())

    def view(module: nn.Module) -> nn.Module:
        if packs(module):
            return make_kernel(choose_kernel(tuple(module.weight.shape), layout[0]), module, layout[0], direct=True)
        if type(module) is nn.Dropout and not module.training:
            return made(nn.Identity)  # what it computes in eval mode
        if not changes(module):
            return module  # shared as it is
        # the same parameters and buffers; its own table of submodules
        copy = copied(module, {name: view(child) for name, child in module._modules.items()})
        one_call = one_call_step(module, copy, layout[0]) if compiled else None
        return copy if one_call is None else one_call

    if not changes(model):
        return model  # nothing kept: a page already huge takes microseconds to check
    _packed[model] = (state, layout, view(model))
    return _packed[model][2]
