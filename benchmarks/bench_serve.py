"""The server under load: tokens/s of 1, 4, 8 and 16 concurrent streams against the same requests sent one after
another, time to first token, and the server's memory, on a GPT-2-124M-shaped model with random weights; or, with
--against=transformers, the same against Hugging Face's own server, `transformers serve --continuous-batching`.

    python benchmarks/bench_serve.py                                  # levels 1,4,8,16; 3 rounds; 64 new tokens
    python benchmarks/bench_serve.py --levels 1 8 --rounds=5 --max_tokens=128 --json=serve.json
    python benchmarks/bench_serve.py --levels 1 8 16 --quantize=int8             # the server on int8 weights
    python benchmarks/bench_serve.py --against=transformers --levels 1 8 16 --rounds=3 --json=vs_transformers.json

The script saves the model as a run folder (GPT-2's shape: 12 layers, 12 heads, 768 wide, vocab 50,304, block
1,024, GELU MLP with biases) with GPT-2's tokenizer, starts `python -m gptlite.serve` on it in a process of its
own, and sends each level's requests (distinct prompts, greedy, `max_tokens` each, streamed) all at once
("concurrent") and then one after another ("sequential": the same server, one request at a time, so one row on
its single-row path). Tokens/s counts the completion tokens the server reports over the wall time of the whole
batch of requests. Time to first token is from sending a request to its first text. Levels and modes are
interleaved, round after round, because the machine may be shared: the table gives each figure's min and
median over the rounds. Memory: the server's resident set (VmRSS) sampled while the most streams run, and its peak
(VmHWM) since it started. This is a script that prints a table, not a test.

--against=transformers: the run folder is exported to Hugging Face's layout with gptlite's own exporter
(`python -m gptlite.hf export`: config.json, model.safetensors, GPT-2's vocab.json and merges.txt), and that one
directory is served by both servers, one at a time (never both at once: they would share the cores), each on the
CPU in float32, offline (HF_HUB_OFFLINE=1):

    python -m gptlite.serve --model=DIR --device=cpu --dtype=float32 --max_batch=16 ...
    python -m transformers.cli.transformers serve DIR --continuous-batching --device=cpu --dtype=float32 \
        --cb-num-blocks=64 ...

(the second is the `transformers serve` command; its requests name the model by DIR, the model it was started
with). Each round starts gptlite's server, warms it up, runs every level, stops it, then does the same with
transformers', so rounds interleave the servers. The warm-up is one request alone, then as many at once as the
most streams measured, so that neither server meets a batch of that size for the first time while timed. At each
level the n requests go all at once twice: non-streamed (the tokens/s of the table, counted from each response's
`usage`) and streamed (their first text gives the time to first token, and their tokens/s shows what streaming
costs each server).

End of text: both servers stop a completion at GPT-2's end of text (id 50,256, config.json's eos_token_id), which
a random-weight model may emit. The requests are the same for both and greedy, so both stop at the same places;
tokens/s counts the tokens each server reports, and the table says how many completions ended before max_tokens.

The KV cache: gptlite preallocates max_batch x block_size tokens. transformers' continuous batching, left to
itself, sizes its paged cache on a CPU as 60% of the machine's total RAM less its own resident set, whatever other
processes hold, and writes all of it before its first request. A user starts it that way, so transformers runs
twice in each round: first at its defaults ("transformers"), the comparison that counts, and then with as many
tokens of cache as gptlite's ("transformers, matched cache": `--cb-num-blocks` = max_batch x 1,024 / 256, its
blocks holding 256 tokens; --cb_num_blocks=N gives another count). Every server's peak memory (VmHWM) is printed
under the table, and the first line names the CPU and its extensions.

`transformers serve` needs the packages of transformers' `serving` extra (fastapi, uvicorn, openai, pydantic,
starlette, rich, accelerate), which gptlite's own extras do not install:

    pip install "transformers[serving]"     # torch is already installed; pip keeps it
"""

from __future__ import annotations

import importlib.util
import json
import math
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
from gptlite.device import machine_line  # noqa: E402
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
SERVERS = ("gptlite", "transformers", "transformers, matched cache")
# What `transformers serve` imports before it starts (transformers.utils.import_utils.is_serve_available).
SERVE_MODULES = ("transformers", "fastapi", "uvicorn", "openai", "pydantic")
SERVE_INSTALL = 'pip install "transformers[serving]"'


@dataclass
class BenchOptions:
    levels: list[int] = option(default_factory=lambda: [1, 4, 8, 16], help="concurrent streams per level")
    rounds: int = option(3, "times each level runs in each mode (interleaved)")
    max_tokens: int = option(64, "completion tokens per request")
    against: str = option(
        "sequential",
        "what the concurrent streams are measured against: the same requests one after another on the same server, "
        "or `transformers serve --continuous-batching` on the same model",
        choices=("sequential", "transformers"),
    )
    tokenizer: str = option("", "GPT-2's .tiktoken ranks file (default: ../shared/tokenizers/gpt2.tiktoken)")
    port: int = option(8765, "the server's port")
    max_batch: int = option(16, "the server's --max_batch: rows decoded together (more streams wait their turn)")
    compile: bool = option(False, "start the server with --compile (its first requests compile, before the timing)")
    quantize: str = option("", "start the server with --quantize=int8 or int4 (weight-only quantized weights)")
    cb_num_blocks: int = option(
        0,
        "--against=transformers: the matched row's --cb-num-blocks, KV cache blocks of 256 tokens (0: as many "
        "tokens as gptlite's cache, max_batch x 1,024); the first transformers row always runs at its defaults",
    )
    json: str = option("", "also write the results here")

    def __post_init__(self) -> None:
        if self.cb_num_blocks < 0:
            raise ValueError(
                f"cb_num_blocks={self.cb_num_blocks}: give a number of blocks, or 0 (as many tokens as gptlite's "
                "cache); transformers at its own size is the first row anyway"
            )


@dataclass
class Result:
    tokens_per_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # the median over a run's requests, per run (streamed runs)
    short: list[int] = field(default_factory=list)  # completions that ended before max_tokens, per run


def make_run(folder: Path, tokenizer: str) -> None:
    torch.manual_seed(0)
    cfg = build_config(dict(GPT2_SHAPE))
    save_checkpoint(folder / "ckpt.pt", {"config": config_to_dict(cfg), "model": GPT(cfg.model).state_dict()})
    get_tokenizer(tokenizer).save(folder / "tokenizer.json")


def export_hf(run: Path, hf_dir: Path) -> None:
    """The run folder in Hugging Face's layout, written by `python -m gptlite.hf export` as a user would."""
    cmd = [sys.executable, "-m", "gptlite.hf", "export", f"--model={run}", f"--out={hf_dir}"]
    done = subprocess.run(cmd, env=server_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the export failed:\n{done.stdout}{done.stderr}")


def check_transformers_serve() -> None:
    """`transformers serve`'s packages are installed, or one line that says how to install them."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"--against=transformers needs transformers serve's packages ({', '.join(missing)} missing): "
            f"{SERVE_INSTALL}"
        )


def prompt(i: int) -> str:
    """A distinct prompt of a dozen words."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12))


def one_request(
    client: httpx.Client, url: str, model: str, i: int, max_tokens: int, stream: bool = True
) -> tuple[int, float]:
    """(completion tokens, seconds to the first text) of one greedy request; the time is NaN when not streamed."""
    body = {"model": model, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    start, first, tokens = time.perf_counter(), None, 0
    if not stream:
        r = client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], float("nan")
    body["stream_options"] = {"include_usage": True}  # transformers sends usage anyway, and logs that it ignores this
    with client.stream("POST", url + "/v1/completions", json=body) as r:
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


def run_level(
    url: str, model: str, n: int, max_tokens: int, concurrent: bool, stream: bool = True
) -> tuple[float, float, int]:
    """(tokens/s, median time to first token, completions shorter than max_tokens) of n requests, all at once or
    one after another. One client, made before the clock starts, sends them all over its pool of connections, as a
    load generator does: an httpx client of its own per request would build an SSL context each time (tens of
    milliseconds of this machine's two cores, taken from the server while the requests arrive)."""
    workers = n if concurrent else 1  # one worker sends them one after another
    with (
        httpx.Client(timeout=600, limits=httpx.Limits(max_connections=n)) as client,
        ThreadPoolExecutor(workers) as pool,
    ):
        start = time.perf_counter()
        results = list(pool.map(lambda i: one_request(client, url, model, i, max_tokens, stream), range(n)))
        seconds = time.perf_counter() - start
    short = sum(t < max_tokens for t, _ in results)
    return sum(t for t, _ in results) / seconds, statistics.median(f for _, f in results), short


def memory(pid: int) -> dict[str, int]:
    """The process's VmRSS and VmHWM, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}


def server_env() -> dict[str, str]:
    """The environment of the processes the script starts: this checkout's gptlite, and no network for Hugging
    Face's libraries (everything they load is on disk)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # wheels carried beside it
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def gptlite_command(source: str, options: BenchOptions, *extra: str) -> list[str]:
    """`python -m gptlite.serve` on `source` (--model=RUN or --model=DIR), its model named "bench"."""
    return [
        sys.executable,
        "-m",
        "gptlite.serve",
        source,
        "--model_name=bench",
        f"--port={options.port}",
        f"--max_batch={options.max_batch}",
        "--log_level=warning",
        f"--compile={options.compile}",
        *([f"--quantize={options.quantize}"] if options.quantize else []),
        *extra,
    ]


def transformers_command(hf_dir: Path, port: int, num_blocks: int) -> list[str]:
    """`transformers serve DIR --continuous-batching` on the CPU in float32, its KV cache `num_blocks` blocks of 256
    tokens (-1: its own size); DIR is loaded at start, and requests must name it as their model."""
    blocks = [f"--cb-num-blocks={num_blocks}"] if num_blocks > 0 else []
    return [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(hf_dir),
        "--continuous-batching",
        "--device=cpu",
        "--dtype=float32",
        "--host=127.0.0.1",
        f"--port={port}",
        "--log-level=warning",
        *blocks,
    ]


def transformers_blocks(options: BenchOptions) -> int:
    """transformers' KV cache in blocks of 256 tokens: options.cb_num_blocks, or (0) as many tokens as gptlite's."""
    return options.cb_num_blocks or math.ceil(options.max_batch * GPT2_SHAPE["block_size"] / 256)


def start_server(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """The server of `cmd` once it answers GET /v1/models (both servers load their model before they listen)."""
    server = subprocess.Popen(cmd, env=server_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return server
        except httpx.HTTPError:
            if server.poll() is not None or time.time() > deadline:
                stop_server(server)
                raise RuntimeError(f"the server did not start:\n{log.read_text()}") from None
            time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(30)


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
                tps, ttft, short = run_level(url, "bench", n, options.max_tokens, mode == "concurrent")
                done.set()
                if sampler:
                    sampler.join()
                results[n, mode].tokens_per_s.append(tps)
                results[n, mode].ttft_s.append(ttft)
                results[n, mode].short.append(short)
                print(f"round {r + 1}: {n:2d} {mode:10s} {tps:7.1f} tokens/s, first token {ttft:.3f} s", flush=True)
    return results, {"streams_sampled": most, "rss_at_most_streams_mib": max(rss, default=0), **memory(pid)}


def sample_rss(pid: int, out: list[int], done: threading.Event) -> None:
    while not done.wait(0.1):
        out.append(memory(pid)["VmRSS"])


def measure_against_transformers(options: BenchOptions, hf_dir: Path, logs: Path) -> tuple[dict, dict]:
    """Round after round, each server in turn started, warmed up, run through every level (non-streamed, then
    streamed) and stopped: {(server, streams, streamed): Result}, and each server's peak memory (MiB)."""
    results = {(s, n, streamed): Result() for s in SERVERS for n in options.levels for streamed in (False, True)}
    peak = dict.fromkeys(SERVERS, 0)
    url = f"http://127.0.0.1:{options.port}"
    for r in range(options.rounds):
        for name in SERVERS:
            if name == "gptlite":
                cmd = gptlite_command(f"--model={hf_dir}", options, "--device=cpu", "--dtype=float32")
                model = "bench"
            else:
                blocks = transformers_blocks(options) if name == "transformers, matched cache" else -1
                cmd = transformers_command(hf_dir, options.port, blocks)
                model = str(hf_dir)
            started = time.perf_counter()
            server = start_server(cmd, options.port, logs / f"{name}.log")
            try:
                # The first greedy request also starts transformers' continuous batching, whose sampling settings
                # are those of its first request: greedy, as every request here. Then the largest batch, once.
                run_level(url, model, 1, 8, concurrent=False, stream=False)
                run_level(url, model, max(options.levels), 8, concurrent=True)
                print(f"round {r + 1}: {name} ready after {time.perf_counter() - started:.1f} s", flush=True)
                for n in options.levels:
                    for streamed in (False, True):
                        tps, ttft, short = run_level(url, model, n, options.max_tokens, True, streamed)
                        result = results[name, n, streamed]
                        result.tokens_per_s.append(tps)
                        result.short.append(short)
                        if streamed:
                            result.ttft_s.append(ttft)
                        first = f", first token {ttft:.3f} s" if streamed else ""
                        print(
                            f"round {r + 1}: {name:12s} {n:2d} {'streamed' if streamed else 'plain':8s} "
                            f"{tps:7.1f} tokens/s{first}" + (f", {short} ended early" if short else ""),
                            flush=True,
                        )
                peak[name] = max(peak[name], memory(server.pid)["VmHWM"])
            finally:
                stop_server(server)
    return results, peak


def mm(xs: list[float], fmt: str) -> str:
    """min / median of xs."""
    return f"{format(min(xs), fmt)} / {format(statistics.median(xs), fmt)}"


def table(options: BenchOptions, results: dict, mem: dict) -> str:
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


def table_against_transformers(options: BenchOptions, results: dict, peak: dict) -> str:
    peers = SERVERS[1:]
    lines = [
        "| streams | server | tokens/s | gptlite / this | streamed tokens/s | first token (s) |",
        "|---|---|---|---|---|---|",
    ]
    for n in options.levels:
        ours = statistics.median(results["gptlite", n, False].tokens_per_s)
        for name in SERVERS:
            plain = results[name, n, False]
            streamed = results[name, n, True]
            ratio = "" if name == "gptlite" else f"**{ours / statistics.median(plain.tokens_per_s):.2f}x**"
            lines.append(
                f"| {n} | {name} | {spread(plain.tokens_per_s, '.1f')} | {ratio} | "
                f"{spread(streamed.tokens_per_s, '.1f')} | {spread(streamed.ttft_s, '.3f')} |"
            )
    short = {s: sum(sum(r.short) for (name, _, _), r in results.items() if name == s) for s in SERVERS}
    total = 2 * options.rounds * sum(options.levels)
    ended = ", ".join(f"{s} {short[s]}" for s in SERVERS)
    memory_line = ", ".join(f"{s} {peak[s]} MiB" for s in SERVERS)
    lines.append(
        f"\nmedian (min-max) of {options.rounds} rounds, each server started afresh in each; gptlite / this = median "
        f"gptlite / median of the row, non-streamed; {options.max_tokens} new tokens per request, greedy, the same "
        f"requests to every server; time to first token from the streamed runs. Completions that ended at end of "
        f"text before max_tokens (tokens/s counts the tokens each server reported): {ended}, of {total} each. KV "
        f"cache: gptlite {options.max_batch} x {GPT2_SHAPE['block_size']} tokens; {peers[0]} at its defaults; "
        f"{peers[1]} {transformers_blocks(options)} blocks of 256 tokens. Peak memory (VmHWM): {memory_line}."
    )
    return "\n".join(lines)


def spread(xs: list[float], fmt: str) -> str:
    """median (min-max) of xs."""
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def against_transformers(options: BenchOptions, ranks: str) -> int:
    check_transformers_serve()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        hf_dir = Path(tmp) / "hf"
        make_run(run, ranks)
        export_hf(run, hf_dir)
        results, peak = measure_against_transformers(options, hf_dir, Path(tmp))
    print(table_against_transformers(options, results, peak))
    if options.json:
        data = {f"{s} {n} {'streamed' if streamed else 'plain'}": asdict(r) for (s, n, streamed), r in results.items()}
        write_json(
            Path(options.json),
            {
                "against": "transformers",
                "options": asdict(options),
                "transformers_cache_blocks": transformers_blocks(options),
                "results": data,
                "peak_memory_mib": peak,
            },
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        options = parse(BenchOptions, sys.argv[1:] if argv is None else argv, "bench_serve.py", __doc__)
        print(machine_line(), flush=True)
        ranks = options.tokenizer or str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken")
        if options.against == "transformers":
            return against_transformers(options, ranks)
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp)
            make_run(run, ranks)
            server = start_server(gptlite_command(f"--model={run}", options), options.port, run / "server.log")
            try:
                url = f"http://127.0.0.1:{options.port}"
                run_level(url, "bench", 1, 8, concurrent=False)  # warm up (or compile) the one-row path
                run_level(url, "bench", 2, 8, concurrent=True)  # and the batch's
                results, mem = measure(options, url, server.pid)
            finally:
                stop_server(server)
        print(table(options, results, mem))
        if options.json:
            data = {f"{n} {mode}": asdict(r) for (n, mode), r in results.items()}
            write_json(Path(options.json), {"results": data, "memory_mib": mem})
        return 0

    return run_command("bench_serve.py", body, "nothing was measured")


if __name__ == "__main__":
    sys.exit(main())
