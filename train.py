"""Train a GPT on token shards: one CPU, one GPU, or many through torchrun (PyTorch DDP, or FSDP2 with --fsdp).

    python train.py [CONFIG.toml] --data_dir=DIR [--key=value ...] [--resume]
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data_dir=DIR

Config precedence: defaults (gptlite/config.py) < TOML file < --key=value. `python train.py --help` lists keys.
Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits; --resume continues exactly.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import resource  # the peak resident set, on Unix
except ImportError:  # Windows
    resource = None

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import (
    discard_damaged,
    holds_run,
    load_checkpoint,
    remove_leftovers,
    rng_state,
    run_files,
    save_run_checkpoint,
    set_rng_state,
)
from gptlite.cli import config_help, parse_args
from gptlite.config import TrainConfig, build_config, config_to_dict, convert, flat_fields, model_changes, read_toml, unknown_key
from gptlite.data import ChatLoader, ShardLoader, check_vocab, find_shards, is_chat_data, read_shard
from gptlite.device import pick_device, pick_dtype
from gptlite.evaluate import byte_lengths, loss_and_bpb, loss_sums
from gptlite.files import FolderLock, error, fault, make_dir
from gptlite.hf import fingerprint
from gptlite.lora import add_lora, lora_state_dict
from gptlite.metrics import METRICS_FILE, MetricsLog, mfu, peak_flops
from gptlite.model import GPT
from gptlite.optim import Muon, block_matrices
from gptlite.tokenizer import TOKENIZER_FILE, load_tokenizer

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU


# ---------------------------------------------------------------------------------------------
# Helpers


def setup_distributed() -> tuple[int, int, int]:
    """(rank, local_rank, world_size); starts a process group when launched by torchrun."""
    if "RANK" not in os.environ:
        return 0, 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size()


class StopSignals(list):
    """The SIGINT / SIGTERM signals received while installed, recorded instead of ending the process, so the
    loop can finish its step, save and exit. Before `install()` (setup, data checks) Ctrl-C works as usual."""

    def install(self) -> None:
        self.previous = {s: signal.signal(s, lambda signum, frame: self.append(signum)) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for s, handler in getattr(self, "previous", {}).items():
            signal.signal(s, handler)


@contextlib.contextmanager
def training_session():
    """(rank, local_rank, world_size, StopSignals): starts the process group under torchrun; on the way out,
    also on errors, restores the signal handlers and ends the process group, after everything that uses it.

    The order matters at exit: a DDP reducer or an FSDP module freed after the process group (its last
    reference gone, or collected later from a reference cycle) made gloo's destructor join its worker
    threads while holding the GIL, a hang in about one run in ten, or abort ("terminate called without an
    active exception"). So the run's frames are cleared (on an error, the traceback keeps them alive) and
    collected first."""
    rank, local_rank, world_size = setup_distributed()
    signals = StopSignals()
    try:
        yield rank, local_rank, world_size, signals
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        signals.restore()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def lr_at(step: int, cfg: TrainConfig, minutes: float = 0.0) -> float:
    """Linear warmup to learning_rate over warmup_iters steps, then cosine decay to min_lr: at lr_decay_iters
    (lr_schedule="steps"), or when `minutes` reach max_minutes (lr_schedule="time"), then min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    min_lr = min(cfg.min_lr, cfg.learning_rate)  # learning_rate=0: nothing moves
    if cfg.lr_schedule == "time":
        progress = minutes / cfg.max_minutes
    else:
        decay_iters = cfg.lr_decay_iters or cfg.max_iters
        progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    progress = min(progress, 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - min_lr)


def make_optimizers(model: GPT, cfg: TrainConfig, device_type: str) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay on matrices (linear weights and the tied embedding/head, as nanoGPT) and
    none on vectors (norm weights, biases). The fused version, on the CPU too: for the 4x128 char model
    its step took 0.52 ms against 3.05 ms for the default for-each one (2-core CPU).

    With optimizer="muon", a second optimizer, Muon (gptlite.optim), takes the 2-D weights inside the blocks,
    q, k, v and SwiGLU's W1 and W3 each orthogonalised on its own (a group per `split`), with muon_weight_decay;
    AdamW keeps the token embedding (tied to the head), learned positions and the vectors. Every group's
    `lr_ratio` is its peak learning rate over learning_rate: the schedule scales all of them alike."""
    params = [p for p in model.parameters() if p.requires_grad]
    splits = block_matrices(model) if cfg.optimizer == "muon" else {}  # parameter -> logical matrices in it
    splits = {p: split for p, split in splits.items() if p.requires_grad}  # LoRA: the adapters, never frozen weights
    rest = [p for p in params if p not in splits]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_ratio": 1.0},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_ratio": 1.0},
    ]
    optimizers = [
        torch.optim.AdamW(
            groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device_type in ("cuda", "cpu")
        )
    ]
    if splits:
        ratio = cfg.muon_lr / cfg.learning_rate if cfg.learning_rate else 0.0  # learning_rate=0 moves nothing
        groups = [
            {"params": [p for p, s in splits.items() if s == split], "split": split, "lr_ratio": ratio}
            for split in sorted(set(splits.values()), key=lambda s: (isinstance(s, tuple), s))
        ]
        ns_dtype = torch.bfloat16 if device_type == "cuda" else torch.float32  # see gptlite.optim.Muon
        optimizers.append(
            Muon(
                groups,
                lr=cfg.muon_lr,
                momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay,
                ns_dtype=ns_dtype,
            )
        )
    return optimizers


def load_training_state(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: dict, strict: bool = True
) -> None:
    """Load a checkpoint's weights and optimizer state (moments, momentum buffers, step counts). Every group's
    hyperparameters (lr_ratio, weight decay, betas, momentum) stay those of this run's config: one changed with
    --key=value on --resume takes effect, and a checkpoint saved before groups had an lr_ratio loads. `strict=False`
    loads a LoRA checkpoint's adapters into a model whose frozen weights came from elsewhere."""
    hyper = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    set_state_dict(
        model,
        optimizers,
        model_state_dict=ckpt["model"],
        optim_state_dict=ckpt["optimizer"],
        options=StateDictOptions(full_state_dict=True, strict=strict),
    )  # a LoRA checkpoint: adapters only
    for opt, groups in zip(optimizers, hyper):
        for group, values in zip(opt.param_groups, groups):
            group.update(values)


def make_loaders(cfg: TrainConfig, rank: int, world_size: int) -> tuple[ShardLoader, ShardLoader]:
    """Train and val loaders over data_dir's shards, after checking that no shard is empty, every token id
    is below vocab_size and each split holds at least one global batch. Rank r reads the r-th slice of
    every global batch, so ranks never read the same window. Shards with roles files (data/prepare.py --chat)
    give whole conversations whose assistant tokens alone are targets (ChatLoader)."""
    loaders = []
    for split, seed in (("train", cfg.seed), ("val", cfg.seed + 1)):
        files = find_shards(cfg.data_dir, split)
        for path in files:
            if len(read_shard(path)) == 0:
                raise ValueError(f"shard {path} holds no tokens; delete it or prepare the data again")
        check_vocab(
            files,
            cfg.model.vocab_size,
            fix=f"prepare the data with {cfg.init_from}'s tokenizer, whose ids the pretrained model knows"
            if cfg.init_from
            else "",
        )
        loader = ChatLoader if is_chat_data(files) else ShardLoader
        try:
            loaders.append(
                loader(files, cfg.batch_size, cfg.model.block_size, seed=seed, rank=rank, world_size=world_size)
            )
        except ValueError as e:
            raise ValueError(f"{split} split: {e}") from None
    return loaders[0], loaders[1]


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
        return None if shutil.which(cxx) else f"no C++ compiler '{cxx}' for its CPU kernels (set CXX)"
    return None


def accumulate_gradients(
    model: torch.nn.Module, loader, grad_accum: int, device: str, autocast, scaler, chunked_loss: bool = True
) -> torch.Tensor:
    """Forward and backward over `grad_accum` micro-batches from `loader`; returns their mean loss (0-dim).

    The gradients are those of the mean loss over all micro-batches, the same as one batch `grad_accum` times
    larger. Conversations (a ChatLoader) average the loss over every target token of the step, on every rank: a
    micro-batch with fewer assistant tokens weighs less. Under DDP or FSDP, gradients are reduced across ranks on
    the last micro-step only. `chunked_loss`: the head and loss a chunk of tokens at a time (see gptlite.loss)."""
    if isinstance(loader, ChatLoader):
        return accumulate_over_targets(
            model, [loader.next_batch() for _ in range(grad_accum)], device, autocast, scaler, chunked_loss
        )
    loss_sum = torch.zeros((), device=device)
    for micro in range(grad_accum):
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())  # (B, T) each
        sync_on_last(model, micro == grad_accum - 1)
        with autocast:
            loss = model(x, y, return_logits=not chunked_loss)[1]  # logits, if any, not held through backward
        scaler.scale(loss / grad_accum).backward()
        loss_sum += loss.detach()
    return loss_sum / grad_accum


def accumulate_over_targets(
    model: torch.nn.Module, batches: list, device: str, autocast, scaler, chunked_loss: bool = True
) -> torch.Tensor:
    """accumulate_gradients for batches whose targets are partly -1: each micro-batch's summed loss over the step's
    target count (all-reduced across ranks, times world_size, which DDP's mean over ranks divides away)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.tensor(float(sum(int((y >= 0).sum()) for _, y in batches)), device=device)
    if world > 1:
        dist.all_reduce(total)
    scale = world / total.clamp_min(1.0)
    loss_sum = torch.zeros((), device=device)
    for micro, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, L) each
        sync_on_last(model, micro == len(batches) - 1)
        with autocast:
            loss = model(x, y, reduction="sum", return_logits=not chunked_loss)[1]
        scaler.scale(loss * scale).backward()
        loss_sum += loss.detach() * scale
    return loss_sum


def sync_on_last(model: torch.nn.Module, last: bool) -> None:
    """Under DDP or FSDP, reduce gradients across ranks on the step's last micro-batch only."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = last
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: ShardLoader, iters: int, device: str, autocast, lengths: torch.Tensor | None
) -> tuple[float, float | None]:
    """Mean loss per token and bits per byte (None without the tokens' byte `lengths`, see
    gptlite.evaluate.byte_lengths) over the first `iters` global batches of the val set (the same batches at
    every evaluation), or over every val window when iters=0. Each rank evaluates its slice; the sums are
    all-reduced."""
    model.eval()
    loader.restore({"epoch": 0, "shard": 0, "index": 0})
    batches = loader.every_window() if iters == 0 else (loader.next_batch() for _ in range(iters))
    sums = torch.zeros(4, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            sums += loss_sums(model, x, y, lengths)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return loss_and_bpb(sums)


def out_of_memory_advice(cfg: TrainConfig, total_batch: int) -> str:
    B, T = cfg.batch_size, cfg.model.block_size
    failed = f"out of memory in the first step, on a micro-batch of batch_size={B} x block_size={T} tokens per device"
    if B == 1:
        return f"{failed}; use a smaller block_size or model, or --dtype=bfloat16"
    keep = (
        "total_batch_size stays, gradient accumulation makes up the difference"
        if cfg.total_batch_size
        else f"add --total_batch_size={total_batch} to keep the global batch"
    )
    return f"{failed}; try --batch_size={B // 2} ({keep})"


def read_vocab_size(data_dir: str) -> int:
    """vocab_size recorded in DATA_DIR/tokenizer.json by data/prepare.py."""
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(
            f"data_dir {data_dir} does not exist or is not a folder; prepare data there first "
            f"(python data/prepare.py --input=... --out_dir={data_dir}) or check the path"
        )
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist, so the vocabulary size is unknown; pass --vocab_size=N "
            "(e.g. 50304 for GPT-2 token shards) or prepare the data with data/prepare.py"
        )
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} has no valid vocab_size ({e}); prepare the data again or pass --vocab_size=N"
        ) from None


def pretrained_values(init_from: str, values: dict) -> dict:
    """The model keys of a pretrained checkpoint (its config.json only), after checking that `values` changes none
    of them but block_size and dropout."""
    from gptlite.hf import pretrained_config

    pretrained = dict(vars(pretrained_config(init_from)))
    changed = [f"{k}={v} (the model has {old})" for k, v, old in model_changes(values, pretrained) if k != "block_size"]
    if changed:
        raise ValueError(
            f"--init_from={init_from} fixes the model's shape; drop {', '.join(changed)} "
            "(block_size may be smaller, dropout anything)"
        )
    return pretrained


def claim_run_folder(out_dir: Path, cfg: TrainConfig, log) -> FolderLock:
    """Rank 0: make out_dir and lock it for this run (a second train.py on it is refused, naming the process),
    delete the temporary files a crash left, and refuse a fresh run (no --resume) into a folder that holds an
    earlier run's checkpoints or metrics, unless --overwrite, which moves them into out_dir/previous-TIME/."""
    make_dir(out_dir, "out_dir")
    lock = FolderLock(out_dir, "out_dir")
    try:
        for path in remove_leftovers(out_dir):
            log(f"deleted {path}, a temporary file an interrupted save left")
        earlier = run_files(out_dir) if not cfg.resume and holds_run(out_dir) else []
        if earlier and not cfg.overwrite:
            raise ValueError(
                f"out_dir {out_dir} holds an earlier run ({', '.join(p.name for p in earlier[:3])}"
                f"{', ...' if len(earlier) > 3 else ''}); continue it with --resume, choose another --out_dir, or "
                "pass --overwrite to move its files into a previous-TIME folder inside it first"
            )
        if earlier:
            previous = make_dir(out_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
            for path in earlier:
                os.replace(path, previous / path.name)
            log(f"moved the earlier run's {len(earlier)} files into {previous} (--overwrite)")
    except BaseException:
        lock.release()
        raise
    return lock


def stop_together(problem: str | None, world_size: int) -> None:
    """Raise ValueError(problem) on every rank when rank 0 found one, so that no rank waits in a collective for
    a rank that stopped."""
    if world_size > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ValueError(problem)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_config(argv: list[str]) -> TrainConfig:
    """defaults < TOML < --key=value; on --resume the checkpoint's config is the base, with --init_from the
    pretrained model's shape; otherwise vocab_size comes from the data."""
    toml_path, overrides = parse_args(argv)
    values = {**(read_toml(toml_path) if toml_path else {}), **overrides}
    unknown = [unknown_key(k, flat_fields()) for k in values if k not in flat_fields()]
    if unknown:  # before anything is read: a typo is named first
        raise ValueError("; ".join(unknown))
    if values.get("init_from") in ("scratch", "resume"):  # nanoGPT's values, which mean the same here
        if values.pop("init_from") == "resume":
            values.setdefault("resume", "true")
    out_dir = values.get("out_dir", TrainConfig.out_dir)
    saved = None
    if convert("resume", values.get("resume", False), bool):
        with contextlib.suppress(FileNotFoundError):  # main() says so and starts from scratch
            saved = load_checkpoint(out_dir, on_fallback=lambda message: None)["config"]  # main() reports fallbacks
    if saved:
        changed = [f"{k}={v} (checkpoint has {old})" for k, v, old in model_changes(values, saved)]
        if changed:
            raise ValueError(f"cannot change the model shape on --resume from {out_dir}: {', '.join(changed)}")
        lora = [
            f"{k}={values[k]} (checkpoint has {saved.get(k)})"
            for k in ("lora_rank", "lora_targets", "init_from")
            if k in values and saved.get("lora_rank") and str(values[k]) != str(saved.get(k))
        ]
        if lora:
            raise ValueError(f"cannot change the adapters on --resume of the LoRA run in {out_dir}: {', '.join(lora)}")
        if "optimizer" in values and values["optimizer"] != saved.get("optimizer", "adamw"):
            raise ValueError(
                f"cannot change the optimizer on --resume from {out_dir}: optimizer={values['optimizer']} "
                f"(checkpoint has {saved.get('optimizer', 'adamw')}, whose state it holds); drop "
                "--optimizer, or start a new run in another --out_dir"
            )
        values = {**saved, **values}
    elif values.get("init_from"):
        values = {**pretrained_values(str(values["init_from"]), values), **values}
    if "vocab_size" not in values:
        if not values.get("data_dir"):
            raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
        values["vocab_size"] = read_vocab_size(values["data_dir"])
    return build_config(values)


def main(cfg: TrainConfig, argv: list[str] | None = None) -> dict:
    """Train according to cfg; returns a summary (steps, logged losses, val losses, why it stopped early)."""
    if not cfg.data_dir:
        raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
    with training_session() as session, contextlib.ExitStack() as cleanup:
        return train(cfg, argv, *session, cleanup)


# ---------------------------------------------------------------------------------------------
# The run, phase by phase


@dataclass
class Run:
    """What the phases of one training run share: where it runs, its data, its model and optimizers, its place in
    the schedule. It lives in train()'s frame, so the model and optimizers are gone when train() ends, before the
    process group is (see training_session)."""

    cfg: TrainConfig
    rank: int
    world_size: int
    log: Callable[..., None]
    device: str
    dtype: torch.dtype
    autocast: contextlib.AbstractContextManager
    t_start: float
    train_loader: ShardLoader | None = None
    val_loader: ShardLoader | None = None
    lengths: torch.Tensor | None = None  # each token's bytes, for the val bits per byte (None: unknown)
    total_batch: int = 0  # tokens per optimizer step
    n_params: int = 0
    flops_per_token: float = 0.0
    grad_accum: int = 1  # micro-steps per optimizer step
    model: torch.nn.Module | None = None  # as built: what is saved and evaluated
    train_model: torch.nn.Module | None = None  # compiled and/or wrapped in DDP: what is trained
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    best_val: float = float("inf")
    resumed: bool = False  # from a checkpoint of this run folder
    lora: dict | None = None  # a LoRA run's base (init_from and its sha256) and adapters, saved in its checkpoints
    metrics: MetricsLog | None = None
    wandb: object | None = None
    wandb_id: str | None = None  # the wandb run a resumed run continues

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)


def train(
    cfg: TrainConfig,
    argv: list[str] | None,
    rank: int,
    local_rank: int,
    world_size: int,
    signals: StopSignals,
    cleanup: contextlib.ExitStack,
) -> dict:
    """`main` inside its session: set up, data, model and run folder, optimizer, resume, loop, finish. Every input is
    checked before the run folder is touched: a fresh run claims it only once its weights have loaded."""
    if cfg.data_dir and Path(cfg.data_dir).resolve() == Path(cfg.out_dir).resolve():
        raise ValueError(
            f"out_dir and data_dir are the same folder ({cfg.out_dir}): the run's files would go among "
            "the data's shards; choose another --out_dir"
        )
    run = set_up(cfg, rank, local_rank, world_size)
    load_data(run)
    ckpt = None
    if cfg.resume:  # the run folder first: its checkpoint says whether pretrained weights are needed at all
        claim(run, cleanup)
        ckpt = newest_checkpoint(run)
    # pretrained weights unless a checkpoint holds them all (a LoRA checkpoint holds its adapters only)
    run.model = build_model(run, pretrained=bool(cfg.init_from) and (ckpt is None or "lora" in ckpt))
    if cfg.lora_rank:
        adapt(run, ckpt)
    if not cfg.resume:
        claim(run, cleanup)
    shard(run)
    make_optimizer(run)
    if ckpt:
        resume_from(run, ckpt)
    ckpt = None  # free its memory
    announce(run, argv)
    wrap(run)
    summary = loop(run, signals, Checkpointer(run, argv))
    summary["peak_memory_mb"], where = peak_memory_mb(run.device)
    run.log(
        f"done at step {run.step}"
        + (
            f" | peak memory {summary['peak_memory_mb']:,.0f} MiB {where}"
            if summary["peak_memory_mb"] is not None
            else ""
        )
    )
    if run.master:
        run.metrics.close()
    if run.wandb:
        run.wandb.finish()
    return summary


def peak_memory_mb(device: str) -> tuple[float | None, str]:
    """This process's peak memory in MiB, and what it counts: the tensors torch allocated on a CUDA device, else the
    resident set (None where the system does not say: Windows)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20, "allocated on the GPU"
    if resource is None:
        return None, ""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024), "resident"


def set_up(cfg: TrainConfig, rank: int, local_rank: int, world_size: int) -> Run:
    """The device (TF32 matmuls on CUDA) and the autocast precision; rank 0 alone prints."""
    device = pick_device(cfg.device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = getattr(torch, pick_dtype(cfg.dtype, device))
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.split(":")[0], dtype=dtype)
    log = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    return Run(cfg, rank, world_size, log, device, dtype, autocast, t_start=time.time())


def load_data(run: Run) -> None:
    """The batch arithmetic, the train and val loaders and the tokens' byte lengths: every problem of the data is
    found here, before the first step."""
    cfg = run.cfg
    B, T = cfg.batch_size, cfg.model.block_size
    tokens_per_micro = B * T * run.world_size
    run.total_batch = cfg.total_batch_size or tokens_per_micro
    if run.total_batch % tokens_per_micro:
        raise ValueError(
            f"total_batch_size={run.total_batch} is not a multiple of batch_size*block_size*world_size="
            f"{B}*{T}*{run.world_size}={tokens_per_micro}; set total_batch_size to a multiple of {tokens_per_micro}"
        )
    run.grad_accum = run.total_batch // tokens_per_micro
    run.train_loader, run.val_loader = make_loaders(cfg, run.rank, run.world_size)
    tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
    if tokenizer_file.is_file():
        run.lengths = byte_lengths(load_tokenizer(tokenizer_file), cfg.model.vocab_size).to(run.device)


def claim(run: Run, cleanup: contextlib.ExitStack) -> None:
    """The run folder becomes this run's alone (rank 0 holds its lock until the run ends); a refusal on rank 0
    ends every rank."""
    problem, lock = None, None
    if run.master:
        try:
            lock = claim_run_folder(run.out_dir, run.cfg, run.log)
        except (ValueError, OSError) as e:
            problem = str(e)
    stop_together(problem, run.world_size)
    if lock:
        cleanup.callback(lock.release)


def newest_checkpoint(run: Run) -> dict | None:
    """The run folder's newest intact checkpoint, or None (then the run starts from scratch, and says so)."""
    try:
        return load_checkpoint(run.out_dir, on_fallback=run.log)
    except FileNotFoundError:
        run.log(f"no checkpoint in {run.out_dir}; starting from scratch")
        return None


def build_model(run: Run, pretrained: bool) -> GPT:
    """The model on its device: cfg.init_from's weights when `pretrained`, else fresh ones (the same on every rank:
    FSDP does not broadcast them)."""
    cfg = run.cfg
    torch.manual_seed(cfg.seed)
    if pretrained:
        model = GPT.from_pretrained(
            cfg.init_from, torch.float32, block_size=cfg.model.block_size, dropout=cfg.model.dropout
        )  # float32 master weights; autocast does the rest
        model = model.train().to(run.device)
    else:
        model = GPT(cfg.model).to(run.device)
    model.checkpoint_blocks = cfg.activation_checkpointing
    if cfg.activation_checkpointing and run.device == "cpu":
        return_freed_memory()
    torch.manual_seed(cfg.seed + run.rank)  # a different dropout stream per rank
    run.n_params, run.flops_per_token = model.num_params(), model.flops_per_token()  # before sharding
    return model


def return_freed_memory() -> None:
    """glibc (Linux): give every allocation of 1 MiB or more its own mapping, returned to the system when freed. By
    default glibc raises that threshold as large blocks are freed and serves them from its heap, which then keeps
    the recomputed activations' memory: a 360M-parameter LoRA step on the CPU peaks at 4.0 GB instead of 2.6 GB, for
    about a fifth more time per step (docs/chat.md). Elsewhere this does nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed at 1 MiB
    except (OSError, AttributeError):
        pass


def shard(run: Run) -> None:
    """Under FSDP, each block is sharded, then the rest of the model (adapters included)."""
    if run.cfg.fsdp and run.world_size > 1:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for block in run.model.blocks:
            fully_shard(block)
        fully_shard(run.model)  # the rest: the token embedding (tied to the head), positions, the final norm


def adapt(run: Run, ckpt: dict | None) -> None:
    """LoRA: freeze the pretrained model and add adapters to it (before FSDP would shard it: see build_model), after
    checking that its weights are the ones a resumed run's adapters were trained on."""
    cfg = run.cfg
    base = fingerprint(cfg.init_from)
    if ckpt and ckpt["lora"]["sha256"] != base:
        raise ValueError(
            f"the base weights of --init_from={cfg.init_from} are not the ones this LoRA run in "
            f"{run.out_dir} started from (sha256 {base[:12]}..., the run's {ckpt['lora']['sha256'][:12]}...); "
            "put the original weights back there, or start a new run"
        )
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    add_lora(run.model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, targets)
    run.lora = {
        "base": cfg.init_from,
        "sha256": base,
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha,
        "targets": list(targets),
    }
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    run.log(
        f"LoRA: {trainable:,} trainable parameters in adapters of rank {cfg.lora_rank} on {', '.join(targets)}; "
        f"the {run.n_params:,} of {cfg.init_from} stay frozen"
    )


def make_optimizer(run: Run) -> None:
    """AdamW (and Muon with optimizer="muon"), and the fp16 loss scaler (a no-op in other precisions)."""
    run.optimizers = make_optimizers(run.model, run.cfg, run.device_type)
    run.scaler = torch.amp.GradScaler(run.device_type, enabled=run.dtype == torch.float16)


def resume_from(run: Run, ckpt: dict) -> None:
    """Weights, optimizer state, loss scale, data position, step, best val loss and random streams from ckpt; then
    rank 0 deletes damaged step files newer than it."""
    state = run.model.state_dict()
    run.model.check_state({**state, **ckpt["model"]} if run.lora else ckpt["model"], f"the checkpoint in {run.out_dir}")
    load_training_state(run.model, run.optimizers, ckpt, strict=not run.lora)
    if ckpt["scaler"]:
        run.scaler.load_state_dict(ckpt["scaler"])
    run.train_loader.restore(ckpt["loader"])
    run.step, run.best_val = int(ckpt["step"]), float(ckpt["best_val_loss"])
    run.resumed, run.wandb_id = True, ckpt["meta"].get("wandb_run_id")
    if len(ckpt["rng"]) == run.world_size:
        set_rng_state(ckpt["rng"][run.rank])
    else:
        run.log(
            f"note: the checkpoint comes from a run with world_size={len(ckpt['rng'])} and this one has "
            f"world_size={run.world_size}: the data continues where it stopped, dropout's random streams start "
            "afresh"
        )
    run.log(f"resumed from {run.out_dir} at step {run.step}")
    if run.world_size > 1:
        dist.barrier()  # every rank has read the checkpoint before rank 0 deletes damaged files
    for path in discard_damaged(run.out_dir, run.step) if run.master else []:
        run.log(f"deleted {path}: it is newer than the checkpoint resumed from, and damaged")


def announce(run: Run, argv: list[str] | None) -> None:
    """Rank 0: copy the data's tokenizer into the run folder (sample.py decodes with it), print the config and the
    model line, open the metrics file and wandb."""
    cfg = run.cfg
    if not run.master:
        return
    tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
    if tokenizer_file.is_file():  # copied whole, then renamed
        tmp = run.out_dir / f"{TOKENIZER_FILE}.tmp"
        try:
            shutil.copyfile(tokenizer_file, tmp)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise fault(e, f"could not copy {tokenizer_file} into {run.out_dir}") from None
        os.replace(tmp, run.out_dir / TOKENIZER_FILE)
    run.log("config: " + json.dumps(config_to_dict(cfg)))
    fsdp = " (fsdp)" if cfg.fsdp and run.world_size > 1 else ""
    run.log(
        f"model: {run.n_params / 1e6:.2f}M parameters | device {run.device}, "
        f"{str(run.dtype).removeprefix('torch.')} | world {run.world_size}{fsdp} | {run.total_batch} tokens/step = "
        f"{run.grad_accum} micro-steps of {cfg.batch_size}x{cfg.model.block_size} per rank"
    )
    run.metrics = MetricsLog(run.out_dir / METRICS_FILE, resume_step=run.step if run.resumed else None)
    if cfg.wandb_log:
        import wandb

        run.wandb = wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or None,
            config=config_to_dict(cfg),
            id=run.wandb_id,
            resume="allow",
        )


def wrap(run: Run) -> None:
    """What trains: the model compiled (if asked and possible) and, with several processes and no FSDP, in DDP."""
    run.train_model = run.model
    if run.cfg.compile:
        reason = compile_unavailable(run.device_type)
        if reason:
            run.log(f"warning: torch.compile is unavailable ({reason}); training uncompiled")
        else:
            run.train_model = torch.compile(run.model)
    if run.world_size > 1 and not run.cfg.fsdp:
        device_ids = [torch.device(run.device)] if run.device_type == "cuda" else None
        run.train_model = DDP(run.train_model, device_ids=device_ids)


# ---------------------------------------------------------------------------------------------
# The loop


class Checkpointer:
    """Saves the run (rank 0 writes; every rank takes part in gathering the state), unless the weights went
    non-finite: a good checkpoint is never replaced by a NaN one."""

    def __init__(self, run: Run, argv: list[str] | None):
        self.run = run
        self.meta = {
            "git_commit": git_commit(),
            "command": shlex.join(sys.argv if argv is None else ["train.py", *argv]),
            "wandb_run_id": run.wandb.id if run.wandb else None,
            "hf_architecture": getattr(run.model, "source_architecture", None),
        }

    def save(self, val_loss: float | None) -> None:
        run = self.run
        model_state, optimizer_state = get_state_dict(run.model, run.optimizers, options=FULL_STATE)  # collective
        rngs = [rng_state()]
        if run.world_size > 1:
            rngs = [None] * run.world_size
            dist.all_gather_object(rngs, rng_state())
        if not run.master:
            return
        bad = [k for k, v in model_state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            run.log(
                f"step {run.step}: not saving a checkpoint, the weights are not finite ({', '.join(bad[:3])}); "
                f"the latest good checkpoint stays in {run.out_dir}"
            )
            return
        best = val_loss is not None and val_loss < run.best_val
        if run.lora:  # the adapters alone: the base weights stay where init_from names them
            model_state = lora_state_dict(model_state)
        payload = {
            "config": config_to_dict(run.cfg),
            "model": model_state,
            "optimizer": optimizer_state,
            "scaler": run.scaler.state_dict(),
            "step": run.step,
            "loader": run.train_loader.state(),
            "world_size": run.world_size,
            "rng": rngs,
            "best_val_loss": val_loss if best else run.best_val,
            "val_loss": val_loss,
            "meta": self.meta,
            **({"lora": run.lora} if run.lora else {}),
        }
        try:
            path = save_run_checkpoint(run.out_dir, payload, keep_last=run.cfg.keep_last, best=best)
        except OSError as e:  # e.g. a full disk: nothing half-written is left, the previous checkpoint is whole
            raise error(
                e.errno,
                f"step {run.step}: {e}; the latest good checkpoint stays in {run.out_dir}: fix that, "
                "then continue with --resume",
            ) from None
        run.best_val = payload["best_val_loss"]
        run.log(f"step {run.step:5d} | saved {path}{' (best val loss)' if best else ''}")


@dataclass
class StepStats:
    """One optimizer step, as every rank agrees on it: the global mean loss, the gradient norm, whether any rank
    was asked to stop or ran out of time, and the wall-clock minutes since the start (the mean over ranks)."""

    loss: float
    grad_norm: float
    finite: bool  # an update was made (with fp16 a scaler-skipped overflow counts as made: it is no fault)
    stop: bool
    timed_out: bool
    minutes: float


def optimizer_step(run: Run, signals: StopSignals, lr: float) -> StepStats:
    """Set the learning rates, accumulate gradients, unscale and clip them, agree across ranks (one all-reduce and
    one host sync), then step every optimizer unless the loss or the gradient norm is not finite."""
    cfg = run.cfg
    for group in (group for opt in run.optimizers for group in opt.param_groups):
        group["lr"] = lr * group["lr_ratio"]
    loss = accumulate_gradients(
        run.train_model, run.train_loader, run.grad_accum, run.device, run.autocast, run.scaler, cfg.chunked_loss
    )
    for opt in run.optimizers:
        run.scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    elapsed = (time.time() - run.t_start) / 60
    timed_out = cfg.max_minutes > 0 and elapsed > cfg.max_minutes
    votes = torch.tensor([float(bool(signals) or timed_out), float(timed_out), elapsed], device=run.device)
    stats = torch.cat([torch.stack([loss, grad_norm.float()]), votes])
    if run.world_size > 1:
        dist.all_reduce(stats)
        stats /= run.world_size
    loss_value, norm, stop, time_votes, minutes = stats.tolist()
    finite = math.isfinite(loss_value) and (run.scaler.is_enabled() or math.isfinite(norm))
    # with fp16, gradients that overflowed skip the step of every optimizer (the scaler alone decides per
    # optimizer: Muon could step while AdamW skips) and scaler.update() lowers the scale
    if finite and math.isfinite(norm):
        for opt in run.optimizers:
            run.scaler.step(opt)
    run.scaler.update()
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    run.step += 1
    return StepStats(loss_value, norm, finite, stop > 0, time_votes > 0, minutes)


def loop(run: Run, signals: StopSignals, checkpointer: Checkpointer) -> dict:
    """Optimizer steps until max_iters, a stop signal or the time budget; a log line every log_interval steps, an
    evaluation and a checkpoint every eval_interval steps and at the end, a checkpoint on a stop. Returns the
    summary main() gives."""
    cfg = run.cfg
    history, val_history = [], []
    stopped, skipped, first_step = None, 0, run.step
    t_last, steps_since, minutes = time.perf_counter(), 0, 0.0
    signals.install()  # from here a signal finishes the step and saves
    while run.step < cfg.max_iters:
        lr = lr_at(run.step, cfg, minutes)
        try:
            stats = optimizer_step(run, signals, lr)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, MPS "out of memory"
            if run.step == first_step and "out of memory" in str(e):
                raise ValueError(out_of_memory_advice(cfg, run.total_batch)) from None
            raise
        minutes, steps_since = stats.minutes, steps_since + 1
        last = run.step == cfg.max_iters or stats.timed_out  # the time budget ends with a full evaluation
        if not stats.finite:
            skipped += 1
            skip_or_stop(run, stats)
        elif run.step % cfg.log_interval == 0 or last:
            dt = (time.perf_counter() - t_last) / steps_since
            t_last, steps_since = time.perf_counter(), 0
            history.append((run.step, stats.loss))
            log_step(run, stats, lr, dt)
        if run.step % cfg.eval_interval == 0 or last:
            val_history.append((run.step, evaluate_and_save(run, checkpointer)))
            t_last = time.perf_counter()  # evaluation time is not training time
        elif stats.stop:
            checkpointer.save(None)
        if stats.stop and run.step < cfg.max_iters:
            stopped = (
                signal.Signals(signals[0]).name
                if signals
                else f"max_minutes={cfg.max_minutes:g}"
                if stats.timed_out
                else "a stop request on another rank"
            )
            resume = f"python train.py --out_dir={shlex.quote(str(run.out_dir))} --resume"
            run.log(
                f"stopped after step {run.step} ({stopped}) with a checkpoint in {run.out_dir}; continue with: "
                f"{resume}" + (" (under torchrun, with the same launch options)" if run.world_size > 1 else "")
            )
            break
    return {
        "step": run.step,
        "history": history,
        "val_history": val_history,
        "best_val_loss": run.best_val,
        "stopped": stopped,
        "signal": signals[0] if stopped and signals else None,
        "skipped_steps": skipped,
    }


def record(run: Run, **row) -> None:
    """A row of metrics.jsonl (and of wandb), on rank 0."""
    if run.master:
        run.metrics.write(**row)
        if run.wandb:
            run.wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, float)}, step=row["step"])


def skip_or_stop(run: Run, stats: StepStats) -> None:
    """A step whose loss or gradient norm is not finite made no update: say so, or stop with on_nan=stop."""
    record(run, step=run.step, event="nonfinite", loss=stats.loss, grad_norm=stats.grad_norm)
    problem = f"step {run.step}: loss {stats.loss}, gradient norm {stats.grad_norm} are not finite"
    if run.cfg.on_nan == "stop":
        raise FloatingPointError(
            f"{problem}; stopped without saving (on_nan=stop). The latest good checkpoint is in {run.out_dir}; resume "
            "with --resume and a lower --learning_rate, or --on_nan=skip to skip such steps"
        )
    run.log(f"{problem}; skipped this update (on_nan=skip)")


def log_step(run: Run, stats: StepStats, lr: float, dt: float) -> None:
    """The log line and metrics row of a step: loss, learning rate, gradient norm, time per step, tokens/s, MFU."""
    tokens_per_s = run.total_batch / dt
    peak = peak_flops(torch.cuda.get_device_name(run.device)) if run.device_type == "cuda" else None
    step_mfu = mfu(run.flops_per_token, tokens_per_s / run.world_size, peak)
    run.log(
        f"step {run.step:5d} | loss {stats.loss:.4f} | lr {lr:.2e} | grad norm {stats.grad_norm:.3f} | "
        f"{dt * 1000:7.1f} ms/step | {tokens_per_s:8.0f} tok/s | mfu "
        + ("n/a" if step_mfu is None else f"{100 * step_mfu:.1f}%")
    )
    record(
        run,
        step=run.step,
        tokens=run.step * run.total_batch,
        loss=stats.loss,
        lr=lr,
        grad_norm=stats.grad_norm,
        ms_per_step=dt * 1000,
        tokens_per_s=tokens_per_s,
        mfu=step_mfu,
    )


def evaluate_and_save(run: Run, checkpointer: Checkpointer) -> float:
    """The val loss (and bits per byte) of the model as built, logged and recorded, then a checkpoint; returns the
    loss. Not train_model: compiling a second, eval-mode graph cost more than it saved (8 s for the char GPU recipe,
    whose evaluation then took 0.1 s; DDP adds nothing without gradients)."""
    val_loss, val_bpb = evaluate(run.model, run.val_loader, run.cfg.eval_iters, run.device, run.autocast, run.lengths)
    run.log(f"step {run.step:5d} | val loss {val_loss:.4f}" + ("" if val_bpb is None else f" | val bpb {val_bpb:.4f}"))
    record(run, step=run.step, tokens=run.step * run.total_batch, val_loss=val_loss, val_bpb=val_bpb)
    checkpointer.save(val_loss)
    return val_loss


# ---------------------------------------------------------------------------------------------
# The command


def cli(argv: list[str]) -> int:
    """Command-line entry: a user error prints one line on stderr and exits 2, without a traceback; a stop on a
    non-finite loss exits 1; a stop on SIGINT/SIGTERM exits 128 + the signal number, as shells do."""
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nkeys and defaults:\n" + config_help())
        return 0
    try:
        cfg = resolve_config(argv)
        summary = main(cfg, argv)
    except (ValueError, TypeError, FileNotFoundError, ConnectionError, ImportError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except (FloatingPointError, OSError) as e:  # a stop on a non-finite loss; a fault of the disk (e.g. full)
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    return 128 + summary["signal"] if summary["signal"] else 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
