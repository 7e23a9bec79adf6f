"""train.py --budget on a quiet CPU and beside a busy one: the same command run --rounds times each way, in turns,
each a whole `python train.py --data_dir=D --budget=B` in a fresh process timed from launch to exit. A loaded run
has --busy other processes beside it for its whole life, each spinning on one core (--pin=N fixes the first to core
N; otherwise the kernel moves them). Prints a row per run as it ends (a refusal is a row too: the budget must never
be refused for the other work), then each way's median val loss and spread, the loaded median less the quiet one,
and whether that is within --within.

Time nothing else on the machine meanwhile: the quiet runs must be quiet.

    python benchmarks/bench_budget_load.py --data_dir=data/shakespeare_char --budget=90s [--rounds=4] [--busy=1]
        [--pin=-1] [--within=0.05] [--json=FILE]
"""

from __future__ import annotations

import json
import os
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

# One core's worth of other work: a process that never sleeps.
SPIN = "while True:\n    pass\n"


@dataclass
class Options:
    data_dir: str = option("data/shakespeare_char", "the prepared shards")
    budget: str = option("90s", "the budget every run gets")
    rounds: int = option(4, "runs each way: quiet and loaded, in turns")
    busy: int = option(1, "processes spinning beside each loaded run, a core each")
    pin: int = option(-1, "the core the first busy process is pinned to (-1: not pinned)")
    within: float = option(0.05, "the largest loaded - quiet median val loss that passes")
    json: str = option("", "also write every run here")


def start_busy(count: int, pin: int) -> list[subprocess.Popen]:
    """`count` processes each keeping a core busy; the first pinned to core `pin` where that is not -1."""
    busy = []
    for i in range(count):
        process = subprocess.Popen([sys.executable, "-c", SPIN])
        if i == 0 and pin >= 0:
            os.sched_setaffinity(process.pid, {pin})
        busy.append(process)
    return busy


def stop_busy(busy: list[subprocess.Popen]) -> None:
    for process in busy:
        process.kill()
        process.wait()


def timed(data_dir: str, budget: str, out_dir: Path) -> dict:
    """One whole train.py --budget command, timed from launch to exit: its final val loss, the loss the recipe
    expected, the steps, the recipe's width and windows a step, the step time its probe measured, and the wall-clock;
    or, where train.py refused the budget, its reason."""
    command = [sys.executable, "train.py", f"--data_dir={data_dir}", f"--budget={budget}", f"--out_dir={out_dir}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:  # train.py says why in its last line (a budget it finds too small to train)
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        return {"refused": lines[-1], "wall": wall}
    config = json.loads(re.search(r"^config: (.*)$", done.stdout, re.M)[1])
    probed = re.search(r"([\d.]+) ms a step measured here", done.stdout)
    expected = re.search(r"expected val loss ([\d.]+)", done.stdout)
    return {
        "val_loss": float(re.findall(r"\| val loss ([\d.]+)", done.stdout)[-1]),
        "expected": float(expected[1]) if expected else None,
        "steps": int(re.findall(r"done at step (\d+)", done.stdout)[-1]),
        "width": config["n_embd"],
        "batch": config["batch_size"],
        "probe_ms": float(probed[1]) if probed else None,
        "wall": wall,
        "probe_threads": "budget | probe threads" in done.stdout,
    }


def summary(runs: list[dict], way: str) -> tuple[float | None, str]:
    """(the median val loss of `way`'s runs that trained, a line with it, the spread and the refusals)."""
    losses = [r["val_loss"] for r in runs if r["way"] == way and "val_loss" in r]
    refused = sum(1 for r in runs if r["way"] == way and "refused" in r)
    if not losses:
        return None, f"{way}: no run trained ({refused} refused)"
    median = statistics.median(losses)
    return median, (
        f"{way}: {median:.4f} (median of {len(losses)}, spread {max(losses) - min(losses):.4f}: "
        f"{', '.join(f'{x:.4f}' for x in losses)}); {refused} refused"
    )


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    print(
        f"--budget={args.budget} on {args.data_dir}; loaded: {args.busy} process(es) spinning"
        + (f", the first pinned to core {args.pin}" if args.pin >= 0 else ", not pinned"),
        flush=True,
    )
    columns = ("val loss", "expected", "steps", "width", "batch", "probe ms", "wall s")
    print(f"{'run':8} " + " ".join(f"{c:>{max(5, len(c)) + 1}}" for c in columns), flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_budget_load_") as tmp:
        for i in range(2 * args.rounds):  # quiet and loaded in turns: the machine's drift touches both alike
            way = "quiet" if i % 2 == 0 else "loaded"
            busy = start_busy(args.busy, args.pin) if way == "loaded" else []
            try:
                one = {"way": way, **timed(args.data_dir, args.budget, Path(tmp) / str(i))}
            finally:
                stop_busy(busy)
            runs.append(one)
            if "refused" in one:
                print(f"{way:8} refused after {one['wall']:.1f} s: {one['refused']}", flush=True)
                continue
            expected = "-" if one["expected"] is None else f"{one['expected']:.4f}"
            probe_ms = "-" if one["probe_ms"] is None else f"{one['probe_ms']:.1f}"
            print(
                f"{way:8} {one['val_loss']:9.4f} {expected:>9} {one['steps']:6d} {one['width']:6d} {one['batch']:6d} "
                f"{probe_ms:>9} {one['wall']:7.1f}",
                flush=True,
            )
    quiet, quiet_line = summary(runs, "quiet")
    loaded, loaded_line = summary(runs, "loaded")
    print(f"\n{quiet_line}\n{loaded_line}")
    refusals = sum(1 for r in runs if r["way"] == "loaded" and "refused" in r)
    if quiet is not None and loaded is not None:
        gap = loaded - quiet
        passed = abs(gap) <= args.within and not refusals
        print(
            f"loaded - quiet = {gap:+.4f} (within {args.within:g}: {'yes' if abs(gap) <= args.within else 'no'}); "
            f"loaded refusals: {refusals}; {'PASS' if passed else 'FAIL'}"
        )
    if args.json:
        write_json(
            Path(args.json),
            {"budget": args.budget, "data_dir": args.data_dir, "busy": args.busy, "pin": args.pin, "runs": runs},
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_budget_load.py", lambda: run(parse(Options, argv, "bench_budget_load.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
