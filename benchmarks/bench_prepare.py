"""Dataset-preparation throughput and memory: gptlite.prepare with 1 worker and with every core, against
tiktoken's raw single-thread encode (and its threaded batch encode), and peak memory at two corpus sizes.

    python benchmarks/bench_prepare.py [--scaling_mb 100] [--sizes_mb 50 500] [--repeats 2] [--tokenizer SPEC]
        [--source tinyshakespeare.txt]

The corpus is tiny Shakespeare (--source, else shared/data/tinyshakespeare.txt beside the checkout or an
ancestor, else downloaded) repeated to each size, written under the system temp directory and deleted afterwards. Every preparation
runs in a fresh Python process, so its peak RSS is its own: the main process (which imports torch through
gptlite.data), the largest worker and the sum of all, the last two sampled every 50 ms. Throughput is input MB (and tokens) over the
wall time of `prepare()`, worker start-up included. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.prepare import default_workers, download  # noqa: E402

SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared").is_dir()), ROOT.parent / "shared")  # as tests/conftest.py
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
GPT2_RANKS = SHARED / "tokenizers" / "gpt2.tiktoken"


def make_corpus(path: Path, megabytes: int, source: Path) -> Path:
    """source repeated to at least `megabytes` MB."""
    text = source.read_bytes()
    with open(path, "wb") as f:
        f.writelines(text for _ in range(-(-megabytes * 10**6 // len(text))))
    return path


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident set size (VmRSS), or its peak (VmHWM), of a process from /proc (Linux); 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """The worker processes (and multiprocessing's resource tracker) of a process. A child between fork
    and exec still maps its parent's memory, so only children already running multiprocessing count."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if b"multiprocessing" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    except OSError:
        pass
    return found


def run_one(corpus: str, out_dir: str, workers: int, tokenizer: str) -> dict:
    """One preparation in this process (called in a fresh interpreter): seconds, tokens and peak RSS."""
    from gptlite.prepare import prepare

    peak_total, peak_worker, stop = [0], [0], threading.Event()

    def sample() -> None:  # every 50 ms: the largest worker, and the sum over this process and its workers
        while not stop.is_set():
            workers_kib = [rss_kib(c) for c in children(os.getpid())]
            peak_worker[0] = max([peak_worker[0], *workers_kib])
            peak_total[0] = max(peak_total[0], rss_kib(os.getpid()) + sum(workers_kib))
            time.sleep(0.05)

    import gptlite.data  # noqa: F401  (torch: imported before the clock, as every run of prepare pays it once)

    def cpu_seconds(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, main_cpu, workers_cpu = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
    manifest = prepare([corpus], tokenizer, out_dir, workers=workers, overwrite=True, log=lambda *a: None)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return {
        "seconds": seconds,
        "main_cpu": cpu_seconds(resource.RUSAGE_SELF) - main_cpu,  # the sampler thread's share is small
        "workers_cpu": cpu_seconds(resource.RUSAGE_CHILDREN) - workers_cpu,  # the pool is joined by now
        "bytes": Path(corpus).stat().st_size,
        "tokens": manifest["train_tokens"] + manifest["val_tokens"],
        "workers": workers,
        # VmHWM, not ru_maxrss: Linux carries the pre-exec peak of the forked parent into ru_maxrss
        "main_rss_mb": rss_kib(os.getpid(), "VmHWM") / 1024,
        "worker_rss_mb": peak_worker[0] / 1024,  # sampled: RUSAGE_CHILDREN counts a child's pre-exec copy of this process
        "total_rss_mb": peak_total[0] / 1024,
    }


def prepare_in_subprocess(corpus: Path, out_dir: Path, workers: int, tokenizer: str) -> dict:
    cmd = [sys.executable, __file__, "--_run", str(corpus), str(out_dir), str(workers), tokenizer]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(r.stdout.strip().splitlines()[-1])


def raw_tiktoken(corpus: Path, tokenizer: str, megabytes: int, threads: int) -> dict:
    """tiktoken alone on the first `megabytes` MB, in 1 MiB pieces: encode_ordinary in one thread, or
    encode_ordinary_batch in `threads` threads (the threaded alternative to worker processes)."""
    from gptlite.tokenizer import get_tokenizer

    enc = get_tokenizer(tokenizer).enc
    with open(corpus, "rb") as f:
        data = f.read(megabytes * 10**6).decode("utf-8", errors="ignore")
    pieces = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    start = time.perf_counter()
    if threads == 1:
        tokens = sum(len(enc.encode_ordinary(p)) for p in pieces)
    else:
        tokens = sum(len(t) for t in enc.encode_ordinary_batch(pieces, num_threads=threads))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": len(data.encode()), "tokens": tokens}


def rates(r: dict) -> tuple[float, float]:
    return r["bytes"] / 1e6 / r["seconds"], r["tokens"] / 1e6 / r["seconds"]


def best(runs: list[dict]) -> dict:
    """The fastest of repeated runs (the machine may be shared; the fastest is the least disturbed)."""
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling_mb", type=int, default=100, help="corpus size for the 1-vs-all-cores runs")
    parser.add_argument("--sizes_mb", type=int, nargs=2, default=[50, 500], help="two corpus sizes for peak RSS")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement (the fastest is reported)")
    parser.add_argument("--tokenizer", default=str(GPT2_RANKS) if GPT2_RANKS.is_file() else "gpt2")
    parser.add_argument("--source", type=Path, default=SHAKESPEARE, help="the text to repeat")
    parser.add_argument("--_run", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._run:
        corpus, out_dir, workers, tokenizer = args._run
        print(json.dumps(run_one(corpus, out_dir, int(workers), tokenizer)))
        return

    cores = default_workers()
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_prepare_") as tmp:
        tmp = Path(tmp)
        source = args.source if args.source.is_file() else download(URL, tmp / "tinyshakespeare.txt")
        print(f"corpus: {source.name} repeated; tokenizer {Path(args.tokenizer).name}; {cores} cores; "
              f"best of {args.repeats} runs; load average before: {os.getloadavg()[0]:.2f}")

        corpus = make_corpus(tmp / f"corpus_{args.scaling_mb}mb.txt", args.scaling_mb, source)
        runs: dict[str, list[dict]] = {"raw1": [], "rawn": [], "one": [], "all": []}
        for _ in range(args.repeats):  # interleaved, so a busy spell on a shared machine hits every kind
            runs["raw1"].append(raw_tiktoken(corpus, args.tokenizer, 20, 1))
            runs["rawn"].append(raw_tiktoken(corpus, args.tokenizer, 20, cores))
            runs["one"].append(prepare_in_subprocess(corpus, tmp / "out", 1, args.tokenizer))
            runs["all"].append(prepare_in_subprocess(corpus, tmp / "out", cores, args.tokenizer))
        raw1, rawn, one, alln = (best(runs[k]) for k in ("raw1", "rawn", "one", "all"))

        print(f"\nthroughput, {args.scaling_mb} MB corpus ({one['tokens']:,} tokens)")
        print(f"{'':44} {'MB/s':>7} {'Mtok/s':>7} {'vs raw 1 thread':>16}")
        raw_mb = rates(raw1)[0]
        for name, r in [
            ("tiktoken encode_ordinary, 1 thread (20 MB)", raw1),
            (f"tiktoken encode_ordinary_batch, {cores} threads", rawn),
            ("prepare, 1 worker (in process)", one),
            (f"prepare, {cores} worker processes", alln),
        ]:
            mb, tok = rates(r)
            print(f"{name:44} {mb:7.2f} {tok:7.2f} {mb / raw_mb:15.2f}x")
        print(f"scaling 1 -> {cores} workers: {rates(alln)[0] / rates(one)[0]:.2f}x;  "
              f"per core at {cores} workers: {rates(alln)[0] / cores / raw_mb:.0%} of raw single-thread encode")
        # CPU time is what the work costs whatever else runs on the machine; wall time is what a user waits
        cpu_one, cpu_all = one["main_cpu"] + one["workers_cpu"], alln["main_cpu"] + alln["workers_cpu"]
        print(f"CPU seconds: 1 worker {cpu_one:.1f};  {cores} workers {cpu_all:.1f} (main process {alln['main_cpu']:.1f}, "
              f"workers {alln['workers_cpu']:.1f});  raw encode would take {one['bytes'] / 1e6 / raw_mb:.1f}")
        print(f"scaling bound from CPU time (every core free): {cores * cpu_one / cpu_all:.2f}x")

        print(f"\npeak memory with {cores} workers (MB)")
        print(f"{'corpus':>8} {'tokens':>13} {'seconds':>8} {'main RSS':>9} {'worker RSS':>11} {'total RSS':>10}")
        for size in args.sizes_mb:
            corpus = make_corpus(tmp / f"corpus_{size}mb.txt", size, source)
            r = prepare_in_subprocess(corpus, tmp / "out", cores, args.tokenizer)
            print(f"{size:6} MB {r['tokens']:13,} {r['seconds']:8.1f} {r['main_rss_mb']:9.0f} {r['worker_rss_mb']:11.0f} {r['total_rss_mb']:10.0f}")
            corpus.unlink()
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
