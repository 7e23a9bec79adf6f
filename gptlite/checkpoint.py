"""Checkpoints: atomic save, safe load (`weights_only=True`), and rebuilding a model from one.

A checkpoint is a plain dict of tensors and primitive values:
    config      the flat training config (see gptlite.config.config_to_dict)
    model       the uncompiled, unwrapped module's state_dict
    optimizer   the optimizer's state_dict
    step        optimizer steps taken
    loader      the train loader's position (see gptlite.data.ShardLoader.state)
    best_val_loss, meta (git commit, command line)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gptlite.config import GPTConfig, build_config
from gptlite.model import GPT

CHECKPOINT_NAME = "ckpt.pt"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile and DDP wrappers, so saved keys never carry their prefixes."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def save_checkpoint(path: str | Path, checkpoint: dict) -> None:
    """Write atomically: a temp file in the same directory, fsync, then rename over the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint without unpickling arbitrary objects; a directory means its ckpt.pt."""
    path = Path(path)
    if path.suffix != ".pt":  # a run directory
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; train first (python train.py ... --out_dir={path.parent})")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); it is damaged or not a gptlite checkpoint") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"checkpoint {path} is not a gptlite checkpoint (no 'model' and 'config' entries)")
    return ckpt


def model_from_checkpoint(ckpt: dict) -> GPT:
    """Build the GPT described by a checkpoint's config and load its weights."""
    model_config: GPTConfig = build_config(ckpt["config"]).model
    model = GPT(model_config)
    model.load_state_dict(ckpt["model"])
    return model
