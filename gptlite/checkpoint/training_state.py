"""The training state a checkpoint holds beside the weights, gathered from every rank and put back on a resume: the
optimizers' state keyed by parameter name (also when FSDP gives each rank a shard) and every rank's random generators.

torch.distributed.checkpoint is imported where it is used: it takes a second to import, which sample.py and the
server, loading a checkpoint's weights alone, need not pay.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """This process's python, numpy, torch CPU and current CUDA device generator states, checkpoint-safe
    (tensors and tuples only, so `weights_only` loading accepts them)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict) -> None:
    """Restore generator states saved by `rng_state`."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def gather_training_state(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], world_size: int
) -> tuple[dict, dict, list[dict]]:
    """(model state, optimizers' state, every rank's random generator states) as one checkpoint holds them: whole
    tensors on rank 0's CPU, keyed by parameter name, also when FSDP gives each rank a shard. A collective: every
    rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizers, options=options)
    rngs = [rng_state()]
    if world_size > 1:
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state())
    return model_state, optimizer_state, rngs


def load_training_state(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: dict, strict: bool = True
) -> None:
    """Load a checkpoint's weights and optimizer state (moments, momentum buffers, step counts). Every group's
    hyperparameters (lr_ratio, weight decay, betas, momentum) stay those of this run's config: one changed with
    --key=value on --resume takes effect, and a checkpoint saved before groups had an lr_ratio loads. `strict=False`
    loads a LoRA checkpoint's adapters into a model whose frozen weights came from elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    hyper = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    set_state_dict(
        model,
        optimizers,
        model_state_dict=ckpt["model"],
        optim_state_dict=ckpt["optimizer"],
        options=StateDictOptions(full_state_dict=True, strict=strict),
    )
    for opt, groups in zip(optimizers, hyper, strict=True):
        for group, values in zip(opt.param_groups, groups, strict=True):
            group.update(values)


def check_same_data(saved: dict | None, current: dict[str, str], out_dir: str, data_dir: str, run_data: str) -> None:
    """A resume continues on the data the run trained on: its kind, its shards and (RL) its prompts, as the
    checkpoint's "data" recorded them (gptlite.objective's identity); `run_data` is the data_dir its config names.
    Other data is a one-line error before anything is restored; a checkpoint from before the record (None) is taken
    as it is."""
    if saved is None or saved == current:
        return
    if saved.get("kind") != current.get("kind"):
        differs = f"the run trained on {saved.get('kind')} and {data_dir} holds {current.get('kind')}"
    elif saved.get("data") != current.get("data"):
        differs = f"{data_dir} holds other shards than the run trained on"
    else:
        differs = "--rl_prompts names another prompts file than the run sampled from (its contents differ)"
    raise ValueError(
        f"cannot --resume the run in {out_dir} on other data: {differs}; resume with its own "
        f"(--data_dir={run_data}), or start a new run in another --out_dir"
    )
