"""The features a training config switches on, each chosen once where train.py builds the run, which then calls
what they give it without asking which it has:

    add_adapters    LoRA (--lora_rank): adapters beside the frozen pretrained weights, and their record
    data_parallel   how the processes under torchrun share the work: one process, DDP, or FSDP2 (--fsdp)
    compile_model   torch.compile (--compile), where this device has it

The weight average (--ema_decay) is a part of the training state, set up by
gptlite.checkpoint.training_state.weight_average.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import adapters_record, check_lora_base
from gptlite.config import TrainConfig
from gptlite.device import compile_unavailable
from gptlite.model.network import Transformer
from gptlite.train.lora import add_lora


def add_adapters(
    cfg: TrainConfig, model: Transformer, ckpt: dict | None, out_dir: Path, n_params: int, log: Callable[[str], None]
) -> dict | None:
    """With --lora_rank, LoRA: freeze `model`'s pretrained weights and add low-rank adapters beside them; returns the
    record its checkpoints keep (gptlite.checkpoint.training_state's "lora"), None without. A resumed run's adapters
    only make sense on the weights they were trained on: the base is checked against the checkpoint's record."""
    if not cfg.lora_rank:
        return None
    recorded = adapters_record(ckpt)
    base = check_lora_base(cfg.init_from, recorded and recorded["sha256"], f"this LoRA run in {out_dir}")
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, targets)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"LoRA: {trainable:,} trainable parameters in adapters of rank {cfg.lora_rank} on {', '.join(targets)}; "
        f"the {n_params:,} of {cfg.init_from} stay frozen"
    )
    return {
        "base": cfg.init_from,
        "sha256": base,
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha,
        "targets": list(targets),
    }


class OneProcess:
    """A run in one process (also --fsdp without torchrun): nothing to shard, wrap or synchronize."""

    label = ""  # what the log's "world N" line adds

    def shard(self, model: Transformer) -> None:
        pass

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def sync_gradients(self, sync: bool) -> None:
        pass


class DDPProcesses(OneProcess):
    """DistributedDataParallel: every rank holds the whole model, and their gradients are averaged during
    backward."""

    def __init__(self, device: str):
        self.device = device
        self.wrapped: DDP | None = None

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        device_ids = [torch.device(self.device)] if self.device.startswith("cuda") else None
        self.wrapped = DDP(module, device_ids=device_ids)
        return self.wrapped

    def sync_gradients(self, sync: bool) -> None:
        self.wrapped.require_backward_grad_sync = sync


class FSDPProcesses(OneProcess):
    """FSDP2: every block sharded on its own, then the rest (the embedding tied to the head, positions, the final
    norm); its gradients are reduced during backward."""

    label = " (fsdp)"

    def shard(self, model: Transformer) -> None:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        self.model = model

    def sync_gradients(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)


def data_parallel(cfg: TrainConfig, world_size: int, device: str) -> OneProcess:
    """How the run's processes share the work: FSDP with --fsdp under torchrun, else DDP there, else one process.
    The run shards the model (`shard`, before its optimizers are built), wraps what trains (`wrap`), and tells it
    whether a micro-batch's backward must average the gradients across ranks (`sync_gradients`): only the step's
    last does, until then every rank accumulates its own."""
    if world_size == 1:
        return OneProcess()
    return FSDPProcesses() if cfg.fsdp else DDPProcesses(device)


def compile_model(
    model: torch.nn.Module, cfg: TrainConfig, device_type: str, log: Callable[[str], None]
) -> tuple[torch.nn.Module, bool]:
    """(What trains, whether it is compiled): with --compile, torch.compile's module where this device has it, else
    `model` with a warning."""
    if not cfg.compile:
        return model, False
    reason = compile_unavailable(device_type)
    if reason:
        log(f"warning: torch.compile is unavailable ({reason}); training uncompiled")
        return model, False
    log("torch.compile: the first step compiles the model, a minute or more on a CPU (--compile=false: none)")
    return torch.compile(model), True
