"""Shared fixtures: tiny models and the files of ../shared beside the checkout."""

import os
from pathlib import Path

import pytest
import torch

from gptlite import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout; from a git worktree (e.g. wt/NAME beside the main checkout) the nearest
# ancestor that has one
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared").is_dir()), ROOT.parent / "shared")


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


def tiny_config(**overrides) -> GPTConfig:
    kw = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)
    kw.update(overrides)
    return GPTConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


@pytest.fixture(params=["learned", "sinusoidal"])
def pos_emb(request) -> str:
    return request.param
