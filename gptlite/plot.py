"""Loss curves of one or more runs, from their metrics.jsonl, overlaid in one PNG with matplotlib.

    python -m gptlite.plot RUN [RUN ...] [--x=step|tokens] [--log] [--out=loss.png]

Each run gets one colour: its train loss as a line, its val loss as dots joined by a dashed line, and, when
the runs logged it, val bits per byte in a second panel. `--x=tokens` puts tokens trained on along the x
axis (runs of different batch sizes compare), `--log` makes both axes logarithmic. Needs matplotlib
(`pip install matplotlib`, or `pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from gptlite.metrics import METRICS_FILE, read_metrics


def run_rows(run: str | Path) -> tuple[str, list[dict]]:
    """(label, metrics rows) of a run directory, or of a metrics.jsonl file given directly."""
    path = Path(run)
    path = path / METRICS_FILE if path.is_dir() or not path.suffix else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a training run's out_dir")
    rows = read_metrics(path)
    if not any(math.isfinite(r.get("loss", math.nan)) or r.get("val_loss") is not None for r in rows):
        raise ValueError(f"{path} has no finite loss values to plot")
    return (path.parent.name if path.name == METRICS_FILE else path.stem), rows


def curve(rows: list[dict], key: str, x: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of rows that have a finite `key`."""
    points = [(r[x], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: list[str | Path], out: str | Path, x: str = "step", log: bool = False) -> Path:
    """Draw the runs' curves (see the module docstring) to the PNG `out`; returns its path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("gptlite.plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from None
    labelled = [run_rows(run) for run in runs]
    if x == "tokens":
        old = [label for label, rows in labelled if not any("tokens" in r for r in rows)]
        if old:
            raise ValueError(f"the metrics of {', '.join(old)} have no token counts (runs of older gptlite versions "
                             "did not log them); plot them with --x=step")
    with_bpb = any(r.get("val_bpb") is not None for _, rows in labelled for r in rows)
    fig = Figure(figsize=(12 if with_bpb else 8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if with_bpb else 1, squeeze=False)[0]
    for i, (label, rows) in enumerate(labelled):
        color = f"C{i % 10}"
        axes[0].plot(*curve(rows, "loss", x), color=color, linewidth=1.2, label=f"{label} train")
        axes[0].plot(*curve(rows, "val_loss", x), color=color, linestyle="--", marker="o", markersize=3,
                     label=f"{label} val")
        if with_bpb:
            axes[1].plot(*curve(rows, "val_bpb", x), color=color, linestyle="--", marker="o", markersize=3, label=label)
    for ax, ylabel in zip(axes, ["loss (nats per token)", "val bits per byte"]):
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
    except BaseException:  # a full disk, an interruption: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptlite.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="training runs' out_dirs (or metrics.jsonl files)")
    parser.add_argument("--x", default="step", choices=["step", "tokens"], help="the x axis")
    parser.add_argument("--log", action="store_true", help="logarithmic axes")
    parser.add_argument("--out", help="the PNG (default: RUN/loss.png for one run, loss.png here for several)")
    args = parser.parse_args(argv)
    out = args.out or (Path(args.runs[0]) / "loss.png" if len(args.runs) == 1 and Path(args.runs[0]).is_dir()
                       else Path("loss.png"))
    from gptlite.cli import run_command

    def body() -> int:
        print(f"wrote {plot_runs(args.runs, out, args.x, args.log)}")
        return 0

    return run_command("gptlite.plot", body)


if __name__ == "__main__":
    sys.exit(main())
