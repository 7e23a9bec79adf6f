"""Run metrics: the JSON-lines metrics file of a training run, and model FLOPs utilisation (MFU).

out_dir/metrics.jsonl holds one JSON object per line, each with a "step" and, from training and evaluation
rows, "tokens" (trained on so far):
    training    loss, lr, grad_norm, ms_per_step, tokens_per_s, mfu (null where the peak is unknown), and the
                objective's figures (gptlite.train.objective: DPO's rewards and accuracy, RL's rewards, lengths and KL)
    evaluation  val_loss, val_bpb (null without the data's tokenizer; see gptlite.evaluate), or DPO's val_ figures
    CORE        core (train.py --core_every; see gptlite.evaluate.core)
    events      event (e.g. a skipped non-finite step), with loss and grad_norm; "cpu_threads" with threads, where
                other processes took cores and torch's thread count followed (gptlite.device.CpuThreads)
`python -m gptlite.plot OUT_DIR [OUT_DIR ...]` draws runs to a PNG. The same numbers go to the run's trackers, where it
has any: Weights & Biases (--wandb_log) and TensorBoard's event files in out_dir/tensorboard (--tensorboard).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gptlite.config import TrainConfig, config_to_dict
from gptlite.extras import need
from gptlite.files import fault

METRICS_FILE = "metrics.jsonl"

# Dense bf16/fp16 tensor-core peaks in FLOP/s from the vendors' data sheets (without 2:4 sparsity).
# The first name contained in torch.cuda.get_device_name() wins, so specific names come first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None for CPUs, MPS and GPUs not in PEAK_FLOPS."""
    return next((flops for name, flops in PEAK_FLOPS if name in device_name), None)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one device (PaLM, Chowdhery et al. 2022, appendix B): achieved / peak."""
    return None if not peak else flops_per_token * tokens_per_s / peak


class Evaluation(NamedTuple):
    """An evaluation as a run records it: the val loss (best.pt is the checkpoint with the lowest), the text of its
    log line after "step N | ", and the fields of its metrics.jsonl row after "step" and "tokens"."""

    loss: float
    line: str
    fields: dict[str, float | None]


class Tracker(Protocol):
    """Where a run's figures go besides its own record, metrics.jsonl: a viewer's files or service. `write` takes
    a row's "step" and its numbers (None where a figure is unknown, e.g. MFU on a CPU)."""

    def write(self, step: int, figures: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbTracker:
    """A Weights & Biases run (start_wandb)."""

    def __init__(self, run: Any):
        self.run = run

    def write(self, step: int, figures: dict[str, float]) -> None:
        self.run.log(figures, step=step)

    def close(self) -> None:
        self.run.finish()


TENSORBOARD_DIR = "tensorboard"  # under the run folder: `tensorboard --logdir OUT_DIR` finds it


class TensorBoardTracker:
    """TensorBoard's event files in out_dir/tensorboard, through torch's own SummaryWriter: the local viewer most
    of the field already has (`tensorboard --logdir OUT_DIR`), and no account or server. A resumed run drops the
    events after its checkpoint's step, as metrics.jsonl does (SummaryWriter's purge_step)."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(Path(out_dir) / TENSORBOARD_DIR), purge_step=purge, flush_secs=10)

    def write(self, step: int, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MetricsLog:
    """Appends rows to a run's metrics.jsonl, and their numbers to the run's trackers (Weights & Biases,
    TensorBoard) when it has any. A fresh run starts the file anew; a resumed run keeps the rows up to its
    checkpoint's step and drops later ones (logged by a run that died before its next checkpoint)."""

    def __init__(self, path: str | Path, resume_step: int | None = None, trackers: list[Tracker] | None = None):
        self.path = Path(path)
        self.trackers = trackers or []
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        tmp = self.path.with_name(self.path.name + ".tmp")  # the kept rows replace the file at once
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in kept)
            os.replace(tmp, self.path)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise fault(e, f"could not write {self.path}") from None

    def write(self, **row) -> None:
        """One row: a "step" and the row's figures."""
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:
            raise fault(e, f"could not write {self.path}") from None
        figures = {k: v for k, v in row.items() if k != "step" and isinstance(v, float)}
        for tracker in self.trackers:
            tracker.write(row["step"], figures)

    def close(self) -> None:
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


PACE_NOTE_MINUTES = 10  # a run projected to take longer than this says so early
# steps whose mean time the pace note gives, after the warm-up: the first step allocates and warms up, and takes many
# times a step's time
PACE_STEPS = 5
PACE_CHANGE = 2.0  # a pace this many times slower or faster than the one last said is said again


def duration(seconds: float) -> str:
    """'7 h 23 min', '12 min', '45 s'."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def pace_note(seconds_per_step: float, steps_left: int, where: str, memory: str, again: bool = False) -> str | None:
    """What the rest of a run will take at the pace of its steps after the first (train.py times PACE_STEPS of them),
    when that is more than PACE_NOTE_MINUTES: a recipe written for a GPU says, early, what it costs on a CPU. `where`
    names the device, `memory` the peak so far. `again`: an estimate said before no longer holds (PaceEstimate), so
    the new one is said however short the rest is."""
    seconds = seconds_per_step * steps_left
    if seconds < PACE_NOTE_MINUTES * 60 and not again:
        return None
    changed = f"the pace changed more than {PACE_CHANGE:g}x: " if again else ""
    return (
        f"{changed}{seconds_per_step:.2f} s a step after the first on {where}{memory}: the {steps_left:,} steps left "
        f"take about {duration(seconds)}; --max_minutes=M caps a run, and a smaller model, batch or block_size steps "
        "faster"
    )


# Training FLOPs of one optimizer step past which a step is a GPU's size: the CPU recipes' steps lie far below it, the
# GPU recipes' far above (configs/*.toml)
CPU_STEP_FLOPS = 1e11


def cpu_step_note(flops_per_step: float, toml_path: str | None) -> str | None:
    """A line for a run on the CPU whose steps are a GPU's size (more than CPU_STEP_FLOPS training FLOPs each), said
    at start-up rather than after the first slow steps: a recipe written for a GPU runs on a CPU without a word
    otherwise. It names the recipe's CPU sibling where its folder has one (its name with "cpu" for "gpu":
    configs/shakespeare_char_gpu.toml -> configs/shakespeare_char_cpu.toml)."""
    if flops_per_step <= CPU_STEP_FLOPS:
        return None
    sibling = None
    if toml_path and "gpu" in Path(toml_path).name:
        candidate = Path(toml_path).with_name(Path(toml_path).name.replace("gpu", "cpu"))
        sibling = candidate if candidate.is_file() else None
    fix = (
        f"{sibling} is this recipe for a CPU"
        if sibling
        else "a smaller model, batch_size, total_batch_size or block_size makes it a CPU's"
    )
    return (
        f"warning: a step here trains {flops_per_step:.2g} FLOPs, a GPU's size of step (more than "
        f"{CPU_STEP_FLOPS:.0e}), and this run is on the CPU, where each takes many times longer; {fix}"
    )


class PaceEstimate:
    """The pace of a run's steps, for the note on how long the rest takes: the mean seconds of a step over windows of
    PACE_STEPS steps, each step timed on its own (an evaluation or a save between two steps is no step's time).

    The steps up to `warm` (the first, which allocates and warms up; with torch.compile the first two) are left out,
    and a window starts afresh at `restart()`, where the steps before it ran at a pace that no longer holds (torch's
    thread count changed). The first full window gives the first estimate; each later one gives a new estimate only
    where its pace differs from the last estimate's by more than PACE_CHANGE times, either way: another process took
    cores, or left them."""

    def __init__(self, warm: int):
        self.warm = warm
        self.window: list[float] = []
        self.said: float | None = None  # the last estimate's seconds a step

    def restart(self) -> None:
        """Leave the steps of the window so far out: they ran at another pace."""
        self.window.clear()

    def add(self, step: int, seconds: float) -> float | None:
        """Step `step` took `seconds`: the seconds a step takes where that is a new estimate, else None."""
        if step <= self.warm:
            return None
        self.window.append(seconds)
        if len(self.window) < PACE_STEPS:
            return None
        pace = sum(self.window) / len(self.window)
        self.window.clear()
        if self.said is not None and 1 / PACE_CHANGE <= pace / self.said <= PACE_CHANGE:
            return None
        self.said = pace
        return pace


def start_tensorboard(out_dir: str | Path, resume_step: int | None = None) -> tuple[Any, str | None]:
    """(a TensorBoardTracker for the run in out_dir, None); or, without the tensorboard package, (None, the
    one-line problem)."""
    try:
        need("tensorboard", "tensorboard", "tensorboard=true")  # what torch.utils.tensorboard needs
    except ImportError as e:
        return None, f"{e}; or drop --tensorboard"
    return TensorBoardTracker(out_dir, resume_step), None


def start_wandb(cfg: TrainConfig, run_id: str | None = None) -> tuple[Any, str | None]:
    """(a Weights & Biases run for train.py's config, None), continuing the run `run_id` if given; or, when wandb
    cannot start one (e.g. no API key), (None, the one-line problem)."""
    import wandb

    try:
        run = wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or None,
            config=config_to_dict(cfg),
            id=run_id,
            resume="allow",
        )
    except wandb.errors.Error as e:
        return None, (
            f"wandb_log=true, but wandb cannot start a run ({str(e).splitlines()[0]}); run `wandb login`, "
            "set WANDB_MODE=offline, or drop --wandb_log"
        )
    return run, None


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file ([] if it does not exist); a line cut short by a crash is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
