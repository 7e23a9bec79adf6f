"""train.py --budget against a hand grid, on one corpus and budget: the derived recipe (no config file) run --rounds
times, and a grid of hand choices around it, each a whole `python train.py --budget=B --key=value ...` in a fresh
process timed from launch to exit (its wall-clock is the budget's). The grid varies what the derivation chooses:
the width (and with it depth and heads, gptlite.scaling.recipe.shape), the learning rates (Muon's and AdamW's
together, times 0.5, 1 and 2) and, with --batches, the windows a step trains on (else each point's is the one the
derivation picks for it); with --budget each grid point keeps the same time accounting. Prints a row per run
as it ends, then the derived recipe's median and spread, the grid's best point, and how far the median is from it.

Time nothing else on the machine meanwhile.

    python benchmarks/bench_budget.py --data_dir=data/shakespeare_char --budget=30s [--rounds=3]
        [--widths=48,72,96,144] [--lr_scales=0.5,1,2] [--batches=1,2,6] [--json=FILE]
    python benchmarks/bench_budget.py --budget=90s --hand=configs/shakespeare_char_cpu_90s.toml --grid=false
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402
from gptlite.scaling.recipe import ADAMW_LR, BASE_WIDTH, MUON_LR, shape  # noqa: E402


@dataclass
class Options:
    data_dir: str = option("data/shakespeare_char", "the prepared shards")
    budget: str = option("30s", "the budget every run gets")
    rounds: int = option(3, "runs of the derived recipe (the grid's points run once each)")
    widths: str = option("48,72,96,144", "the grid's widths")
    lr_scales: str = option("0.5,1,2", "the grid's learning-rate factors (Muon's and AdamW's together)")
    batches: str = option("", "the grid's windows a step, comma-separated (default: each point's derived one)")
    grid: bool = option(True, "run the grid (false: the derived recipe and --hand only)")
    hand: str = option("", "a hand-tuned TOML config to run --rounds times too, in turns with the derived recipe")
    json: str = option("", "also write every run here")


def timed(argv: list[str], out_dir: Path) -> dict:
    """One whole train.py command, timed from launch to exit: its final val loss, steps, width, depth, windows a
    step and wall-clock."""
    command = [sys.executable, "train.py", *argv, f"--out_dir={out_dir}", "--overwrite"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:  # train.py says why in its last line (a budget too small to train, a bad key)
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(f"`train.py {' '.join(argv)}` failed: {lines[-1]}")
    config = json.loads(re.search(r"^config: (.*)$", done.stdout, re.M)[1])
    return {
        "val_loss": float(re.findall(r"\| val loss ([\d.]+)", done.stdout)[-1]),
        "steps": int(re.findall(r"done at step (\d+)", done.stdout)[-1]),
        "width": config["n_embd"],
        "n_layer": config["n_layer"],
        "batch": config["batch_size"],
        "learning_rate": config["learning_rate"],
        "muon_lr": config["muon_lr"],
        "wall": wall,
        "contended": "other processes kept" in done.stdout,
    }


def grid_point(width: int, scale: float) -> list[str]:
    """A hand choice: the family's shape at `width`, its learning rates times `scale`."""
    keys = {k: v for k, v in shape(width).items()}
    keys["learning_rate"] = ADAMW_LR * (BASE_WIDTH / width) ** 0.5 * scale
    keys["min_lr"] = keys["learning_rate"] / 40
    keys["muon_lr"] = MUON_LR * scale
    return [f"--{k}={v}" for k, v in keys.items()]


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    base = [f"--data_dir={args.data_dir}", f"--budget={args.budget}"]
    widths = [int(w) for w in args.widths.split(",")]
    scales = [float(s) for s in args.lr_scales.split(",")]
    batches = [(f", batch {b}", [f"--batch_size={b}"]) for b in args.batches.split(",")] if args.batches else [("", [])]
    hand = [[args.hand, f"--data_dir={args.data_dir}"]] if args.hand else []
    grid = []
    if args.grid:
        grid = [
            (f"width {w}, lr x{s:g}{named}", base + grid_point(w, s) + batch)
            for w in widths
            for s in scales
            for named, batch in batches
        ]
    share = -(-len(grid) // args.rounds)  # grid points after each round: the rounds spread through the grid
    plan = []
    for r in range(args.rounds):  # the derived recipe and the hand config take turns, then a share of the grid,
        plan.append(("derived", base))  # so that the machine's speed drifting over a long sitting touches all alike
        plan += [(f"hand {Path(args.hand).name}", h) for h in hand]
        plan += grid[r * share : (r + 1) * share]
    runs = []
    refused = []  # grid points train.py would not run (a budget too small for that model here), with its reason
    print(f"{'run':30} {'val loss':>9} {'steps':>6} {'width':>5} {'layers':>6} {'batch':>5} {'wall s':>7}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_budget_") as tmp:
        for i, (name, extra) in enumerate(plan):
            try:
                one = {"run": name, **timed(extra, Path(tmp) / str(i))}
            except ValueError as e:
                if not name.startswith("width "):  # the derived recipe and the hand config are what is measured
                    raise
                print(f"{name:30} refused: {e}", flush=True)
                refused.append({"run": name, "refused": str(e)})
                continue
            runs.append(one)
            mark = "  (other work shared the CPU)" if one["contended"] else ""
            print(
                f"{name:30} {one['val_loss']:9.4f} {one['steps']:6d} {one['width']:5d} {one['n_layer']:6d} "
                f"{one['batch']:5d} {one['wall']:7.1f}{mark}",
                flush=True,
            )
    derived = [r["val_loss"] for r in runs if r["run"] == "derived"]
    median = statistics.median(derived)
    print(
        f"\n--budget={args.budget} on {args.data_dir}: derived {median:.4f} (median of {len(derived)}, spread "
        f"{max(derived) - min(derived):.4f}: {', '.join(f'{x:.4f}' for x in derived)})"
    )
    hand_runs = [r for r in runs if r["run"].startswith("hand ")]
    if hand_runs:
        losses = [r["val_loss"] for r in hand_runs]
        print(
            f"{args.hand}: {statistics.median(losses):.4f} (median of {len(losses)}, spread "
            f"{max(losses) - min(losses):.4f}: {', '.join(f'{x:.4f}' for x in losses)}, wall "
            f"{statistics.median(r['wall'] for r in hand_runs):.1f} s); derived - hand = "
            f"{median - statistics.median(losses):+.4f}"
        )
    grid = [r for r in runs if r["run"].startswith("width ")]
    if grid:
        best = min(grid, key=lambda r: r["val_loss"])
        print(
            f"the grid's best of {len(grid)}: {best['run']} at {best['val_loss']:.4f}; derived - best = "
            f"{median - best['val_loss']:+.4f}"
        )
    if refused:
        print(f"{len(refused)} grid point(s) refused by train.py: {', '.join(r['run'] for r in refused)}")
    if args.json:
        write_json(
            Path(args.json), {"budget": args.budget, "data_dir": args.data_dir, "runs": runs, "refused": refused}
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_budget.py", lambda: run(parse(Options, argv, "bench_budget.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
