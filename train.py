"""Train a GPT on token shards: one CPU, one GPU, or many through torchrun (PyTorch DDP, or FSDP2 with --fsdp).

    python train.py [CONFIG.toml] --data_dir=DIR [--key=value ...] [--resume]
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data_dir=DIR

Config precedence: defaults (gptlite/config.py) < TOML file < --key=value. `python train.py --help` lists keys.
Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits; --resume continues exactly.
"""

from __future__ import annotations

import contextlib
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
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import (discard_damaged, holds_run, load_checkpoint, remove_leftovers,
                                 rng_state, run_files, save_run_checkpoint, set_rng_state)
from gptlite.cli import config_help, parse_args, pick_device, pick_dtype
from gptlite.config import GPTConfig, TrainConfig, build_config, config_to_dict, read_toml
from gptlite.data import ShardLoader, check_vocab, find_shards, read_shard
from gptlite.metrics import METRICS_FILE, MetricsLog, mfu, peak_flops
from gptlite.model import GPT
from gptlite.optim import Muon, block_matrices
from gptlite.evaluate import byte_lengths, loss_and_bpb, loss_sums
from gptlite.files import FolderLock, error, fault, make_dir
from gptlite.tokenizer import TOKENIZER_FILE, load_tokenizer

# what --resume cannot change: the weights' shapes and the function the model computes (dropout may change)
MODEL_SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "bias", "pos_emb",
                    "rope_theta", "norm", "norm_eps", "ffn")
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
    rest = [p for p in params if p not in splits]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_ratio": 1.0},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_ratio": 1.0},
    ]
    optimizers = [torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device_type in ("cuda", "cpu")
    )]
    if splits:
        ratio = cfg.muon_lr / cfg.learning_rate if cfg.learning_rate else 0.0  # learning_rate=0 moves nothing
        groups = [{"params": [p for p, s in splits.items() if s == split], "split": split, "lr_ratio": ratio}
                  for split in sorted(set(splits.values()))]
        ns_dtype = torch.bfloat16 if device_type == "cuda" else torch.float32  # see gptlite.optim.Muon
        optimizers.append(Muon(groups, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                               weight_decay=cfg.muon_weight_decay, ns_dtype=ns_dtype))
    return optimizers


def load_training_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: dict) -> None:
    """Load a checkpoint's weights and optimizer state (moments, momentum buffers, step counts). Every group's
    hyperparameters (lr_ratio, weight decay, betas, momentum) stay those of this run's config: one changed with
    --key=value on --resume takes effect, and a checkpoint saved before groups had an lr_ratio loads."""
    hyper = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    set_state_dict(model, optimizers, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    for opt, groups in zip(optimizers, hyper):
        for group, values in zip(opt.param_groups, groups):
            group.update(values)


def make_loaders(cfg: TrainConfig, rank: int, world_size: int) -> tuple[ShardLoader, ShardLoader]:
    """Train and val loaders over data_dir's shards, after checking that no shard is empty, every token id
    is below vocab_size and each split holds at least one global batch. Rank r reads the r-th slice of
    every global batch, so ranks never read the same window."""
    loaders = []
    for split, seed in (("train", cfg.seed), ("val", cfg.seed + 1)):
        files = find_shards(cfg.data_dir, split)
        for path in files:
            if len(read_shard(path)) == 0:
                raise ValueError(f"shard {path} holds no tokens; delete it or prepare the data again")
        check_vocab(files, cfg.model.vocab_size)
        try:
            loaders.append(ShardLoader(files, cfg.batch_size, cfg.model.block_size, seed=seed, rank=rank,
                                       world_size=world_size))
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


def accumulate_gradients(model: torch.nn.Module, loader, grad_accum: int, device: str, autocast, scaler
                         ) -> torch.Tensor:
    """Forward and backward over `grad_accum` micro-batches from `loader`; returns their mean loss (0-dim).

    The gradients are those of the mean loss over all micro-batches, the same as one batch `grad_accum`
    times larger. Under DDP or FSDP, gradients are reduced across ranks on the last micro-step only."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(grad_accum):
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())  # (B, T) each
        last = micro == grad_accum - 1
        if isinstance(model, DDP):
            model.require_backward_grad_sync = last
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(last)
        with autocast:
            _, loss = model(x, y)
        scaler.scale(loss / grad_accum).backward()
        loss_sum += loss.detach()
    return loss_sum / grad_accum


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: ShardLoader, iters: int, device: str, autocast,
             lengths: torch.Tensor | None) -> tuple[float, float | None]:
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
    keep = ("total_batch_size stays, gradient accumulation makes up the difference" if cfg.total_batch_size
            else f"add --total_batch_size={total_batch} to keep the global batch")
    return f"{failed}; try --batch_size={B // 2} ({keep})"


def read_vocab_size(data_dir: str) -> int:
    """vocab_size recorded in DATA_DIR/tokenizer.json by data/prepare.py."""
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data_dir {data_dir} does not exist or is not a folder; prepare data there first "
                                f"(python data/prepare.py --input=... --out_dir={data_dir}) or check the path")
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist, so the vocabulary size is unknown; pass --vocab_size=N "
            "(e.g. 50304 for GPT-2 token shards) or prepare the data with data/prepare.py"
        )
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} has no valid vocab_size ({e}); prepare the data again or pass --vocab_size=N") from None


def pretrained_values(init_from: str, values: dict) -> dict:
    """The model keys of a pretrained checkpoint (its config.json only), after checking that `values` changes none
    of them but block_size and dropout."""
    from gptlite.hf import pretrained_config

    pretrained = dict(vars(pretrained_config(init_from)))
    changed = [f"{k}={values[k]} (the model has {pretrained[k]})" for k in MODEL_SHAPE_KEYS
               if k != "block_size" and k in values and str(values[k]).lower() != str(pretrained[k]).lower()]
    if changed:
        raise ValueError(f"--init_from={init_from} fixes the model's shape; drop {', '.join(changed)} "
                         "(block_size may be smaller, dropout anything)")
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
                "pass --overwrite to move its files into a previous-TIME folder inside it first")
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
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_config(argv: list[str]) -> TrainConfig:
    """defaults < TOML < --key=value; on --resume the checkpoint's config is the base, with --init_from the
    pretrained model's shape; otherwise vocab_size comes from the data."""
    toml_path, overrides = parse_args(argv)
    values = {**(read_toml(toml_path) if toml_path else {}), **overrides}
    if values.get("init_from") in ("scratch", "resume"):  # nanoGPT's values, which mean the same here
        if values.pop("init_from") == "resume":
            values.setdefault("resume", "true")
    out_dir = values.get("out_dir", TrainConfig.out_dir)
    resume = str(values.get("resume", "false")).lower() in ("true", "1", "yes", "on")
    saved = None
    if resume:
        with contextlib.suppress(FileNotFoundError):  # main() says so and starts from scratch
            saved = load_checkpoint(out_dir, on_fallback=lambda message: None)["config"]  # main() reports fallbacks
    if saved:
        changed = [
            f"{k}={values[k]} (checkpoint has {saved[k]})"
            for k in MODEL_SHAPE_KEYS
            if k in values and str(values[k]).lower() != str(saved.get(k, getattr(GPTConfig(), k))).lower()
        ]
        if changed:
            raise ValueError(f"cannot change the model shape on --resume from {out_dir}: {', '.join(changed)}")
        if "optimizer" in values and values["optimizer"] != saved.get("optimizer", "adamw"):
            raise ValueError(f"cannot change the optimizer on --resume from {out_dir}: optimizer={values['optimizer']} "
                             f"(checkpoint has {saved.get('optimizer', 'adamw')}, whose state it holds); drop "
                             "--optimizer, or start a new run in another --out_dir")
        values = {**saved, **values}
    elif values.get("init_from"):
        values = {**pretrained_values(str(values["init_from"]), values), **values}
    if "vocab_size" not in values:
        if not values.get("data_dir"):
            raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
        values["vocab_size"] = read_vocab_size(values["data_dir"])
    return build_config(values)


# ---------------------------------------------------------------------------------------------
# The training loop


def main(cfg: TrainConfig, argv: list[str] | None = None) -> dict:
    """Train according to cfg; returns a summary (steps, logged losses, val losses, why it stopped early)."""
    if not cfg.data_dir:
        raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
    with training_session() as session, contextlib.ExitStack() as cleanup:
        return train(cfg, argv, *session, cleanup)


def train(cfg: TrainConfig, argv: list[str] | None, rank: int, local_rank: int, world_size: int,
          signals: StopSignals, cleanup: contextlib.ExitStack) -> dict:
    """`main` inside its session: set up, data, run folder, model, optimizer, resume, loop, finish. The model and
    optimizer live in this function's frame, so they are gone when it ends, before the process group is."""
    t_start = time.time()
    master = rank == 0
    log = functools.partial(print, flush=True) if master else (lambda *a, **k: None)
    device = pick_device(cfg.device, local_rank)
    device_type = device.split(":")[0]
    if device_type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = getattr(torch, pick_dtype(cfg.dtype, device))
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)

    # data: every problem is found here, before the first step
    B, T = cfg.batch_size, cfg.model.block_size
    tokens_per_micro = B * T * world_size
    total_batch = cfg.total_batch_size or tokens_per_micro
    if total_batch % tokens_per_micro:
        raise ValueError(
            f"total_batch_size={total_batch} is not a multiple of batch_size*block_size*world_size="
            f"{B}*{T}*{world_size}={tokens_per_micro}; set total_batch_size to a multiple of {tokens_per_micro}"
        )
    grad_accum = total_batch // tokens_per_micro
    train_loader, val_loader = make_loaders(cfg, rank, world_size)
    tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
    lengths = None  # each token's bytes, for the val bits per byte (unknown without the data's tokenizer)
    if tokenizer_file.is_file():
        lengths = byte_lengths(load_tokenizer(tokenizer_file), cfg.model.vocab_size).to(device)

    # the run folder: this run's alone from here on (rank 0 holds its lock until the run ends)
    out_dir = Path(cfg.out_dir)
    problem, lock = None, None
    if master:
        try:
            lock = claim_run_folder(out_dir, cfg, log)
        except (ValueError, OSError) as e:
            problem = str(e)
    stop_together(problem, world_size)
    if lock:
        cleanup.callback(lock.release)
    ckpt = None
    if cfg.resume:
        try:
            ckpt = load_checkpoint(out_dir, on_fallback=log)
        except FileNotFoundError:
            log(f"no checkpoint in {out_dir}; starting from scratch")

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (FSDP does not broadcast them)
    if cfg.init_from and not ckpt:
        model = GPT.from_pretrained(cfg.init_from, block_size=cfg.model.block_size, dropout=cfg.model.dropout)
        model = model.train().to(device)
    else:
        model = GPT(cfg.model).to(device)
    torch.manual_seed(cfg.seed + rank)  # a different dropout stream per rank
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    fsdp = cfg.fsdp and world_size > 1
    if fsdp:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the rest: the token embedding (tied to the head), positions, the final norm
    optimizers = make_optimizers(model, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    step, best_val = 0, float("inf")
    if ckpt:
        model.check_state(ckpt["model"], f"the checkpoint in {out_dir}")
        load_training_state(model, optimizers, ckpt)
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        train_loader.restore(ckpt["loader"])
        step, best_val = int(ckpt["step"]), float(ckpt["best_val_loss"])
        if len(ckpt["rng"]) == world_size:
            set_rng_state(ckpt["rng"][rank])
        else:
            log(f"note: the checkpoint comes from a run with world_size={len(ckpt['rng'])} and this one has "
                f"world_size={world_size}: the data continues where it stopped, dropout's random streams "
                "start afresh")
        log(f"resumed from {out_dir} at step {step}")
        if world_size > 1:
            dist.barrier()  # every rank has read the checkpoint before rank 0 deletes damaged files
        for path in discard_damaged(out_dir, step) if master else []:
            log(f"deleted {path}: it is newer than the checkpoint resumed from, and damaged")

    if master:
        if tokenizer_file.is_file():  # sample.py decodes with the copy in out_dir (copied whole, then renamed)
            tmp = out_dir / f"{TOKENIZER_FILE}.tmp"
            try:
                shutil.copyfile(tokenizer_file, tmp)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise fault(e, f"could not copy {tokenizer_file} into {out_dir}") from None
            os.replace(tmp, out_dir / TOKENIZER_FILE)
        log("config: " + json.dumps(config_to_dict(cfg)))
        log(
            f"model: {n_params / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')}"
            f" | world {world_size}{' (fsdp)' if fsdp else ''} | {total_batch} tokens/step = {grad_accum}"
            f" micro-steps of {B}x{T} per rank"
        )
    metrics = MetricsLog(out_dir / METRICS_FILE, resume_step=step if ckpt else None) if master else None
    run = None
    if cfg.wandb_log and master:
        import wandb

        run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or None, config=config_to_dict(cfg),
                         id=ckpt["meta"].get("wandb_run_id") if ckpt else None, resume="allow")
    ckpt = None  # free its memory

    train_model = model
    if cfg.compile:
        reason = compile_unavailable(device_type)
        if reason:
            log(f"warning: torch.compile is unavailable ({reason}); training uncompiled")
        else:
            train_model = torch.compile(model)
    if world_size > 1 and not fsdp:
        train_model = DDP(train_model, device_ids=[local_rank] if device_type == "cuda" else None)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None
    meta = {"git_commit": git_commit(), "command": shlex.join(sys.argv if argv is None else ["train.py", *argv]),
            "wandb_run_id": run.id if run else None}

    def record(**row) -> None:
        if master:
            metrics.write(**row)
            if run:
                run.log({k: v for k, v in row.items() if k != "step" and isinstance(v, float)}, step=row["step"])

    def checkpoint(val_loss: float | None) -> None:
        """Save (rank 0), unless the weights went non-finite: a good checkpoint is never replaced by a NaN one."""
        nonlocal best_val
        model_state, optimizer_state = get_state_dict(model, optimizers, options=FULL_STATE)  # collective
        rngs = [rng_state()]
        if world_size > 1:
            rngs = [None] * world_size
            dist.all_gather_object(rngs, rng_state())
        if not master:
            return
        bad = [k for k, v in model_state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            log(f"step {step}: not saving a checkpoint, the weights are not finite ({', '.join(bad[:3])}); "
                f"the latest good checkpoint stays in {out_dir}")
            return
        best = val_loss is not None and val_loss < best_val
        payload = {
            "config": config_to_dict(cfg),
            "model": model_state,
            "optimizer": optimizer_state,
            "scaler": scaler.state_dict(),
            "step": step,
            "loader": train_loader.state(),
            "world_size": world_size,
            "rng": rngs,
            "best_val_loss": val_loss if best else best_val,
            "val_loss": val_loss,
            "meta": meta,
        }
        try:
            path = save_run_checkpoint(out_dir, payload, keep_last=cfg.keep_last, best=best)
        except OSError as e:  # e.g. a full disk: nothing half-written is left, the previous checkpoint is whole
            raise error(e.errno, f"step {step}: {e}; the latest good checkpoint stays in {out_dir}: fix that, then "
                                 "continue with --resume") from None
        best_val = payload["best_val_loss"]
        log(f"step {step:5d} | saved {path}{' (best val loss)' if best else ''}")

    history: list[tuple[int, float]] = []
    val_history: list[tuple[int, float]] = []
    stopped, skipped, first_step = None, 0, step
    t_last, steps_since = time.perf_counter(), 0
    minutes = 0.0  # wall-clock minutes since the start, the mean over ranks (for lr_schedule="time")
    signals.install()
    while step < cfg.max_iters:
        lr = lr_at(step, cfg, minutes)
        for group in (group for opt in optimizers for group in opt.param_groups):
            group["lr"] = lr * group["lr_ratio"]
        try:
            loss = accumulate_gradients(train_model, train_loader, grad_accum, device, autocast, scaler)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, MPS "out of memory"
            if step == first_step and "out of memory" in str(e):
                raise ValueError(out_of_memory_advice(cfg, total_batch)) from None
            raise
        for opt in optimizers:
            scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        elapsed = (time.time() - t_start) / 60
        timed_out = cfg.max_minutes > 0 and elapsed > cfg.max_minutes
        # one all-reduce and one host sync per step: the global mean loss, the grad norm (already equal on all
        # ranks), whether any rank was asked to stop and the minutes elapsed, so that all ranks take the same
        # decisions and learning rates
        votes = torch.tensor([float(bool(signals) or timed_out), float(timed_out), elapsed], device=device)
        stats = torch.cat([torch.stack([loss, grad_norm.float()]), votes])
        if world_size > 1:
            dist.all_reduce(stats)
            stats /= world_size
        loss_value, grad_norm_value, stop_votes, time_votes, minutes = stats.tolist()
        last = step + 1 == cfg.max_iters or time_votes > 0  # the time budget ends with a full evaluation
        finite = math.isfinite(loss_value) and (scaler.is_enabled() or math.isfinite(grad_norm_value))
        # with fp16, gradients that overflowed skip the step of every optimizer (the scaler alone decides per
        # optimizer: Muon could step while AdamW skips) and scaler.update() lowers the scale
        if finite and math.isfinite(grad_norm_value):
            for opt in optimizers:
                scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        step += 1
        steps_since += 1

        if not finite:
            skipped += 1
            record(step=step, event="nonfinite", loss=loss_value, grad_norm=grad_norm_value)
            problem = f"step {step}: loss {loss_value}, gradient norm {grad_norm_value} are not finite"
            if cfg.on_nan == "stop":
                raise FloatingPointError(
                    f"{problem}; stopped without saving (on_nan=stop). The latest good checkpoint is in {out_dir}; "
                    "resume with --resume and a lower --learning_rate, or --on_nan=skip to skip such steps"
                )
            log(f"{problem}; skipped this update (on_nan=skip)")
        elif step % cfg.log_interval == 0 or last:
            dt = (time.perf_counter() - t_last) / steps_since
            t_last, steps_since = time.perf_counter(), 0
            tokens_per_s = total_batch / dt
            step_mfu = mfu(flops_per_token, tokens_per_s / world_size, peak)
            history.append((step, loss_value))
            log(f"step {step:5d} | loss {loss_value:.4f} | lr {lr:.2e} | grad norm {grad_norm_value:.3f} | "
                f"{dt * 1000:7.1f} ms/step | {tokens_per_s:8.0f} tok/s | mfu "
                + ("n/a" if step_mfu is None else f"{100 * step_mfu:.1f}%"))
            record(step=step, tokens=step * total_batch, loss=loss_value, lr=lr, grad_norm=grad_norm_value,
                   ms_per_step=dt * 1000, tokens_per_s=tokens_per_s, mfu=step_mfu)

        if step % cfg.eval_interval == 0 or last:
            # the model as built, not train_model: compiling a second, eval-mode graph cost more than it saved
            # (8 s for the char GPU recipe, whose evaluation then took 0.1 s; DDP adds nothing without gradients)
            val_loss, val_bpb = evaluate(model, val_loader, cfg.eval_iters, device, autocast, lengths)
            val_history.append((step, val_loss))
            log(f"step {step:5d} | val loss {val_loss:.4f}" + ("" if val_bpb is None else f" | val bpb {val_bpb:.4f}"))
            record(step=step, tokens=step * total_batch, val_loss=val_loss, val_bpb=val_bpb)
            checkpoint(val_loss)
            t_last = time.perf_counter()  # evaluation time is not training time
        elif stop_votes > 0:
            checkpoint(None)
        if stop_votes > 0 and step < cfg.max_iters:
            stopped = (signal.Signals(signals[0]).name if signals
                       else f"max_minutes={cfg.max_minutes:g}" if timed_out else "a stop request on another rank")
            resume = f"python train.py --out_dir={shlex.quote(str(out_dir))} --resume"
            log(f"stopped after step {step} ({stopped}) with a checkpoint in {out_dir}; continue with: {resume}"
                + (" (under torchrun, with the same launch options)" if world_size > 1 else ""))
            break

    if master:
        metrics.close()
    if run:
        run.finish()
    return {"step": step, "history": history, "val_history": val_history, "best_val_loss": best_val,
            "stopped": stopped, "signal": signals[0] if stopped and signals else None, "skipped_steps": skipped}


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
