"""Train a GPT on token shards: one CPU, one GPU, or many through torchrun (PyTorch DDP, or FSDP2 with --fsdp).

    python train.py [CONFIG.toml] --data_dir=DIR [--key=value ...] [--resume]
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data_dir=DIR

Config precedence: defaults (gptlite/config.py) < TOML file < --key=value. `python train.py --help` lists keys.
Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits; --resume continues exactly.

This file reads top to bottom in the order training happens: configuration, device, data and objective, the
checkpoint to continue from, model, run folder, optimizer and the training state, what the run records, then the
loop, whose optimizer step (learning rate, micro-steps, clip, update, log, evaluate and save, stop) is a few named
steps. The step is the same for every way of training; what differs (the batches, the loss and its figures, how the
run is judged, what resumes) is the objective's, chosen once from the config and the data (gptlite/train/objective.py
lists them). A feature the config switches on (adapters, a weight average, processes that share the work,
compiling) is set up once where the run is built, and the loop calls what it gives (gptlite/train/features.py); what a
checkpoint holds is a list of parts that save and restore themselves (gptlite/checkpoint/training_state.py). What
is not the story of training (run folders and checkpoints, devices, processes, loaders, the optimizers' groups)
lives in gptlite/, where sample.py, the server and the tests use it too.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gptlite.checkpoint import (
    DataPosition,
    LossScale,
    Optimizers,
    Progress,
    RandomStreams,
    RunRecord,
    TrainingState,
    Weights,
    check_same_data,
    claim_run_folder,
    copy_tokenizer,
    holds_whole_model,
    load_checkpoint,
    load_source,
    record_run,
    source_tokenizer,
    step_files,
    weight_average,
)
from gptlite.cli import StopSignals, parse_args, run_command
from gptlite.config import TrainConfig, config_to_dict
from gptlite.device import (
    THREADS_EVENT,
    CpuThreads,
    autocast,
    batch_mover,
    cpu_summary,
    out_of_memory_advice,
    peak_memory_mb,
    pick_device,
    pick_dtype,
    return_freed_memory,
    use_device,
)
from gptlite.evaluate import core_bundle, core_score, read_bundle
from gptlite.gpt import GPT
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, check_same_tokenizer, load_tokenizer
from gptlite.train.distributed import processes, stop_together
from gptlite.train.features import OneProcess, add_adapters, compile_model, data_parallel
from gptlite.train.metrics import (
    METRICS_FILE,
    MetricsLog,
    PaceEstimate,
    WandbTracker,
    cpu_step_note,
    mfu,
    pace_note,
    peak_flops,
    start_tensorboard,
    start_wandb,
)
from gptlite.train.objective import Objective, make_objective
from gptlite.train.optim import configure_optimizers, lr_at
from gptlite.train.run_config import NO_DATA_DIR, resolve_config
from gptlite.train.update import DeviceUpdate, HostUpdate, StepRecord, make_update, step_stats


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
    # released and the group ends, after everything that uses it (see gptlite.train.distributed).
    with processes() as (rank, local_rank, world_size), contextlib.ExitStack() as cleanup:
        return train(cfg, argv, rank, local_rank, world_size, cleanup, budget_notes)


@dataclass
class Run:
    """What the loop works with, as train() builds it: the loop's steps below take it whole."""

    cfg: TrainConfig
    log: Callable[..., None]
    master: bool  # rank 0 alone prints, writes the run folder and logs metrics
    world_size: int
    out_dir: Path
    device: str
    amp: contextlib.AbstractContextManager
    to_device: Callable[[torch.Tensor], torch.Tensor]
    objective: Objective
    model: GPT  # the module as built: what is evaluated and saved
    train_model: torch.nn.Module  # what trains: compiled, and wrapped by DDP, where the run asks
    parallel: OneProcess
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler
    update: HostUpdate | DeviceUpdate
    state: TrainingState
    metrics: MetricsLog | None  # rank 0's
    signals: StopSignals
    total_batch: int  # tokens per optimizer step, every rank together
    flops_per_token: float
    peak_flops: float | None  # the device's, MFU's denominator (a known GPU's)
    core_tasks: list | None
    tokenizer: Tokenizer | None
    t_start: float  # time.time() as the run started: the time budget's origin


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
    # tokens in every process, grad_accum of them one after the other. The objective (gptlite.train.objective) is the
    # one
    # the config and the data ask for. Every input it reads, every shard included, is checked here, before the first
    # step.
    grad_accum, total_batch = micro_steps(cfg, world_size)
    tokenizer = data_tokenizer(cfg)
    objective = make_objective(cfg, tokenizer, grad_accum, device, amp, rank, world_size, log)
    core_tasks = read_core_tasks(cfg, tokenizer)

    # ---------------------------------------------------------------------------------------------
    # 4. The checkpoint to continue from (--resume): the run folder's newest intact one, of the run's own data.
    ckpt = checkpoint_to_resume(cfg, out_dir, log)
    identity = objective.identity()  # what the run trains on, kept in its checkpoints
    if ckpt is not None:
        check_same_data(ckpt, identity, str(out_dir), cfg.data_dir)

    # ---------------------------------------------------------------------------------------------
    # 5. The model, its adapters where the config asks for them (gptlite.train.features), and the objective's start: its
    # reference is the model as it is now (gptlite.train.lora.ReferenceModel: a frozen copy of these weights, taken
    # before
    # a resume loads the run's own; or these weights without the adapters).
    model = build_model(cfg, ckpt, objective.needs_reference, device, log)
    n_params = model.num_params()
    flops_per_token = model.flops_per_token()  # of the whole model: counted before it is sharded
    torch.manual_seed(cfg.seed + rank)  # a dropout stream of its own for every rank
    adapters = add_adapters(cfg, model, ckpt, out_dir, n_params, log)
    objective.start(model)

    # ---------------------------------------------------------------------------------------------
    # 6. The run folder, claimed only now that every input has been read: a run that cannot start leaves it as it
    # was. Rank 0 holds its lock until the run ends; a refusal there stops every rank.
    claim(cfg, out_dir, master, world_size, cleanup, log)

    # ---------------------------------------------------------------------------------------------
    # 7. How the processes share the work (gptlite.train.features: the model is sharded here, before the optimizers take
    # what is trainable: AdamW, and Muon for the block matrices with --optimizer=muon), the weights' average, and
    # the training state: the parts a checkpoint holds, each saving and restoring its own entries. --resume
    # restores them all: weights, optimizer state, loss scale, data position, average, step, best val loss, random
    # streams and the tracker's run.
    parallel = data_parallel(cfg, world_size, device)
    parallel.shard(model)
    optimizers = configure_optimizers(model, cfg, device_type)
    state = TrainingState(
        weights=Weights(model, adapters, out_dir),
        optimizers=Optimizers(model, optimizers),
        scale=LossScale(scaler),
        position=DataPosition(objective, identity, out_dir, cfg.data_dir),
        average=weight_average(model, cfg.ema_decay),  # what the end of the run evaluates, if asked for
        progress=Progress(),
        streams=RandomStreams(rank, world_size, log),
        record=RunRecord(cfg, shlex.join([sys.argv[0], *argv]), code=Path(__file__).parent),
    )
    update = make_update(optimizers, scaler, state.average, device_type)  # decided on the host or the GPU
    resumed = ckpt is not None
    if resumed:
        state.resume(ckpt, out_dir, master, log)
    ckpt = None  # free its memory

    # ---------------------------------------------------------------------------------------------
    # 8. What the run records: the data's tokenizer beside the checkpoints (sample.py decodes with it), the config
    # and the model, metrics.jsonl (and its trackers), and in every checkpoint where it came from.
    metrics, wandb_run_id = start_records(cfg, argv, state, resumed, master, world_size, log)
    log(
        f"model: {n_params / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')} | "
        f"world {world_size}{parallel.label} | {total_batch} tokens/step = {grad_accum} micro-steps of "
        f"{cfg.batch_size}x{cfg.model.block_size} per rank"
    )
    state.record.describe(wandb_run_id, model.source_architecture, tokenizer)  # what every checkpoint keeps
    if device_type == "cpu":  # a GPU's recipe on the CPU says so now, not after its first slow steps
        note = cpu_step_note(flops_per_token * total_batch, parse_args(argv)[0])
        if note:
            log(note)

    # ---------------------------------------------------------------------------------------------
    # 9. What trains: the model compiled (if asked, and possible here), and wrapped by DDP where the processes
    # share the work that way. `model`, the module as built, is what is evaluated and saved.
    compiled_model, compiled = compile_model(model, cfg, device_type, log)
    train_model = parallel.wrap(compiled_model)
    cleanup.callback(torch.set_num_threads, torch.get_num_threads())  # Pace may change them

    # ---------------------------------------------------------------------------------------------
    # 10. The training loop: optimizer steps until max_iters, a stop signal or the time budget (max_minutes).
    signals = StopSignals()
    signals.install()  # from here Ctrl-C and SIGTERM finish the step and save instead of ending the process
    cleanup.callback(signals.restore)
    run = Run(
        cfg=cfg,
        log=log,
        master=master,
        world_size=world_size,
        out_dir=out_dir,
        device=device,
        amp=amp,
        to_device=to_device,
        objective=objective,
        model=model,
        train_model=train_model,
        parallel=parallel,
        optimizers=optimizers,
        scaler=scaler,
        update=update,
        state=state,
        metrics=metrics,
        signals=signals,
        total_batch=total_batch,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None,
        core_tasks=core_tasks,
        tokenizer=tokenizer,
        t_start=t_start,
    )
    stopped = loop(run, Pace(run, compiled))

    # ---------------------------------------------------------------------------------------------
    # 11. The end.
    peak_mb, counted = peak_memory_mb(device)
    step = state.progress.step
    log(f"done at step {step}" + (f" | peak memory {peak_mb:,.0f} MiB {counted}" if peak_mb is not None else ""))
    if master:
        metrics.close()  # and its trackers
    return 128 + signals[0] if stopped and signals else 0


# ---------------------------------------------------------------------------------------------
# Set-up's steps


def micro_steps(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(grad_accum, total_batch): the micro-steps of batch_size x block_size tokens per rank that make an optimizer
    step's total_batch_size tokens (one micro-step of every rank when it is 0)."""
    tokens_per_micro_step = cfg.batch_size * cfg.model.block_size * world_size
    total_batch = cfg.total_batch_size or tokens_per_micro_step
    if total_batch % tokens_per_micro_step:
        raise ValueError(
            f"total_batch_size={total_batch} is not a multiple of batch_size*block_size*world_size="
            f"{cfg.batch_size}*{cfg.model.block_size}*{world_size}={tokens_per_micro_step}; set total_batch_size to a "
            f"multiple of {tokens_per_micro_step}"
        )
    return total_batch // tokens_per_micro_step, total_batch


def data_tokenizer(cfg: TrainConfig) -> Tokenizer | None:
    """The data's tokenizer, if it has one; with --init_from, checked to be the model's: the ids of the data must
    mean what they meant to the model."""
    tokenizer_file = Path(cfg.data_dir) / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    if cfg.init_from and tokenizer is not None:
        model_tokenizer = source_tokenizer(cfg.init_from)  # None where it cannot be told offline (a hub name)
        if model_tokenizer is not None:
            check_same_tokenizer(
                model_tokenizer,
                cfg.init_from,
                tokenizer,
                f"the data in {cfg.data_dir}",
                f"prepare the data with --tokenizer={cfg.init_from} (data/prepare.py)",
            )
    return tokenizer


def read_core_tasks(cfg: TrainConfig, tokenizer: Tokenizer | None) -> list | None:
    """CORE's tasks (--core_every), each file checked before the first step; the prompts need the data's tokenizer."""
    if not cfg.core_every:
        return None
    if tokenizer is None:
        raise FileNotFoundError(
            f"--core_every scores text prompts, which needs the data's tokenizer: "
            f"{Path(cfg.data_dir) / TOKENIZER_FILE} does not exist; prepare the data with data/prepare.py, or leave "
            "--core_every out"
        )
    return read_bundle(core_bundle(cfg.core_bundle, "--core_bundle"), cfg.core_max_per_task)


def checkpoint_to_resume(cfg: TrainConfig, out_dir: Path, log: Callable[[str], None]) -> dict | None:
    """With --resume, the run folder's newest intact checkpoint (a damaged newer file is skipped, and said so);
    None without --resume, or where the folder holds none yet (the run starts from scratch, and says so)."""
    if not cfg.resume:
        return None
    try:
        # a checksum file in error beside a whole checkpoint: the resume says so as it rewrites it (TrainingState)
        return load_checkpoint(out_dir, on_fallback=log, on_note=lambda note: None)
    except FileNotFoundError:
        log(f"no checkpoint in {out_dir}; starting from scratch")
        return None


def build_model(
    cfg: TrainConfig, ckpt: dict | None, needs_reference: bool, device: str, log: Callable[[str], None]
) -> GPT:
    """The model to train: --init_from's weights unless the checkpoint holds them all (a LoRA checkpoint holds its
    adapters alone), else fresh ones, the same on every rank (FSDP does not broadcast them). An objective with a
    reference needs the start-of-run weights even then: its reference is the model as the run began, not as it was
    resumed."""
    torch.manual_seed(cfg.seed)
    if cfg.init_from and (ckpt is None or not holds_whole_model(ckpt) or needs_reference):
        model = load_source(cfg.init_from, torch.float32, block_size=cfg.model.block_size, dropout=cfg.model.dropout)
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
    return model


def claim(
    cfg: TrainConfig,
    out_dir: Path,
    master: bool,
    world_size: int,
    cleanup: contextlib.ExitStack,
    log: Callable[[str], None],
) -> None:
    """Claim the run folder for this run: rank 0 locks it until the run ends (`cleanup` releases it), and a refusal
    there (another run holds it, a finished run's folder without --overwrite) stops every rank."""
    problem = None
    if master:
        try:
            lock = claim_run_folder(out_dir, cfg.resume, cfg.overwrite, log)
            cleanup.callback(lock.release)
        except (ValueError, OSError) as e:
            problem = str(e)
    stop_together(problem, world_size)


def start_records(
    cfg: TrainConfig,
    argv: list[str],
    state: TrainingState,
    resumed: bool,
    master: bool,
    world_size: int,
    log: Callable[[str], None],
) -> tuple[MetricsLog | None, str | None]:
    """(metrics.jsonl's log, the Weights & Biases run's id): what the run records, started on rank 0 (None, None
    elsewhere). The trackers come first: one that cannot start stops the run before anything more is written; a
    resumed run continues its Weights & Biases run. Then the data's tokenizer beside the checkpoints, run.json (what
    --resume takes before a save), the config line and metrics.jsonl."""
    out_dir = Path(cfg.out_dir)
    step = state.progress.step
    wandb_run = None
    tensorboard = None
    problem = None
    if master and cfg.wandb_log:
        wandb_run, problem = start_wandb(cfg, state.record.wandb_run_id)
    if master and cfg.tensorboard and problem is None:
        tensorboard, problem = start_tensorboard(out_dir, step if resumed else None)
    stop_together(problem, world_size)
    if not master:
        return None, None
    copy_tokenizer(cfg.data_dir, out_dir)
    record_run(out_dir, config_to_dict(cfg), shlex.join([sys.argv[0], *argv]))
    log("config: " + json.dumps(config_to_dict(cfg)))
    trackers = []  # where the figures go besides metrics.jsonl, the run's own record
    if wandb_run is not None:
        trackers.append(WandbTracker(wandb_run))
    if tensorboard is not None:
        trackers.append(tensorboard)
    metrics = MetricsLog(out_dir / METRICS_FILE, resume_step=step if resumed else None, trackers=trackers)
    return metrics, wandb_run.id if wandb_run else None


# ---------------------------------------------------------------------------------------------
# The loop and its steps


def loop(run: Run, pace: Pace) -> str | None:
    """Optimizer steps until max_iters, a stop signal or the time budget (max_minutes); returns why the run stopped
    before max_iters (a signal's name, "max_minutes=M", a stop on another rank), None where it did not."""
    cfg = run.cfg
    progress = run.state.progress
    first_step = progress.step
    clock = LogClock()
    minutes = 0.0  # wall-clock minutes since the start, as the ranks agree on them after each step
    while progress.step < cfg.max_iters:
        # the learning rate: warmup, then cosine decay; every group in proportion to its own peak (Muon's differs)
        lr = lr_at(progress.step, cfg, minutes)
        for opt in run.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_ratio"]
        started = time.perf_counter()
        records = train_step(run, lr, minutes, first_step)
        stop = any(r.stop for r in records)
        timed_out = any(r.timed_out for r in records)
        if records:
            minutes = records[-1].minutes
        last = progress.step == cfg.max_iters or timed_out  # the time budget ends with a full evaluation too
        if last:  # a run with a weight average ends as it: evaluated, saved and sampled
            run.state.finish(run.log)
        log_steps(run, records, last, clock)
        pace.after(progress.step, time.perf_counter() - started)  # the step's time, no evaluation's
        evaluate_and_save(run, last, stop, clock)
        if stop and progress.step < cfg.max_iters:
            return stop_early(run, timed_out)
    return None


def train_step(run: Run, lr: float, minutes: float, first_step: int) -> list[StepRecord]:
    """One optimizer step: forward and backward over the step's micro-batches, the gradients clipped, the figures
    agreed on by every rank, and the update. Returns the records of the steps the host reads now
    (gptlite.train.update)."""
    cfg = run.cfg
    objective = run.objective
    progress = run.state.progress
    # forward and backward over the step's micro-batches, which the objective gives (none, with the event that
    # metrics.jsonl records, when it has a reason to make no update); their gradients add up in .grad
    batches, no_update = objective.batches(progress.step, minutes)
    step_loss = torch.zeros((), device=run.device)
    try:
        for micro, (x, y) in enumerate(batches):
            x, y = run.to_device(x), run.to_device(y)  # (B, T) each
            # DDP and FSDP average gradients across ranks during backward. Within a step that is needed once,
            # after the last micro-batch: until then every rank only accumulates its own.
            run.parallel.sync_gradients(micro == len(batches) - 1)
            with run.amp:
                loss = objective.loss(run.train_model, x, y)  # this micro-batch's share of the step's loss
            run.scaler.scale(loss).backward()
            step_loss += loss.detach()
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError, MPS "out of memory"
        if progress.step == first_step and "out of memory" in str(e):
            advice = out_of_memory_advice(cfg.batch_size, cfg.model.block_size, cfg.total_batch_size, run.total_batch)
            raise ValueError(advice) from None
        raise

    # the gradients back to their true scale (float16), then their norm clipped
    for opt in run.optimizers:
        run.scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()

    # every rank agrees on the loss, the gradient norm, the objective's figures and whether to stop: one
    # all-reduce
    elapsed = (time.time() - run.t_start) / 60
    out_of_time = cfg.max_minutes > 0 and elapsed > cfg.max_minutes
    # built on the host and sent like a batch: torch.tensor(..., device="cuda") would wait for the GPU's queue
    votes = run.to_device(torch.tensor([float(bool(run.signals) or out_of_time), float(out_of_time), elapsed]))
    step_figures = objective.figures()  # name -> 0-d tensor
    stats = step_stats(step_loss, grad_norm, step_figures, votes)
    if run.world_size > 1:
        dist.all_reduce(stats)
        stats /= run.world_size

    # the update, unless the loss or the gradient norm is not finite, and the figures the host reads now: this
    # step's, or where the update is decided on the GPU itself, the step's before (gptlite.train.update), so that
    # the host queues the next step's work while this one runs. Those are read at once only where the loop
    # needs them: an evaluation and save, a stop, the last step.
    progress.step += 1
    step = progress.step
    records = run.update.apply(step, lr, no_update, list(step_figures), stats)
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    if run.update.pending and (step == cfg.max_iters or step % cfg.eval_interval == 0 or any(r.stop for r in records)):
        records += run.update.flush()
    return records


@dataclass
class LogClock:
    """When the last log line was written, and the steps since: a log line's time per step."""

    t_last: float = 0.0
    steps_since_log: int = 0

    def __post_init__(self):
        self.t_last = time.perf_counter()


def log_steps(run: Run, records: list[StepRecord], last: bool, clock: LogClock) -> None:
    """The log: a line and a row of metrics.jsonl every log_interval steps and at the last; a step that made no
    update always gets its event's row, and a step whose loss or gradient norm is not finite is skipped
    (on_nan=skip) or stops the run (on_nan=stop)."""
    cfg = run.cfg
    log = run.log
    metrics = run.metrics
    step = run.state.progress.step
    for record in records:
        clock.steps_since_log += 1
        if record.no_update and run.master:
            metrics.write(step=record.step, event=record.no_update)
        if not record.finite:
            if run.master:
                metrics.write(step=record.step, event="nonfinite", loss=record.loss, grad_norm=record.grad_norm)
            problem = f"step {record.step}: loss {record.loss}, gradient norm {record.grad_norm} are not finite"
            if cfg.on_nan == "stop" and step_files(run.out_dir):
                raise FloatingPointError(
                    f"{problem}; stopped without saving (on_nan=stop). The latest good checkpoint is in "
                    f"{run.out_dir}; resume with --resume and a lower --learning_rate, or --on_nan=skip to skip such "
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
        dt = (time.perf_counter() - clock.t_last) / clock.steps_since_log
        clock.t_last = time.perf_counter()
        clock.steps_since_log = 0
        tokens_per_s = run.total_batch / dt
        step_mfu = mfu(run.flops_per_token, tokens_per_s / run.world_size, run.peak_flops)
        log(
            f"step {record.step:5d} | loss {record.loss:.4f} | lr {record.lr:.2e} | "
            f"grad norm {record.grad_norm:.3f} | {dt * 1000:7.1f} ms/step | {tokens_per_s:8.0f} tok/s | mfu "
            + ("n/a" if step_mfu is None else f"{100 * step_mfu:.1f}%")
            + run.objective.log_text(record.figures)
        )
        if run.master:
            metrics.write(
                step=record.step,
                tokens=record.step * run.total_batch,
                loss=record.loss,
                lr=record.lr,
                grad_norm=record.grad_norm,
                ms_per_step=dt * 1000,
                tokens_per_s=tokens_per_s,
                mfu=step_mfu,
                **run.objective.log_fields(record.figures),
            )


def evaluate_and_save(run: Run, last: bool, stop: bool, clock: LogClock) -> None:
    """Evaluate and save: every eval_interval steps and at the end; a stop saves without evaluating. CORE every
    core_every steps and at the end."""
    cfg = run.cfg
    log = run.log
    progress = run.state.progress
    step = progress.step
    evaluate = step % cfg.eval_interval == 0 or last
    progress.val_loss = None
    if evaluate:
        # The model as built, not train_model: compiling a second, eval-mode graph costs more than it saves, and
        # DDP adds nothing without gradients. The objective judges the run; its val loss picks best.pt.
        evaluation = run.objective.evaluate(run.model)
        progress.val_loss = evaluation.loss
        log(f"step {step:5d} | {evaluation.line}")
        if run.master:
            run.metrics.write(step=step, tokens=step * run.total_batch, **evaluation.fields)
    # CORE (gptlite.evaluate.core); the ranks share its items
    score_core = run.core_tasks is not None and (step % cfg.core_every == 0 or last)
    if score_core:
        with run.amp:
            core_metric = core_score(run.model, run.tokenizer, run.core_tasks)["metric"]
        log(f"step {step:5d} | core {core_metric:.4f}")
        if run.master:
            run.metrics.write(step=step, tokens=step * run.total_batch, core=core_metric)
    if evaluate or stop:
        run.state.save(run.out_dir, cfg.keep_last, run.master, log)  # every rank gathers, rank 0 writes
    if evaluate or score_core:
        clock.t_last = time.perf_counter()  # evaluating and saving is not training time


def stop_early(run: Run, timed_out: bool) -> str | None:
    """Why the run stops before max_iters: a signal, the time budget, or a stop on another rank, said with how to
    continue. A schedule over the time budget (lr_schedule="time", as --budget's recipes) has ended when the budget
    has: the run is done, not stopped (None)."""
    cfg = run.cfg
    log = run.log
    step = run.state.progress.step
    if timed_out and not run.signals and cfg.lr_schedule == "time":
        log(f"step {step:5d} | the time budget (max_minutes={cfg.max_minutes:g}) is spent: the run is done")
        return None
    if run.signals:
        stopped = signal.Signals(run.signals[0]).name
    elif timed_out:
        stopped = f"max_minutes={cfg.max_minutes:g}"
    else:
        stopped = "a stop request on another rank"
    resume = f"python train.py --out_dir={shlex.quote(str(run.out_dir))} --resume"
    how = " (under torchrun, with the same launch options)" if run.world_size > 1 else ""
    log(f"stopped after step {step} ({stopped}) with a checkpoint in {run.out_dir}; continue with: {resume}{how}")
    return stopped


class Pace:
    """Notes on the run's pace: a run that will take long without a time budget says so early, at the pace of
    PACE_STEPS steps after the warm-up (the first step allocates and warms up; with torch.compile the first two: the
    first compiles) and after torch's thread count has first been fitted to the cores other processes leave free
    (gptlite.device.CpuThreads, on a CPU); said again when the pace changes more than 2x
    (gptlite.train.metrics.PaceEstimate)."""

    def __init__(self, run: Run, compiled: bool):
        self.run = run
        self.estimate = PaceEstimate(warm=run.state.progress.step + (2 if compiled else 1))
        self.said = False  # whether a pace note was said: a changed pace is then said again, however short the rest
        device_type = run.device.split(":")[0]
        self.threads = CpuThreads() if device_type == "cpu" and run.world_size == 1 else None
        self.where = (
            torch.cuda.get_device_name(run.device) if device_type == "cuda" else f"this {device_type} ({cpu_summary()})"
        )

    def after(self, step: int, seconds: float) -> None:
        """After optimizer step `step`, which took `seconds`."""
        cfg = self.run.cfg
        log = self.run.log
        if self.threads is not None:
            note = self.threads.update()
            if note:
                log(f"step {step:5d} | {note}")
                self.run.metrics.write(step=step, event=THREADS_EVENT, threads=self.threads.threads)
                self.estimate.restart()  # the steps so far ran on the other thread count
                return
            if not self.threads.fitted:  # the pace before the thread count is chosen is not the run's
                return
        pace = self.estimate.add(step, seconds)
        if pace is None or cfg.max_minutes:
            return
        peak_mb, _ = peak_memory_mb(self.run.device)
        memory = "" if peak_mb is None else f", {peak_mb / 1024:.1f} GiB of memory"
        note = pace_note(pace, cfg.max_iters - step, self.where, memory, again=self.said)
        if note:
            log(f"step {step:5d} | {note}")
            self.said = True


if __name__ == "__main__":
    sys.exit(run_command("train.py", lambda: main(sys.argv[1:]), on_interrupt="nothing was trained"))
