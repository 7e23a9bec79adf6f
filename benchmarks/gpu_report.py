"""Check and measure gptlite on an NVIDIA GPU in one command of about 8 minutes, and print the results as a table.

    python benchmarks/gpu_report.py --corpus=tinyshakespeare.txt --tiktoken=gpt2.tiktoken --json=report.json
    python benchmarks/gpu_report.py --device=cpu --tiny --corpus=... --tiktoken=...   # a dry run of the script

Each row runs the toolkit as a user does, in its own process and with a time limit, so that one failure
leaves the other rows standing. The default rows, in the order they run (the most wanted first):
    mfu       GPT-2 124M shape (block 1024, bf16, compile) through train.py at --mfu_batch_sizes' first batch that
              fits: tokens/s and MFU as train.py logs them (the median of its log lines after the first), with the
              chunked head + loss (the default) and then with --chunked_loss=false (inductor's fused cross-entropy)
    tests     GPTLITE_TEST_DEVICE=cuda python -m pytest -q -m "not slow": the device-generic tests on the GPU
    generate  benchmarks/bench_generate.py at the 124M shape, batch 1 and 8: gptlite's default and compiled
              (CUDA graphs) decode against Hugging Face `generate`, in one process
    speedrun  configs/shakespeare_char_gpu_90s.toml through train.py: the val loss of 90 s of wall-clock
    sample    sample.py from the speedrun's checkpoint (row generate measures the compiled decode)
    serve     benchmarks/bench_serve.py: the server's tokens/s at 8 and 32 concurrent streams (GPT-2 124M shape)
              against the same requests one after another; needs fastapi, uvicorn and llguidance
    budget    train.py --budget=2min on GPT-2 tokens of the corpus: what it chose, and the val loss it reached
    profile   benchmarks/profile_train_step.py: where the 124M step's GPU time goes (the faster loss of row mfu)
and, when asked for with --checks: open (bench_open_models.py, SmolLM2-360M shape: loading memory and GQA decode)
and lora (bench_lora.py: LoRA against full fine-tuning). A row that would start after --deadline seconds is
listed as not run, and every command ends by --hard_stop seconds, so that the table comes back within a lease
(--checks=... runs the rest in a second call). Needs no network and no wandb: the corpus (tiny Shakespeare) and
the GPT-2 BPE ranks (a .tiktoken file) come as paths. Data, runs and every command's log (each line with its seconds
since the start) go to --work_dir; nothing there is deleted. `--tiny` shrinks every row to seconds (any device, the
CPU too) to check the script itself; its figures mean nothing.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gptlite from this checkout, installed or not
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import cpu_summary, machine_line  # noqa: E402

CHECKS = ("mfu", "tests", "generate", "speedrun", "sample", "serve", "budget", "profile", "open", "lora")
DEFAULT_CHECKS = CHECKS[:8]
SPEEDRUN = "configs/shakespeare_char_gpu_90s.toml"
MFU_CONFIG = "configs/gpt2_124m.toml"
TINY_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--compile=false"]


class Report:
    """The rows measured so far, printed as a table and rewritten to the JSON file after every row."""

    def __init__(self, header: dict, json_path: str | None):
        self.header, self.rows, self.json_path = header, [], json_path

    def add(self, check: str, result: str, goal: str, status: str, **details) -> None:
        self.rows.append({"check": check, "result": result, "goal": goal, "status": status, "details": details})
        print(f"[{status}] {check}: {result}", flush=True)
        if self.json_path:  # written whole, then renamed: a report stopped mid-row leaves the last complete file
            tmp = Path(f"{self.json_path}.tmp")
            tmp.write_text(json.dumps({**self.header, "rows": self.rows}, indent=1) + "\n")
            tmp.replace(self.json_path)

    def table(self) -> str:
        h = self.header
        title = (
            f"gptlite GPU report | {h['device']} (driver {h['driver']}) | torch {h['torch']} (CUDA {h['cuda']}) | "
            f"{h['date']} | commit {h['commit']}{' | TINY DRY RUN: figures mean nothing' if h['tiny'] else ''}"
        )
        lines = [title, "", "| check | result | goal | status |", "|---|---|---|---|"]
        lines += [f"| {r['check']} | {r['result']} | {r['goal']} | {r['status']} |" for r in self.rows]
        return "\n".join(lines)


def run(
    cmd: list[str], log: Path, timeout: float, env: dict | None = None
) -> tuple[int | None, list[tuple[float, str]]]:
    """Run cmd from the repository root, writing its output to `log` line by line with the seconds since the
    start. Returns (exit code, or None when it ran past `timeout` and was killed; [(seconds, line)])."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    start, lines = time.monotonic(), []
    with (
        open(log, "w", encoding="utf-8") as f,
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: a timeout ends its workers too
        ) as proc,
    ):
        f.write(f"$ {' '.join(cmd)}\n")
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:
            t = time.monotonic() - start
            lines.append((t, line.rstrip("\n")))
            f.write(f"{t:8.2f} {line}")
            f.flush()
        code = proc.wait()
        expired = not timer.is_alive() and code == -signal.SIGKILL
        timer.cancel()
    return (None if expired else code), lines


def time_left(args) -> float:
    """A command's time limit: --row_timeout, or less where the report's --hard_stop comes sooner."""
    return max(1.0, min(args.row_timeout, args.stop_at - time.monotonic()))


def tail(lines: list[tuple[float, str]], n: int = 1) -> str:
    return " / ".join(line for _, line in lines[-n:] if line.strip())[-300:]


def failed(what: str, code: int | None, lines: list[tuple[float, str]], log: Path) -> str:
    how = "ran past its time limit" if code is None else f"exited {code}"
    return f"{what} {how}: {tail(lines)} (log: {log})"


def prepare_data(args, name: str, inputs: list[Path], tokenizer: str) -> Path:
    """work_dir/NAME: token shards of `inputs` through data/prepare.py (a finished folder is reused)."""
    out = args.work / name
    log = args.logs / f"prepare_{name}.log"
    code, lines = run(
        [
            sys.executable,
            "data/prepare.py",
            "--input",
            *map(str, inputs),
            f"--tokenizer={tokenizer}",
            f"--out_dir={out}",
        ],
        log,
        300,
    )
    if code != 0:
        raise RuntimeError(failed("data/prepare.py", code, lines, log))
    return out


def corpus_copies(args, copies: int) -> Path:
    """work_dir/corpus_xN.txt: the corpus N times over (a val split that holds a batch of 64 x 1024 GPT-2 tokens)."""
    corpus = args.work / f"corpus_x{copies}.txt"
    if not corpus.is_file():
        text = args.corpus.read_text(encoding="utf-8")
        corpus.with_suffix(".tmp").write_text(text * copies, encoding="utf-8")
        corpus.with_suffix(".tmp").replace(corpus)
    return corpus


def new_run_dir(args, name: str) -> Path:
    """A run folder of its own under work_dir/runs, so no run mixes with an earlier one."""
    return args.work / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def train_rows(out: Path) -> list[dict]:
    """The run's metrics.jsonl rows ([] if it wrote none)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# ---------------------------------------------------------------------------------------------
# The checks: each adds one or more rows


def check_mfu(args, report: Report) -> None:
    """GPT-2 124M through train.py: the chunked loss, then all logits at once, at the first batch that fits."""
    data = prepare_data(args, "shakespeare_gpt2_x4", [corpus_copies(args, 4)], str(args.tiktoken))
    tried = []
    for batch in args.mfu_batch_sizes:
        code, lines, rows, log = train_for_mfu(args, data, batch, chunked=True)
        if code == 2 and any("out of memory" in line for _, line in lines):
            tried.append(f"batch {batch}: out of memory")
            continue
        if not rows:
            report.add(
                "mfu: GPT-2 124M training",
                failed("train.py", code, lines, log),
                "MFU >= 50%",
                "FAIL",
                tried=tried,
                log=str(log),
            )
            return
        check = f"mfu: GPT-2 124M training (block 1024, bf16, compile, batch {batch}, chunked head + loss)"
        args.mfu_results["chunked"] = add_mfu_row(report, check, rows, tried, log, batch)
        code, lines, rows, log = train_for_mfu(args, data, batch, chunked=False)
        if rows:
            check = "mfu: the same with all logits at once (--chunked_loss=false: inductor's fused cross-entropy)"
            args.mfu_results["whole"] = add_mfu_row(report, check, rows, [], log, batch)
        else:
            report.add("mfu: --chunked_loss=false", failed("train.py", code, lines, log), "-", "FAIL", log=str(log))
        args.mfu_batch = batch
        return
    report.add("mfu: GPT-2 124M training", "; ".join(tried), "MFU >= 50%", "FAIL", tried=tried)


def train_for_mfu(args, data: Path, batch: int, chunked: bool) -> tuple[int | None, list, list[dict], Path]:
    """train.py at the 124M shape: (exit code, output lines, metrics rows after the first logged one, log)."""
    tiny = [*TINY_MODEL, "--block_size=128"] if args.tiny else []
    name = f"mfu_b{batch}" + ("" if chunked else "_whole_logits")
    out, log = new_run_dir(args, name), args.logs / f"{name}.log"
    code, lines = run(
        [
            sys.executable,
            "train.py",
            MFU_CONFIG,
            f"--data_dir={data}",
            f"--out_dir={out}",
            f"--device={args.device}",
            f"--batch_size={batch}",
            "--total_batch_size=0",
            f"--max_iters={args.mfu_iters}",
            "--warmup_iters=10",
            "--log_interval=5",
            "--eval_interval=1000000",
            "--eval_iters=1",
            "--keep_last=1",
            f"--chunked_loss={str(chunked).lower()}",
            *tiny,
        ],
        log,
        time_left(args),
    )
    rows = [r for r in train_rows(out) if "tokens_per_s" in r] if code == 0 else []
    return code, lines, rows[1:], log  # the first log line includes compiling


def add_mfu_row(report: Report, check: str, rows: list[dict], tried: list[str], log: Path, batch: int) -> float:
    """Adds the row; returns its median ms per step."""
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    mfu = statistics.median(r["mfu"] for r in rows) if rows[0]["mfu"] is not None else None
    ms = [r["ms_per_step"] for r in rows]
    mfu_text = "n/a (unknown peak)" if mfu is None else f"{100 * mfu:.1f}%"
    spread = f" (ms/step {min(ms):.1f}-{max(ms):.1f} over {len(ms)} log lines)"
    report.add(
        check,
        f"{tps:,.0f} tok/s, {statistics.median(ms):.1f} ms/step, MFU {mfu_text}{spread}"
        + (f" ({'; '.join(tried)})" if tried else ""),
        "MFU >= 50%",
        "pass" if mfu and mfu >= 0.5 else "miss",
        batch_size=batch,
        tokens_per_s=tps,
        mfu=mfu,
        ms_per_step=ms,
        tried=tried,
        log=str(log),
    )
    return statistics.median(ms)


def check_generate(args, report: Report) -> None:
    out = args.logs / "generate.json"
    log = args.logs / "generate.log"
    options = (
        ["--models=char", "--batch_sizes=1", "--new_tokens=32", "--paths=default,compile"]
        if args.tiny
        else ["--models=gpt2", "--batch_sizes=1,8", "--naive_max_batch=0", "--paths=default,compile"]
    )
    code, lines = run(
        [sys.executable, "benchmarks/bench_generate.py", *options, f"--device={args.device}", f"--json={out}"],
        log,
        time_left(args),
    )
    if code != 0 or not out.is_file():
        report.add(
            "generate: 124M",
            failed("bench_generate.py", code, lines, log),
            ">= 2x HF at batch 1",
            "FAIL",
            log=str(log),
        )
        return
    for row in json.loads(out.read_text())["rows"]:
        rates, path = row["tokens_per_s"], row["path"]
        name = f"generate: {row['model']}, batch {row['batch']}, {path}, {row['dtype']}"
        if rates["gptlite"] is None:  # the second process: its first compiled call only
            report.add(name, f"first call {row['first_call_s']:.1f} s", "-", "info", **row)
            continue
        vs_hf = f" = {row['vs_hf']:.2f}x HF generate ({rates['hf']:,.0f})" if row["vs_hf"] else ""
        goal = {"default": ">= 1.5x HF", "compile": ">= 2x HF"}.get(path, "-")
        floor = {"default": 1.5, "compile": 2.0}.get(path)
        status = ("pass" if row["vs_hf"] >= floor else "miss") if floor and row["vs_hf"] else "info"
        report.add(
            name, f"{rates['gptlite']:,.0f} tok/s{vs_hf}, first call {row['first_call_s']:.1f} s", goal, status, **row
        )


def check_speedrun(args, report: Report) -> Path | None:
    """The 90-second char run; returns its run folder for sample.py (None if training failed)."""
    data = prepare_data(args, "shakespeare_char", [args.corpus], "char")
    out = new_run_dir(args, "speedrun_gpu_90s")
    tiny = [*TINY_MODEL, "--max_minutes=0.1", "--batch_size=8", "--block_size=64"] if args.tiny else []
    log = args.logs / "speedrun.log"
    code, lines = run(
        [
            sys.executable,
            "train.py",
            SPEEDRUN,
            f"--data_dir={data}",
            f"--out_dir={out}",
            f"--device={args.device}",
            *tiny,
        ],
        log,
        time_left(args),
    )
    wall = lines[-1][0] if lines else 0.0
    vals = [r["val_loss"] for r in train_rows(out) if r.get("val_loss") is not None]
    steps = [r["step"] for r in train_rows(out) if "tokens_per_s" in r]
    if code != 0 or not vals:
        report.add(f"speedrun: {SPEEDRUN}", failed("train.py", code, lines, log), "val in 90 s wall", "FAIL")
        return None
    report.add(
        f"speedrun: 90 s of char-level tiny Shakespeare ({SPEEDRUN})",
        f"val {vals[-1]:.4f} after {steps[-1] if steps else '?'} steps, {wall:.1f} s wall",
        "<= 90 s wall",
        "pass" if wall <= 90 else "miss",
        val_loss=vals[-1],
        wall_s=wall,
        steps=steps[-1] if steps else None,
        run_dir=str(out),
        log=str(log),
    )
    return out


def check_sample(args, report: Report, run_dir: Path | None) -> None:
    if run_dir is None:
        report.add("sample: sample.py", "no checkpoint: the speedrun row failed", "prints text", "FAIL")
        return
    n = 32 if args.tiny else 256
    for compile in args.sample_compile:
        log = args.logs / f"sample{'_compile' if compile else ''}.log"
        start = time.monotonic()
        code, lines = run(
            [
                sys.executable,
                "sample.py",
                f"--model={run_dir}",
                "--start=ROMEO:",
                "--num_samples=2",
                f"--max_new_tokens={n}",
                "--seed=1",
                f"--device={args.device}",
                *(["--compile"] if compile else []),
            ],
            log,
            time_left(args),
        )
        wall = time.monotonic() - start
        text = "\n".join(line for _, line in lines)
        ok = code == 0 and text.count("-" * 40) == 1 and len(text) > 2 * n  # two samples, one separator
        first = " ".join(text[text.find("ROMEO:") :].split())[:70]  # stdout's text, after any start-up warnings
        result = f'{wall:.1f} s, {len(text)} chars: "{first}..."' if ok else failed("sample.py", code, lines, log)
        report.add(
            f"sample: sample.py{' --compile' if compile else ''} on {args.device}",
            result,
            "prints text",
            "pass" if ok else "FAIL",
            wall_s=wall,
            chars=len(text),
            log=str(log),
        )


def check_serve(args, report: Report) -> None:
    levels = ["1", "2"] if args.tiny else ["1", "8", "32"]
    tiny = ["--rounds=1", "--max_tokens=8"] if args.tiny else ["--rounds=2", "--max_tokens=64"]
    results, problem, log = benchmark(
        args, "serve", "bench_serve.py", ["--levels", *levels, "--max_batch=32", f"--tokenizer={args.tiktoken}", *tiny]
    )
    if results is None:
        report.add("serve: the server under load", problem, "-", "FAIL", log=str(log))
        return
    sequential = statistics.median(results["results"]["1 sequential"]["tokens_per_s"])
    for n in levels[1:]:
        row = results["results"][f"{n} concurrent"]
        tps, ttft = statistics.median(row["tokens_per_s"]), statistics.median(row["ttft_s"])
        report.add(
            f"serve: GPT-2 124M shape, {n} concurrent streams",
            f"{tps:,.0f} tok/s = {tps / sequential:.2f}x one stream ({sequential:,.0f}), first token {ttft:.2f} s",
            "-",
            "info",
            tokens_per_s=tps,
            ttft_s=ttft,
        )


def check_budget(args, report: Report) -> None:
    """train.py --budget=2min on GPT-2 tokens of the corpus: the recipe it derived and what it reached."""
    data = prepare_data(args, "shakespeare_gpt2", [args.corpus], str(args.tiktoken))
    out = new_run_dir(args, "budget_2min")
    log = args.logs / "budget.log"
    budget = "1min" if args.tiny else "2min"
    code, lines = run(
        [
            sys.executable,
            "train.py",
            f"--data_dir={data}",
            f"--out_dir={out}",
            f"--budget={budget}",
            f"--device={args.device}",
        ],
        log,
        time_left(args),
    )
    wall = lines[-1][0] if lines else 0.0
    chose = [line.removeprefix("budget | ") for _, line in lines if line.startswith("budget | ")]
    model = next((line for _, line in lines if line.startswith("model: ")), "")
    vals = [r["val_loss"] for r in train_rows(out) if r.get("val_loss") is not None]
    steps = [r["step"] for r in train_rows(out) if "tokens_per_s" in r]
    if code != 0 or not vals:
        report.add(f"budget: train.py --budget={budget}", failed("train.py", code, lines, log), "-", "FAIL")
        return
    report.add(
        f"budget: train.py --budget={budget} on GPT-2 tokens of tiny Shakespeare",
        f"val {vals[-1]:.4f} after {steps[-1] if steps else '?'} steps in {wall:.1f} s wall; "
        f"{model.removeprefix('model: ').split(' | ')[0]}; chose: " + " / ".join(chose)[:400],
        f"ends within {budget}",
        "info",
        val_loss=vals[-1],
        wall_s=wall,
        chose=chose,
        log=str(log),
    )


def check_tests(args, report: Report) -> None:
    shared = args.work / "shared"  # laid out as ../shared, for the tests that read the corpus and the ranks
    for relative, source in (("data/tinyshakespeare.txt", args.corpus), ("tokenizers/gpt2.tiktoken", args.tiktoken)):
        (shared / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, shared / relative)
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") and not args.tiny else []
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow",
        *workers,
        *(["tests/model/test_network.py", "tests/train/test_update.py"] if args.tiny else ["tests"]),
    ]
    log = args.logs / "tests.log"
    start = time.monotonic()
    code, lines = run(
        cmd, log, time_left(args), env={"GPTLITE_TEST_DEVICE": args.device, "GPTLITE_SHARED": str(shared)}
    )
    summary = next(
        (line.strip("= ") for _, line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), ""
    )
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    ok = code == 0 and counts.get("passed", 0) > 0
    result = f"{summary} ({time.monotonic() - start:.0f} s)" if summary else failed("pytest", code, lines, log)
    failures = [line for _, line in lines if line.startswith(("FAILED", "ERROR"))]
    report.add(
        f'tests: GPTLITE_TEST_DEVICE={args.device} python -m pytest -q -m "not slow"',
        result + (f"; {' / '.join(failures)[:600]}" if failures else ""),
        "all pass",
        "pass" if ok else "FAIL",
        counts=counts,
        failures=failures,
        exit_code=code,
        log=str(log),
    )


def check_profile(args, report: Report) -> None:
    """The 124M step profiled, with the loss that trained faster in row mfu (the chunked one if it did not run)."""
    results = args.mfu_results
    chunked = not results or results.get("chunked", math.inf) <= results.get("whole", math.inf)
    batch = getattr(args, "mfu_batch", args.mfu_batch_sizes[0])
    options = [f"--batch_size={batch}", f"--chunked_loss={str(chunked).lower()}", f"--device={args.device}"]
    results, problem, log = benchmark(
        args, "profile", "profile_train_step.py", [*options, *(["--tiny"] if args.tiny else [])]
    )
    if results is None:
        report.add("profile: the 124M training step", problem, "-", "FAIL", log=str(log))
        return
    step_ms = results["step_ms"]
    groups = sorted(results["groups_ms"].items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{group} {100 * ms / step_ms:.0f}%" for group, ms in groups if ms > 0.005 * step_ms)
    mfu_text = "n/a" if results["mfu"] is None else f"{100 * results['mfu']:.1f}%"
    report.add(
        f"profile: the bare 124M step (batch {batch}, {'chunked' if chunked else 'whole-logits'} loss, no host reads)",
        f"{step_ms:.1f} ms/step, MFU {mfu_text}; {shares}",
        "-",
        "info",
        **results,
    )


def benchmark(args, name: str, script: str, options: list[str]) -> tuple[dict | None, str, Path]:
    """Run benchmarks/SCRIPT with --json: (its results, or None if it failed; the failure in words; its log)."""
    out, log = args.logs / f"{name}.json", args.logs / f"{name}.log"
    code, lines = run([sys.executable, f"benchmarks/{script}", *options, f"--json={out}"], log, time_left(args))
    if code != 0 or not out.is_file():
        return None, failed(script, code, lines, log), log
    return json.loads(out.read_text()), "", log


def check_open(args, report: Report) -> None:
    cuda = args.device.startswith("cuda")
    tiny = ["--prompt=16", "--new_tokens=4", "--batch_sizes=1"] if args.tiny else []
    results, problem, log = benchmark(
        args,
        "open_models",
        "bench_open_models.py",
        [
            "--parts=memory,decode",
            f"--device={args.device}",
            f"--dtype={'bfloat16' if cuda else 'float32'}",
            *tiny,
        ],
    )
    if results is None:
        report.add("open: open models (SmolLM2-360M shape)", problem, "-", "FAIL", log=str(log))
        return
    for row in results["memory"]:
        ours = row["loader"] == "gptlite"
        gpu = f"; GPU {row['gpu_peak_mb'] / row['model_mb']:.2f}x" if row["gpu_peak_mb"] else ""
        report.add(
            f"open: loading SmolLM2-360M shape, {row['loader']}, {row['dtype']}",
            f"host peak {row['peak_rss_mb']:,.0f} MB = {row['peak_rss_mb'] / row['model_mb']:.2f}x the model's "
            f"{row['model_mb']:,.0f} MB{gpu}",
            "host <= 1.3x" if ours else "-",
            ("pass" if row["peak_rss_mb"] <= 1.3 * row["model_mb"] else "miss") if ours else "info",
            **row,
        )
    for row in results["decode"]:
        ratio = row["gqa"] / row["hf"]
        report.add(
            f"open: decode SmolLM2-360M shape (GQA), batch {row['batch']}, {row['dtype']}",
            f"{row['gqa']:,.0f} tok/s = {ratio:.2f}x transformers ({row['hf']:,.0f}); with n_kv_head = n_head "
            f"{row['full_kv_heads']:,.0f}",
            ">= 1x transformers",
            "pass" if ratio >= 1 else "miss",
            **row,
        )


def check_lora(args, report: Report) -> None:
    results, problem, log = benchmark(
        args,
        "lora",
        "bench_lora.py",
        [f"--device={args.device}", f"--steps={2 if args.tiny else 6}", f"--corpus={args.corpus}"],
    )
    if results is None:
        report.add("lora: LoRA against full fine-tuning", problem, "-", "FAIL", log=str(log))
        return
    for row in results["rows"]:
        kept = "recomputed" if row["activation_checkpointing"] else "kept"
        report.add(
            f"lora: fine-tuning SmolLM2-360M shape, block 1024, activations {kept}",
            f"full {row['full_mb']:,.0f} MB, {row['full_s_per_step']:.3f} s/step; LoRA {row['lora_mb']:,.0f} MB "
            f"({row['lora_mb'] / row['full_mb']:.2f}x), {row['lora_s_per_step']:.3f} s/step",
            "-",
            "info",
            **row,
        )


# ---------------------------------------------------------------------------------------------


def header(args) -> dict:
    try:
        git = [
            subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            for cmd in (["rev-parse", "--short=10", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
        ]
        commit = git[0] + (" with local changes" if git[0] and git[1] else "")  # the measured code is not that commit
    except OSError:
        commit = ""
    cuda = args.device.startswith("cuda")
    return {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "driver": driver_version() if cuda else "none",
        "cpu": cpu_summary(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "tiny": args.tiny,
    }


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except OSError:
        return "unknown"


@dataclass
class Options:
    corpus: str = option(help="tiny Shakespeare as a text file")
    tiktoken: str = option(help="the GPT-2 BPE ranks as a .tiktoken file")
    json: str | None = option(None, "write the report here as JSON (rewritten after every row)")
    work_dir: str = option(str(ROOT / "out" / "gpu_report"), "data, runs and logs (nothing there is deleted)")
    checks: str = option(",".join(DEFAULT_CHECKS), f"comma-separated rows to run, in that order: {', '.join(CHECKS)}")
    device: str = option("cuda", "cuda, or cpu for a dry run with --tiny")
    mfu_batch_sizes: str = option("64,32,16", "row mfu takes the first that fits in memory")
    mfu_iters: int = option(40, "row mfu's training steps (logged every 5)")
    row_timeout: float = option(300.0, "seconds each command may run")
    sample_compile: str = option("false", "row sample: comma-separated --compile values to run sample.py with")
    deadline: float = option(480.0, "seconds after the start past which no further row starts")
    hard_stop: float = option(570.0, "seconds after the start by which every command has ended (its time limit)")
    tiny: bool = option(False, "tiny versions of every row, on any device (checks the script)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("gpu_report.py", lambda: report_all(parse(Options, argv, "gpu_report.py", __doc__)))


def report_all(args: Options) -> int:
    started = time.monotonic()
    print(machine_line(), flush=True)
    args.corpus, args.tiktoken, args.work_dir = Path(args.corpus), Path(args.tiktoken), Path(args.work_dir)
    checks = args.checks.split(",")
    problems = [f"--checks: unknown {c!r} (choose from {', '.join(CHECKS)})" for c in checks if c not in CHECKS]
    problems += [
        f"--{name} {path} does not exist"
        for name, path in (("corpus", args.corpus), ("tiktoken", args.tiktoken))
        if not path.is_file()
    ]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append("--device=cuda, but CUDA is not available here; --device=cpu --tiny dry-runs the script")
    elif not args.device.startswith(("cuda", "cpu")):
        problems.append(f"--device={args.device!r}: give cuda, or cpu for a dry run with --tiny")
    elif args.device == "cpu" and not args.tiny:
        problems.append("--device=cpu measures nothing worth the hours it takes: add --tiny for a dry run")
    if problems:
        raise ValueError("; ".join(problems))
    args.corpus, args.tiktoken = args.corpus.resolve(), args.tiktoken.resolve()
    args.mfu_batch_sizes = [int(b) for b in args.mfu_batch_sizes.split(",")]
    args.sample_compile = [c.strip() == "true" for c in args.sample_compile.split(",")]
    args.stop_at = started + args.hard_stop
    args.mfu_results = {}  # "chunked" / "whole" -> median ms per step, for the profile row's choice
    if args.tiny:
        args.mfu_batch_sizes = [4]
        args.mfu_iters = 20
    args.work = args.work_dir.resolve()
    args.logs = args.work / "logs" / time.strftime("%Y%m%d-%H%M%S")
    args.logs.mkdir(parents=True, exist_ok=True)

    report = Report(header(args), args.json)
    print(f"logs: {args.logs}", flush=True)
    speedrun_dir = None
    for check in checks:
        if time.monotonic() - started > args.deadline:
            report.add(check, f"not run: the report passed its --deadline of {args.deadline:.0f} s", "-", "not run")
            continue
        row_start = time.monotonic()
        try:
            if check == "speedrun":
                speedrun_dir = check_speedrun(args, report)
            elif check == "sample":
                run_dir = speedrun_dir if "speedrun" in checks else latest_run(args, "speedrun_gpu_90s")
                check_sample(args, report, run_dir)
            else:
                ROWS[check](args, report)
        except Exception as e:  # a broken row must not hide the others
            report.add(check, f"the report itself failed: {type(e).__name__}: {e}", "-", "FAIL")
        print(f"({check}: {time.monotonic() - row_start:.0f} s; {time.monotonic() - started:.0f} s so far)", flush=True)
    print("\n" + report.table())
    return 0 if all(r["status"] != "FAIL" for r in report.rows) else 1


ROWS = {
    "mfu": check_mfu,
    "generate": check_generate,
    "serve": check_serve,
    "budget": check_budget,
    "tests": check_tests,
    "profile": check_profile,
    "open": check_open,
    "lora": check_lora,
}


def latest_run(args, name: str) -> Path | None:
    """The newest run folder of `name` with a checkpoint (for --checks=sample without the speedrun)."""
    runs = sorted(p for p in (args.work / "runs").glob(f"{name}-*") if (p / "ckpt.pt").exists())
    return runs[-1] if runs else None


if __name__ == "__main__":
    sys.exit(main())
