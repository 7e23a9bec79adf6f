"""Check and measure gptlite on an NVIDIA GPU in one command, and print the results as a table.

    python benchmarks/gpu_report.py --corpus=tinyshakespeare.txt --tiktoken=gpt2.tiktoken --json=report.json

Each row runs the toolkit as a user does, in its own process and with a time limit, so that one failure
leaves the other rows standing:
    1 tests     the device-generic tests on CUDA (GPTLITE_TEST_DEVICE=cuda python -m pytest)
    2 recipe    configs/shakespeare_char_gpu.toml through train.py: final val loss and the command's wall time
    3 mfu       GPT-2 124M shape (block 1024, bf16, compile) through train.py, largest batch that fits:
                tokens/s and MFU as train.py logs them (the median of its log lines after the first), with the
                chunked head + loss (the default) and then with --chunked_loss=false at the same batch
    4 generate  benchmarks/bench_generate.py at the 124M shape, batch 1 and 8: gptlite's default and
                compiled (CUDA graphs) decode against Hugging Face `generate`, in one process
    5 sample    sample.py from row 2's checkpoint, with and without --compile
    6 hellaswag HellaSwag throughput, once gptlite has an evaluation module
    7 open      benchmarks/bench_open_models.py at the SmolLM2-360M shape: loading memory (host and GPU) and
                GQA decode tokens/s at batch 1 and 8 in bf16 against transformers
    8 lora      benchmarks/bench_lora.py: LoRA against full fine-tuning at that shape, bf16, time per step and
                the peak GPU memory train.py reports, with and without --activation_checkpointing
    9 serve     benchmarks/bench_serve.py: the server's tokens/s at 1, 8 and 32 concurrent streams (GPT-2
                124M shape) against the same requests one after another; needs fastapi, uvicorn and httpx
Needs no network and no wandb: the corpus (tiny Shakespeare) and the GPT-2 BPE ranks (a .tiktoken file) come
as paths. Data, runs and every command's log (each line with its seconds since the start) go to --work_dir;
nothing there is deleted. `--smoke` shrinks every row to seconds (any device, the CPU too) to check the
script itself; its figures mean nothing.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
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
sys.path.insert(0, str(ROOT))  # gptlite from this checkout, installed or not (row 6 looks for a module of it)
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import cpu_summary, machine_line  # noqa: E402

CHECKS = ("tests", "recipe", "mfu", "generate", "sample", "hellaswag", "open", "lora", "serve")
RECIPE = "configs/shakespeare_char_gpu.toml"
MFU_CONFIG = "configs/gpt2_124m.toml"
SMOKE_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--compile=false"]


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
            f"gptlite GPU report | {h['device']} | torch {h['torch']} (CUDA {h['cuda']}) | {h['date']} | "
            f"commit {h['commit']}{' | SMOKE RUN: figures mean nothing' if h['smoke'] else ''}"
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


def tail(lines: list[tuple[float, str]], n: int = 1) -> str:
    return " / ".join(line for _, line in lines[-n:] if line.strip())[-300:]


def failed(what: str, code: int | None, lines: list[tuple[float, str]], log: Path) -> str:
    how = "ran past its time limit" if code is None else f"exited {code}"
    return f"{what} {how}: {tail(lines)} (log: {log})"


def prepare_data(args, name: str, inputs: list[Path], tokenizer: str) -> Path:
    """work_dir/NAME: token shards of `inputs` through data/prepare.py (a finished folder is reused)."""
    out = args.work / name
    code, lines = run(
        [
            sys.executable,
            "data/prepare.py",
            "--input",
            *map(str, inputs),
            f"--tokenizer={tokenizer}",
            f"--out_dir={out}",
        ],
        args.logs / f"prepare_{name}.log",
        600,
    )
    if code != 0:
        raise RuntimeError(failed("data/prepare.py", code, lines, args.logs / f"prepare_{name}.log"))
    return out


def new_run_dir(args, name: str) -> Path:
    """A run folder of its own under work_dir/runs, so no run mixes with an earlier one."""
    return args.work / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---------------------------------------------------------------------------------------------
# The checks: each adds one or more rows


def check_tests(args, report: Report) -> None:
    shared = args.work / "shared"  # laid out as ../shared, for the tests that read the corpus and the ranks
    for relative, source in (("data/tinyshakespeare.txt", args.corpus), ("tokenizers/gpt2.tiktoken", args.tiktoken)):
        (shared / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, shared / relative)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") and not args.smoke else []
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *workers,
        *(["tests/test_model.py"] if args.smoke else ["tests"]),
    ]
    log = args.logs / "tests.log"
    start = time.monotonic()
    code, lines = run(cmd, log, args.timeout, env={"GPTLITE_TEST_DEVICE": device, "GPTLITE_SHARED": str(shared)})
    summary = next(
        (line.strip("= ") for _, line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), ""
    )
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    ok = code == 0 and counts.get("passed", 0) > 0
    result = f"{summary} ({time.monotonic() - start:.0f} s)" if summary else failed("pytest", code, lines, log)
    report.add(
        f"1. test suite on {device} (GPTLITE_TEST_DEVICE={device})",
        result,
        "all pass",
        "pass" if ok else "FAIL",
        counts=counts,
        exit_code=code,
        log=str(log),
    )


def check_recipe(args, report: Report) -> Path | None:
    """Row 2; returns the run folder for sample.py (None if training failed)."""
    data = prepare_data(args, "shakespeare_char", [args.corpus], "char")
    out = new_run_dir(args, "shakespeare_char_gpu")
    smoke = (
        [
            *SMOKE_MODEL,
            "--max_iters=20",
            "--eval_interval=10",
            "--eval_iters=2",
            "--log_interval=5",
            "--batch_size=8",
            "--block_size=64",
        ]
        if args.smoke
        else []
    )
    log = args.logs / "recipe.log"
    code, lines = run(
        [sys.executable, "train.py", RECIPE, f"--data_dir={data}", f"--out_dir={out}", *smoke], log, args.timeout
    )
    wall = lines[-1][0] if lines else 0.0
    vals = [(t, float(m.group(2))) for t, line in lines if (m := re.match(r"step\s+(\d+) \| val loss ([\d.]+)", line))]
    steps = [t for t, line in lines if re.match(r"step\s+\d+ \| loss", line)]
    if code != 0 or not vals:
        report.add(
            "2. Shakespeare-char GPU recipe",
            failed("train.py", code, lines, log),
            "val <= 1.47 in < 60 s",
            "FAIL",
            log=str(log),
        )
        return None
    val = vals[-1][1]
    ok = val <= 1.47 and wall < 60
    first = f", first step logged at {steps[0]:.1f} s" if steps else ""
    report.add(
        f"2. Shakespeare-char GPU recipe ({RECIPE})",
        f"val {val:.4f} in {wall:.1f} s wall{first}",
        "val <= 1.47 in < 60 s",
        "pass" if ok else "miss",
        val_loss=val,
        wall_s=wall,
        first_step_s=steps[0] if steps else None,
        val_history=[v for _, v in vals],
        run_dir=str(out),
        log=str(log),
    )
    return out


def check_mfu(args, report: Report) -> None:
    corpus = args.work / "corpus_x4.txt"  # four copies: a val split that holds a batch of 64 x 1024 tokens
    if not corpus.is_file():
        text = args.corpus.read_text(encoding="utf-8")
        corpus.with_suffix(".tmp").write_text(text * 4, encoding="utf-8")
        corpus.with_suffix(".tmp").replace(corpus)
    data = prepare_data(args, "shakespeare_gpt2_x4", [corpus], str(args.tiktoken))
    tried = []
    for batch in args.mfu_batch_sizes:
        code, lines, rows, log = train_for_mfu(args, data, batch, chunked=True)
        if code == 2 and any("out of memory" in line for _, line in lines):
            tried.append(f"batch {batch}: out of memory")
            continue
        if not rows:
            report.add(
                "3. GPT-2 124M training throughput",
                failed("train.py", code, lines, log),
                "MFU >= 50%",
                "FAIL",
                tried=tried,
                log=str(log),
            )
            return
        add_mfu_row(
            report, f"3. GPT-2 124M training (block 1024, bf16, compile, batch {batch})", rows, tried, log, batch
        )
        code, lines, rows, log = train_for_mfu(args, data, batch, chunked=False)
        if rows:
            add_mfu_row(report, "3. the same with all logits at once (--chunked_loss=false)", rows, [], log, batch)
        else:
            report.add("3. --chunked_loss=false", failed("train.py", code, lines, log), "-", "FAIL", log=str(log))
        return
    report.add("3. GPT-2 124M training throughput", "; ".join(tried), "MFU >= 50%", "FAIL", tried=tried)


def train_for_mfu(args, data: Path, batch: int, chunked: bool) -> tuple[int | None, list, list[dict], Path]:
    """train.py at the 124M shape: (exit code, output lines, metrics rows after the first logged one, log)."""
    smoke = [*SMOKE_MODEL, "--block_size=128"] if args.smoke else []
    name = f"mfu_b{batch}" + ("" if chunked else "_whole_logits")
    out, log = new_run_dir(args, name), args.logs / f"{name}.log"
    code, lines = run(
        [
            sys.executable,
            "train.py",
            MFU_CONFIG,
            f"--data_dir={data}",
            f"--out_dir={out}",
            f"--batch_size={batch}",
            "--total_batch_size=0",
            f"--max_iters={args.mfu_iters}",
            "--warmup_iters=10",
            "--log_interval=10",
            "--eval_interval=1000000",
            "--eval_iters=1",
            "--keep_last=1",
            f"--chunked_loss={str(chunked).lower()}",
            *smoke,
        ],
        log,
        args.timeout,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    return code, lines, [r for r in rows if "tokens_per_s" in r][1:], log  # the first log line includes compiling


def add_mfu_row(report: Report, check: str, rows: list[dict], tried: list[str], log: Path, batch: int) -> None:
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    mfu = statistics.median(r["mfu"] for r in rows) if rows[0]["mfu"] is not None else None
    ms = statistics.median(r["ms_per_step"] for r in rows)
    mfu_text = "n/a (unknown peak)" if mfu is None else f"{100 * mfu:.1f}%"
    report.add(
        check,
        f"{tps:,.0f} tok/s, {ms:.0f} ms/step, MFU {mfu_text}" + (f" ({'; '.join(tried)})" if tried else ""),
        "MFU >= 50%",
        "pass" if mfu and mfu >= 0.5 else "miss",
        batch_size=batch,
        tokens_per_s=tps,
        mfu=mfu,
        ms_per_step=ms,
        tried=tried,
        log=str(log),
    )


def check_generate(args, report: Report) -> None:
    out = args.logs / "generate.json"
    log = args.logs / "generate.log"
    options = (
        ["--models=char", "--batch_sizes=1", "--new_tokens=32", "--paths=default,int8"]
        if args.smoke
        else ["--models=gpt2", "--batch_sizes=1,8", "--naive_max_batch=0"]
    )
    code, lines = run([sys.executable, "benchmarks/bench_generate.py", *options, f"--json={out}"], log, args.timeout)
    if code != 0 or not out.is_file():
        report.add(
            "4. generation, 124M",
            failed("bench_generate.py", code, lines, log),
            ">= 2x HF at batch 1",
            "FAIL",
            log=str(log),
        )
        return
    for row in json.loads(out.read_text())["rows"]:
        rates, path = row["tokens_per_s"], row["path"]
        name = f"4. generation {row['model']}, batch {row['batch']}, {path}, {row['dtype']}"
        if rates["gptlite"] is None:  # the second process: its first compiled call only
            report.add(name, f"first call {row['first_call_s']:.1f} s", "-", "info", **row)
            continue
        vs_hf = f" = {row['vs_hf']:.2f}x HF ({rates['hf']:,.0f})" if row["vs_hf"] else ""
        goal = {"default": ">= 1.5x HF", "int8": ">= 2x HF", "compile": ">= 2x HF"}.get(path, "-")
        floor = {"default": 1.5, "int8": 2.0, "compile": 2.0}.get(path)
        status = ("pass" if row["vs_hf"] >= floor else "miss") if floor and row["vs_hf"] else "info"
        report.add(
            name, f"{rates['gptlite']:,.0f} tok/s{vs_hf}, first call {row['first_call_s']:.1f} s", goal, status, **row
        )


def check_sample(args, report: Report, run_dir: Path | None) -> None:
    if run_dir is None:
        report.add("5. sample.py", "no checkpoint: row 2 failed", "prints text", "FAIL")
        return
    n = 32 if args.smoke else 256
    for compile in (False, True):
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
                *(["--compile"] if compile else []),
            ],
            log,
            args.timeout,
        )
        wall = time.monotonic() - start
        text = "\n".join(line for _, line in lines)
        ok = code == 0 and text.count("-" * 40) == 1 and len(text) > 2 * n  # two samples, one separator
        first = " ".join(text[text.find("ROMEO:") :].split())[:70]  # stdout's text, after any start-up warnings
        result = f'{wall:.1f} s, {len(text)} chars: "{first}..."' if ok else failed("sample.py", code, lines, log)
        report.add(
            f"5. sample.py{' --compile' if compile else ''}",
            result,
            "prints text",
            "pass" if ok else "FAIL",
            wall_s=wall,
            chars=len(text),
            log=str(log),
        )


def check_hellaswag(args, report: Report) -> None:
    if importlib.util.find_spec("gptlite.evaluate") is None:
        report.add("6. HellaSwag throughput", "not built: gptlite has no evaluation module yet", "-", "n/a")
        return
    report.add("6. HellaSwag throughput", "gptlite.evaluate exists: add its row to this report", "-", "n/a")


def benchmark(args, name: str, script: str, options: list[str]) -> tuple[dict | None, str, Path]:
    """Run benchmarks/SCRIPT with --json: (its results, or None if it failed; the failure in words; its log)."""
    out, log = args.logs / f"{name}.json", args.logs / f"{name}.log"
    code, lines = run([sys.executable, f"benchmarks/{script}", *options, f"--json={out}"], log, args.timeout)
    if code != 0 or not out.is_file():
        return None, failed(script, code, lines, log), log
    return json.loads(out.read_text()), "", log


def check_open(args, report: Report) -> None:
    cuda = torch.cuda.is_available()
    smoke = ["--prompt=16", "--new_tokens=4", "--batch_sizes=1"] if args.smoke else []
    results, problem, log = benchmark(
        args,
        "open_models",
        "bench_open_models.py",
        [
            "--parts=memory,decode",
            f"--device={'cuda' if cuda else 'cpu'}",
            f"--dtype={'bfloat16' if cuda else 'float32'}",
            *smoke,
        ],
    )
    if results is None:
        report.add("7. open models (SmolLM2-360M shape)", problem, "-", "FAIL", log=str(log))
        return
    for row in results["memory"]:
        ours = row["loader"] == "gptlite"
        gpu = f"; GPU {row['gpu_peak_mb'] / row['model_mb']:.2f}x" if row["gpu_peak_mb"] else ""
        report.add(
            f"7. loading SmolLM2-360M shape, {row['loader']}, {row['dtype']}",
            f"host peak {row['peak_rss_mb']:,.0f} MB = {row['peak_rss_mb'] / row['model_mb']:.2f}x the model's "
            f"{row['model_mb']:,.0f} MB{gpu}",
            "host <= 1.3x" if ours else "-",
            ("pass" if row["peak_rss_mb"] <= 1.3 * row["model_mb"] else "miss") if ours else "info",
            **row,
        )
    for row in results["decode"]:
        ratio = row["gqa"] / row["hf"]
        report.add(
            f"7. decode SmolLM2-360M shape (GQA), batch {row['batch']}, {row['dtype']}",
            f"{row['gqa']:,.0f} tok/s = {ratio:.2f}x transformers ({row['hf']:,.0f}); with n_kv_head = n_head "
            f"{row['full_kv_heads']:,.0f}",
            ">= 1x transformers",
            "pass" if ratio >= 1 else "miss",
            **row,
        )


def check_lora(args, report: Report) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results, problem, log = benchmark(
        args,
        "lora",
        "bench_lora.py",
        [f"--device={device}", f"--steps={2 if args.smoke else 6}", f"--corpus={args.corpus}"],
    )
    if results is None:
        report.add("8. LoRA against full fine-tuning", problem, "-", "FAIL", log=str(log))
        return
    for row in results["rows"]:
        kept = "recomputed" if row["activation_checkpointing"] else "kept"
        report.add(
            f"8. fine-tuning SmolLM2-360M shape, block 1024, activations {kept}",
            f"full {row['full_mb']:,.0f} MB, {row['full_s_per_step']:.3f} s/step; LoRA {row['lora_mb']:,.0f} MB "
            f"({row['lora_mb'] / row['full_mb']:.2f}x), {row['lora_s_per_step']:.3f} s/step",
            "-",
            "info",
            **row,
        )


def check_serve(args, report: Report) -> None:
    levels = ["1", "2"] if args.smoke else ["1", "8", "32"]
    smoke = ["--rounds=1", "--max_tokens=8"] if args.smoke else ["--rounds=3", "--max_tokens=128"]
    results, problem, log = benchmark(
        args, "serve", "bench_serve.py", ["--levels", *levels, "--max_batch=32", f"--tokenizer={args.tiktoken}", *smoke]
    )
    if results is None:
        report.add("9. server under load", problem, "-", "FAIL", log=str(log))
        return
    sequential = statistics.median(results["results"]["1 sequential"]["tokens_per_s"])
    for n in levels:
        row = results["results"][f"{n} concurrent"]
        tps, ttft = statistics.median(row["tokens_per_s"]), statistics.median(row["ttft_s"])
        report.add(
            f"9. server, GPT-2 124M shape, {n} concurrent stream{'s' if n != '1' else ''}",
            f"{tps:,.0f} tok/s = {tps / sequential:.2f}x one stream ({sequential:,.0f}), first token {ttft:.2f} s",
            "-",
            "info",
            tokens_per_s=tps,
            ttft_s=ttft,
        )


# ---------------------------------------------------------------------------------------------


def header(smoke: bool) -> dict:
    try:
        git = [
            subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            for cmd in (["rev-parse", "--short=10", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
        ]
        commit = git[0] + (" with local changes" if git[0] and git[1] else "")  # the measured code is not that commit
    except OSError:
        commit = ""
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "cpu": cpu_summary(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "smoke": smoke,
    }


@dataclass
class Options:
    corpus: str = option(help="tiny Shakespeare as a text file")
    tiktoken: str = option(help="the GPT-2 BPE ranks as a .tiktoken file")
    json: str | None = option(None, "write the report here as JSON (rewritten after every row)")
    work_dir: str = option(str(ROOT / "out" / "gpu_report"), "data, runs and logs (nothing there is deleted)")
    checks: str = option(
        ",".join(CHECKS), "comma-separated rows to run, in the order given (sample uses the newest recipe run)"
    )
    mfu_batch_sizes: str = option("64,32,16", "row 3 takes the first that fits in memory")
    mfu_iters: int = option(60, "row 3's training steps")
    timeout: float = option(600.0, "seconds each command may run")
    smoke: bool = option(False, "tiny versions of every row, on any device (checks the script)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("gpu_report.py", lambda: report_all(parse(Options, argv, "gpu_report.py", __doc__)))


def report_all(args: Options) -> int:
    print(machine_line(), flush=True)
    args.corpus, args.tiktoken, args.work_dir = Path(args.corpus), Path(args.tiktoken), Path(args.work_dir)
    checks = args.checks.split(",")
    problems = [f"--checks: unknown {c!r} (choose from {', '.join(CHECKS)})" for c in checks if c not in CHECKS]
    problems += [
        f"--{name} {path} does not exist"
        for name, path in (("corpus", args.corpus), ("tiktoken", args.tiktoken))
        if not path.is_file()
    ]
    if not torch.cuda.is_available() and not args.smoke:
        problems.append("CUDA is not available here; this report measures an NVIDIA GPU (--smoke runs it anywhere)")
    if problems:
        raise ValueError("; ".join(problems))
    args.corpus, args.tiktoken = args.corpus.resolve(), args.tiktoken.resolve()
    args.mfu_batch_sizes = [int(b) for b in args.mfu_batch_sizes.split(",")]
    if args.smoke:
        args.mfu_batch_sizes, args.mfu_iters = [4], 30
    args.work = args.work_dir.resolve()
    args.logs = args.work / "logs" / time.strftime("%Y%m%d-%H%M%S")
    args.logs.mkdir(parents=True, exist_ok=True)

    report = Report(header(args.smoke), args.json)
    print(f"logs: {args.logs}", flush=True)
    run_dir = None
    for check in checks:
        try:
            if check == "tests":
                check_tests(args, report)
            elif check == "recipe":
                run_dir = check_recipe(args, report)
            elif check == "sample":
                check_sample(args, report, run_dir if "recipe" in checks else latest_run(args, "shakespeare_char_gpu"))
            elif check == "mfu":
                check_mfu(args, report)
            elif check == "generate":
                check_generate(args, report)
            elif check == "hellaswag":
                check_hellaswag(args, report)
            else:
                {"open": check_open, "lora": check_lora, "serve": check_serve}[check](args, report)
        except Exception as e:  # a broken row must not hide the others
            report.add(check, f"the report itself failed: {type(e).__name__}: {e}", "-", "FAIL")
    print("\n" + report.table())
    return 0 if all(r["status"] != "FAIL" for r in report.rows) else 1


def latest_run(args, name: str) -> Path | None:
    """The newest run folder of `name` with a checkpoint (for --checks=sample without the recipe)."""
    runs = sorted(p for p in (args.work / "runs").glob(f"{name}-*") if (p / "ckpt.pt").exists())
    return runs[-1] if runs else None


if __name__ == "__main__":
    sys.exit(main())
