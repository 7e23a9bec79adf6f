"""The CPU fast path of eager decoding: each large linear layer runs through the kernel that measured fastest for its
shape on this CPU, in a view of the model that shares everything else (`packed_for_cpu`).

The kernels: per-thread weight slabs (`SlabLinear`, one row), oneDNN on a prepacked weight (`PackedLinear`), plain
`F.linear` (MKL), and gptlite's own compiled kernel (`NativeLinear`, gptlite.inference.cpu.native: each thread streams
its share of the weight once for all the rows), where it could be built on this machine. Which one streams a layer's
weights fastest depends on the CPU: on a 2-core AMD EPYC with AVX2 the slabs led at one row and oneDNN at a batch, and
on an Intel Xeon with AVX-512 and AMX the slab path made batch-1 decode slower than Hugging Face's plain linear layers.
So the choice is measured, not assumed: the first time a shape and row count meet a CPU, each kernel runs it a few
times on a random weight of that shape, and the fastest replaces the default (the compiled kernel; without it, slabs
at one row and oneDNN at a batch) where it was at least 10% faster (a closer call is within what other work on the
machine can shift); the choice is kept in a small JSON file (`choices_file`) under the CPU's model name, the thread
count and torch's version, so that later processes start without measuring. The candidates are part of the kept
choice's name, so that a kernel that becomes available (the compiled one, once a compiler is installed) is measured
then.

Where the compiled kernels are loaded, a decode step's attention (the token's keys and values written into the
cache, and its heads attending over it) runs in one call of theirs too (gptlite.model.network's `NativeAttention`):
through PyTorch it took a dozen operator calls a layer, which on a small model cost more than its weights took to
stream. And where each matrix of a block takes the compiled kernel, the block's whole decode step does (`NativeBlock`:
norms, matrices, attention, activation and residual additions in one call), sparing the operator calls between its
matrices.

GPTLITE_CPU_LINEAR=slab|packed|linear|native forces one kernel for every layer (to compare them, or when a
measurement went wrong); deleting the file measures again. A measurement taken while other processes kept the CPU
busy is used by the process that took it and not kept, as the load shifts one kernel's time more than another's.
"""

from __future__ import annotations

import copy
import json
import os
import time
import weakref
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.device import CpuThreads, cpu_info, cpu_times, huge_pages
from gptlite.files import write_text
from gptlite.inference.cpu import native

if TYPE_CHECKING:
    from gptlite.model.network import Transformer


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


class PlainLinear(nn.Module):
    """An nn.Linear through F.linear (MKL's GEMM, or its matrix-vector product at one row), as the model runs it:
    the measured choice where it streams the weights fastest."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class NativeLinear(nn.Module):
    """An nn.Linear through gptlite's compiled kernel (`torch.ops.gptlite.float_linear`, gptlite.inference.cpu.native):
    each thread reads its contiguous share of the weight's rows once, in streams prefetched ahead, and multiplies up to
    8 rows of the input into each weight row while that row is in the cache. More rows than native.MAX_ROWS (a
    prompt) go through F.linear, PyTorch's GEMM, which reads the weight once however many rows there are. Only for
    layers whose input width `native.fits`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > native.MAX_ROWS * x.size(-1):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.gptlite.float_linear(x, self.weight, self.bias)  # (..., N)

    def runs_natively(self, rows: int) -> bool:
        """Whether gptlite.model.network's NativeBlock may multiply this layer in its step (at up to native.MAX_ROWS
        rows): always, the view having chosen the compiled kernel for it."""
        return True

    def native_operands(self) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """(weight, scale, bias) as the compiled block step takes them: a float32 weight has no scale."""
        return self.weight, None, self.bias


def one_call_variant(module: nn.Module) -> type[nn.Module] | None:
    """The class whose decode steps run in one call of gptlite's compiled kernels that `module` can become, as the
    module itself answers (its `one_call_variant`): gptlite.model.network's NativeAttention for an attention layer,
    NativeBlock for a block; None for other modules, and for what the kernels do not compute (rotary positions, q/k
    norms, windows, other norms or activations). Asked, not imported: gptlite.model.network imports generation, which
    imports this module."""
    variant = getattr(module, "one_call_variant", None)
    return None if variant is None else variant()


KERNELS = ("slab", "packed", "linear", "native")
DEFAULT = {True: "slab", False: "packed"}  # the kernels that led on the AVX2 machine, at one row and at a batch
MARGIN = 0.9  # another kernel replaces the default one where it measured at least 10% faster
PACK_MIN_WEIGHTS = 1 << 18  # smaller layers (the char model's) decode faster as they are: per-call overhead
FORCE_ENV = "GPTLITE_CPU_LINEAR"
# other processes kept at least this many cores busy, on average, while a measurement ran: its choice holds for this
# process only, and the next one measures again (the load slows each kernel by its own share, not alike)
LOADED = CpuThreads.BUSY
_choices: dict[Path, dict[str, dict[str, str]]] = {}  # each choices file's contents, read once per process
_unkept: dict[tuple[str, str], str] = {}  # (machine, key) -> a choice measured under load, for this process only


def choices_file() -> Path:
    """Where the measured choices are kept: $XDG_CACHE_HOME/gptlite (or ~/.cache/gptlite)/cpu_linear.json."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "gptlite" / "cpu_linear.json"


def machine_key() -> str:
    """What a measurement holds for: the CPU's model, the thread count, torch's version."""
    return f"{cpu_info()[0]} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def make_kernel(name: str, linear: nn.Linear, rows: int) -> nn.Module:
    """`linear` as kernel `name` for `rows` rows at a time (1: one row decoding)."""
    if name == "slab":
        return SlabLinear(linear)
    if name == "packed":
        return PackedLinear(linear, rows)
    if name == "native":
        return NativeLinear(linear)
    return PlainLinear(linear)


def available_kernels(shape: tuple[int, int], rows: int) -> tuple[str, ...]:
    """The kernels that can run a layer of weight `shape` (N, K) at `rows` rows here: the slabs at one row only,
    the compiled kernel where it was built (gptlite.inference.cpu.native) and takes the layer's input width."""
    names = [name for name in KERNELS if name != "slab" or rows == 1]
    if not (native.fits(shape[1]) and native.load()):
        names.remove("native")
    return tuple(names)


COLD_BYTES = 128 << 20  # measured weights span at least this much memory, more than a CPU's last-level cache


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


def time_in_turns(calls: dict[str, list[Callable[[], object]]], rounds: int = 5) -> dict[str, float]:
    """The seconds one call of each kind takes: the best of `rounds` rounds over all of that kind's calls (each on
    a copy of the weight of its own, so that each reads memory, not cache), the kinds taking turns within each
    round so that a burst of other work slows all of them alike. Every call runs once first (allocations, packing)."""
    best = dict.fromkeys(calls, float("inf"))
    with torch.no_grad():
        for each in calls.values():
            for call in each:
                call()
        for _ in range(rounds):
            for name, each in calls.items():
                start = time.perf_counter()
                for call in each:
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / len(each))
    return best


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


def remembered_choice(key: str, names: Sequence[str], default: str, measure: Callable[[], dict[str, float]]) -> str:
    """The choice among `names` kept for `key` on this machine (`machine_key`) in the choices file, or, when there
    is none, `measure()`'s fastest among `names` where it beat `default` by the margin (else `default`), kept in the
    file for the next process, unless other processes kept LOADED cores or more busy while it measured: then the
    choice holds for this process only, and the next measures again. The candidates are part of the key: another set
    of them is measured again."""
    path = choices_file()
    if path not in _choices:
        _choices[path] = read_choices(path)
    choices = _choices[path]
    machine = machine_key()
    key = f"{key} among {', '.join(names)}"
    kept = choices.get(machine, {}).get(key, _unkept.get((machine, key)))
    if kept in names:
        return kept
    before = cpu_times()
    start = time.monotonic()
    times = measure()
    others = cores_busy_elsewhere(before, cpu_times(), time.monotonic() - start)
    choice = default
    fastest = min((name for name in names if name in times), key=times.get)  # only a candidate, whatever was timed
    if times[fastest] < MARGIN * times[choice]:
        choice = fastest
    if others is not None and others >= LOADED:
        _unkept[machine, key] = choice  # measured while other work ran: not kept for good
        return choice
    choices.setdefault(machine, {})[key] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(choices, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home: the choice holds for this process, and is measured again in the next
    return choice


def cores_busy_elsewhere(
    before: tuple[float, float] | None, after: tuple[float, float] | None, seconds: float
) -> float | None:
    """How many cores other processes kept busy, on average, over `seconds` between two of gptlite.device's
    `cpu_times` (the machine's busy time less this process's own); None where the load cannot be read."""
    if before is None or after is None:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / max(seconds, 1e-9)


def read_choices(path: Path) -> dict[str, dict[str, str]]:
    """The choices file's {machine: {shape: kernel}}; empty when there is none yet or it is not such a table (then
    what is measured next replaces it)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        return {}
    return table


_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its weights' state, layout, view)


def called_directly(module: nn.Module) -> nn.Module:
    """A module the view made or copied (never one of the model's own), changed to be called as a plain function:
    its class becomes a subclass whose `__call__` is its `forward` (nn.Module's call looks for hooks to run first),
    and its submodules and parameters become plain attributes of it (nn.Module finds them in Python, through
    `__getattr__`, at every access). A decode step makes a few hundred such calls and accesses, and the first after
    each matrix runs with the caches full of weights: together a few per cent of a GPT-2 step on the Intel Xeon
    (docs/generation.md). Buffers stay nn.Module's (a module may replace one, as a position table grows, which the
    view would not see), and so does a module with hooks, its own or every module's, so that they run (the view is
    made again when hooks are added or removed: `hook_state`)."""
    if hook_count(module) or global_hook_count():
        return module
    module.__class__ = direct_class(type(module))
    module.__dict__.update(module._modules)
    module.__dict__.update(module._parameters)
    return module


def hook_count(module: nn.Module) -> int:
    """The hooks nn.Module's call runs around `module`'s forward (a copy shares the model's module's)."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return sum(len(table) for table in hooks)


def global_hook_count() -> int:
    """The hooks registered to run around every module's forward (torch.nn.modules.module's)."""
    from torch.nn.modules import module as torch_module

    return len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)


def hook_state(model: nn.Module) -> tuple[int, ...]:
    """Where hooks are registered, for the kept view to be made again when that changes."""
    return (global_hook_count(), *(hook_count(m) for m in model.modules()))


@cache
def direct_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` under its own name, called straight through to its forward."""
    return type(cls.__name__, (cls,), {"__call__": cls.forward, "__module__": cls.__module__})


def packed_for_cpu(model: Transformer, rows: int) -> Transformer:
    """The model as eager decoding on the CPU runs it: a view that shares every module and tensor except the nn.Linear
    layers of at least PACK_MIN_WEIGHTS weights, which become the kernel measured fastest for their shape at one
    row, or at a batch (measured at 8 rows); smaller layers are bound by per-call overhead, and are left as they
    are. Where gptlite's compiled kernels are loaded, the attention layers that can (`one_call_variant`) become
    gptlite.model.network's NativeAttention (a decode step's attention in one call), quantized models' too, and the
    blocks that can and whose four matrices all took the compiled kernel become NativeBlock (a block's decode step in
    one call). The modules the view makes or copies (the ones above, the modules that hold them, and the norms, whose
    class says `views_may_copy`) are called directly (`called_directly`). The view is kept for the next call (the
    slabs and packed copies cost up to as much memory as the linear weights) and made again when the weights, the
    hooks or the thread count change. Each time, the weights are first backed by huge pages where Linux can
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
        copied = getattr(module, "views_may_copy", False)  # called at every layer: worth calling directly
        return copied or any(packs(m) or runs_in_one_call(m) is not None for m in module.modules())

    def multiplies_natively(variant: type[nn.Module], original: nn.Module, clone: nn.Module) -> bool:
        # a block step multiplies the block's weights itself: only where each of its matrices was to take the
        # compiled kernel (a float32 layer the view made a NativeLinear, an int8 one whose measured way is the
        # compiled kernel; not int4, a LoRA'd layer or one measured faster another way), no hook waits on a module
        # it would not call, and nothing is dropped out (it computes eval mode's block)
        native = all(
            hasattr(layer, "runs_natively") and layer.runs_natively(layout[0]) for layer in variant.matrices(clone)
        )
        hooked = global_hook_count() or any(hook_count(m) for m in original.modules())
        return native and not hooked and not original.training

    def view(module: nn.Module) -> nn.Module:
        if packs(module):
            kernel = make_kernel(choose_kernel(tuple(module.weight.shape), layout[0]), module, layout[0])
            return called_directly(kernel)
        if type(module) is nn.Dropout and not module.training:
            return called_directly(nn.Identity())  # what it computes in eval mode
        if not changes(module):
            return module  # shared as it is
        clone = copy.copy(module)  # the same parameters and buffers; its own table of submodules
        clone._modules = {name: view(child) for name, child in module._modules.items()}
        variant = runs_in_one_call(module)
        multiplies = hasattr(variant, "matrices")  # NativeBlock's step runs the block's matrices
        if variant is not None and (not multiplies or multiplies_natively(variant, module, clone)):
            clone.__class__ = variant
        return called_directly(clone)

    if not changes(model):
        return model  # nothing kept: a page already huge takes microseconds to check
    _packed[model] = (state, layout, view(model))
    return _packed[model][2]
