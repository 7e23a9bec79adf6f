"""The device a command computes on: the one "auto" choice of device and precision, and what training needs to
know of the device (TF32 and autocast, whether torch.compile can work here, peak memory, advice when memory runs
out, and how glibc returns freed memory to the system), and which CPU this is: the same command runs at different
speeds, and through different kernels, on an AMD EPYC with AVX2 and an Intel Xeon with AVX-512 and AMX.

Nothing here runs at import time: torch is imported by the functions that need it, so that the commands that
only read options (data preparation) start without it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# /proc/cpuinfo's flags -> the names Intel and AMD give the extensions torch's and llama.cpp's CPU kernels choose by
CPU_EXTENSIONS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
}


def cpu_info() -> tuple[str, set[str]]:
    """This CPU's model name and its flags, as Linux's /proc/cpuinfo gives them; elsewhere the name `platform`
    gives and no flags."""
    name = ""
    flags = set()
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return platform.processor() or platform.machine() or "an unknown CPU", flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name or platform.machine() or "an unknown CPU", flags


def cpu_extensions() -> list[str]:
    """The vector and matrix extensions of this CPU that change which kernels run, e.g. ['AVX2'] or
    ['AVX2', 'AVX-512', 'AVX512-BF16', 'AMX']."""
    _, flags = cpu_info()
    return [label for flag, label in CPU_EXTENSIONS.items() if flag in flags]


def cpu_summary() -> str:
    """One line for a benchmark's header or an error: 'AMD EPYC, 2 cores, AVX2', or 'INTEL(R) XEON(R) ..., 2 cores,
    AVX2/AVX-512/AVX512-BF16/AMX'."""
    name, _ = cpu_info()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    extensions = cpu_extensions()
    return f"{name}, {cores} cores, {'/'.join(extensions) or 'no AVX2, AVX-512 or AMX'}"


def pick_device(name: str = "auto", local_rank: int = 0) -> str:
    """cuda > mps > cpu for 'auto'; a CUDA device that is not there is a one-line error. A CUDA device always gets
    its index (torch.cuda.set_device needs one): under torchrun each process takes cuda:LOCAL_RANK, else plain
    'cuda' is the current device, cuda:0 by default."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if not re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", name):
        raise ValueError(f"device={name!r} is not a device gptlite runs on; use auto, cpu, cuda, cuda:N or mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available here; use --device=cpu or --device=auto")
    if name.startswith("mps") and not torch.backends.mps.is_available():
        # torch.device("mps") is accepted everywhere and fails only at the first tensor moved there, deep in the load
        raise ValueError(
            f"device={name} but MPS (Apple's GPU) is not available here; use --device=cpu or --device=auto"
        )
    if name == "cuda":
        name = f"cuda:{local_rank if 'RANK' in os.environ else torch.cuda.current_device()}"
    return name


def pick_dtype(name: str, device: str) -> str:
    """'auto' is bfloat16 on CUDA GPUs that support it, float32 elsewhere; other names are kept."""
    import torch

    if name == "auto":
        return "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    return name


def use_device(device: str) -> None:
    """Make `device` this process's CUDA device, with TF32 matmuls and convolutions (float32 matmuls on tensor
    cores, as nanoGPT does: the mantissa they drop is below what training notices). Nothing to do elsewhere."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The context that runs the forward pass in `dtype` (mixed precision), or does nothing for float32."""
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.split(":")[0], dtype=dtype)


def batch_mover(device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a training step sends a host tensor (its batch, its stop votes) to `device`: to a GPU through page-locked
    host memory, whose copy is queued behind the GPU's earlier work without the host waiting for it (torch's
    blocking copy from ordinary memory waits for the stream to finish); to other devices as it is."""
    if device.startswith("cuda"):
        return lambda t: t.pin_memory().to(device, non_blocking=True)
    return lambda t: t.to(device)


def compile_unavailable(device_type: str) -> str | None:
    """Why torch.compile cannot work here (None if it should): platform, Triton on CUDA, a C++ compiler on CPU."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"not supported on Python {sys.version.split()[0]} on {sys.platform}"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    if device_type == "cpu":
        cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
        if not shutil.which(cxx):
            return f"no C++ compiler '{cxx}' for its CPU kernels (set CXX)"
        return cpu_compiler_problem(cxx)
    return None


@functools.cache
def cpu_compiler_problem(cxx: str) -> str | None:
    """Why `cxx` cannot build torch.compile's CPU kernels, None where it builds a one-line shared library: a program
    that exits 0 and writes nothing (CXX=/bin/true) or one that fails would otherwise end the first compiled step
    in a traceback from deep inside torch's inductor."""
    fix = "set CXX to a working C++ compiler"
    try:
        with tempfile.TemporaryDirectory(prefix="gptlite-cxx-") as folder:
            library = Path(folder) / "probe.so"
            command = [cxx, "-x", "c++", "-shared", "-fPIC", "-o", str(library), "-"]
            done = subprocess.run(command, input=b"int probe() { return 0; }\n", capture_output=True, timeout=120)
            if done.returncode != 0:
                lines = done.stderr.decode(errors="replace").strip().splitlines()
                said = lines[-1][:200] if lines else f"exit status {done.returncode}"
                return f"the C++ compiler '{cxx}' failed on a one-line program ({said}); {fix}"
            if not library.is_file():
                return f"the C++ compiler '{cxx}' exited 0 on a one-line program but wrote no library; {fix}"
    except subprocess.TimeoutExpired:
        return f"the C++ compiler '{cxx}' took over 120 s on a one-line program; {fix}"
    except OSError as e:  # it could not be started, or no temporary folder could be written
        return f"the C++ compiler '{cxx}' could not build a one-line program ({e.strerror or e}); {fix}"
    return None


def peak_memory_mb(device: str) -> tuple[float | None, str]:
    """This process's peak memory in MiB, and what it counts: the tensors torch allocated on a CUDA device, else the
    resident set (None where the system does not say: Windows)."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20, "allocated on the GPU"
    try:
        import resource  # the peak resident set, on Unix
    except ImportError:  # Windows
        return None, ""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024), "resident"


def return_freed_memory() -> None:
    """glibc (Linux): give every allocation of 1 MiB or more its own mapping, returned to the system when freed. By
    default glibc raises that threshold as large blocks are freed and serves them from its heap, which then keeps
    the memory of activations recomputed in backward (activation checkpointing) long after they are freed: the
    peak grows by the heap's high-water mark, for a little time saved per step (figures in docs/chat.md).
    Elsewhere this does nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed at 1 MiB
    except (OSError, AttributeError):
        pass


HUGE_PAGE = 2 << 20  # x86's and most Arm Linux kernels' transparent huge page
MADV_COLLAPSE = 25  # Linux 6.1 on: back a mapped range with huge pages now, its contents kept


def huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Back the CPU tensors' memory with 2 MiB pages where Linux can (madvise MADV_COLLAPSE, Linux 6.1 on), in place
    (the same addresses and contents). A decode step streams every weight once, and with 4 KiB pages the processor
    looks up a new page every 4 KiB: on the Intel Xeon, GPT-2 124M's matrices streamed 3-5% faster from huge pages,
    which llama.cpp's weights get from the kernel's file cache (figures: docs/generation.md). Tensors less than a
    huge page apart are taken as one range (`storage_ranges`), so that weights smaller than a huge page, which
    hold no whole one, are covered with their neighbours: GPT-2 124M's 475 MB of weights lay in one range, of which
    472 MB collapsed, against 376 MB tensor by tensor. A range the kernel refuses whole (a gap in it not mapped) is
    asked for tensor by tensor. The kernel copies the pages, about a second per GB, once. Returns the bytes
    collapsed; elsewhere, on older kernels, or where the kernel refuses (no memory free in 2 MiB blocks, THP
    switched off), nothing changes."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def collapse(start: int, end: int) -> int:
        """The bytes of the whole huge pages inside [start, end) collapsed: all of them, or 0."""
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        last = end // HUGE_PAGE * HUGE_PAGE
        if last <= first or madvise(first, last - first, MADV_COLLAPSE) != 0:
            return 0
        return last - first

    done = 0
    for start, end, members in storage_ranges(tensors, HUGE_PAGE):
        whole = collapse(start, end)
        done += whole if whole or len(members) == 1 else sum(collapse(*member) for member in members)
    return done


def storage_ranges(tensors: Iterable[torch.Tensor], gap: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The CPU tensors' storages as address ranges, those less than `gap` bytes apart merged: (start, end, the
    storages' own (start, end) in it), in address order. Views of one tensor, and a tied weight, share a storage."""
    spans = set()
    for tensor in tensors:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            spans.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    ranges: list[tuple[int, int, list[tuple[int, int]]]] = []
    for start, end in sorted(spans):
        if ranges and start - ranges[-1][1] < gap:
            first, last, members = ranges[-1]
            ranges[-1] = (first, max(last, end), [*members, (start, end)])
        else:
            ranges.append((start, end, [(start, end)]))
    return ranges


def out_of_memory_advice(batch_size: int, block_size: int, total_batch_size: int, total_batch: int) -> str:
    """What to change when the first training step runs out of memory: a smaller micro-batch, keeping the global
    batch (`total_batch` tokens per step) through gradient accumulation."""
    failed = (
        f"out of memory in the first step, on a micro-batch of batch_size={batch_size} x block_size={block_size} "
        "tokens per device"
    )
    if batch_size == 1:
        return f"{failed}; use a smaller block_size or model, or --dtype=bfloat16"
    if total_batch_size:
        keep = "total_batch_size stays, gradient accumulation makes up the difference"
    else:
        keep = f"add --total_batch_size={total_batch} to keep the global batch"
    return f"{failed}; try --batch_size={batch_size // 2} ({keep})"


def cpu_times() -> tuple[float, float] | None:
    """Seconds of CPU time spent since boot by the whole machine (every process, all cores) and by this process,
    read from Linux's /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = int(fields[3]) + int(fields[4])  # idle and iowait
    busy = sum(int(v) for v in fields[:8]) - idle  # user, nice, system, irq, softirq, steal
    own = os.times()
    return busy / ticks, own.user + own.system


# The event of metrics.jsonl that records each change of the thread count (with "threads", the new count): the run's
# own record that other processes shared its CPU, which the scaling sweep reads (gptlite.scaling.sweep)
THREADS_EVENT = "cpu_threads"


class CpuThreads:
    """torch's CPU thread count, fitted to the cores that other work leaves free.

    torch starts one OpenMP thread per core, and its threads wait for each other at the end of every parallel
    region by spinning. When another process keeps a core busy, the thread that shares that core runs in time
    slices, and the others spin until it catches up: on a 2-core machine with one busy process beside it, a small
    model's training step went from 56 ms to 210 ms with 2 threads, where 1 thread took 92 ms (docs/training.md).
    `update()`, called between steps, measures how many cores other processes used in the last few seconds (the
    machine's busy time less this process's own) and sets torch's thread count to the cores left, at least one,
    back up when the other work ends. A thread count the user chose (OMP_NUM_THREADS) is kept, and so is torch's
    own count on machines whose load cannot be read (other than Linux)."""

    BUSY = 0.5  # a core that other work keeps busy at least half the time is not free
    WINDOW = 2.0  # seconds: the shortest time over which the other work is measured

    def __init__(self):
        import torch

        self.cores = torch.get_num_threads()
        self.threads = self.cores
        self.active = "OMP_NUM_THREADS" not in os.environ and self.cores > 1 and cpu_times() is not None
        self.last = (time.monotonic(), cpu_times())
        self.fitted = not self.active  # whether the count has followed a measurement yet (a count not fitted: always)

    def update(self, window: float = WINDOW) -> str | None:
        """Measure the other work since the last call, if at least `window` seconds ago, and fit the thread count to
        it; say so when it changes."""
        if not self.active:
            return None
        import torch

        now = time.monotonic()
        then, (busy_then, own_then) = self.last
        wall = now - then
        if wall < window:
            return None
        times = cpu_times()
        self.last = now, times
        self.fitted = True
        others = max(0.0, (times[0] - busy_then) - (times[1] - own_then)) / wall  # cores other processes kept busy
        threads = max(1, self.cores - math.floor(others + 1 - self.BUSY))
        if threads == self.threads:
            return None
        was = self.threads
        self.threads = threads
        torch.set_num_threads(threads)
        return (
            f"other processes kept {others:.1f} of {self.cores} cores busy: torch now computes on {threads} "
            f"thread{'s' if threads > 1 else ''} (was {was}; OMP_NUM_THREADS=N fixes the count)"
        )


def machine_line() -> str:
    """A benchmark's first line: the CPU and its extensions, torch and its threads, the GPU if there is one. Every
    figure depends on them, and the machines this project runs on change from day to day."""
    import torch

    gpu = f" | GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"machine: {cpu_summary()} | torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"
