"""gptlite's compiled CPU decode kernels (matvec.cpp): built once per CPU, checked in a child process, loaded as
torch operators, and called through one typed Python function each. This is the one module that names
`torch.ops.gptlite`: everything else calls `float_linear`, `int8_linear`, `int8_dot_linear`, `int4_dot_linear`,
`cached_attention`, `block_step` and `argmax` here, with named operands (`CacheSlot`, `Matrix`, `Norm`,
`BlockWeights`, `BlockOptions`), and asks the library's own limits (`multiple()`, `max_rows()`, `block()`) rather than
copying its constants. The int4 codes' layout the integer kernels read is made and read here too (`pack_nibbles`,
`unpack_nibbles`), and the integer kernels' rule for quantizing activations restated in torch for references
(`quantized_blocks`).

`load()` makes the operators available and says whether it could. The first call on a machine compiles matvec.cpp with
the C++ compiler at hand (`$CXX`, else `c++`) against the installed torch, for this CPU's instruction set
(-march=native), with OpenMP where the compiler takes it (without, on one thread: `openmp_flags`), into the build cache
(GPTLITE_NATIVE_CACHE, default $XDG_CACHE_HOME or ~/.cache, then gptlite/native); it says so on stderr, with how long
it may take and, while the compiler runs, the time so far. The library is named by a hash of its source, the compiler,
torch's version and the CPU's features, so a cache shared between machines never runs a library built for another
CPU. Before a library is first loaded, a child process loads it and compares its operators
with PyTorch's own results: a library that crashes (an instruction this CPU lacks, a truncated file, a bad build) takes
down that child, never the caller, and is not used. A marker beside a library that passed holds the library's sha256 and
the CPU's digest; a library the marker does not vouch for that way is checked again, and one that fails is built anew.
Where GPTLITE_NATIVE is false (false, 0, no, off), there is no compiler, or the build, the cache (read-only, full) or
the check fails, `load()` says why in one line naming the fix and returns False, never raising, and decoding keeps
PyTorch's kernels: the compiled linear kernels are one more candidate that gptlite.inference.cpu.decode and
gptlite.inference.quantize measure, never a requirement, and attention, blocks and greedy picks keep PyTorch's way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from gptlite.config import FALSE_WORDS, TRUE_WORDS, parse_bool

SOURCE = Path(__file__).with_name("matvec.cpp")
DISABLE_ENV = "GPTLITE_NATIVE"
CACHE_ENV = "GPTLITE_NATIVE_CACHE"
# at::parallel_for, which the kernels split their work with, is OpenMP's in torch's builds; the process shares torch's
# libgomp (libomp on macOS)
OPENMP = ("-fopenmp",)
PROGRESS_SECONDS = 10  # how often a build says on stderr that it still runs
BUILD_TIMEOUT = 600  # seconds a build may take before it is given up
CHECK_TIMEOUT = 300  # seconds the child process's check may take
_state: dict[str, object] = {}  # "loaded": bool, "why": the reason it is not, "limits": the loaded library's Limits


class Limits(NamedTuple):
    """The library's own constants, as its `constants` operator reports them (matvec.cpp's kMultiple and kTile)."""

    multiple: int  # a layer's input width must be a multiple of this
    # rows multiplied per pass over a weight: each more reads the weight again, which past it makes PyTorch's GEMM
    # the faster (figures: docs/generation.md)
    tile: int
    # the integer kernels (`int8_dot_linear`, `int4_dot_linear`) quantize activations in blocks of this many numbers,
    # and take input widths (and a weight's groups) that are a multiple of it
    block: int


# What the library's `constants` reported when this module was written, answered where no library is loaded (no
# compiler, GPTLITE_NATIVE=0, before the first `load()`): nothing runs through the kernels then, and these only word
# answers such as `why_not`'s. Once a library loads, its own report replaces them (`limits`).
UNLOADED_LIMITS = Limits(multiple=16, tile=8, block=32)


def cache_dir() -> Path:
    """Where built libraries are kept: GPTLITE_NATIVE_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/gptlite/native."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "gptlite" / "native"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def arch_flags() -> list[str]:
    """The flags that build for this CPU's whole instruction set."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def cpu_features() -> str:
    """The CPU's model and feature flags, as Linux lists them (elsewhere the processor's name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def build_command(cxx: str, output: Path, arch: list[str], threads: Sequence[str] = OPENMP) -> list[str]:
    """The compiler's command line: matvec.cpp against the installed torch, for the instruction set `arch` names,
    its kernels' threads by the flags `threads` (OPENMP; none where the compiler takes no OpenMP: `openmp_flags`)."""
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *arch,
        "-O3",
        "-std=gnu++17",  # GNU mode: multiply-adds are fused, as -ffp-contract=fast
        "-shared",
        "-fPIC",
        *threads,
        "-w",  # torch's headers warn under some compilers; the build's own errors still print
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        str(SOURCE),
        "-o",
        str(output),
        *[f"-L{path}" for path in libraries],
        *[f"-Wl,-rpath,{path}" for path in libraries],
        "-lc10",
        "-ltorch_cpu",
    ]


def openmp_flags(cxx: str, scratch: Path) -> list[str]:
    """OPENMP where `cxx` builds a library with it (tried on a few lines in the folder `scratch`), else none, saying
    so in one line on stderr: Apple's clang takes no -fopenmp. at::parallel_for is inlined from torch's headers, and
    in torch's builds for Linux and macOS it runs on OpenMP's threads: built without OpenMP, the kernels run on one
    thread (PyTorch's kernels, measured beside them, keep their threads)."""
    source = scratch / "openmp.cpp"
    source.write_text("#include <omp.h>\nint threads() { return omp_get_max_threads(); }\n")
    command = [cxx, *OPENMP, "-shared", "-fPIC", str(source), "-o", str(scratch / "openmp.so")]
    try:
        taken = subprocess.run(command, capture_output=True, timeout=BUILD_TIMEOUT).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        taken = False
    if not taken:
        print(
            f"gptlite: {cxx} takes no {' '.join(OPENMP)}: the CPU decode kernels are built without OpenMP and run on "
            "one thread",
            file=sys.stderr,
            flush=True,
        )
    return list(OPENMP) if taken else []


def library_path(cxx: str) -> Path:
    """The library's file in the build cache, named by everything that decides its contents."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cxx.encode(), torch.__version__.encode(), cpu_features().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"matvec-{digest.hexdigest()[:16]}.so"


def load() -> bool:
    """Whether torch.ops.gptlite's kernels are loaded: built, checked and loaded on the first call, warning once
    (one line) where they cannot be. Never raises: the kernels are an optional speed-up."""
    if "loaded" not in _state:
        why = load_or_say_why()
        _state["loaded"] = why == ""
        _state["why"] = why
        if why:
            warnings.warn(
                f"gptlite: the compiled CPU kernels are not used ({why}); decoding runs PyTorch's", stacklevel=2
            )
    return bool(_state["loaded"])


def load_for_command(prog: str) -> bool:
    """`load()` for the command `prog`, called before its output starts: the first build's notes go to stderr on
    lines of their own before any text streams, and why the kernels are not used is one line, `PROG: note: ...`,
    not a Python warning with its source line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load()
    for warning in caught:
        print(f"{prog}: note: {warning.message}", file=sys.stderr, flush=True)
    return loaded


def load_or_say_why() -> str:
    """'' once the kernels are loaded into this process, else why not, in one line that names the fix."""
    try:
        return prepare_and_load()
    except Exception as error:  # an optional speed-up never fails the command: whatever was not foreseen says why
        return f"{type(error).__name__}: {error}".splitlines()[0]


def prepare_and_load() -> str:
    """load_or_say_why's work: the switch, the compiler, a checked library (`ready`), then the load."""
    setting = os.environ.get(DISABLE_ENV, "true")
    try:
        wanted = parse_bool(DISABLE_ENV, setting)
    except ValueError:
        return f"{DISABLE_ENV}={setting!r} is not a boolean; use one of {', '.join((*TRUE_WORDS, *FALSE_WORDS))}"
    if not wanted:
        return f"{DISABLE_ENV}={setting}"
    cxx = compiler()
    named = os.environ.get("CXX") or "c++"
    if cxx is None and len(named.split()) > 1:  # make's CXX may carry flags or a wrapper; this runs one program
        return (
            f"CXX={named!r} is not one program: gptlite runs $CXX alone, without flags; set CXX to the compiler's path"
        )
    if cxx is None:
        return f"no C++ compiler: {named} was not found; install one (g++) or set CXX"
    path = library_path(cxx)
    why = ready(cxx, path)
    if why:
        return why
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:  # its operators already registered by another library
        return f"loading {path}: {error}"
    register_shapes()
    _state["limits"] = library_limits()
    return ""


def ready(cxx: str, path: Path) -> str:
    """Makes `path` a library that passed `check` on this CPU: '' or why it could not. A library whose marker
    (`marker_text`) vouches for its bytes on this CPU is taken as it is; any other (no marker, an old one, a
    truncated or replaced file, a cache copied from another CPU) is checked again in a child process first, and one
    that fails there, or none, is built anew and checked. A library that fails is never loaded into this process."""
    vouched = path.is_file() and marker_text(path)
    if vouched and vouched == read_marker(path):
        return ""
    if path.is_file():
        why = check_in_child(path)
        if why == "":
            write_marker(path)
            return ""
        print(f"gptlite: {why}; building it again", file=sys.stderr)
    why = build(cxx, path) or check_in_child(path)
    if why == "":
        write_marker(path)
    return why


def marker_text(path: Path) -> str:
    """What the marker beside a library that passed the check holds: the library's sha256 and the digests of the CPU
    and torch it passed on, so that it vouches for those bytes there and nothing else ('' where the library cannot be
    read)."""
    try:
        library = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""
    cpu = hashlib.sha256(cpu_features().encode()).hexdigest()[:16]
    return f"checked: library sha256 {library}, cpu {cpu}, torch {torch.__version__}\n"


def read_marker(path: Path) -> str:
    """The text of the marker beside the library `path` ('' where there is none, or none that can be read)."""
    try:
        return path.with_suffix(".checked").read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def write_marker(path: Path) -> None:
    """Writes `path`'s marker whole or not at all; a cache that takes the library but not its marker (read-only,
    full) costs the next process another check, nothing else."""
    marker = path.with_suffix(".checked")
    scratch = marker.with_name(f".{marker.name}.{os.getpid()}")
    try:
        scratch.write_text(marker_text(path))
        os.replace(scratch, marker)
    except OSError:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)


def register_shapes() -> None:
    """The operators' output shapes, for torch.compile, which traces a model on tensors without data and calls the
    compiled kernels as opaque operators."""

    def product(x: torch.Tensor, weight: torch.Tensor, *scale_and_bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.size(0))  # (..., N), whatever the scale and bias

    def attention(qkv, k_cache, v_cache, slot, span, visible, scale, n_head: int, *head_operands) -> torch.Tensor:
        return qkv.new_empty(qkv.size(0), 1, n_head * k_cache.size(3))  # (B, 1, H D)

    def block(x: torch.Tensor, *operands) -> torch.Tensor:
        return torch.empty_like(x)  # (B, 1, C)

    torch.library.register_fake("gptlite::float_linear", product)
    torch.library.register_fake("gptlite::int8_linear", product)
    torch.library.register_fake("gptlite::cached_attention", attention)
    torch.library.register_fake("gptlite::block_step", block)
    torch.library.register_fake("gptlite::int8_dot_linear", product)
    torch.library.register_fake("gptlite::int4_dot_linear", product)
    torch.library.register_fake("gptlite::argmax", lambda logits: logits.new_empty(logits.size(0), dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# The operators, typed: the one place that calls torch.ops.gptlite (after a `load()` that returned True)


def library_limits() -> Limits:
    """The loaded library's own constants (its `constants` operator)."""
    reported = torch.ops.gptlite.constants()
    return Limits(multiple=int(reported["multiple"]), tile=int(reported["tile"]), block=int(reported["block"]))


def limits() -> Limits:
    """The loaded library's constants; UNLOADED_LIMITS where none is loaded."""
    return _state.get("limits", UNLOADED_LIMITS)


def multiple() -> int:
    """A layer's input width must be a multiple of this for the kernels to take it."""
    return limits().multiple


def max_rows() -> int:
    """The most rows the float32 kernel multiplies in one pass over a weight (and a block's step takes): a prompt of
    more takes PyTorch's GEMM, which reads the weight once however many rows there are."""
    return limits().tile


def block() -> int:
    """The integer kernels quantize activations in blocks of this many numbers: a layer's input width (and an int4
    weight's group) must be a multiple of it for them."""
    return limits().block


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) times weight (N, K), plus bias (N,): (..., N), all float32, K a multiple of `multiple()`."""
    return torch.ops.gptlite.float_linear(x, weight, bias)


def int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) float32 times the int8 weight codes (N, K), each times its scale, one per row (scale (N,)) or one per
    group of K / G inputs (scale (N, G)), plus bias (N,): (..., N) float32."""
    return torch.ops.gptlite.int8_linear(x, codes, scale, bias)


def int8_dot_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) float32, quantized to int8 per block of `block()` numbers (`quantized_blocks`' way), times the int8
    weight codes (N, K) in integer arithmetic, each block's sum times the scales, one per weight row (scale (N,)) or
    one per group of K / G inputs (scale (N, G)), plus bias (N,): (..., N) float32. K a multiple of `block()`."""
    return torch.ops.gptlite.int8_dot_linear(x, codes, scale, bias)


def int4_dot_linear(
    x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) float32 quantized as for `int8_dot_linear`, times the int4 weight (N, K / 2) uint8 (`pack_nibbles`'
    layout: a code q stands for q - 8), one scale per group of K / G inputs (scale (N, G)), plus bias (N,): (..., N)
    float32."""
    return torch.ops.gptlite.int4_dot_linear(x, nibbles, scale, bias)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (N, K) in [0, 15] -> (N, K / 2) uint8 as `int4_dot_linear` reads them: each block of 32 codes in
    16 bytes, code j in the low nibble of byte j and code j + 16 in the high one (q4_0's order, so that both halves
    of a block unpack with one shift and one mask). K a multiple of 32."""
    N, K = codes.shape
    blocks = codes.to(torch.uint8).view(N, K // 32, 2, 16)  # (N, K / 32, halves, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles`' inverse: (N, K / 2) uint8 -> the codes (N, K) uint8 in [0, 15]."""
    N, half = nibbles.shape
    blocks = nibbles.view(N, half // 16, 1, 16)  # (N, K / 32, 1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(N, 2 * half)


def quantized_blocks(x: torch.Tensor, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float32 quantized as the integer kernels quantize their activations, blocks of `width` numbers each
    with one scale d = max |x| / 127 (float32), codes round(x / d) (ties to even) -> (codes (..., K) float32 whole
    numbers in [-127, 127], scales (..., K / width) float32). The tests' and `check`'s reference."""
    blocks = x.float().unflatten(-1, (-1, width))  # (..., K / width, width)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return torch.round(blocks * inverse).flatten(-2), d.squeeze(-1)


def dequantized_blocks(x: torch.Tensor, width: int = 32) -> torch.Tensor:
    """x (..., K) as the integer kernels multiply it: its `quantized_blocks` codes times their scales, in float64
    (exact) -> (..., K)."""
    codes, d = quantized_blocks(x, width)
    return (codes.double().unflatten(-1, (-1, width)) * d.double()[..., None]).flatten(-2)


def assert_int_linear_close(
    got: torch.Tensor,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    what: str = "the product",
) -> None:
    """AssertionError naming `what` where an integer kernel's result `got` (..., N) is further from the exact product
    of x's quantized blocks (`dequantized_blocks`) and the weight codes (N, K) (int4's already less 8) times their
    scales, plus bias, than float32 can err in combining the blocks' exact sums (`linear_error_bound`)."""
    blocks = dequantized_blocks(x, block())
    assert_within(
        got, linear_reference(blocks, codes, scale, bias), linear_error_bound(blocks, codes, scale, bias), what
    )


class CacheSlot(NamedTuple):
    """One layer's cache as a decode step of one token per row reads and writes it: every row at one slot (sample.py's
    batch, its rows as long as each other), or each at its own (`slots`: the server's rows, a request each)."""

    keys: torch.Tensor  # (B, KV, L, D) float32, contiguous: the token's keys are written at `slot`
    values: torch.Tensor  # (B, KV, L, D) float32, contiguous: the token's values are written at `slot`
    slot: int  # the slot the token's keys and values go to (with `slots`, the last of theirs)
    span: int  # the step attends over slots 0..span-1
    visible: torch.Tensor | None  # (B, L) bool, which slots each row sees; None where it sees every one
    # (B,) int64: each row's own slot, where rows differ: row b's token goes there and it attends over slots 0..slots[b]
    slots: torch.Tensor | None = None


class Angles(NamedTuple):
    """RoPE's angles at each row's position, as the model's RotaryPositions computes them (its scaling, its base and
    direction, its attention factor all in the numbers): the leading R coordinates of every head's q and k are
    rotated, pairs (i, i + R/2) (rotate_half's)."""

    cos: torch.Tensor  # (B, R) float32, or (1, R) for every row
    sin: torch.Tensor  # (B, R) or (1, R)


class HeadNorms(NamedTuple):
    """RMSNorm over each head's q and over each head's k (Qwen3's), or over all of a row's q and all of its k (OLMo
    2's), before the rotation: the weights' widths say which."""

    q: torch.Tensor  # (D,) or (H D,) float32: q's weight (1 + weight for a norm with a unit offset; ones for none)
    k: torch.Tensor  # (D,) or (KV D,) float32: k's
    eps: float


def attention_operands(angles: Angles | None, head_norms: HeadNorms | None) -> list:
    """The operators' trailing operands of an attention's rotation and q/k norms (cos, sin, q_norm, k_norm, head_eps),
    each None (and the epsilon 0) where there is none."""
    cos, sin = angles if angles is not None else (None, None)
    q_norm, k_norm, eps = head_norms if head_norms is not None else (None, None, 0.0)
    return [cos, sin, q_norm, k_norm, eps]


def cached_attention(
    qkv: torch.Tensor,
    cache: CacheSlot,
    *,
    n_head: int,
    scale: float,
    angles: Angles | None = None,
    head_norms: HeadNorms | None = None,
    window: int = 0,
) -> torch.Tensor:
    """A decode step's attention in one call: the token's keys and values, the end of each row of qkv
    (B, 1, (H + 2 KV) D), written into `cache` at its slot, and the n_head query heads attending over the slots it
    shows, each key/value head serving H / KV of them, scores times `scale` -> (B, 1, H D). Where given, each head's
    q and k are first normalized (`head_norms`), then rotated (`angles`); the cache holds the keys so changed. A
    `window` > 0 (a sliding window's layer) attends over the slots [slot - window + 1, slot] only."""
    return torch.ops.gptlite.cached_attention(
        qkv,
        cache.keys,
        cache.values,
        cache.slot,
        cache.span,
        cache.visible,
        scale,
        n_head,
        *attention_operands(angles, head_norms),
        window,
        cache.slots,
    )


INPUT_BITS = {"float32": 32, "int8": 8}  # the operator's name for what each matrix multiplies (its input_bits)


class Matrix(NamedTuple):
    """A linear layer as a block's step multiplies it."""

    weight: torch.Tensor  # (N, K) float32, or int8 codes; or (N, K / 2) uint8 int4 codes (`pack_nibbles`)
    scale: torch.Tensor | None  # (N,) float32: an int8 weight's scale per row, (N, G) an int4 one's per group
    bias: torch.Tensor | None  # (N,) float32
    # what the weight multiplies: float32 activations, or the activations quantized to int8 (`int8_dot_linear`'s,
    # `int4_dot_linear`'s way; an int4 weight takes only these)
    inputs: str = "float32"


class Norm(NamedTuple):
    """A norm's tensors, each None where the norm has none."""

    weight: torch.Tensor | None  # (C,)
    bias: torch.Tensor | None  # (C,)


class BlockWeights(NamedTuple):
    """A block's tensors, pre-norm: x + attn_out(attention(qkv(attn_norm(x)))), then
    x + ffn_out(activation(fc(ffn_norm(x)))); post-norm (BlockOptions.position): x + attn_norm(attn_out(...(x))) and
    x + ffn_norm(ffn_out(...(x))); both: x + attn_post_norm(attn_out(...(attn_norm(x)))), and so for the
    feed-forward."""

    attn_norm: Norm
    qkv: Matrix  # (Q, C), Q = (H + 2 KV) D: rows q, then k, then v
    attn_out: Matrix  # (C, H D)
    ffn_norm: Norm
    fc: Matrix  # (F, C), or (2F, C) for a gated activation: rows gate, then value
    ffn_out: Matrix  # (C, F)
    head_norms: HeadNorms | None = None  # the attention's q/k norms, where it has them
    attn_post_norm: Norm | None = None  # the norms on the branches' outputs, where the norms stand on both sides
    ffn_post_norm: Norm | None = None


class BlockOptions(NamedTuple):
    """What a block's step computes besides its tensors."""

    # every norm's kind: "layernorm", "rmsnorm" (x / rms(x) times the weight, plus the bias) or "rmsnorm_unit_offset"
    # (times 1 + the weight: Gemma's)
    norm: str
    eps: float  # the norms' epsilon
    activation: str  # "gelu_tanh", "relu_squared", "silu_gate" (SwiGLU) or "gelu_gate" (GeGLU)
    n_head: int  # query heads (the key/value heads are the cache's)
    scale: float  # the attention scores' scale
    residual_scale: float  # each branch's output is added to the residual stream times this
    position: str = "pre"  # where the norms stand: "pre" (before each branch), "post" (on its output) or "both"
    window: int = 0  # > 0: the attention's sliding window (cached_attention's)


def block_step(
    x: torch.Tensor, weights: BlockWeights, cache: CacheSlot, options: BlockOptions, angles: Angles | None = None
) -> torch.Tensor:
    """A block's whole decode step in one call (`BlockWeights`' math, its norms where `options.position` puts them,
    the attention `cached_attention`'s, its q and k rotated by `angles` where given, the token's keys and values
    written into `cache`): x (B, 1, C) -> (B, 1, C), B at most `max_rows()`."""
    return torch.ops.gptlite.block_step(*block_step_arguments(x, weights, cache, options, angles))


def block_step_arguments(
    x: torch.Tensor, weights: BlockWeights, cache: CacheSlot, options: BlockOptions, angles: Angles | None = None
) -> list:
    """The compiled operator's 25 arguments, in its schema's order (matvec.cpp's TORCH_LIBRARY), from the named
    operands: the norms' tensors in the modules' order, the post-norms' last where the block has them."""
    norms = [weights.attn_norm.weight, weights.attn_norm.bias, weights.ffn_norm.weight, weights.ffn_norm.bias]
    if weights.attn_post_norm is not None:
        norms += [weights.attn_post_norm.weight, weights.attn_post_norm.bias]
        norms += [weights.ffn_post_norm.weight, weights.ffn_post_norm.bias]
    matrices = (weights.qkv, weights.attn_out, weights.fc, weights.ffn_out)
    return [
        x,
        norms,
        [matrix.weight for matrix in matrices],
        [matrix.scale for matrix in matrices],
        [matrix.bias for matrix in matrices],
        cache.keys,
        cache.values,
        cache.slot,
        cache.span,
        cache.visible,
        options.scale,
        options.n_head,
        options.norm,
        options.eps,
        options.activation,
        options.residual_scale,
        *attention_operands(angles, weights.head_norms),
        options.position,
        options.window,
        cache.slots,
        [INPUT_BITS[matrix.inputs] for matrix in matrices],
    ]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float32 -> (B,) int64, each row's first largest (a NaN counting as the largest), as torch.max's
    indices."""
    return torch.ops.gptlite.argmax(logits)


def build(cxx: str, path: Path, arch: list[str] | None = None) -> str:
    """Compiles matvec.cpp into `path` (written whole or not at all) for `arch` (default: this CPU, `arch_flags`);
    '' or why it failed, naming the fix. Says on stderr, each on its own line, that it compiles, for how long it may,
    and every PROGRESS_SECONDS that it still does."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return cache_error(path.parent, error)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-", ignore_cleanup_errors=True) as scratch:
            print(
                f"gptlite: compiling the CPU decode kernels for this CPU into {path} (once: about a minute on a "
                "small machine, and decoding waits for it)",
                file=sys.stderr,
                flush=True,
            )
            output = Path(scratch) / path.name
            why = compile_into(cxx, output, arch_flags() if arch is None else arch)
            if why:
                return why
            os.replace(output, path)
    except OSError as error:  # the scratch folder, the move: a read-only or full cache
        return cache_error(path.parent, error)
    return ""


def cache_error(folder: Path, error: OSError) -> str:
    """Why the build cache `folder` cannot take the library (read-only, full, not a folder), and the fix."""
    return f"cannot write the build cache {folder}: {error.strerror or error}; set {CACHE_ENV} to a writable folder"


def compile_into(cxx: str, output: Path, arch: list[str]) -> str:
    """Runs the compiler (`build_command`) to write `output`: '' or why it failed, naming the fix. Prints the time
    it has taken on stderr every PROGRESS_SECONDS while it runs, and stops it after BUILD_TIMEOUT seconds."""
    command = build_command(cxx, output, arch, openmp_flags(cxx, output.parent))
    fix = "set CXX to a working C++ compiler, or GPTLITE_NATIVE=0"
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        return f"{cxx} could not be started: {error.strerror or error}; {fix}"
    started = time.monotonic()
    while True:
        try:
            _, errors = process.communicate(timeout=PROGRESS_SECONDS)
            break
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - started
            if elapsed > BUILD_TIMEOUT:
                process.kill()
                process.communicate()
                return f"{cxx} took over {BUILD_TIMEOUT} s on {SOURCE.name}; {fix}"
            print(f"gptlite: still compiling the CPU decode kernels ({elapsed:.0f} s)", file=sys.stderr, flush=True)
    if process.returncode != 0:
        first = next((line for line in errors.splitlines() if "error" in line), errors.strip()[:300])
        full = [line.strip() for line in errors.splitlines() if "No space left on device" in line]
        if full:
            folder = output.parent.parent  # the build cache, which holds the scratch folder
            return f"no space left for the build ({full[0]}); free space in {folder} and TMPDIR, or set {CACHE_ENV}"
        said = f": {first}" if first else f" with exit status {process.returncode} and no message"
        return f"{cxx} failed on {SOURCE.name}{said}; {fix}"
    if not output.is_file():
        return f"{cxx} exited 0 on {SOURCE.name} but wrote no library; {fix}"
    return ""


def check_in_child(path: Path) -> str:
    """Runs `check(path)` in a child process: '' when the library's results match PyTorch's, else why not (a crash
    there, an instruction this CPU lacks or a truncated file, ends the child, never this process)."""
    command = [
        sys.executable,
        "-c",
        "import sys; from gptlite.inference.cpu.native import check; check(sys.argv[1])",
        str(path),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"checking {path} took over {CHECK_TIMEOUT} s"
    except OSError as error:
        return f"checking {path}: {sys.executable} could not be started ({error.strerror or error})"
    if done.returncode < 0:
        return f"checking {path} failed (killed by {signal_name(-done.returncode)})"
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"checking {path} failed ({tail})"
    return ""


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def check(path: str) -> None:
    """Loads the library at `path` and compares its operators with PyTorch's results: the linear ones at one row
    and at a batch, with and without a bias, on a width that is not a multiple of the thread count, the attention
    (`check_attention`) and a block's step (`check_block`), each within float32's own error on this CPU (never a
    fixed tolerance, which another CPU's order of additions can exceed), and its report of its constants (the width
    checked must be a multiple of its `multiple`): AssertionError if they differ."""
    torch.ops.load_library(path)
    reported = library_limits()
    assert reported.tile > 0 and reported.multiple > 0 and 192 % reported.multiple == 0, f"constants {reported}"
    generator = torch.Generator().manual_seed(0)
    N = 203
    K = 192
    weight = torch.randn(N, K, generator=generator)
    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    row_scales = torch.rand(N, generator=generator)
    group_scales = torch.rand(N, K // 32, generator=generator)  # q8_0's blocks of 32
    bias = torch.randn(N, generator=generator)
    for rows in (1, 3, 8, 13):
        x = torch.randn(rows, K, generator=generator)
        for b in (None, bias):
            got = float_linear(x, weight, b)
            assert_linear_close(got, x, weight, None, b, f"float_linear, {rows} rows")
            for scale in (row_scales, group_scales):
                got = int8_linear(x, codes, scale, b)
                assert_linear_close(got, x, codes, scale, b, f"int8_linear, {rows} rows, scales {tuple(scale.shape)}")
    check_integer_linears(generator)
    check_attention(generator)
    check_block(generator)
    logits = torch.randn(3, 1000, generator=generator)
    logits[1, 500:] = logits[1, 100]  # ties: the first
    assert torch.equal(argmax(logits), logits.max(dim=-1).indices)


UNIT_ROUNDOFF = 2.0**-24  # float32's: one rounding moves a number by at most this fraction of it
# How many times PyTorch's own float32 error a composite operator's (attention, a block's step) may have: they sum
# in another order, which errs as much in general and somewhat more on some numbers
FLOAT32_SLACK = 16


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What float_linear and int8_linear compute, in float64: x (..., K) times the weight (N, K) (float32 or int8
    codes), each weight times its scale where there is one, one per row (scale (N,)) or one per group of K / G inputs
    (scale (N, G)), plus bias -> (..., N) float64."""
    N, K = weight.shape
    matrix = weight.double()  # (N, K)
    if scale is not None:
        groups = scale.reshape(N, -1).size(1)
        matrix = matrix * scale.double().reshape(N, groups).repeat_interleave(K // groups, dim=1)  # (N, K)
    y = torch.nn.functional.linear(x.double(), matrix)  # (..., N)
    return y if bias is None else y + bias.double()


def int8_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What int8_linear computes (`linear_reference`), rounded to float32 -> (M, N)."""
    return linear_reference(x, codes, scale, bias).float()


def linear_error_bound(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The most a float32 computation of `linear_reference` can differ from it, whatever the order of its sums and
    fused multiply-adds or not (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1: a sum of
    n rounded terms errs by at most gamma_n = n u / (1 - n u) times the sum of their magnitudes), n = K + 3: the K
    products and their additions, a scale's product and the bias's addition -> (..., N) float64. A wrong or missing
    term (a bug) errs by about one term's magnitude, far above it for any K of a model."""
    n = x.size(-1) + 3
    gamma = n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)
    magnitudes = linear_reference(
        x.abs(),
        weight.double().abs(),
        None if scale is None else scale.abs(),
        None if bias is None else bias.abs(),
    )  # (..., N)
    return gamma * magnitudes


def assert_linear_close(
    got: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    what: str = "the product",
) -> None:
    """AssertionError naming `what` where a linear kernel's result `got` (..., N) is further from
    `linear_reference` than float32 can err (`linear_error_bound`)."""
    want = linear_reference(x, weight, scale, bias)
    assert_within(got, want, linear_error_bound(x, weight, scale, bias), what)


def assert_as_close_as_float32(got: torch.Tensor, want32: torch.Tensor, want64: torch.Tensor, what: str) -> None:
    """AssertionError naming `what` where `got`, a float32 computation of what `want64` holds in float64, is further
    from it than FLOAT32_SLACK times PyTorch's own float32 computation `want32` is at its furthest (or a rounding of the
    largest number, where want32 is exact): the tolerance of a computation too composite for a bound of its own
    (norms, softmax, activations), taken from float32's error on the CPU that runs it."""
    spread = (want32.double() - want64).abs().max().item() if want64.numel() else 0.0
    largest = want64.abs().max().item() if want64.numel() else 0.0
    assert_within(got, want64, FLOAT32_SLACK * spread + 2 * UNIT_ROUNDOFF * largest, what)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    """AssertionError naming `what` and the worst element where |got - want| exceeds `bound` (a NaN always does)."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, not {tuple(want.shape)}")
    error = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(error)
    outside = ~(error <= bound)  # NaN compares false
    if outside.any():
        worst = int(torch.where(outside, error - bound, torch.inf).flatten().argmax())  # a NaN first
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
        raise AssertionError(
            f"{what}: {int(outside.sum())} of {error.numel()} numbers are off; at {index} "
            f"{got.flatten()[worst].item():.9g} against {want.flatten()[worst].item():.9g}, |difference| "
            f"{error.flatten()[worst].item():.3g} > {bound.flatten()[worst].item():.3g} allowed"
        )


def as_float64(operands):
    """`operands` (a tensor, or a tuple, named tuple or list of them and other values) with each floating tensor in
    float64: the reference's own operands."""
    if isinstance(operands, torch.Tensor):
        return operands.double() if operands.is_floating_point() else operands
    if hasattr(operands, "_fields"):  # a named tuple (CacheSlot, Matrix, ...) takes its fields one by one
        return type(operands)(*(as_float64(operand) for operand in operands))
    if isinstance(operands, (tuple, list)):
        return type(operands)(as_float64(operand) for operand in operands)
    return operands


def check_integer_linears(generator: torch.Generator) -> None:
    """int8_dot_linear and int4_dot_linear against the exact product of the quantized activations
    (`assert_int_linear_close`): input widths of 3 and 6 blocks, an output width no thread or stream split divides,
    one row and batches past a tile, with and without a bias, int8 with a scale per row and per block, int4 in groups
    of one block and of the whole row; and each row's result the same, bit for bit, alone and in a batch."""
    N = 203
    for K in (96, 192):
        codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
        int4 = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=generator)
        nibbles = pack_nibbles(int4)
        bias = torch.randn(N, generator=generator)
        x = torch.randn(13, K, generator=generator) * 3
        x[2, :32] = 0  # a block of zeros: its scale 0
        for scale in (torch.rand(N, generator=generator), torch.rand(N, K // 32, generator=generator)):
            for rows in (1, 3, 13):
                got = int8_dot_linear(x[:rows], codes, scale, bias)
                assert_int_linear_close(got, x[:rows], codes, scale, bias, f"int8_dot_linear, K {K}, {rows} rows")
        for groups in (K // 32, 1):
            scale = torch.rand(N, groups, generator=generator)
            for b in (None, bias):
                got = int4_dot_linear(x, nibbles, scale, b)
                assert_int_linear_close(got, x, int4.to(torch.int8) - 8, scale, b, f"int4_dot_linear, K {K}")
        alone = torch.cat([int4_dot_linear(x[i : i + 1], nibbles, scale, bias) for i in range(len(x))])
        assert torch.equal(alone, int4_dot_linear(x, nibbles, scale, bias)), "int4_dot_linear: a row alone"
        scale = torch.rand(N, generator=generator)
        alone = torch.cat([int8_dot_linear(x[i : i + 1], codes, scale, bias) for i in range(len(x))])
        assert torch.equal(alone, int8_dot_linear(x, codes, scale, bias)), "int8_dot_linear: a row alone"


def check_attention(generator: torch.Generator) -> None:
    """cached_attention against `attention_reference`: grouped heads (6 query heads on 2 key/value heads), a width D
    that is not a multiple of a vector, with and without a mask that hides some slots, the caches written exactly,
    every row at one slot and each at its own (`CacheSlot.slots`); and with q/k norms and rotations (every
    coordinate, each row at its angles; the leading 12, all rows at one row's), the keys written within float32's
    error."""
    B = 3  # rows
    H = 6  # query heads
    KV = 2  # key/value heads
    L = 41  # cache slots
    D = 20  # a head's width
    slot = 36
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, generator=generator)
    caches = torch.randn(2, B, KV, L, D, generator=generator)
    visible = torch.rand(B, L, generator=generator) < 0.7
    visible[:, slot] = True  # a decode step always sees its own key
    for shown in (None, visible):
        want32, keys, values = attention_reference(qkv, *caches, slot, shown, 0.3, H)
        want64 = attention_reference(qkv.double(), *caches.double(), slot, shown, 0.3, H)[0]
        k_cache, v_cache = caches.clone()
        out = cached_attention(qkv, CacheSlot(k_cache, v_cache, slot, slot + 1, shown), n_head=H, scale=0.3)
        assert_as_close_as_float32(out, want32, want64, "cached_attention")
        assert torch.equal(k_cache, keys) and torch.equal(v_cache, values), "cached_attention's cache writes"
    slots = torch.tensor([36, 4, 40])  # rows at lengths of their own (the server's)
    own = visible.clone()
    own[torch.arange(B), slots] = True
    for shown in (None, own):
        want32, keys, values = attention_reference(qkv, *caches, slots, shown, 0.3, H)
        want64 = attention_reference(qkv.double(), *caches.double(), slots, shown, 0.3, H)[0]
        k_cache, v_cache = caches.clone()
        out = cached_attention(qkv, CacheSlot(k_cache, v_cache, 40, 41, shown, slots), n_head=H, scale=0.3)
        assert_as_close_as_float32(out, want32, want64, "cached_attention, each row at its own slot")
        assert torch.equal(k_cache, keys) and torch.equal(v_cache, values), "cached_attention's writes at own slots"
    for R, rows in ((D, B), (12, 1)):  # every coordinate rotated, each row at its angles; the leading 12, one row's
        angles, head_norms = rotary_operands(generator, rows, R, D)
        want32, keys32, values32 = attention_reference(qkv, *caches, slot, visible, 0.3, H, angles, head_norms)
        want64, keys64, values64 = attention_reference(
            *as_float64((qkv, *caches, slot, visible, 0.3, H, angles, head_norms))
        )
        k_cache, v_cache = caches.clone()
        cache = CacheSlot(k_cache, v_cache, slot, slot + 1, visible)
        out = cached_attention(qkv, cache, n_head=H, scale=0.3, angles=angles, head_norms=head_norms)
        assert_as_close_as_float32(out, want32, want64, f"cached_attention, {R} coordinates rotated")
        assert_as_close_as_float32(k_cache, keys32, keys64, f"cached_attention's keys, {R} coordinates rotated")
        assert torch.equal(v_cache, values32), "cached_attention's values"


def attention_reference(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: int | torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    n_head: int,
    angles: Angles | None = None,
    head_norms: HeadNorms | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What cached_attention computes, through PyTorch: copies of the caches (B, KV, L, D) with the token's keys and
    values (the end of each row of qkv (B, 1, (H + 2 KV) D)) written at `slot` (or each row's at its own, a (B,)
    tensor) by indexing, and SDPA of its n_head query heads over slots 0..slot (the row's own) where visible (B, L)
    shows them, and only the last `window` of them where it is > 0 -> (out (B, 1, H D), keys, values); each head's q
    and k first through F.rms_norm times its weight (`head_norms`: over each head, or over all heads where the weight
    spans them), then rotated (`heads_rotated`), where given."""
    B, KV, _, D = k_cache.shape
    q, k, v = qkv.split([n_head * D, KV * D, KV * D], dim=-1)
    q = q.reshape(B, n_head, D)
    k = k.reshape(B, KV, D)
    if head_norms is not None:
        q = heads_normalized(q, head_norms.q, head_norms.eps)
        k = heads_normalized(k, head_norms.k, head_norms.eps)
    if angles is not None:
        q = heads_rotated(q, angles)
        k = heads_rotated(k, angles)
    keys = k_cache.clone()
    values = v_cache.clone()
    slots = torch.as_tensor(slot).expand(B)  # (B,) each row's slot
    keys[torch.arange(B), :, slots] = k  # indexed as (B, KV, D)
    values[torch.arange(B), :, slots] = v.view(B, KV, D)
    span = int(slots.max()) + 1
    near = torch.arange(span)[None, :] <= slots[:, None]  # (B, S): each row's own slots, up to its token's
    if window:
        near = near & (torch.arange(span)[None, :] > slots[:, None] - window)  # the window's slots
    if visible is not None:
        near = near & visible[:, :span]
    mask = None if visible is None and not window and isinstance(slot, int) else near[:, None, None]  # (B, 1, 1, S)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(B, n_head, 1, D), keys[:, :, :span], values[:, :, :span], mask, scale=scale, enable_gqa=True
    )  # (B, H, 1, D)
    return out.reshape(B, 1, n_head * D), keys, values


def heads_normalized(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """heads (B, N, D) through F.rms_norm over each head times weight (D,), or over all N heads together times weight
    (N D,) -> (B, N, D)."""
    B, N, D = heads.shape
    if weight.numel() == D:
        return torch.nn.functional.rms_norm(heads, (D,), eps=eps) * weight
    return (torch.nn.functional.rms_norm(heads.reshape(B, N * D), (N * D,), eps=eps) * weight).view(B, N, D)


def heads_rotated(heads: torch.Tensor, angles: Angles) -> torch.Tensor:
    """heads (B, N, D) with each row's leading R coordinates rotated by its angles (B or 1, R), RoPE's
    x cos + rotate_half(x) sin over pairs (i, i + R/2), the rest as they are -> (B, N, D)."""
    R = angles.cos.size(-1)
    cos, sin = (t.to(heads.dtype)[:, None] for t in angles)  # (B or 1, 1, R)
    rotated, kept = heads[..., :R], heads[..., R:]
    first, second = rotated.chunk(2, dim=-1)
    return torch.cat([rotated * cos + torch.cat([-second, first], dim=-1) * sin, kept], dim=-1)


def check_block(generator: torch.Generator) -> None:
    """block_step against `block_reference`: GPT-2's block (LayerNorm, GELU, biases) on 3 rows with a mask hiding
    some slots, Llama's (RMSNorm, SwiGLU, no biases) on 2 rows with grouped heads and a residual scale, GPT-2's
    on int8 weights, Qwen3's (Llama's with q/k norms, rotated) on 3 rows, each at its own angles, all at one slot
    and each at its own (the server's rows), OLMo 2's (norms after each branch, q/k norms over all heads) and Gemma
    3's local layer (norms on both sides times 1 + weight, GeGLU, a sliding window), all at one slot and each at its
    own, and Llama's on int8 and int4 weights multiplying int8 inputs."""
    cases = [
        (3, 6, 6, "layernorm", "gelu_tanh", True, 1.0, False),
        (2, 6, 2, "rmsnorm", "silu_gate", False, 0.5, False),
        (1, 6, 6, "layernorm", "gelu_tanh", True, 1.0, True),
    ]
    for B, H, KV, norm, activation, biased, residual_scale, int8 in cases:
        x, weights, cache = block_operands(generator, B, H, KV, 16, 48, norm, activation, biased, int8)
        options = BlockOptions(norm, 1e-5, activation, H, 0.25, residual_scale)
        assert_block_step_close(x, weights, cache, options, f"{norm}, {activation}")
    x, weights, cache = block_operands(generator, 3, 6, 2, 16, 48, "rmsnorm", "silu_gate", False)
    angles, head_norms = rotary_operands(generator, 3, 16, 16)
    options = BlockOptions("rmsnorm", 1e-5, "silu_gate", 6, 0.25, 1.0)
    assert_block_step_close(x, weights._replace(head_norms=head_norms), cache, options, "Qwen3's", angles)
    own = cache._replace(slot=35, span=36, visible=None, slots=torch.tensor([35, 2, 17]))  # the server's rows
    assert_block_step_close(x, weights._replace(head_norms=head_norms), own, options, "Qwen3's, own slots", angles)
    x, weights, cache = block_operands(generator, 2, 6, 2, 16, 48, "rmsnorm", "silu_gate", False)
    angles, head_norms = rotary_operands(generator, 2, 16, 16, whole=(6, 2))
    options = BlockOptions("rmsnorm", 1e-5, "silu_gate", 6, 0.25, 1.0, "post")
    assert_block_step_close(x, weights._replace(head_norms=head_norms), cache, options, "OLMo 2's", angles)
    x, weights, cache = block_operands(generator, 2, 6, 2, 16, 48, "rmsnorm", "gelu_gate", False, position="both")
    angles, head_norms = rotary_operands(generator, 1, 16, 16)
    options = BlockOptions("rmsnorm_unit_offset", 1e-6, "gelu_gate", 6, 0.25, 1.0, "both", 7)
    assert_block_step_close(x, weights._replace(head_norms=head_norms), cache, options, "Gemma 3's", angles)
    own = cache._replace(slot=35, span=36, visible=None, slots=torch.tensor([35, 4]))  # a window past one row's start
    assert_block_step_close(x, weights._replace(head_norms=head_norms), own, options, "Gemma 3's, own slots", angles)
    options = BlockOptions("rmsnorm", 1e-5, "silu_gate", 6, 0.25, 1.0)
    for kind in ("int8", "int4"):  # int8 inputs: widths of whole blocks
        x, weights, cache = block_operands(generator, 2, 6, 2, 16, 64, "rmsnorm", "silu_gate", False)
        weights = integer_matrices(generator, weights, kind)
        assert_block_step_close(x, weights, cache, options, f"Llama's, {kind} weights, int8 inputs")


def assert_block_step_close(
    x: torch.Tensor,
    weights: BlockWeights,
    cache: CacheSlot,
    options: BlockOptions,
    what: str,
    angles: Angles | None = None,
) -> None:
    """AssertionError naming `what` where block_step on `block_operands`' (x, weights, cache) (it writes the cache),
    its q and k rotated by `angles` where given, gives another output or other keys and values than `block_reference`
    computes, within float32's error (`assert_as_close_as_float32`: the reference in float32 and in float64)."""
    want32, keys32, values32 = block_reference(x, weights, cache, options, angles)
    want64, keys64, values64 = block_reference(*as_float64((x, weights, cache)), options, as_float64(angles))
    got = block_step(x, weights, cache, options, angles)
    assert_as_close_as_float32(got, want32, want64, f"block_step ({what})")
    assert_as_close_as_float32(cache.keys, keys32, keys64, f"block_step's keys ({what})")  # written in place
    assert_as_close_as_float32(cache.values, values32, values64, f"block_step's values ({what})")


def block_operands(
    generator: torch.Generator,
    B: int,
    H: int,
    KV: int,
    D: int,
    F: int,
    norm: str,
    activation: str,
    biased: bool,
    int8: bool = False,
    position: str = "pre",
) -> tuple[torch.Tensor, BlockWeights, CacheSlot]:
    """Random operands of block_step for B rows, H query heads of width D on KV key/value heads (C = H D), an
    activation of F numbers: (x (B, 1, C), the block's weights, a cache of 40 slots), the weights float32 (scales
    None) or int8 codes with a scale per row, the cache's slot 29, its visible (B, 40) hiding some of the slots before
    it (never the slot itself). RMSNorm gets no bias, and no weight where there are no biases (nanochat's); a block
    whose norms stand on both sides of each branch (`position` "both") gets post-norms too."""
    C = H * D
    gated = activation in ("silu_gate", "gelu_gate")
    slot = 29

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    def maybe(*shape: int) -> torch.Tensor | None:
        return random(*shape) if biased else None

    if norm == "layernorm":
        norms = [Norm(1 + random(C), maybe(C)) for _ in range(4)]
    else:
        norms = [Norm(1 + random(C) if biased else None, None), *(Norm(1 + random(C), None) for _ in range(3))]
    shapes = [((H + 2 * KV) * D, C), (C, C), ((2 if gated else 1) * F, C), (C, F)]
    if int8:
        weights = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator) for shape in shapes]
        scales = [torch.rand(shape[0], generator=generator) * 0.3 / 127 for shape in shapes]
    else:
        weights = [random(*shape) for shape in shapes]
        scales = [None] * 4
    biases = [maybe(shape[0]) for shape in shapes]
    matrices = [Matrix(*operands) for operands in zip(weights, scales, biases, strict=True)]
    k_cache, v_cache = random(2, B, KV, 40, D)
    visible = torch.rand(B, 40, generator=generator) < 0.7
    visible[:, slot] = True
    block = BlockWeights(norms[0], matrices[0], matrices[1], norms[1], matrices[2], matrices[3])
    if position == "both":
        block = block._replace(attn_post_norm=norms[2], ffn_post_norm=norms[3])
    return random(B, 1, C), block, CacheSlot(k_cache.clone(), v_cache.clone(), slot, slot + 1, visible)


def integer_matrices(generator: torch.Generator, weights: BlockWeights, kind: str) -> BlockWeights:
    """`weights` with its four matrices replaced by random integer ones of the same shapes that multiply int8 inputs:
    int8 codes with a scale per row ("int8"), or int4 codes (`pack_nibbles`) with one per block of 32 inputs
    ("int4"); the biases kept."""

    def integer(matrix: Matrix) -> Matrix:
        N, K = matrix.weight.shape
        if kind == "int8":
            codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
            return Matrix(codes, torch.rand(N, generator=generator) * 0.3 / 127, matrix.bias, "int8")
        codes = pack_nibbles(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=generator))
        return Matrix(codes, torch.rand(N, K // 32, generator=generator) * 0.3 / 8, matrix.bias, "int8")

    matrices = (weights.qkv, weights.attn_out, weights.fc, weights.ffn_out)
    qkv, attn_out, fc, ffn_out = (integer(matrix) for matrix in matrices)
    return weights._replace(qkv=qkv, attn_out=attn_out, fc=fc, ffn_out=ffn_out)


def rotary_operands(
    generator: torch.Generator, B: int, R: int, D: int, whole: tuple[int, int] | None = None
) -> tuple[Angles, HeadNorms]:
    """Random angles of B rows (B, R) (1 for one row that all share) and q/k norm weights of D, as a rotary block with
    Qwen3's norms of q and k has them, or with `whole` (H, KV) weights of H D and KV D, as OLMo 2's norms over all of
    q and all of k have them: (angles, head norms)."""
    angle = torch.rand(B, R // 2, generator=generator) * 40  # (B, R/2): positions times frequencies
    # the pairs' second coordinates at other angles than their first (RoPE's are the same): a kernel that reads one
    # coordinate's cos or sin for the other's is caught
    angle = torch.cat([angle, angle * 0.5], dim=-1)  # (B, R)
    heads = (1, 1) if whole is None else whole
    q = 1 + torch.randn(heads[0] * D, generator=generator) * 0.3
    k = 1 + torch.randn(heads[1] * D, generator=generator) * 0.3
    return Angles(angle.cos(), angle.sin()), HeadNorms(q, k, 1e-6)


def block_reference(
    x: torch.Tensor, weights: BlockWeights, cache: CacheSlot, options: BlockOptions, angles: Angles | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What block_step computes, through PyTorch's own operators: x (B, 1, C) + residual_scale times the attention
    branch (`attention_reference` over slots 0..slot, or its window), then + residual_scale times the feed-forward
    branch, each branch's norms where `options.position` puts them, an int8 weight multiplied as its codes times its
    row's scale, in x's precision (float64 on `as_float64`'s operands) -> (out (B, 1, C), the keys and values with
    the token's written at the cache's slot)."""
    C = x.size(-1)
    F = weights.ffn_out.weight.size(1) * (2 if weights.ffn_out.weight.dtype == torch.uint8 else 1)  # activation's

    def linear(h: torch.Tensor, matrix: Matrix) -> torch.Tensor:
        if matrix.inputs == "int8":
            h = dequantized_blocks(h, block()).to(x.dtype)
        codes = matrix.weight
        if codes.dtype == torch.uint8:  # int4: the codes stand for q - 8
            codes = unpack_nibbles(codes).to(torch.int8) - 8
        if matrix.scale is None:
            weight = codes
        else:
            N, K = codes.shape
            scale = matrix.scale.reshape(N, -1)  # (N, 1) or (N, G)
            weight = codes.to(x.dtype) * scale.repeat_interleave(K // scale.size(1), dim=1)
        return torch.nn.functional.linear(h, weight, matrix.bias)

    def normalize(h: torch.Tensor, norm: Norm) -> torch.Tensor:
        if options.norm == "layernorm":
            return torch.nn.functional.layer_norm(h, (C,), norm.weight, norm.bias, options.eps)
        y = torch.nn.functional.rms_norm(h, (C,), eps=options.eps)
        if norm.weight is not None and options.norm == "rmsnorm_unit_offset":
            y = y * (1 + norm.weight)
        elif norm.weight is not None:
            y = y * norm.weight
        return y if norm.bias is None else y + norm.bias

    def activate(h: torch.Tensor) -> torch.Tensor:
        gate, value = h[..., :F], h[..., F:]
        if options.activation == "gelu_tanh":
            return torch.nn.functional.gelu(h, approximate="tanh")
        if options.activation == "relu_squared":
            return torch.nn.functional.relu(h).square()
        if options.activation == "silu_gate":
            return torch.nn.functional.silu(gate) * value
        return torch.nn.functional.gelu(gate, approximate="tanh") * value

    before = options.position != "post"  # where each branch's norms stand
    pre_norms = (weights.attn_norm, weights.ffn_norm) if before else (None, None)
    post_norms = {
        "pre": (None, None),
        "post": (weights.attn_norm, weights.ffn_norm),
        "both": (weights.attn_post_norm, weights.ffn_post_norm),
    }[options.position]

    def maybe_normalize(h: torch.Tensor, norm: Norm | None) -> torch.Tensor:
        return h if norm is None else normalize(h, norm)

    qkv = linear(maybe_normalize(x, pre_norms[0]), weights.qkv)  # (B, 1, (H + 2 KV) D)
    heads, keys, values = attention_reference(
        qkv,
        cache.keys,
        cache.values,
        cache.slot if cache.slots is None else cache.slots,
        cache.visible,
        options.scale,
        options.n_head,
        angles,
        weights.head_norms,
        options.window,
    )  # (B, 1, H D)
    x = x + options.residual_scale * maybe_normalize(linear(heads, weights.attn_out), post_norms[0])
    hidden = linear(maybe_normalize(x, pre_norms[1]), weights.fc)  # (B, 1, F or 2F)
    x = x + options.residual_scale * maybe_normalize(linear(activate(hidden), weights.ffn_out), post_norms[1])
    return x, keys, values


def fits(in_features: int) -> bool:
    """Whether the kernels take a layer of `in_features` inputs."""
    return in_features % multiple() == 0


def why_not(in_features: int) -> str:
    """Why the kernels cannot run a layer of `in_features` inputs here, or '' when they can."""
    if not fits(in_features):
        return f"its input width {in_features} is not a multiple of {multiple()}"
    if not load():
        return str(_state["why"])
    return ""
