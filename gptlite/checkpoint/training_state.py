"""The training state: the parts a checkpoint holds, each saving and restoring its own entries with a `state_dict()`
/ `load_state_dict()` pair (torch.distributed.checkpoint's `Stateful` shape), and `TrainingState`, the one list of
them that a run saves (`TrainingState.save`) and resumes (`TrainingState.resume`) through.

A checkpoint is a plain dict of tensors and primitive values, each entry written by one part:
    config          RunRecord: the flat training config (see gptlite.config.config_to_dict)
    model           Weights: the uncompiled, unwrapped module's state_dict (no `_orig_mod.` or `module.` prefixes),
                    whole on rank 0 also under FSDP; a LoRA run's holds its adapters alone (lora_A, lora_B)
    optimizer       Optimizers: the optimizers' state (AdamW's, and Muon's with optimizer="muon") keyed by parameter
                    name (torch.distributed.checkpoint's full state dict, one for all); their learning-rate
                    schedule is a function of the step (gptlite.train.optim.lr_at), their hyperparameters the config's
    scaler          LossScale: the fp16 GradScaler's state ({} when unused)
    step            Progress: optimizer steps taken
    loader          DataPosition: the objective's position in its data (gptlite.train.objective: the train loader's
                    state, see gptlite.data.loader.ShardLoader.state; an RL run's prompt order,
                    gptlite.train.rl.PromptLoader.state) data            DataPosition: what the run trains on (the
                    objective's identity(): the data's kind and a fingerprint of its shards, an RL run's prompts file's
                    too), which a resume checks (absent before 2026-11-27)
    world_size      RandomStreams: the processes that trained
    rng             RandomStreams: one entry per rank: python, numpy, torch CPU and CUDA generator states
    best_val_loss   Progress: the lowest val loss so far (best.pt's)
    val_loss        Progress: this save's val loss (None for a save without an evaluation: a stop)
    meta            RunRecord: git_commit, command (the command line), wandb_run_id (the tracker's run, which a
                    resumed run continues) and hf_architecture (the Hugging Face architecture --init_from was read
                    as: how it exports back), tokenizer (the data's tokenizer's identity)
and, where they apply:
    lora            Weights: a LoRA run's adapters: base (its --init_from), sha256 (those base weights'
                    fingerprint, gptlite.hf.fingerprint), rank, alpha, targets
    ema             Average: ema_decay: the weights' moving average (gptlite.train.optim.WeightAverage.state_dict)
    trained_model   Weights: a run that ended as its moving average: the weights it trained, which --resume
                    continues from (`model` then holds the average)
A part's state_dict() gives its entries and its load_state_dict() takes a dict that holds them (a whole checkpoint);
an entry a part does not find (a checkpoint older than the entry) leaves that part as the run built it.

torch.distributed.checkpoint is imported where it is used: it takes a second to import, which sample.py and the
server, loading a checkpoint's weights alone, need not pay.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from gptlite.checkpoint.file import git_commit, nonfinite
from gptlite.checkpoint.run_folder import repair_run_folder, save_run_checkpoint, step_files
from gptlite.config import TrainConfig, config_to_dict
from gptlite.files import error
from gptlite.tokenizer import Tokenizer
from gptlite.train.lora import lora_state_dict
from gptlite.train.optim import WeightAverage

if TYPE_CHECKING:
    from gptlite.train.objective import Objective

# the entries of a checkpoint, in the order a checkpoint holds them (the module's docstring says what each is)
ENTRIES = (
    "config",
    "model",
    "optimizer",
    "scaler",
    "step",
    "loader",
    "data",
    "world_size",
    "rng",
    "best_val_loss",
    "val_loss",
    "meta",
    "lora",
    "ema",
    "trained_model",
)


class Stateful(Protocol):
    """A part of the training state (torch.distributed.checkpoint.stateful.Stateful's shape)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


# ---------------------------------------------------------------------------------------------
# What a resume reads before the run is built: the checkpoint's data, and a LoRA run's record of its base


def check_same_data(ckpt: dict, current: dict[str, str], out_dir: str, data_dir: str) -> None:
    """A resume continues on the data the run trained on: its kind, its shards and (RL) its prompts, as the
    checkpoint's "data" recorded them (gptlite.train.objective's identity). Other data is a one-line error before
    anything is restored; a checkpoint from before the record is taken as it is."""
    saved = ckpt.get("data")
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
        f"(--data_dir={ckpt['config'].get('data_dir')}), or start a new run in another --out_dir"
    )


def holds_whole_model(ckpt: dict) -> bool:
    """Whether a checkpoint holds every weight of its model; a LoRA run's holds its adapters alone, which go onto
    the base weights its --init_from names."""
    return "lora" not in ckpt


def adapters_record(ckpt: dict | None) -> dict | None:
    """A LoRA run's record of its adapters and base ("lora"), None for a checkpoint of whole weights or none."""
    return None if ckpt is None else ckpt.get("lora")


# ---------------------------------------------------------------------------------------------
# The parts


class Weights:
    """The model's weights ("model"), a LoRA run's adapters alone with their record ("lora"), and, once a run has
    ended as its weights' average (Average.finish), the weights it trained ("trained_model"), which a resume goes on
    from. Gathering them is a collective under FSDP: every rank calls state_dict()."""

    def __init__(self, model: torch.nn.Module, lora: dict | None, out_dir: str | Path):
        self.model = model
        self.lora = lora
        self.out_dir = out_dir
        self.trained: dict[str, torch.Tensor] | None = None  # the trained weights of a run that ends as its average

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        entries: dict[str, Any] = {"model": lora_state_dict(state) if self.lora else state}
        if self.lora:
            entries["lora"] = self.lora
        if self.trained:
            entries["trained_model"] = lora_state_dict(self.trained) if self.lora else self.trained
        return entries

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The trained weights where the run ended as their average, else the model's; a LoRA checkpoint's adapters
        go onto the base weights the model already holds. Weights of another shape are a one-line error."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        weights = state.get("trained_model", state["model"])
        self.model.check_state(
            {**self.model.state_dict(), **weights} if self.lora else weights, f"the checkpoint in {self.out_dir}"
        )
        options = StateDictOptions(full_state_dict=True, strict=not self.lora)
        set_model_state_dict(self.model, weights, options=options)


class Optimizers:
    """The optimizers' state ("optimizer": moments, momentum buffers, step counts), keyed by parameter name also
    when FSDP gives each rank a shard. On a resume every group's hyperparameters (lr_ratio, weight decay, betas,
    momentum) stay those of this run's config: one changed with --key=value on --resume takes effect, and a
    checkpoint saved before groups had an lr_ratio loads."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"optimizer": get_optimizer_state_dict(self.model, self.optimizers, options=options)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        hyper = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers]
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizers, state["optimizer"], options=options)
        for opt, groups in zip(self.optimizers, hyper, strict=True):
            for group, values in zip(opt.param_groups, groups, strict=True):
                group.update(values)


class LossScale:
    """float16's loss scaler ("scaler"; {} where it is off, which restores nothing)."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])


class DataPosition:
    """The objective's position in its data ("loader") and what it trains on ("data", its identity() as the run
    started: check_same_data reads it before the run is built)."""

    def __init__(self, objective: Objective, identity: dict[str, str], out_dir: str | Path, data_dir: str):
        self.objective = objective
        self.identity = identity
        self.out_dir = out_dir
        self.data_dir = data_dir

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.objective.state(), "data": self.identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.objective.restore(state["loader"])
        except (KeyError, TypeError):  # a checkpoint from before its data was recorded, of another kind of data
            raise ValueError(
                f"cannot --resume the run in {self.out_dir} on {self.data_dir}: its checkpoint's position is in other "
                f"data (its config names --data_dir={state['config'].get('data_dir')}); resume with that, or start a "
                "new run in another --out_dir"
            ) from None


class Average:
    """The weights' moving average of a run with ema_decay ("ema", gptlite.train.optim.WeightAverage), updated after
    each optimizer step; the run ends as it (`finish`). `weight_average` builds it, or NoAverage."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model = model
        self.average = WeightAverage(model, decay)

    def update(self) -> None:
        self.average.update()

    def finish(self, weights: Weights, step: int, log: Callable[[str], None]) -> None:
        """Put the average into the model, which the run's end evaluates, saves and samples; the trained weights go
        into the checkpoint beside it (Weights.trained), so that --resume goes on from them."""
        weights.trained = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.average.copy_to_model()
        log(f"step {step:5d} | the weights are now their moving average (ema_decay={self.average.decay:g})")

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.average.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ema" in state:
            self.average.load_state_dict(state["ema"])


class NoAverage:
    """A run without a weight average (ema_decay=0): nothing to update, save or end as."""

    def update(self) -> None:
        pass

    def finish(self, weights: Weights, step: int, log: Callable[[str], None]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def weight_average(model: torch.nn.Module, decay: float) -> Average | NoAverage:
    """The run's weight average: an Average of `model`'s trainable weights with `decay` (--ema_decay), none for 0."""
    return Average(model, decay) if decay else NoAverage()


@dataclass
class Progress:
    """The optimizer steps taken ("step"), the lowest val loss saved so far ("best_val_loss", best.pt's) and this
    save's ("val_loss", set by the evaluation before it; None for a save without one)."""

    step: int = 0
    best_val_loss: float = math.inf
    val_loss: float | None = None

    @property
    def best(self) -> bool:
        """Whether this save's val loss is the lowest so far."""
        return self.val_loss is not None and self.val_loss < self.best_val_loss

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "best_val_loss": self.val_loss if self.best else self.best_val_loss,
            "val_loss": self.val_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.best_val_loss = float(state["best_val_loss"])


class RandomStreams:
    """Every rank's random generators ("rng", one entry per rank) and how many ranks trained ("world_size"). A
    resume at another world size restores none (and says so): the data continues where it stopped, dropout's
    streams start afresh. Gathering them is a collective: every rank calls state_dict()."""

    def __init__(self, rank: int, world_size: int, log: Callable[[str], None]):
        self.rank = rank
        self.world_size = world_size
        self.log = log

    def state_dict(self) -> dict[str, Any]:
        rngs = [rng_state()]
        if self.world_size > 1:
            import torch.distributed as dist

            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, rng_state())
        return {"world_size": self.world_size, "rng": rngs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["rng"]) == self.world_size:
            set_rng_state(state["rng"][self.rank])
            return
        self.log(
            f"note: the checkpoint comes from a run with world_size={len(state['rng'])} and this one has "
            f"world_size={self.world_size}: the data continues where it stopped, dropout's random streams start "
            "afresh"
        )


class RunRecord:
    """What the run is ("config") and where it came from ("meta": see the module's docstring), once its tracker has
    started (`describe`); a resume reads the tracker's run id (`wandb_run_id`), which the resumed run continues.
    `command` is the command line, `code` a folder of the git work tree whose commit is recorded."""

    def __init__(self, cfg: TrainConfig, command: str, code: Path):
        self.cfg = cfg
        self.command = command
        self.code = code
        self.meta: dict[str, Any] = {}
        self.wandb_run_id: str | None = None

    def describe(self, wandb_run_id: str | None, hf_architecture: str | None, tokenizer: Tokenizer | None) -> None:
        """The meta every checkpoint keeps: the tracker's run (None without one), the Hugging Face architecture
        --init_from was read as (how it exports back, gptlite.hf), the data's tokenizer (checked wherever it is
        read)."""
        self.meta = {
            "git_commit": git_commit(self.code),
            "command": self.command,
            "wandb_run_id": wandb_run_id,
            "hf_architecture": hf_architecture,
            "tokenizer": None if tokenizer is None else tokenizer.identity(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"config": config_to_dict(self.cfg), "meta": self.meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wandb_run_id = state["meta"].get("wandb_run_id")


# ---------------------------------------------------------------------------------------------
# The list


@dataclass
class TrainingState:
    """The parts of a run's training state, in the order a resume restores them; a checkpoint is their entries
    together (the module's docstring lays them out). A new part is a field here, its entries named in ENTRIES and
    described in the module's docstring."""

    weights: Weights
    optimizers: Optimizers
    scale: LossScale
    position: DataPosition
    average: Average | NoAverage
    progress: Progress
    streams: RandomStreams
    record: RunRecord

    def parts(self) -> list[Stateful]:
        return [getattr(self, f.name) for f in fields(self)]

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: every part's entries, in the order of ENTRIES. A collective (see Weights)."""
        entries = {}
        for part in self.parts():
            entries.update(part.state_dict())
        unknown = set(entries) - set(ENTRIES)
        assert not unknown, f"entries without a place in the checkpoint's format: {sorted(unknown)}"
        return {name: entries[name] for name in ENTRIES if name in entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts():
            part.load_state_dict(state)

    def finish(self, log: Callable[[str], None]) -> None:
        """At the run's last step: a run with a weight average ends as it (Average.finish)."""
        self.average.finish(self.weights, self.progress.step, log)

    def resume(self, ckpt: dict, out_dir: Path, master: bool, log: Callable[[str], None]) -> None:
        """Continue from `ckpt`, the newest whole checkpoint in out_dir: every part restored, then (rank 0, once
        every rank has read it) its checksum file rewritten where that was in error, and the damaged files newer than
        it moved aside (gptlite.checkpoint.run_folder.repair_run_folder)."""
        self.load_state_dict(ckpt)
        log(f"resumed from {out_dir} at step {self.progress.step}")
        if self.streams.world_size > 1:
            import torch.distributed as dist

            dist.barrier()  # every rank has read the checkpoint before rank 0 moves damaged files
        for line in repair_run_folder(out_dir, self.progress.step) if master else []:
            log(line)

    def save(self, out_dir: Path, keep_last: int, master: bool, log: Callable[[str], None]) -> None:
        """Save a checkpoint into out_dir (rank 0; every rank gathers), as the newest and, when its val loss is the
        lowest so far, as best.pt. A good checkpoint is never replaced by one of non-finite weights; a failed write
        (a full disk) is a one-line error that leaves the previous file whole."""
        checkpoint = self.state_dict()  # every rank
        if not master:
            return
        step = self.progress.step
        best = self.progress.best
        bad = nonfinite(checkpoint["model"])
        # what a failed save leaves: the latest good checkpoint, or (the first save) none yet
        kept = (
            f"the latest good checkpoint stays in {out_dir}"
            if step_files(out_dir)
            else f"no checkpoint of this run was saved yet in {out_dir}"
        )
        if bad:
            names = ", ".join(bad[:3])
            log(f"step {step}: not saving a checkpoint, the weights are not finite ({names}); {kept}")
            return
        try:
            path = save_run_checkpoint(out_dir, checkpoint, keep_last=keep_last, best=best)
        except OSError as e:  # e.g. a full disk: nothing half-written is left, the previous file is whole
            message = f"step {step}: {e}; {kept}: fix that, then continue with --resume"
            raise error(e.errno, message) from None
        self.progress.best_val_loss = checkpoint["best_val_loss"]
        log(f"step {step:5d} | saved {path}{' (best val loss)' if best else ''}")
