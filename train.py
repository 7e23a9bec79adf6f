"""Train a GPT on token shards: one CPU, one GPU, or many through torchrun (PyTorch DDP, or FSDP2 with --fsdp).

    python train.py [CONFIG.toml] --data_dir=DIR [--key=value ...] [--resume]
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data_dir=DIR

Config precedence: defaults (gptlite/config.py) < TOML file < --key=value. `python train.py --help` lists keys.
Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits; --resume continues exactly.

This file reads top to bottom in the order training happens: configuration, device, data and objective, model, run
folder, optimizer, resume, then the loop, whose optimizer step (learning rate, micro-steps, clip, update, log,
evaluate and save) is one block. The step is the same for every way of training; what differs (the batches, the
loss and its figures, how the run is judged, what resumes) is the objective's, chosen once from the config and the
data (gptlite/objective.py lists them). What is not the story of training (run folders and checkpoints, devices,
processes, loaders, the optimizers' groups) lives in gptlite/, where sample.py, the server and the tests use it too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shlex
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlite.checkpoint import (
    check_lora_base,
    check_same_data,
    claim_run_folder,
    copy_tokenizer,
    discard_damaged,
    gather_training_state,
    git_commit,
    load_checkpoint,
    load_source,
    load_training_state,
    nonfinite,
    record_run,
    run_checkpoint,
    save_run_checkpoint,
    set_rng_state,
    source_tokenizer,
    step_files,
)
from gptlite.cli import StopSignals, run_command
from gptlite.config import TrainConfig, config_to_dict
from gptlite.device import (
    THREADS_EVENT,
    CpuThreads,
    autocast,
    batch_mover,
    compile_unavailable,
    cpu_summary,
    out_of_memory_advice,
    peak_memory_mb,
    pick_device,
    pick_dtype,
    return_freed_memory,
    use_device,
)
from gptlite.distributed import processes, stop_together
from gptlite.evaluate import core_bundle, core_score, read_bundle
from gptlite.files import error
from gptlite.lora import add_lora
from gptlite.metrics import (
    METRICS_FILE,
    PACE_STEPS,
    MetricsLog,
    WandbTracker,
    mfu,
    pace_note,
    peak_flops,
    start_tensorboard,
    start_wandb,
)
from gptlite.model import GPT
from gptlite.objective import make_objective
from gptlite.optim import WeightAverage, configure_optimizers, lr_at
from gptlite.run_config import NO_DATA_DIR, resolve_config
from gptlite.tokenizer import TOKENIZER_FILE, check_same_tokenizer, load_tokenizer
from gptlite.update import make_update, step_stats


def main(argv: list[str]) -> int:
    """Train as argv says. Returns the exit code: 0, or 128 + the number of the signal that stopped the run."""
    # ---------------------------------------------------------------------------------------------
    # 1. Configuration: defaults < TOML file < --key=value. On --resume the run's own config is the base.
    budget_notes: list[str] = []  # with --budget, why each key of the recipe is what it is
    cfg = resolve_config(argv, doc=__doc__, notes=budget_notes)
    if not cfg.data_dir:
        raise ValueError(NO_DATA_DIR)
    if Path(cfg.data_dir).resolve() == Path(cfg.out_dir).resolve():
        raise ValueError(
            f"out_dir and data_dir are the same folder ({cfg.out_dir}): the run's files would go among the data's "
            "shards; choose another --out_dir"
        )
    # Under torchrun this starts the process group. On the way out, also on an error, the run folder's lock is
    # released and the group ends, after everything that uses it (see gptlite.distributed).
    with processes() as (rank, local_rank, world_size), contextlib.ExitStack() as cleanup:
        return train(cfg, argv, rank, local_rank, world_size, cleanup, budget_notes)


def train(
    cfg: TrainConfig,
    argv: list[str],
    rank: int,
    local_rank: int,
    world_size: int,
    cleanup: contextlib.ExitStack,
    budget_notes: list[str],
) -> int:
    """The run, from set-up to the last step, in one process of `world_size`."""
    master = rank == 0  # rank 0 alone prints, writes the run folder and logs metrics
    log = functools.partial(print, flush=True) if master else (lambda *args, **kwargs: None)
    for note in budget_notes:
        log(f"budget | {note}")
    out_dir = Path(cfg.out_dir)
    t_start = time.time()

    # ---------------------------------------------------------------------------------------------
    # 2. Device and precision. Weights stay float32; autocast runs the forward pass in bfloat16 or float16, and
    # float16's loss is scaled up so that small gradients do not underflow (the scaler does nothing otherwise).
    device = pick_device(cfg.device, local_rank)
    device_type = device.split(":")[0]
    use_device(device)
    dtype = getattr(torch, pick_dtype(cfg.dtype, device))
    amp = autocast(device, dtype)
    to_device = batch_mover(device)  # to a GPU through page-locked memory, without waiting for it
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)

    # ---------------------------------------------------------------------------------------------
    # 3. Data and objective. An optimizer step takes total_batch_size tokens: micro-batches of batch_size x block_size
    # tokens in every process, grad_accum of them one after the other. The objective (gptlite.objective) is the one
    # the config and the data ask for. Every input it reads, every shard included, is checked here, before the first
    # step.
    B, T = cfg.batch_size, cfg.model.block_size
    tokens_per_micro_step = B * T * world_size
    total_batch = cfg.total_batch_size or tokens_per_micro_step
    if total_batch % tokens_per_micro_step:
        raise ValueError(
            f"total_batch_size={total_batch} is not a multiple of batch_size*block_size*world_size="
            f"{B}*{T}*{world_size}={tokens_per_micro_step}; set total_batch_size to a multiple of "
            f"{tokens_per_micro_step}"
        )
    grad_accum = total_batch // tokens_per_micro_step
    tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None  # the data's, if it has one
    if cfg.init_from and tokenizer is not None:  # the ids of the data must mean what they meant to the model
        model_tokenizer = source_tokenizer(cfg.init_from)  # None where it cannot be told offline (a hub name)
        if model_tokenizer is not None:
            check_same_tokenizer(
                model_tokenizer,
                cfg.init_from,
                tokenizer,
                f"the data in {cfg.data_dir}",
                f"prepare the data with --tokenizer={cfg.init_from} (data/prepare.py)",
            )
    objective = make_objective(cfg, tokenizer, grad_accum, device, amp, rank, world_size, log)
    core_tasks = None  # CORE's tasks (--core_every), each file checked here too; the prompts need the tokenizer
    if cfg.core_every:
        if tokenizer is None:
            raise FileNotFoundError(
                f"--core_every scores text prompts, which needs the data's tokenizer: {tokenizer_file} does not "
                "exist; prepare the data with data/prepare.py, or leave --core_every out"
            )
        core_tasks = read_bundle(core_bundle(cfg.core_bundle, "--core_bundle"), cfg.core_max_per_task)

    # ---------------------------------------------------------------------------------------------
    # 4. The checkpoint to continue from (--resume): the run folder's newest intact one.
    ckpt = None
    if cfg.resume:
        try:
            ckpt = load_checkpoint(out_dir, on_fallback=log)  # a damaged newer file is skipped, and said so
        except FileNotFoundError:
            log(f"no checkpoint in {out_dir}; starting from scratch")
    identity = objective.identity()  # what the run trains on, kept in its checkpoints
    if ckpt is not None:
        check_same_data(ckpt.get("data"), identity, str(out_dir), cfg.data_dir, ckpt["config"].get("data_dir"))

    # ---------------------------------------------------------------------------------------------
    # 5. The model: --init_from's weights unless the checkpoint holds them all (a LoRA checkpoint holds its
    # adapters alone), else fresh ones, the same on every rank (FSDP does not broadcast them). An objective with a
    # reference needs the start-of-run weights even then: its reference is the model as the run began, not as it was
    # resumed.
    torch.manual_seed(cfg.seed)
    if cfg.init_from and (ckpt is None or "lora" in ckpt or objective.needs_reference):
        model = load_source(cfg.init_from, torch.float32, block_size=T, dropout=cfg.model.dropout)
        model = model.train().to(device)
        added = cfg.model.vocab_size - model.config.vocab_size  # special tokens the data's tokenizer added
        if added > 0:
            log(
                f"the data's tokenizer has {added} token(s) that {cfg.init_from} lacks (a chat template's markers): "
                f"the embeddings{'' if cfg.model.tie_embeddings else ' and the head'} grow by {added} row(s), "
                "each the mean of the existing rows, as transformers' resize_token_embeddings starts them"
            )
            model.grow_vocab(cfg.model.vocab_size)
    else:
        model = GPT(cfg.model).to(device)
    model.checkpoint_blocks = cfg.activation_checkpointing  # recompute each block in backward, keep its input only
    if cfg.activation_checkpointing and device == "cpu":
        return_freed_memory()
    n_params = model.num_params()
    flops_per_token = model.flops_per_token()  # of the whole model: counted before FSDP shards it
    torch.manual_seed(cfg.seed + rank)  # a dropout stream of its own for every rank
    lora = None  # a LoRA run's base model and adapters, recorded in its checkpoints
    if cfg.lora_rank:
        # LoRA freezes the pretrained weights and trains low-rank adapters beside them; a resumed run's adapters
        # only make sense on the weights they were trained on.
        base = check_lora_base(cfg.init_from, ckpt["lora"]["sha256"] if ckpt else None, f"this LoRA run in {out_dir}")
        targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
        add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, targets)
        lora = {
            "base": cfg.init_from,
            "sha256": base,
            "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha,
            "targets": list(targets),
        }
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log(
            f"LoRA: {trainable:,} trainable parameters in adapters of rank {cfg.lora_rank} on {', '.join(targets)}; "
            f"the {n_params:,} of {cfg.init_from} stay frozen"
        )
    # the objective's start: its reference is the model as it is now (gptlite.lora.ReferenceModel: without LoRA a
    # frozen copy of these weights, taken before a resume loads the run's own; with LoRA the adapters off)
    objective.start(model)

    # ---------------------------------------------------------------------------------------------
    # 6. The run folder, claimed only now that every input has been read: a run that cannot start leaves it as it
    # was. Rank 0 holds its lock until the run ends; a refusal there stops every rank.
    problem = None
    if master:
        try:
            lock = claim_run_folder(out_dir, cfg.resume, cfg.overwrite, log)
            cleanup.callback(lock.release)
        except (ValueError, OSError) as e:
            problem = str(e)
    stop_together(problem, world_size)

    # ---------------------------------------------------------------------------------------------
    # 7. FSDP shards every block on its own, then the rest (the embedding tied to the head, positions, the final
    # norm); the optimizers take what is trainable: AdamW, and Muon for the block matrices with --optimizer=muon.
    if cfg.fsdp and world_size > 1:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizers = configure_optimizers(model, cfg, device_type)
    ema = WeightAverage(model, cfg.ema_decay) if cfg.ema_decay else None  # what the end of the run evaluates
    update = make_update(optimizers, scaler, ema, device_type)  # the update, decided on the host or the GPU

    # ---------------------------------------------------------------------------------------------
    # 8. Resume: weights, optimizer state, loss scale, data position, step, best val loss and random streams.
    step = 0  # optimizer steps taken
    best_val = math.inf  # the lowest val loss so far: best.pt's
    wandb_id = None  # the Weights & Biases run that a resumed run continues
    if ckpt:
        if "trained_model" in ckpt:  # the run ended as its average (ema_decay): it goes on from the weights it trained
            ckpt["model"] = ckpt["trained_model"]
        saved = {**model.state_dict(), **ckpt["model"]} if lora else ckpt["model"]
        model.check_state(saved, f"the checkpoint in {out_dir}")
        load_training_state(model, optimizers, ckpt, strict=not lora)  # a LoRA checkpoint: the adapters alone
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        try:
            objective.restore(ckpt["loader"])
        except (KeyError, TypeError):  # a checkpoint from before its data was recorded, of another kind of data
            raise ValueError(
                f"cannot --resume the run in {out_dir} on {cfg.data_dir}: its checkpoint's position is in other data "
                f"(its config names --data_dir={ckpt['config'].get('data_dir')}); resume with that, or start a new run "
                "in another --out_dir"
            ) from None
        if ema is not None and "ema" in ckpt:
            ema.load_state_dict(ckpt["ema"])
        step = int(ckpt["step"])
        best_val = float(ckpt["best_val_loss"])
        wandb_id = ckpt["meta"].get("wandb_run_id")
        if len(ckpt["rng"]) == world_size:
            set_rng_state(ckpt["rng"][rank])
        else:
            log(
                f"note: the checkpoint comes from a run with world_size={len(ckpt['rng'])} and this one has "
                f"world_size={world_size}: the data continues where it stopped, dropout's random streams start "
                "afresh"
            )
        log(f"resumed from {out_dir} at step {step}")
        if world_size > 1:
            dist.barrier()  # every rank has read the checkpoint before rank 0 deletes damaged files
        for path in discard_damaged(out_dir, step) if master else []:
            log(f"deleted {path}: it is newer than the checkpoint resumed from, and damaged")
    resumed = ckpt is not None
    ckpt = None  # free its memory

    # ---------------------------------------------------------------------------------------------
    # 9. What the run records: the data's tokenizer beside the checkpoints (sample.py decodes with it), the config
    # and the model, metrics.jsonl (and Weights & Biases), and in every checkpoint where it came from.
    wandb_run = None
    tensorboard = None
    problem = None
    if master and cfg.wandb_log:  # first: a tracker that cannot start stops the run before anything more is written
        wandb_run, problem = start_wandb(cfg, wandb_id)
    if master and cfg.tensorboard and problem is None:
        tensorboard, problem = start_tensorboard(out_dir, step if resumed else None)
    stop_together(problem, world_size)
    metrics = None
    if master:
        copy_tokenizer(cfg.data_dir, out_dir)
        record_run(out_dir, config_to_dict(cfg), shlex.join([sys.argv[0], *argv]))  # what --resume takes before a save
        log("config: " + json.dumps(config_to_dict(cfg)))
        fsdp = " (fsdp)" if cfg.fsdp and world_size > 1 else ""
        log(
            f"model: {n_params / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')} | "
            f"world {world_size}{fsdp} | {total_batch} tokens/step = {grad_accum} micro-steps of {B}x{T} per rank"
        )
        trackers = []  # where the figures go besides metrics.jsonl, the run's own record
        if wandb_run is not None:
            trackers.append(WandbTracker(wandb_run))
        if tensorboard is not None:
            trackers.append(tensorboard)
        metrics = MetricsLog(out_dir / METRICS_FILE, resume_step=step if resumed else None, trackers=trackers)
    meta = {
        "git_commit": git_commit(Path(__file__).parent),
        "command": shlex.join([sys.argv[0], *argv]),
        "wandb_run_id": wandb_run.id if wandb_run else None,
        "hf_architecture": model.source_architecture,  # how it exports back (gptlite.hf)
        "tokenizer": None if tokenizer is None else tokenizer.identity(),  # the data's, checked wherever it is read
    }

    # ---------------------------------------------------------------------------------------------
    # 10. What trains: the model compiled (if asked, and possible here), and in DDP under torchrun without FSDP.
    # `model`, the module as built, is what is evaluated and saved.
    train_model = model
    compiled = False
    if cfg.compile:
        reason = compile_unavailable(device_type)
        if reason:
            log(f"warning: torch.compile is unavailable ({reason}); training uncompiled")
        else:
            compiled = True
            log("torch.compile: the first step compiles the model, a minute or more on a CPU (--compile=false: none)")
            train_model = torch.compile(model)
    if world_size > 1 and not cfg.fsdp:
        train_model = DDP(train_model, device_ids=[torch.device(device)] if device_type == "cuda" else None)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None  # MFU's denominator
    where = torch.cuda.get_device_name(device) if device_type == "cuda" else f"this {device_type} ({cpu_summary()})"
    # On a CPU that other processes share, torch's threads follow the cores they leave free (gptlite.device)
    threads = CpuThreads() if device_type == "cpu" and world_size == 1 else None
    cleanup.callback(torch.set_num_threads, torch.get_num_threads())

    # ---------------------------------------------------------------------------------------------
    # 11. The training loop: optimizer steps until max_iters, a stop signal or the time budget (max_minutes).
    signals = StopSignals()
    signals.install()  # from here Ctrl-C and SIGTERM finish the step and save instead of ending the process
    cleanup.callback(signals.restore)
    first_step = step
    stopped = None  # why the run ended before max_iters
    minutes = 0.0  # wall-clock minutes since the start, as the ranks agree on them after each step
    t_last = time.perf_counter()  # the last log line's time
    steps_since_log = 0
    while step < cfg.max_iters:
        # the learning rate: warmup, then cosine decay; every group in proportion to its own peak (Muon's differs)
        lr = lr_at(step, cfg, minutes)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_ratio"]

        # forward and backward over the step's micro-batches, which the objective gives (none, with the event that
        # metrics.jsonl records, when it has a reason to make no update); their gradients add up in .grad
        batches, no_update = objective.batches(step, minutes)
        step_loss = torch.zeros((), device=device)
        try:
            for micro, (x, y) in enumerate(batches):
                x, y = to_device(x), to_device(y)  # (B, T) each
                # DDP and FSDP average gradients across ranks during backward. Within a step that is needed once,
                # after the last micro-batch: until then every rank only accumulates its own.
                last_micro = micro == len(batches) - 1
                if isinstance(train_model, DDP):
                    train_model.require_backward_grad_sync = last_micro
                elif cfg.fsdp and world_size > 1:
                    model.set_requires_gradient_sync(last_micro)
                with amp:
                    loss = objective.loss(train_model, x, y)  # this micro-batch's share of the step's loss
                scaler.scale(loss).backward()
                step_loss += loss.detach()
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, MPS "out of memory"
            if step == first_step and "out of memory" in str(e):
                raise ValueError(out_of_memory_advice(B, T, cfg.total_batch_size, total_batch)) from None
            raise

        # the gradients back to their true scale (float16), then their norm clipped
        for opt in optimizers:
            scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()

        # every rank agrees on the loss, the gradient norm, the objective's figures and whether to stop: one
        # all-reduce
        elapsed = (time.time() - t_start) / 60
        out_of_time = cfg.max_minutes > 0 and elapsed > cfg.max_minutes
        # built on the host and sent like a batch: torch.tensor(..., device="cuda") would wait for the GPU's queue
        votes = to_device(torch.tensor([float(bool(signals) or out_of_time), float(out_of_time), elapsed]))
        step_figures = objective.figures()  # name -> 0-d tensor
        stats = step_stats(step_loss, grad_norm, step_figures, votes)
        if world_size > 1:
            dist.all_reduce(stats)
            stats /= world_size

        # the update, unless the loss or the gradient norm is not finite, and the figures the host reads now: this
        # step's, or where the update is decided on the GPU itself, the step's before (gptlite.update), so that
        # the host queues the next step's work while this one runs. Those are read at once only where the loop
        # needs them: an evaluation and save, a stop, the last step.
        step += 1
        records = update.apply(step, lr, no_update, list(step_figures), stats)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if update.pending and (step == cfg.max_iters or step % cfg.eval_interval == 0 or any(r.stop for r in records)):
            records += update.flush()
        stop = any(r.stop for r in records)
        timed_out = any(r.timed_out for r in records)
        if records:
            minutes = records[-1].minutes
        # the pace: a run that will take long without a time budget says so early, at the pace of the PACE_STEPS
        # steps after the first (which allocates and warms up; with torch.compile the first two: the first compiles)
        warm = first_step + (2 if compiled else 1)
        if step == warm:
            t_warm = time.perf_counter()
        if step == warm + PACE_STEPS and not cfg.max_minutes:
            peak_mb, _ = peak_memory_mb(device)
            memory = "" if peak_mb is None else f", {peak_mb / 1024:.1f} GiB of memory"
            note = pace_note((time.perf_counter() - t_warm) / PACE_STEPS, cfg.max_iters - step, where, memory)
            if note:
                log(f"step {step:5d} | {note}")
        if threads is not None:
            note = threads.update()
            if note:
                log(f"step {step:5d} | {note}")
                metrics.write(step=step, event=THREADS_EVENT, threads=threads.threads)
        last = step == cfg.max_iters or timed_out  # the time budget ends with a full evaluation too
        trained_state = None  # ema_decay: the trained weights, kept beside their average so that --resume goes on
        if last and ema is not None:  # the run ends as its weights' moving average: evaluated, saved and sampled
            trained_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            ema.copy_to_model()
            log(f"step {step:5d} | the weights are now their moving average (ema_decay={cfg.ema_decay:g})")

        # log: a line and a row of metrics.jsonl every log_interval steps; a step that made no update always
        for record in records:
            steps_since_log += 1
            if record.no_update and master:
                metrics.write(step=record.step, event=record.no_update)
            if not record.finite:
                if master:
                    metrics.write(step=record.step, event="nonfinite", loss=record.loss, grad_norm=record.grad_norm)
                problem = f"step {record.step}: loss {record.loss}, gradient norm {record.grad_norm} are not finite"
                if cfg.on_nan == "stop" and step_files(out_dir):
                    raise FloatingPointError(
                        f"{problem}; stopped without saving (on_nan=stop). The latest good checkpoint is in "
                        f"{out_dir}; resume with --resume and a lower --learning_rate, or --on_nan=skip to skip such "
                        "steps"
                    )
                if cfg.on_nan == "stop":
                    raise FloatingPointError(
                        f"{problem}; stopped before any checkpoint was saved (on_nan=stop); run the command again "
                        "with --overwrite and a lower --learning_rate, or --on_nan=skip to skip such steps"
                    )
                log(f"{problem}; skipped this update (on_nan=skip)")
                continue
            if record.no_update:  # a skipped step's figures are not figures
                continue
            if record.step % cfg.log_interval and not (last and record.step == step):
                continue
            dt = (time.perf_counter() - t_last) / steps_since_log
            t_last = time.perf_counter()
            steps_since_log = 0
            tokens_per_s = total_batch / dt
            step_mfu = mfu(flops_per_token, tokens_per_s / world_size, peak)
            log(
                f"step {record.step:5d} | loss {record.loss:.4f} | lr {record.lr:.2e} | "
                f"grad norm {record.grad_norm:.3f} | {dt * 1000:7.1f} ms/step | {tokens_per_s:8.0f} tok/s | mfu "
                + ("n/a" if step_mfu is None else f"{100 * step_mfu:.1f}%")
                + objective.log_text(record.figures)
            )
            if master:
                metrics.write(
                    step=record.step,
                    tokens=record.step * total_batch,
                    loss=record.loss,
                    lr=record.lr,
                    grad_norm=record.grad_norm,
                    ms_per_step=dt * 1000,
                    tokens_per_s=tokens_per_s,
                    mfu=step_mfu,
                    **objective.log_fields(record.figures),
                )

        # evaluate and save: every eval_interval steps and at the end; a stop saves without evaluating
        evaluate = step % cfg.eval_interval == 0 or last
        val_loss = None
        if evaluate:
            # The model as built, not train_model: compiling a second, eval-mode graph costs more than it saves, and
            # DDP adds nothing without gradients. The objective judges the run; its val loss picks best.pt.
            evaluation = objective.evaluate(model)
            val_loss = evaluation.loss
            log(f"step {step:5d} | {evaluation.line}")
            if master:
                metrics.write(step=step, tokens=step * total_batch, **evaluation.fields)
        # CORE (gptlite.evaluate.core) every core_every steps and at the end; the ranks share its items
        score_core = core_tasks is not None and (step % cfg.core_every == 0 or last)
        if score_core:
            with amp:
                core_metric = core_score(model, tokenizer, core_tasks)["metric"]
            log(f"step {step:5d} | core {core_metric:.4f}")
            if master:
                metrics.write(step=step, tokens=step * total_batch, core=core_metric)
        if evaluate or stop:
            model_state, optimizer_state, rngs = gather_training_state(model, optimizers, world_size)  # every rank
            if master:
                best = val_loss is not None and val_loss < best_val
                checkpoint = run_checkpoint(
                    config=config_to_dict(cfg),
                    model=model_state,
                    optimizer=optimizer_state,
                    scaler=scaler.state_dict(),
                    step=step,
                    loader=objective.state(),
                    data=identity,
                    world_size=world_size,
                    rng=rngs,
                    best_val_loss=val_loss if best else best_val,
                    val_loss=val_loss,
                    meta=meta,
                    lora=lora,
                    ema=None if ema is None else ema.state_dict(),
                    trained_model=trained_state,
                )
                bad = nonfinite(checkpoint["model"])
                # what a failed save leaves: the latest good checkpoint, or (the first save) none yet
                kept = (
                    f"the latest good checkpoint stays in {out_dir}"
                    if step_files(out_dir)
                    else f"no checkpoint of this run was saved yet in {out_dir}"
                )
                if bad:  # a good checkpoint is never replaced by one of NaN weights
                    names = ", ".join(bad[:3])
                    log(f"step {step}: not saving a checkpoint, the weights are not finite ({names}); {kept}")
                else:
                    try:
                        path = save_run_checkpoint(out_dir, checkpoint, keep_last=cfg.keep_last, best=best)
                    except OSError as e:  # e.g. a full disk: nothing half-written is left, the previous file is whole
                        message = f"step {step}: {e}; {kept}: fix that, then continue with --resume"
                        raise error(e.errno, message) from None
                    best_val = checkpoint["best_val_loss"]
                    log(f"step {step:5d} | saved {path}{' (best val loss)' if best else ''}")
        if evaluate or score_core:
            t_last = time.perf_counter()  # evaluating and saving is not training time

        # stop early: a signal, the time budget, or a stop on another rank. A schedule over the time budget
        # (lr_schedule="time", as --budget's recipes) has ended when the budget has: the run is done, not stopped.
        if stop and step < cfg.max_iters and timed_out and not signals and cfg.lr_schedule == "time":
            log(f"step {step:5d} | the time budget (max_minutes={cfg.max_minutes:g}) is spent: the run is done")
            break
        if stop and step < cfg.max_iters:
            if signals:
                stopped = signal.Signals(signals[0]).name
            elif timed_out:
                stopped = f"max_minutes={cfg.max_minutes:g}"
            else:
                stopped = "a stop request on another rank"
            resume = f"python train.py --out_dir={shlex.quote(str(out_dir))} --resume"
            how = " (under torchrun, with the same launch options)" if world_size > 1 else ""
            log(f"stopped after step {step} ({stopped}) with a checkpoint in {out_dir}; continue with: {resume}{how}")
            break

    # ---------------------------------------------------------------------------------------------
    # 12. The end.
    peak_mb, counted = peak_memory_mb(device)
    log(f"done at step {step}" + (f" | peak memory {peak_mb:,.0f} MiB {counted}" if peak_mb is not None else ""))
    if master:
        metrics.close()  # and its trackers
    return 128 + signals[0] if stopped and signals else 0


if __name__ == "__main__":
    sys.exit(run_command("train.py", lambda: main(sys.argv[1:]), on_interrupt="nothing was trained"))
