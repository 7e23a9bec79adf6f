"""Shared fixtures: tiny models, the files of ../shared beside the checkout, and the device the tests run on.

GPTLITE_TEST_DEVICE=cuda (default cpu) runs the device-generic tests, those marked `device` (model,
generation, checkpoints, sample.py, an end-to-end train + resume + sample), on that device, and only them.
GPTLITE_SHARED=DIR points at a folder laid out like ../shared (data/tinyshakespeare.txt,
tokenizers/gpt2.tiktoken) on a machine without one beside the checkout.
"""

import errno
import os
from pathlib import Path

import pytest
import torch

from gptlite import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout; from a git worktree (e.g. wt/NAME beside the main checkout) the nearest
# ancestor that has one
SHARED = (
    Path(os.environ["GPTLITE_SHARED"])
    if os.environ.get("GPTLITE_SHARED")
    else next((p / "shared" for p in ROOT.parents if (p / "shared").is_dir()), ROOT.parent / "shared")
)
DEVICE = os.environ.get("GPTLITE_TEST_DEVICE", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: device-generic; runs on GPTLITE_TEST_DEVICE")
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
def exact_float32_matmuls():
    """train.main turns TF32 on for CUDA, for the rest of the process; the reference comparisons need full
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
