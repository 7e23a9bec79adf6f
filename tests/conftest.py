"""Shared fixtures: tiny models, the files of ../shared beside the checkout, and the device the tests run on.

GPTLITE_TEST_DEVICE=cuda (default cpu) runs the device-generic tests, those marked `device` (model,
generation, checkpoints, sample.py, an end-to-end train + resume + sample), on that device, and only them.
GPTLITE_SHARED=DIR points at a folder laid out like ../shared (data/tinyshakespeare.txt,
tokenizers/gpt2.tiktoken) on a machine without one beside the checkout.
GPTLITE_TEST_CACHE=DIR keeps the run's caches (the compiled kernels, the kernel choices) in DIR, kept after the run
(default: a temporary folder, removed at its end); the user's own ~/.cache is never written.
"""

import atexit
import contextlib
import errno
import io
import json
import os
import random
import re
import runpy
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# The run's caches in a folder of its own, set before gptlite reads where they are and inherited by every process the
# tests start: gptlite's kernel choices (cpu_linear.json) and compiled kernels stay out of the user's ~/.cache, which a
# test run must leave as it found it. The compiled CPU kernels (gptlite.inference.cpu.native) are built once for the
# whole run, on first use: tests that point XDG_CACHE_HOME at a folder of their own (a choices file of their own) and
# the processes they start find the library built there, instead of compiling it again each.
# GPTLITE_TEST_CACHE=DIR keeps them in DIR instead (kept after the run): this module may be imported twice in a run
# (as conftest and as tests.conftest) and by the processes the tests start, which all take the folder it names.
if not os.environ.get("GPTLITE_TEST_CACHE"):
    os.environ["GPTLITE_TEST_CACHE"] = tempfile.mkdtemp(prefix="gptlite-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["GPTLITE_TEST_CACHE"], ignore_errors=True)
RUN_CACHE = Path(os.environ["GPTLITE_TEST_CACHE"])
os.environ["XDG_CACHE_HOME"] = str(RUN_CACHE)
os.environ["GPTLITE_NATIVE_CACHE"] = str(RUN_CACHE / "gptlite" / "native")

import pytest  # noqa: E402 (after the caches are set: nothing may read them first)
import torch  # noqa: E402

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.train.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout; from a git worktree (e.g. wt/NAME beside the main checkout) the nearest
# ancestor that has one
SHARED = (
    Path(os.environ["GPTLITE_SHARED"])
    if os.environ.get("GPTLITE_SHARED")
    else next((p / "shared" for p in ROOT.parents if (p / "shared").is_dir()), ROOT.parent / "shared")
)
DEVICE = os.environ.get("GPTLITE_TEST_DEVICE", "cpu")
# A fixed thread count for the whole run: train.py would otherwise fit torch's threads to the load of other
# processes (gptlite.device.CpuThreads), and a reduction over another number of threads rounds differently where
# tests compare runs bit for bit. Setting it keeps torch's own count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
pytest_plugins = ["pytester"]  # a pytest run inside a test: the suite goes on past a crash in native code


def pytest_configure(config):
    config.addinivalue_line("markers", "device: device-generic; runs on GPTLITE_TEST_DEVICE")
    config.addinivalue_line("markers", "slow: starts processes or compiles; -m 'not slow' leaves it out (CI runs all)")
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"GPTLITE_TEST_DEVICE={DEVICE} but CUDA is not available here; unset it to test on the CPU"
        )
    if not DEVICE.startswith(("cpu", "cuda", "mps")):
        raise pytest.UsageError(f"GPTLITE_TEST_DEVICE={DEVICE!r} must be cpu, cuda, cuda:N or mps")


def pytest_collection_modifyitems(config, items):
    """On another device than the CPU, run the device-generic tests only (the others test the CPU's code paths,
    files and processes, which the device does not change)."""
    if DEVICE == "cpu":
        return
    selected = [item for item in items if item.get_closest_marker("device")]
    config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("device")])
    items[:] = selected


@pytest.fixture(autouse=True)
def process_globals_restored():
    """Each test starts with the thread count and random states the run started with, and leaves them so: what a
    test measures or draws never depends on which tests ran before it."""
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    state = random.getstate()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    random.setstate(state)


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """train.py turns TF32 on for CUDA, for the rest of the process; the reference comparisons need full
    float32, so every test starts without it."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def shared_file(relative: str) -> Path:
    """A file of ../shared (the GPT-2 ranks, tiny Shakespeare). CI and developer machines always have
    them, so there a missing file fails the test; a user's checkout without ../shared skips it."""
    path = SHARED / relative
    if not path.is_file():
        message = f"{path} is missing (see the README's Tests section)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class FullDisk:
    """A file whose writes fail with ENOSPC once it holds `limit` bytes, as on a full disk."""

    def __init__(self, f, limit: int):
        self.f, self.limit = f, limit

    def write(self, data) -> int:
        if self.f.tell() + len(data) > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def tiny_config(**overrides) -> GPTConfig:
    kw = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)
    kw.update(overrides)
    return GPTConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    """A tiny random model in eval mode, on the test device."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).to(DEVICE).eval()


def randint(high: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random token ids on the test device."""
    return torch.randint(0, high, shape, device=DEVICE)


def tensor(data) -> torch.Tensor:
    """torch.tensor(data) on the test device."""
    return torch.tensor(data, device=DEVICE)


class ListLoader:
    """A loader (next_batch) over a list of (x, y) batches."""

    def __init__(self, batches):
        self.batches = iter(batches)

    def next_batch(self):
        return next(self.batches)


# Architectures every model-level property is checked on: each switch of GPTConfig, and GPT-2's and Llama's
VARIANTS = {
    "learned": {},
    "sinusoidal": {"pos_emb": "sinusoidal"},
    "rope": {"pos_emb": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "gpt2": {"ffn": "gelu", "bias": True},  # learned positions, LayerNorm and linears with biases, GELU MLP
    "llama": {"pos_emb": "rope", "norm": "rmsnorm", "rope_theta": 500.0},  # SwiGLU, no biases
    # today's open models: grouped-query attention, an untied head, Qwen2's q/k/v biases, Qwen3's q/k norms and head
    # width, Llama 3's RoPE scaling (its original context shorter than the tiny models' block_size of 32)
    "gqa-untied": {"pos_emb": "rope", "norm": "rmsnorm", "n_kv_head": 2, "tie_embeddings": False},
    "qwen2": {"pos_emb": "rope", "norm": "rmsnorm", "n_kv_head": 1, "qkv_bias": True},
    "qwen3": {"pos_emb": "rope", "norm": "rmsnorm", "n_kv_head": 2, "qk_norm": True, "head_dim": 16},
    "llama3": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "n_kv_head": 2,
        "rope_scaling": "llama3",
        "rope_factor": 4.0,
        "rope_original_context": 16,
    },
}


@pytest.fixture(params=list(VARIANTS))
def variant(request) -> dict:
    """GPTConfig overrides of one architecture (see VARIANTS)."""
    return VARIANTS[request.param]


# ---------------------------------------------------------------------------------------------
# train.py as a command


@dataclass
class TrainRun:
    """What one train.py command did, read as a user would read it: its exit code and output, and the rows that
    its own steps wrote to the run's metrics.jsonl (a resumed run's earlier rows are not its own)."""

    code: int
    out: str
    err: str
    step: int | None = None  # the last step ("done at step N"), None when the run did not get there
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss) per log line
    val_history: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss) per evaluation
    skipped_steps: int = 0  # steps whose loss or gradient norm was not finite
    stopped: str | None = None  # why it stopped before max_iters: a signal's name, "max_minutes=..."
    peak_memory_mb: int | None = None  # from the last line

    def __getitem__(self, name: str):
        """A field by name, as from a dict: run["history"]."""
        return getattr(self, name)

    @property
    def error(self) -> str:
        """The one-line error of a run that failed (exit 2 for a user's error, 1 for on_nan=stop), without the
        "train.py: error: " before it."""
        assert self.code in (1, 2), (self.code, self.out, self.err)
        lines = self.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train.py: error: "), self.err
        return lines[0].removeprefix("train.py: error: ")

    @property
    def signal(self) -> int | None:
        """The signal that stopped the run (its exit code is 128 + the signal's number)."""
        return self.code - 128 if self.code > 128 else None


class Tee(io.TextIOBase):
    """Writes to every stream it is given."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def run_train(*args, **options) -> TrainRun:
    """Run `python train.py ARGS --key=value ...` (one --key=value per option) in this process: runpy executes
    the script as __main__, as Python does for the command, without starting another Python and importing torch
    again, and a fault a test monkeypatches into the package reaches it. Its output reaches capsys too. An error
    that the command does not turn into a one-line message (a bug) propagates as the exception it is."""
    argv = [*map(str, args), *(f"--{k}={v}" for k, v in options.items())]
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = [str(ROOT / "train.py"), *argv]
    try:
        with contextlib.redirect_stdout(Tee(sys.stdout, out)), contextlib.redirect_stderr(Tee(sys.stderr, err)):
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = saved_argv
    run = TrainRun(code, out.getvalue(), err.getvalue())
    config = re.search(r"^config: (.*)$", run.out, re.M)
    done = re.search(r"^done at step (\d+)(?: \| peak memory ([\d,]+) MiB)?", run.out, re.M)
    if not config or not done:
        return run
    run.step = int(done[1])
    run.peak_memory_mb = int(done[2].replace(",", "")) if done[2] else None
    resumed = re.search(r"^resumed from .* at step (\d+)$", run.out, re.M)
    first = int(resumed[1]) if resumed else 0
    rows = [r for r in read_metrics(Path(json.loads(config[1])["out_dir"]) / "metrics.jsonl") if r["step"] > first]
    run.history = [(r["step"], r["loss"]) for r in rows if "lr" in r]
    run.val_history = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    run.skipped_steps = sum(r.get("event") == "nonfinite" for r in rows)
    stopped = re.search(r"^stopped after step \d+ \((.*?)\) with a checkpoint", run.out, re.M)
    run.stopped = stopped[1] if stopped else None
    return run
