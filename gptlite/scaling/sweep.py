"""python -m gptlite.scaling: measure the scaling laws of your data on your machine, for `train.py --budget`.

    python -m gptlite.scaling --data_dir=DIR [--out_dir=out/scaling] [--budgets=10s,20s,40s,80s]
                              [--widths=48,72,96,144,192] [--check]

It trains the recipe family (gptlite.scaling.recipe) at each width for each budget of training time, each run a
`train.py` process of its own (nothing is shared between runs but the files), smallest budgets first, so that an
interrupted sweep is already worth fitting. Each finished run is a line of OUT_DIR/runs.jsonl: a sweep run again
skips the runs it holds (run it again to resume; a run cut short is run again whole). A progress line per run says
how far it is. Then it fits the laws (gptlite.scaling.laws) and writes OUT_DIR/laws.json, OUT_DIR/frontier.png, and
the same laws to gptlite's cache for this data and this machine, where `train.py --budget` finds them.

--check then trains the recipe `train.py --budget` derives for three times the largest budget, and compares its val
loss with what the law predicted (recorded in laws.json as "check"); a miss of more than CHECK_TOLERANCE says which
budget to add.

Time nothing else meanwhile: on a shared CPU the runs' step counts, and the laws, would be the other work's too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gptlite.cli import parse, run_command
from gptlite.config import option
from gptlite.device import THREADS_EVENT
from gptlite.files import FolderLock, make_dir
from gptlite.train.metrics import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[2]  # train.py's folder
RUNS_FILE = "runs.jsonl"
LAWS_FILE = "laws.json"
PLOT_FILE = "frontier.png"
ATTEMPTS = 3  # a run that other work shared the CPU with is run again, up to this many times in all
PAUSE_S = 30
# The check's run may lie this far from the loss law's prediction. A law fitted through budgets that stop before the
# loss flattens extrapolates it too far down: on tiny Shakespeare on a 2-core AVX-512 EPYC (docs/scaling.md) the
# sweep of 10-80 s missed its check at 240 s by +3.5%, and the same sweep with 160 s added met its check at 480 s
# (+1.6%, median of 3).
CHECK_TOLERANCE = 0.02


@dataclass
class SweepOptions:
    data_dir: str = option("", "the prepared shards (data/prepare.py) whose laws to measure")
    out_dir: str = option("out/scaling", "where the runs, runs.jsonl, laws.json and frontier.png go")
    budgets: str = option("10s,20s,40s,80s", "the training times to sweep, comma-separated (s or min)")
    widths: str = option("48,72,96,144,192", "the model widths to sweep at each budget (gptlite.scaling.recipe.WIDTHS)")
    seed: int = option(1337, "every run's seed")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N")
    check: bool = option(False, "then train the derived recipe at 3x the largest budget against the law's prediction")
    name: str = option("", "the data's name in laws.json and the plot (default: data_dir's folder name)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "gptlite.scaling",
        lambda: sweep(parse(SweepOptions, argv, "python -m gptlite.scaling", __doc__)),
        "the runs finished so far are in runs.jsonl; run the command again to go on",
    )


def sweep(options: SweepOptions) -> int:
    """Check the options, then run the sweep holding its folder's lock: a second sweep into the folder is refused
    before it touches anything there (the runs' logs and runs.jsonl are the first one's)."""
    budgets, widths, vocab_size, fingerprint = check(options)
    out_dir = make_dir(options.out_dir, "--out_dir")
    lock = FolderLock(out_dir, "the sweep folder")
    try:
        return run_sweep(options, out_dir, budgets, widths, vocab_size, fingerprint)
    finally:
        lock.release()


def run_sweep(
    options: SweepOptions, out_dir: Path, budgets: list[float], widths: list[int], vocab_size: int, fingerprint: str
) -> int:
    from gptlite.scaling.laws import fit_laws, machine_key, save_laws

    every_run = read_runs(out_dir / RUNS_FILE)
    runs = [r for r in every_run if not r.get("check")]
    todo = [(b, w) for b in budgets for w in widths if not any(r["seconds"] == b and r["width"] == w for r in runs)]
    print(
        f"sweep of {options.data_dir}: {len(widths)} widths x {len(budgets)} budgets, {len(runs)} run(s) done, "
        f"{len(todo)} to go (about {sum(b + 8 for b, _ in todo) / 60:.0f} min)"
    )
    start = time.monotonic()
    for i, (seconds, width) in enumerate(todo, 1):
        run = train_point(options, out_dir, width, seconds, vocab_size)
        append_run(out_dir / RUNS_FILE, run)
        runs.append(run)
        spent = time.monotonic() - start
        left = spent / i * (len(todo) - i)
        print(
            f"[{i}/{len(todo)}] width {width} ({run['params'] / 1e6:.3g}M) for {seconds:g} s: val loss "
            f"{run['val_loss']:.4f} after {run['steps']:,} steps | {spent / 60:.1f} min in, about {left / 60:.1f} left",
            flush=True,
        )
    laws = fit_laws([r for r in runs if r["width"] in widths and r["seconds"] in budgets])
    contended = [r for r in runs if r.get("contended")]
    if contended:
        print(f"note: {len(contended)} run(s) shared the CPU with other work (see runs.jsonl): their losses are high")
    laws["data"] = {
        "name": options.name or Path(options.data_dir).resolve().name,
        "dir": options.data_dir,
        "fingerprint": fingerprint,
        "vocab_size": vocab_size,
    }
    laws["machine"] = machine_key()
    laws["runs"] = runs
    if options.check:
        earlier = [r for r in every_run if r.get("check")]
        laws["check"] = check_run(options, out_dir, laws, budgets, vocab_size, earlier)
    save_laws(laws, out_dir / LAWS_FILE)
    print_laws(laws)
    if "size_note" in laws:
        print(f"note: {laws['size_note']}")
    plot(laws, out_dir / PLOT_FILE)
    print(f"wrote {out_dir / LAWS_FILE} and {out_dir / PLOT_FILE}; train.py --budget=... now uses these laws")
    return 0


def check(options: SweepOptions) -> tuple[list[float], list[int], int, str]:
    """(budgets in seconds, widths, the data's vocab_size, its fingerprint), every option checked first."""
    from gptlite.data.loader import data_identity
    from gptlite.data.shards import find_shards
    from gptlite.scaling.recipe import WIDTHS, parse_budget
    from gptlite.train.run_config import read_vocab_size

    if not options.data_dir:
        raise ValueError("--data_dir is required: the prepared shards whose laws to measure")
    vocab_size = read_vocab_size(options.data_dir)
    budgets = []
    for text in options.budgets.split(","):
        budget = parse_budget(text.strip(), "--budgets")
        if budget.kind != "seconds":
            raise ValueError(f"--budgets: {text!r} is not a time; the sweep's budgets are training times (10s, 2min)")
        budgets.append(budget.amount)
    try:
        widths = [int(w) for w in options.widths.split(",")]
    except ValueError:
        raise ValueError(f"--widths={options.widths!r}: give integers, comma-separated") from None
    unknown = [w for w in widths if w not in WIDTHS]
    if unknown:
        raise ValueError(f"--widths: {unknown} are not widths of the recipe family; choose from {list(WIDTHS)}")
    for name, values, unit in (("budgets", budgets, " s"), ("widths", widths, "")):
        twice = sorted({f"{v:g}{unit}" for v in values if values.count(v) > 1})
        if twice:  # each would run, and count in the fit, twice
            raise ValueError(
                f"--{name}={getattr(options, name)} names {', '.join(twice)} more than once; give each once"
            )
    if len(widths) < 3 or len(budgets) < 2:
        raise ValueError("the laws need at least 3 widths and 2 budgets")
    fingerprint = data_identity(find_shards(options.data_dir, "train"), "text")["data"]
    return sorted(budgets), sorted(widths), vocab_size, fingerprint


def read_runs(path: Path) -> list[dict]:
    """The finished runs of an earlier sweep in this folder (a line cut short by an interruption is dropped)."""
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            runs.append(json.loads(line))
        except ValueError:
            continue
    return runs


def append_run(path: Path, run: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(run) + "\n")
        f.flush()
        os.fsync(f.fileno())


def train_point(options: SweepOptions, out_dir: Path, width: int, seconds: float, vocab_size: int) -> dict:
    """Train the family's model at `width` for `seconds` of training time in a train.py process of its own; its
    figures from the run's metrics.jsonl."""
    from gptlite.device import pick_device
    from gptlite.scaling.derive import block_params, probe_batch
    from gptlite.scaling.recipe import recipe

    device = pick_device(options.device)

    # the step time sets Muon's momentum, the learning rates' horizon and, for a run of few steps, the batch, chosen
    # as train.py --budget chooses it, so that the runs measure the recipes it derives
    def keys_at(windows: int) -> dict:
        return recipe(width, vocab_size, steps=1, seconds=seconds, windows=windows)

    windows, step_s, _, _ = probe_batch(keys_at, device, seconds)
    keys = recipe(width, vocab_size, steps=int(seconds / step_s), seconds=seconds, windows=windows)
    run_dir = out_dir / "runs" / f"w{width}-{seconds:g}s"
    for attempt in range(1, ATTEMPTS + 1):
        started = time.monotonic()
        contended = train(options, run_dir, keys)
        wall = time.monotonic() - started
        if not contended:
            break
        print(
            f"note: other processes used the CPU during the run at width {width} for {seconds:g} s, so its step count "
            f"is theirs too; "
            + (f"running it again in {PAUSE_S} s" if attempt < ATTEMPTS else "kept, marked contended in runs.jsonl"),
            flush=True,
        )
        if attempt < ATTEMPTS:
            time.sleep(PAUSE_S)
    return {
        "width": width,
        "seconds": seconds,
        "params": block_params(width),
        **figures(run_dir, keys),
        "wall": wall,
        "probe_step_s": step_s,
        "contended": contended,
    }


def train(options: SweepOptions, run_dir: Path, keys: dict) -> bool:
    """One train.py run with `keys`, its output in RUN_DIR.log; a failed run stops the sweep, naming its log. Returns
    whether other processes took CPU time from it (see contended)."""
    argv = [f"--{k}={v}" for k, v in keys.items()]
    argv += [f"--data_dir={options.data_dir}", f"--out_dir={run_dir}", f"--seed={options.seed}", "--overwrite"]
    argv += [f"--device={options.device}", "--wandb_log=false"]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise ValueError(f"the run in {run_dir} failed (exit {done.returncode}); its output is in {log}")
    return contended(run_dir)


def contended(run_dir: Path) -> bool:
    """Whether other processes took CPU time from the run in run_dir: its metrics.jsonl records each time train.py
    fitted torch's threads to them (gptlite.device.CpuThreads, THREADS_EVENT)."""
    return any(row.get("event") == THREADS_EVENT for row in read_metrics(run_dir / METRICS_FILE))


def figures(run_dir: Path, keys: dict) -> dict:
    """A finished run's final val loss, steps, tokens and training FLOPs (its model's flops_per_token x tokens)."""
    from gptlite.scaling.derive import flops_per_token

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if r.get("val_loss") is not None]
    if not evaluated:
        raise ValueError(f"the run in {run_dir} recorded no val loss; see its log")
    last = evaluated[-1]
    tokens = int(last["tokens"])
    return {
        "val_loss": float(last["val_loss"]),
        "steps": int(last["step"]),
        "tokens": tokens,
        "flops": flops_per_token(keys) * tokens,
    }


def check_run(
    options: SweepOptions, out_dir: Path, laws: dict, budgets: list[float], vocab_size: int, earlier: list[dict]
) -> dict:
    """The recipe the laws give for three times the longest of the sweep's `budgets` of training, trained (or this
    sweep's earlier run of it, among the check runs kept in runs.jsonl, `earlier`), against the loss the law predicts
    for it."""
    from gptlite.scaling.derive import nearest_width
    from gptlite.scaling.laws import power, saturating

    seconds = 3 * max(budgets)
    width = nearest_width(power(laws["params_per_second"], seconds))
    done = [r for r in earlier if r["seconds"] == seconds and r["width"] == width]
    if done:
        run = done[-1]
    else:
        run = {**train_point(options, out_dir, width, seconds, vocab_size), "check": True}
        append_run(out_dir / RUNS_FILE, run)
    predicted = saturating(laws["loss_per_second"], seconds)
    off = run["val_loss"] / predicted - 1
    print(
        f"check: {seconds:g} s of training (3x the largest budget) at width {width}: val loss {run['val_loss']:.4f}, "
        f"the law predicted {predicted:.4f} ({100 * off:+.1f}%)"
    )
    note = check_note(off, budgets)
    if note:
        print(f"note: {note}")
    return {**run, "predicted": predicted, "off": off, "note": note}


def check_note(off: float, budgets: list[float]) -> str:
    """Nothing ("") where the check's run lay within CHECK_TOLERANCE of the law (`off`: its val loss / the
    prediction - 1), else what the miss says and which budget to sweep next: twice the longest of `budgets`."""
    if abs(off) <= CHECK_TOLERANCE:
        return ""
    longest = max(budgets)
    more = ",".join(f"{seconds:g}s" for seconds in [*budgets, 2 * longest])
    return (
        f"the check lay {100 * abs(off):.1f}% {'above' if off > 0 else 'below'} the law, more than "
        f"{100 * CHECK_TOLERANCE:g}%: the loss law knows the budgets up to {longest:g} s, and 3x past them the loss "
        f"{'flattened more' if off > 0 else 'fell further'} than it foresaw; add a longer budget "
        f"(--budgets={more}) and run the sweep again with --check (the runs done are kept)"
    )


def print_laws(laws: dict) -> None:
    from gptlite.scaling.laws import MIN_FIT_STEPS

    n = laws["params_per_second"]
    loss = laws["loss_per_second"]
    print(f"optimal size: N* = {n['coef']:.3g} t^{n['exponent']:.3f} block parameters, t in seconds of training")
    print(f"loss: L*(t) = {loss['E']:.3f} + {loss['A']:.3g} t^-{loss['alpha']:.3f}")
    c = laws["params_per_flop"]
    d = laws["tokens_per_flop"]
    print(f"against FLOPs: N* = {c['coef']:.3g} C^{c['exponent']:.3f}, D* = {d['coef']:.3g} C^{d['exponent']:.3f}")
    for point in laws["frontier"]:
        doubts = []  # why the point only bounds the optimum or says little about it
        if point["edge"]:
            doubts.append("at the edge of the widths run")
        if point["steps"] < MIN_FIT_STEPS:
            doubts.append(f"its best run took {point['steps']} steps")
        left_out = "" if point["fitted"] else ": left out of the size laws"
        doubt = f" ({', '.join(doubts)}{left_out})" if doubts else ""
        print(
            f"  {point['seconds']:g} s: best {point['params'] / 1e6:.3g}M at val loss {point['val_loss']:.4f}, "
            f"{point['flops']:.3g} FLOPs, {point['tokens']:,.0f} tokens{doubt}"
        )


def plot(laws: dict, path: Path) -> None:
    """Loss against training FLOPs for every run (a line per width), the optima and the law L*(C)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no plot: matplotlib is not installed (pip install matplotlib)")
        return
    import numpy as np

    from gptlite.scaling.laws import saturating

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for width in sorted({r["width"] for r in laws["runs"]}):
        runs = sorted(
            (r for r in laws["runs"] if r["width"] == width and "predicted" not in r), key=lambda r: r["flops"]
        )
        axis.plot([r["flops"] for r in runs], [r["val_loss"] for r in runs], "o-", alpha=0.6, label=f"width {width}")
    best = laws["frontier"]
    axis.plot([p["flops"] for p in best], [p["val_loss"] for p in best], "k*", markersize=12, label="optimum")
    flops = np.geomspace(min(p["flops"] for p in best) / 2, max(p["flops"] for p in best) * 6, 50)
    axis.plot(flops, [saturating(laws["loss_per_flop"], c) for c in flops], "k--", label="law L*(C)")
    if "check" in laws:
        axis.plot([laws["check"]["flops"]], [laws["check"]["val_loss"]], "rx", markersize=12, label="check (3x)")
    axis.set_xscale("log")
    axis.set_xlabel("training FLOPs")
    axis.set_ylabel("val loss")
    axis.set_title(f"{laws['data']['name']} on {laws['machine']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
