"""Train a GPT on token shards: one CPU, one GPU, or many through torchrun (PyTorch DDP).

    python train.py [CONFIG.toml] --data_dir=DIR [--key=value ...] [--resume]
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data_dir=DIR

Config precedence: defaults (gptlite/config.py) < TOML file < --key=value. `python train.py --help` lists keys.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint, unwrap
from gptlite.config import TrainConfig, build_config, config_help, config_to_dict, parse_args, read_toml
from gptlite.data import ShardLoader, check_vocab, find_shards
from gptlite.model import GPT

TOKENIZER_FILE = "tokenizer.json"


# ---------------------------------------------------------------------------------------------
# Helpers


def setup_distributed() -> tuple[int, int, int]:
    """(rank, local_rank, world_size); starts a process group when launched by torchrun."""
    if "RANK" not in os.environ:
        return 0, 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()


def pick_device(name: str, local_rank: int) -> str:
    """cuda > mps > cpu for 'auto'; under torchrun each process takes cuda:LOCAL_RANK."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda" and "RANK" in os.environ:
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available here; use --device=cpu or --device=auto")
    return name


def pick_dtype(name: str, device_type: str) -> torch.dtype:
    """Autocast precision: bf16 on CUDA GPUs that support it, float32 elsewhere, unless set explicitly."""
    if name == "auto":
        cuda_bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, name)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    if step >= decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: GPT, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear weights and the tied embedding/head, as nanoGPT) and
    none on vectors (norm weights, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device_type == "cuda"
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: ShardLoader, iters: int, device: str, autocast) -> float:
    """Mean loss over the first `iters` batches of a fresh loader (the same batches at every evaluation)."""
    model.eval()
    loader.restore({"epoch": 0, "shard": 0, "index": 0})
    total = torch.zeros((), device=device)
    for _ in range(iters):
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())
        with autocast:
            _, loss = model(x, y)
        total += loss.float()
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    model.train()
    return total.item() / iters


def read_vocab_size(data_dir: str) -> int:
    """vocab_size recorded in DATA_DIR/tokenizer.json by data/prepare.py."""
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


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_config(argv: list[str]) -> TrainConfig:
    """defaults < TOML < --key=value; on --resume the checkpoint's config is the base; vocab_size from the data."""
    toml_path, overrides = parse_args(argv)
    values = {**(read_toml(toml_path) if toml_path else {}), **overrides}
    out_dir = values.get("out_dir", TrainConfig.out_dir)
    resume = str(values.get("resume", "false")).lower() in ("true", "1", "yes", "on")
    ckpt_path = Path(out_dir) / CHECKPOINT_NAME
    if resume and ckpt_path.is_file():
        saved = load_checkpoint(ckpt_path)["config"]
        changed = [
            f"{k}={values[k]} (checkpoint has {saved[k]})"
            for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "bias", "pos_emb")
            if k in values and str(values[k]).lower() != str(saved[k]).lower()
        ]
        if changed:
            raise ValueError(f"cannot change the model shape on --resume from {ckpt_path}: {', '.join(changed)}")
        values = {**saved, **values}
    if "vocab_size" not in values:
        if not values.get("data_dir"):
            raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
        values["vocab_size"] = read_vocab_size(values["data_dir"])
    return build_config(values)


# ---------------------------------------------------------------------------------------------
# The training loop


def main(cfg: TrainConfig, argv: list[str] | None = None) -> dict:
    """Train according to cfg; returns a summary (steps, logged losses, last val loss) for scripts and tests."""
    if not cfg.data_dir:
        raise ValueError("data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)")
    rank, local_rank, world_size = setup_distributed()
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    device = pick_device(cfg.device, local_rank)
    device_type = device.split(":")[0]
    if device_type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = pick_dtype(cfg.dtype, device_type)
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    torch.manual_seed(cfg.seed + rank)

    # data: every problem is found here, before the first step
    B, T = cfg.batch_size, cfg.model.block_size
    train_files, val_files = find_shards(cfg.data_dir, "train"), find_shards(cfg.data_dir, "val")
    check_vocab(train_files + val_files, cfg.model.vocab_size)
    tokens_per_micro = B * T * world_size
    total_batch = cfg.total_batch_size or tokens_per_micro
    if total_batch % tokens_per_micro:
        raise ValueError(
            f"total_batch_size={total_batch} is not a multiple of batch_size*block_size*world_size="
            f"{B}*{T}*{world_size}={tokens_per_micro}; set total_batch_size to a multiple of {tokens_per_micro}"
        )
    grad_accum = total_batch // tokens_per_micro
    train_loader = ShardLoader(train_files, B, T, seed=cfg.seed, rank=rank, world_size=world_size)
    val_loader = ShardLoader(val_files, B, T, seed=cfg.seed + 1, rank=rank, world_size=world_size)

    model = GPT(cfg.model).to(device)
    optimizer = make_optimizer(model, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    out_dir = Path(cfg.out_dir)
    step, best_val = 0, float("inf")
    if cfg.resume and (out_dir / CHECKPOINT_NAME).is_file():
        ckpt = load_checkpoint(out_dir / CHECKPOINT_NAME, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.restore(ckpt["loader"])
        step, best_val = int(ckpt["step"]), float(ckpt["best_val_loss"])
        log(f"resumed from {out_dir / CHECKPOINT_NAME} at step {step}")
    elif cfg.resume:
        log(f"no checkpoint in {out_dir}; starting from scratch")

    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
        if tokenizer_file.is_file():  # sample.py decodes with the copy in out_dir
            shutil.copyfile(tokenizer_file, out_dir / TOKENIZER_FILE)
        log("config: " + json.dumps(config_to_dict(cfg)))
        log(
            f"model: {model.num_params() / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')}"
            f" | world {world_size} | {total_batch} tokens/step = {grad_accum} micro-steps of {B}x{T} per rank"
        )
    run = None
    if cfg.wandb_log and master:
        import wandb

        run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or None, config=config_to_dict(cfg))

    train_model = torch.compile(model) if cfg.compile else model
    if world_size > 1:
        train_model = DDP(train_model, device_ids=[local_rank] if device_type == "cuda" else None)
    meta = {"git_commit": git_commit(), "argv": list(sys.argv if argv is None else argv)}

    def checkpoint(val_loss: float) -> None:
        save_checkpoint(out_dir / CHECKPOINT_NAME, {
            "config": config_to_dict(cfg),
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "loader": train_loader.state(),
            "best_val_loss": best_val,
            "val_loss": val_loss,
            "meta": meta,
        })

    history: list[tuple[int, float]] = []
    val_history: list[tuple[int, float]] = []
    t_last, steps_since = time.perf_counter(), 0
    while step < cfg.max_iters:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(grad_accum):
            x, y = (t.to(device, non_blocking=True) for t in train_loader.next_batch())
            if isinstance(train_model, DDP):  # all-reduce gradients only on the last micro-step
                train_model.require_backward_grad_sync = micro == grad_accum - 1
            with autocast:
                _, loss = train_model(x, y)
            scaler.scale(loss / grad_accum).backward()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_since += 1

        if step % cfg.log_interval == 0 or step == cfg.max_iters:
            loss_value = loss.item()  # the last micro-batch's loss; .item() also waits for the GPU
            dt = (time.perf_counter() - t_last) / steps_since
            t_last, steps_since = time.perf_counter(), 0
            history.append((step, loss_value))
            log(f"step {step:5d} | loss {loss_value:.4f} | lr {lr:.2e} | {dt * 1000:7.1f} ms/step | {total_batch / dt:8.0f} tok/s")
            if run:
                run.log({"train/loss": loss_value, "lr": lr, "tokens_per_s": total_batch / dt}, step=step)

        if step % cfg.eval_interval == 0 or step == cfg.max_iters:
            val_loss = evaluate(train_model, val_loader, max(1, cfg.eval_iters), device, autocast)
            best_val = min(best_val, val_loss)
            val_history.append((step, val_loss))
            log(f"step {step:5d} | val loss {val_loss:.4f}")
            if run:
                run.log({"val/loss": val_loss}, step=step)
            if master:
                checkpoint(val_loss)
            t_last = time.perf_counter()  # evaluation time is not training time

    if run:
        run.finish()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"step": step, "history": history, "val_history": val_history, "best_val_loss": best_val}


def cli(argv: list[str]) -> int:
    """Command-line entry: a user error prints one line on stderr and exits 2, without a traceback."""
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nkeys and defaults:\n" + config_help())
        return 0
    try:
        cfg = resolve_config(argv)
        main(cfg, argv)
    except (ValueError, TypeError, FileNotFoundError, ConnectionError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
