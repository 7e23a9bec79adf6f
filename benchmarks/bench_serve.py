"""The server under load: tokens/s of 1, 4, 8 and 16 concurrent streams against the same requests sent one after
another, time to first token, and the server's memory, on a GPT-2-124M-shaped model with random weights.

    python benchmarks/bench_serve.py                                  # levels 1,4,8,16; 3 rounds; 64 new tokens
    python benchmarks/bench_serve.py --levels 1 8 --rounds=5 --max_tokens=128 --json=serve.json

The script saves the model as a run folder (GPT-2's shape: 12 layers, 12 heads, 768 wide, vocab 50,304, block
1,024, GELU MLP with biases) with GPT-2's tokenizer, starts `python -m gptlite.serve` on it in a process of its
own, and sends each level's requests (distinct prompts, greedy, `max_tokens` each, streamed) all at once
("concurrent") and then one after another ("sequential": the same server, one request at a time, so one row on
its single-row path). Tokens/s counts the completion tokens the server reports over the wall time of the whole
batch of requests. Time to first token is from sending a request to its first text. Levels and modes are
interleaved, round after round, because the machine may be shared: the table gives each figure's min and
median over the rounds. Memory: the server's resident set (VmRSS) sampled while the most streams run, and its peak
(VmHWM) since it started. This is a script that prints a table, not a test.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite import GPT  # noqa: E402
from gptlite.checkpoint import save_checkpoint  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import build_config, config_to_dict, option  # noqa: E402
from gptlite.files import write_json  # noqa: E402
from gptlite.tokenizer import get_tokenizer  # noqa: E402

GPT2_SHAPE = {
    "vocab_size": 50304,
    "block_size": 1024,
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "ffn": "gelu",
    "bias": True,
    "pos_emb": "learned",
    "norm": "layernorm",
}
WORDS = "the of and to in is was for that with as on by he at from his it an were are which this be".split()


@dataclass
class BenchOptions:
    levels: list[int] = option(default_factory=lambda: [1, 4, 8, 16], help="concurrent streams per level")
    rounds: int = option(3, "times each level runs in each mode (interleaved)")
    max_tokens: int = option(64, "completion tokens per request")
    tokenizer: str = option("", "GPT-2's .tiktoken ranks file (default: ../shared/tokenizers/gpt2.tiktoken)")
    port: int = option(8765, "the server's port")
    max_batch: int = option(16, "the server's --max_batch: rows decoded together (more streams wait their turn)")
    compile: bool = option(False, "start the server with --compile (its first requests compile, before the timing)")
    json: str = option("", "also write the results here")


@dataclass
class Result:
    tokens_per_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # the median over a run's requests, per run


def make_run(folder: Path, tokenizer: str) -> None:
    torch.manual_seed(0)
    cfg = build_config(dict(GPT2_SHAPE))
    save_checkpoint(folder / "ckpt.pt", {"config": config_to_dict(cfg), "model": GPT(cfg.model).state_dict()})
    get_tokenizer(tokenizer).save(folder / "tokenizer.json")


def prompt(i: int) -> str:
    """A distinct prompt of a dozen words."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12))


def one_request(url: str, i: int, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds to the first text) of one streamed, greedy request."""
    body = {
        "model": "bench",
        "prompt": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return tokens, first if first is not None else float("nan")


def run_level(url: str, n: int, max_tokens: int, concurrent: bool) -> tuple[float, float]:
    """(tokens/s, median time to first token) of n requests, all at once or one after another."""
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda i: one_request(url, i, max_tokens), range(n)))
    else:
        results = [one_request(url, i, max_tokens) for i in range(n)]
    seconds = time.perf_counter() - start
    return sum(t for t, _ in results) / seconds, statistics.median(f for _, f in results)


def memory(pid: int) -> dict[str, int]:
    """The process's VmRSS and VmHWM, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}


def start_server(run: Path, port: int, log: Path, compile: bool, max_batch: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "gptlite.serve",
        f"--out_dir={run}",
        "--model_name=bench",
        f"--port={port}",
        f"--max_batch={max_batch}",
        "--log_level=warning",
        f"--compile={compile}",
    ]
    server = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return server
        except httpx.HTTPError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}") from None
            time.sleep(0.5)


def measure(options: BenchOptions, url: str, pid: int) -> tuple[dict, dict]:
    results = {(n, mode): Result() for n in options.levels for mode in ("concurrent", "sequential")}
    rss, most = [], max(options.levels)
    for r in range(options.rounds):
        for n in options.levels:
            for mode in ("concurrent", "sequential"):
                done = threading.Event()
                sampler = (
                    threading.Thread(target=sample_rss, args=(pid, rss, done))
                    if n == most and mode == "concurrent"
                    else None
                )
                if sampler:
                    sampler.start()
                tps, ttft = run_level(url, n, options.max_tokens, mode == "concurrent")
                done.set()
                if sampler:
                    sampler.join()
                results[n, mode].tokens_per_s.append(tps)
                results[n, mode].ttft_s.append(ttft)
                print(f"round {r + 1}: {n:2d} {mode:10s} {tps:7.1f} tokens/s, first token {ttft:.3f} s", flush=True)
    return results, {"streams_sampled": most, "rss_at_most_streams_mib": max(rss, default=0), **memory(pid)}


def sample_rss(pid: int, out: list[int], done: threading.Event) -> None:
    while not done.wait(0.1):
        out.append(memory(pid)["VmRSS"])


def table(options: BenchOptions, results: dict, mem: dict) -> str:
    def mm(xs: list[float], fmt: str) -> str:
        return f"{format(min(xs), fmt)} / {format(statistics.median(xs), fmt)}"

    lines = [
        "| streams | concurrent tokens/s | sequential tokens/s | ratio | first token, concurrent (s) | "
        "first token, sequential (s) |",
        "|---|---|---|---|---|---|",
    ]
    for n in options.levels:
        c, s = results[n, "concurrent"], results[n, "sequential"]
        ratio = statistics.median(c.tokens_per_s) / statistics.median(s.tokens_per_s)
        lines.append(
            f"| {n} | {mm(c.tokens_per_s, '.1f')} | {mm(s.tokens_per_s, '.1f')} | {ratio:.2f}x | "
            f"{mm(c.ttft_s, '.3f')} | {mm(s.ttft_s, '.3f')} |"
        )
    lines.append(
        f"\nmin / median of {options.rounds} rounds; ratio = median concurrent / median sequential; "
        f"{options.max_tokens} new tokens per request. Server memory: {mem['rss_at_most_streams_mib']} MiB resident "
        f"at {mem['streams_sampled']} streams (peak since start {mem['VmHWM']} MiB)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        options = parse(BenchOptions, sys.argv[1:] if argv is None else argv, "bench_serve.py", __doc__)
        ranks = options.tokenizer or str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken")
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp)
            make_run(run, ranks)
            server = start_server(run, options.port, run / "server.log", options.compile, options.max_batch)
            try:
                url = f"http://127.0.0.1:{options.port}"
                run_level(url, 1, 8, concurrent=False)  # warm up (or compile) the one-row path
                run_level(url, 2, 8, concurrent=True)  # and the batch's
                results, mem = measure(options, url, server.pid)
            finally:
                server.terminate()
                server.wait(30)
        print(table(options, results, mem))
        if options.json:
            data = {f"{n} {mode}": asdict(r) for (n, mode), r in results.items()}
            write_json(Path(options.json), {"results": data, "memory_mib": mem})
        return 0

    return run_command("bench_serve.py", body, "nothing was measured")


if __name__ == "__main__":
    sys.exit(main())
