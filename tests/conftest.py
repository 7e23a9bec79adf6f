"""Shared fixtures: tiny models and the paths of ../shared (present on every developer machine and CI)."""

from pathlib import Path

import pytest
import torch

from gptlite import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


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
