"""The 90-second CPU speedrun, variant by variant: each a whole `python train.py configs/shakespeare_char_cpu_90s.toml`
in a fresh process, timed from launch to exit, with one speedrun technique switched on or off by `--key=value`, over
several seeds. Runs take turns (every variant once per seed, in the same order), so that a slow spell of the machine
falls on every variant alike. Prints one row per run as it ends, then per variant the median val loss, its spread
(max - min), the median steps, step time and wall-clock; --json writes every run.

Time nothing else on the machine meanwhile: on 2 cores a test suite beside a run halves its steps.

    python data/shakespeare/prepare.py
    python benchmarks/bench_speedrun.py --data_dir=data/shakespeare_char [--seeds=1337,1,2] [--variants=shipped,...]
"""

from __future__ import annotations

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

CONFIG = ROOT / "configs" / "shakespeare_char_cpu_90s.toml"

# name -> the --key=value overrides of the shipped config. "round one" is the recipe before issue 45 (windows of 64
# tokens throughout, no bigram embedding, a shorter budget); "-X" is the shipped recipe without its technique X
# ("-long windows": 64-token windows throughout, batches of 48), "+X" with a technique it leaves off.
VARIANTS = {
    "shipped": [],
    "round one": [
        "--block_size=64",
        "--batch_size=48",
        "--seq_len_start=0",
        "--bigram_vocab=0",
        "--max_minutes=1.38",
    ],
    "-bigram": ["--bigram_vocab=0"],
    "-long windows": ["--block_size=64", "--batch_size=48", "--seq_len_start=0"],
    "-seq_len_warmup": ["--seq_len_start=0"],
    "+value_embeds": ["--value_embeds=true"],
    "+normuon": ["--normuon=true"],
    "+polar_express": ["--muon_ns=polar_express"],
    "+ema": ["--ema_decay=0.99"],
    "+logit_softcap": ["--logit_softcap=15"],
    "+zero_init_out": ["--zero_init_out=true"],
    "+unet_skips": ["--unet_skips=true"],
    "+relu2": ["--ffn=relu2", "--ffn_hidden=384"],
}


@dataclass
class Options:
    data_dir: str = option("data/shakespeare_char", "char-level tiny Shakespeare (data/shakespeare/prepare.py)")
    variants: str = option("shipped,round one", f"comma-separated, from: {', '.join(VARIANTS)}")
    seeds: str = option("1337,1,2", "comma-separated seeds: every variant runs once with each")
    json: str = option("", "also write every run here")


@dataclass
class Run:
    variant: str
    seed: int
    val_loss: float
    steps: int
    ms_per_step: float
    wall_s: float


def timed_run(overrides: list[str], seed: int, data_dir: str, out_dir: Path) -> Run:
    """One whole training command, timed from launch to exit; its final val loss, steps and median step time."""
    command = [
        sys.executable,
        "train.py",
        str(CONFIG),
        f"--data_dir={data_dir}",
        f"--out_dir={out_dir}",
        f"--seed={seed}",
        *overrides,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    val = float(re.findall(r"\| val loss ([\d.]+)", done.stdout)[-1])
    steps = int(re.findall(r"done at step (\d+)", done.stdout)[-1])
    step_ms = [float(ms) for ms in re.findall(r"\| +([\d.]+) ms/step", done.stdout)]
    return Run("", seed, val, steps, statistics.median(step_ms), wall)


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: {', '.join(unknown)} unknown; choose among {', '.join(VARIANTS)}")
    if not Path(args.data_dir).is_dir():
        raise FileNotFoundError(
            f"--data_dir={args.data_dir} does not exist; prepare it with python data/shakespeare/prepare.py"
        )
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    print(f"{'variant':16} {'seed':>5} {'val loss':>9} {'steps':>6} {'ms/step':>8} {'wall s':>7}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_speedrun_") as tmp:
        for seed in seeds:
            for i, name in enumerate(names):
                one = timed_run(VARIANTS[name], seed, args.data_dir, Path(tmp) / f"{seed}-{i}")
                one.variant = name
                runs.append(one)
                print(
                    f"{name:16} {seed:5d} {one.val_loss:9.4f} {one.steps:6d} {one.ms_per_step:8.1f} {one.wall_s:7.1f}",
                    flush=True,
                )
    print(f"\n{'variant':16} {'median val':>10} {'spread':>7} {'steps':>6} {'ms/step':>8} {'wall s':>7}  runs")
    for name in names:
        mine = [r for r in runs if r.variant == name]
        losses = [r.val_loss for r in mine]
        print(
            f"{name:16} {statistics.median(losses):10.4f} {max(losses) - min(losses):7.4f} "
            f"{statistics.median(r.steps for r in mine):6.0f} {statistics.median(r.ms_per_step for r in mine):8.1f} "
            f"{statistics.median(r.wall_s for r in mine):7.1f}  {', '.join(f'{x:.4f}' for x in losses)}"
        )
    if args.json:
        write_json(Path(args.json), {"config": str(CONFIG.relative_to(ROOT)), "runs": [vars(r) for r in runs]})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_speedrun.py", lambda: run(parse(Options, argv, "bench_speedrun.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
