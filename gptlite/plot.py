"""The curves of one or more runs, from their metrics.jsonl, overlaid in one PNG with matplotlib.

    python -m gptlite.plot RUN [RUN ...] [--x=step|tokens] [--log] [--out=loss.png|.pdf|.svg]

Each run gets one colour, its training figures as lines and its evaluations as dots joined by a dashed line, and
each kind of figure an axis of its own, drawn when some run logged it:
    loss            the language-model loss in nats per token (text, conversations; an RL run's val loss)
    DPO loss        a preference run's loss and val loss (not nats per token of text: it starts at ln 2)
    policy loss     an RL run's loss
    rewards         an RL run's mean reward and pass@k, training and val
    accuracy        a preference run's reward accuracy and margin, training and val
    bits per byte   val bits per byte
    CORE            train.py --core_every
`--x=tokens` puts tokens trained on along the x axis (runs of different batch sizes compare), `--log` makes the
axes logarithmic where the figures are positive (losses, bits per byte). Needs matplotlib (`pip install
matplotlib`, or `pip install -e ".[plot]"`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gptlite.cli import parse, run_command
from gptlite.config import option
from gptlite.extras import need
from gptlite.files import fault
from gptlite.train.metrics import METRICS_FILE, read_metrics


def metrics_path(run: str | Path) -> Path:
    """A run directory's metrics.jsonl, or a metrics file given directly."""
    path = Path(run)
    return path / METRICS_FILE if path.is_dir() or not path.suffix else path


def run_rows(run: str | Path) -> tuple[str, list[dict]]:
    """(label, metrics rows) of a run directory, or of a metrics.jsonl file given directly. Rows that are not JSON
    objects with a numeric step are refused, naming the file."""
    path = metrics_path(run)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a training run's out_dir")
    rows = read_metrics(path)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not is_number(r.get("step"))), None)
    if bad is not None:
        raise ValueError(
            f"{path}: row {bad + 1} is not a metrics row (a JSON object with a numeric step): "
            f"{str(rows[bad])[:80]}; pass a metrics.jsonl that train.py wrote"
        )
    if not any(curve(rows, key, "step")[0] for key in ("loss", "val_loss")):
        raise ValueError(f"{path} has no finite loss values to plot")
    return (path.parent.name if path.name == METRICS_FILE else path.stem), rows


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def curve(rows: list[dict], key: str, x: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of rows whose `key` and x value are finite numbers."""
    points = [(r[x], r[key]) for r in rows if is_number(r.get(key)) and is_number(r.get(x))]
    return [p[0] for p in points], [p[1] for p in points]


def run_kind(rows: list[dict]) -> str:
    """'dpo' (rows with reward accuracy), 'rl' (rows with a mean reward) or 'lm': what its loss means."""
    if any("rewards_accuracy" in r for r in rows):
        return "dpo"
    if any("mean_reward" in r for r in rows):
        return "rl"
    return "lm"


@dataclass(frozen=True)
class Panel:
    """One axis: its label, whether --log makes its y axis logarithmic, and which of a run's keys it draws (by the
    run's kind), each as a line (training) or dots (evaluation)."""

    ylabel: str
    log_y: bool
    keys: dict  # kind ('lm', 'dpo', 'rl' or '*' for any) -> ((key, evaluation), ...)

    def series(self, kind: str, rows: list[dict]) -> list[tuple[str, bool]]:
        """The keys this panel draws for a run of `kind`, those the run logged."""
        wanted = [*self.keys.get(kind, ()), *self.keys.get("*", ())]
        found = []
        for key, evaluation in wanted:
            if key.endswith("@"):  # pass@k, whatever k the run sampled
                found += sorted({(k, evaluation) for r in rows for k in r if k.startswith(key)})
            elif any(r.get(key) is not None for r in rows):
                found.append((key, evaluation))
        return found


PANELS = (
    Panel(
        "loss (nats per token)",
        True,
        {"lm": (("loss", False), ("val_loss", True)), "rl": (("val_loss", True),)},
    ),
    Panel("DPO loss", True, {"dpo": (("loss", False), ("val_loss", True))}),
    Panel("policy loss", False, {"rl": (("loss", False),)}),
    Panel(
        "reward and pass@k",
        False,
        {"rl": (("mean_reward", False), ("pass@", False), ("val_mean_reward", True), ("val_pass@", True))},
    ),
    Panel(
        "reward accuracy and margin",
        False,
        {
            "dpo": (
                ("rewards_accuracy", False),
                ("rewards_margin", False),
                ("val_rewards_accuracy", True),
                ("val_rewards_margin", True),
            )
        },
    ),
    Panel("val bits per byte", True, {"*": (("val_bpb", True),)}),
    Panel("CORE (mean centered accuracy)", False, {"*": (("core", True),)}),
)


def plot_runs(runs: list[str | Path], out: str | Path, x: str = "step", log: bool = False) -> Path:
    """Draw the runs' curves (see the module docstring) to `out` (.png, .pdf or .svg); returns its path."""
    FigureCanvasAgg = need("matplotlib.backends.backend_agg", "plot", "gptlite.plot").FigureCanvasAgg
    Figure = need("matplotlib.figure", "plot", "gptlite.plot").Figure
    check_out([str(r) for r in runs], Path(out))
    labelled = [run_rows(run) for run in runs]
    if x == "tokens":
        old = [label for label, rows in labelled if not any("tokens" in r for r in rows)]
        if old:
            raise ValueError(
                f"the metrics of {', '.join(old)} have no token counts (runs of older gptlite versions "
                "did not log them); plot them with --x=step"
            )
    kinds = [run_kind(rows) for _, rows in labelled]
    panels = [p for p in PANELS if any(p.series(k, rows) for k, (_, rows) in zip(kinds, labelled, strict=True))]
    fig = Figure(figsize=(8 + 4 * (len(panels) - 1), 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    several = len(labelled) > 1
    for i, ((label, rows), kind) in enumerate(zip(labelled, kinds, strict=True)):
        color = f"C{i % 10}"
        for ax, panel in zip(axes, panels, strict=True):
            for key, evaluation in panel.series(kind, rows):
                name = f"{label} {key}" if several else key
                if evaluation:
                    ax.plot(*curve(rows, key, x), color=color, linestyle="--", marker="o", markersize=3, label=name)
                else:
                    ax.plot(*curve(rows, key, x), color=color, linewidth=1.2, label=name)
    for ax, panel in zip(axes, panels, strict=True):
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log" if panel.log_y else "linear")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format=FORMATS[out.suffix.lower()], dpi=100)
    except BaseException as e:  # a full disk, an interruption: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise fault(e, f"could not write {out}") from None
        raise
    tmp.replace(out)
    return out


FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}  # the file's ending says its format


def check_out(runs: list[str], out: Path) -> None:
    """The plot's file: a known format, in an existing folder, never one of the runs' own files."""
    inputs = {os.path.realpath(metrics_path(run)) for run in runs}
    if os.path.realpath(out) in inputs:
        raise ValueError(
            f"--out={out} is one of the metrics files plotted; it would be overwritten: choose another "
            "name, e.g. loss.png"
        )
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"--out={out}: the ending {out.suffix or '(none)'} names no format; use .png, .pdf or .svg")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out={out}: folder {out.parent} does not exist; create it or plot elsewhere")
    if out.is_dir():
        raise IsADirectoryError(f"--out={out} is a folder; give the plot's file name, e.g. {out / 'loss.png'}")


@dataclass
class PlotOptions:
    runs: list[str] = option(
        default_factory=list, help="training runs' out_dirs (or metrics.jsonl files)", positional=True
    )
    x: str = option("step", "the x axis", choices=("step", "tokens"))
    log: bool = option(False, "logarithmic axes")
    out: str = option(
        "",
        "the plot: .png, .pdf or .svg (default: RUN/loss.png for one run, loss.png beside the first run for several)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = parse(PlotOptions, argv, "python -m gptlite.plot", __doc__)
        if not args.runs:
            raise ValueError("give at least one run: python -m gptlite.plot RUN [RUN ...]")
        one = len(args.runs) == 1 and Path(args.runs[0]).is_dir()
        # by default the plot goes with the runs (out/ is ignored by git), never into the directory the command runs in
        out = args.out or (Path(args.runs[0]) / "loss.png" if one else Path(args.runs[0]).parent / "loss.png")
        print(f"wrote {plot_runs(args.runs, out, args.x, args.log)}")
        return 0

    return run_command("gptlite.plot", body)


if __name__ == "__main__":
    sys.exit(main())
