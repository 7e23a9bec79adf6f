"""Dataset-preparation throughput per input format at two corpus sizes, against raw tiktoken in one thread.

    python benchmarks/bench_prepare.py [--sizes_mb 14 56] [--repeats 3] [--formats text jsonl parquet]
        [--tokenizer SPEC] [--source tinyshakespeare.txt]

Corpora: tiny Shakespeare (--source, else shared/data/tinyshakespeare.txt beside the checkout or an ancestor, else
downloaded) repeated to each size: as one text file, and its paragraphs as short records (~150 bytes of text each)
in a JSONL file ({"text": ...} per line) and in a Parquet file (the same records; skipped without pyarrow). They
are written under the system temp directory and deleted afterwards.

Each measurement is the best of --repeats runs, prepare and raw interleaved:
  prepare  the whole command, `python data/prepare.py --input FILE --out_dir DIR` in a fresh process, start-up
           included (what a user waits for), into an empty DIR; also the peak RSS of its largest process
  raw      tiktoken's encode_ordinary in one thread of this process over the same texts: each record's text, or
           the text file in pieces of about 1 MiB cut at line ends
MB/s counts text (the UTF-8 bytes tokenized; a Parquet file is compressed, a JSONL line has its JSON around the
text); "vs raw" is raw seconds over prepare seconds, the same texts in both. "per byte, large/small" is seconds per
byte at the larger size over that at the smaller: about 1 when costs grow with the corpus, below 1 as start-up is
spread wider, above 1 for a cost that grows faster than the corpus. Last, the whole command on a 100 KB text file.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
from gptlite.data.download import download  # noqa: E402
from gptlite.data.prepare.workers import default_workers  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.tokenizer import get_tokenizer  # noqa: E402

SHARED = next(
    (p / "shared" for p in ROOT.parents if (p / "shared").is_dir()), ROOT.parent / "shared"
)  # as tests/conftest.py
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
GPT2_RANKS = SHARED / "tokenizers" / "gpt2.tiktoken"
FORMATS = ("text", "jsonl", "parquet")
# runs a command in a fresh process: its wall seconds and the peak RSS of its largest process (this small process
# is the parent, so the peak is the command's own, not the benchmark's carried into a forked child)
TIMER = """import json, resource, subprocess, sys, time
start = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
seconds = time.perf_counter() - start
if r.returncode:
    sys.exit(r.stderr)
print(json.dumps({"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"""


def lines_to_size(lines: list[str], n_bytes: int) -> list[str]:
    """lines repeated (the last copy cut short) until they hold at least n_bytes of UTF-8."""
    out, size = [], 0
    while size < n_bytes:
        for line in lines:
            out.append(line)
            size += len(line.encode("utf-8"))
            if size >= n_bytes:
                break
    return out


def make_corpus(fmt: str, megabytes: float, source: str, path: Path) -> list[str]:
    """Write the corpus of one format (its file near `megabytes` MB) and return the texts raw tiktoken encodes."""
    if fmt == "text":
        text = "".join(lines_to_size(source.splitlines(keepends=True), int(megabytes * 1e6)))
        path.write_text(text, encoding="utf-8")
        pieces, start = [], 0  # about 1 MiB each, cut at line ends, as prepare reads
        while start < len(text):
            end = text.find("\n", start + (1 << 20)) + 1 or len(text)
            pieces.append(text[start:end])
            start = end
        return pieces
    paragraphs = [p + "\n" for p in source.split("\n\n") if p.strip()]
    lines = lines_to_size([json.dumps({"text": p}) + "\n" for p in paragraphs], int(megabytes * 1e6))
    texts = [paragraphs[i % len(paragraphs)] for i in range(len(lines))]  # line i holds paragraph i % n
    if fmt == "jsonl":
        path.write_text("".join(lines), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
    return texts


def run_prepare(corpus: Path, out_dir: Path, tokenizer: str) -> dict:
    """The whole command in a fresh process: wall seconds, peak RSS (MB) and the tokens it wrote."""
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [
        sys.executable,
        str(ROOT / "data" / "prepare.py"),
        "--input",
        str(corpus),
        "--tokenizer",
        tokenizer,
        "--out_dir",
        str(out_dir),
    ]
    r = subprocess.run([sys.executable, "-c", TIMER, *command], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{r.stderr}")
    result = json.loads(r.stdout)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return result | {"tokens": manifest["train_tokens"] + manifest["val_tokens"]}


def run_raw(texts: list[str], enc) -> dict:
    """tiktoken's encode_ordinary over texts in this thread: seconds and tokens."""
    start = time.perf_counter()
    tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def best(runs: list[dict]) -> dict:
    """The fastest of repeated runs (the machine may be shared; the fastest is the least disturbed)."""
    return min(runs, key=lambda r: r["seconds"])


def measure(fmt: str, megabytes: float, source: str, tmp: Path, enc, args) -> dict:
    """prepare and raw on one corpus, best of args.repeats each, interleaved so that a busy spell on a shared
    machine hits both."""
    corpus = tmp / f"corpus_{megabytes:g}mb.{'txt' if fmt == 'text' else fmt}"
    texts = make_corpus(fmt, megabytes, source, corpus)
    runs: dict[str, list[dict]] = {"prepare": [], "raw": []}
    for _ in range(args.repeats):
        runs["prepare"].append(run_prepare(corpus, tmp / "out", args.tokenizer))
        runs["raw"].append(run_raw(texts, enc))
    row = {"file_mb": corpus.stat().st_size / 1e6, "text_bytes": sum(len(t.encode("utf-8")) for t in texts)}
    corpus.unlink()
    return row | {"prepare": best(runs["prepare"]), "raw": best(runs["raw"])}


HEADER = (
    f"{'format':8} {'file MB':>8} {'text MB':>8} {'tokens':>12} {'prepare s':>10} {'MB/s':>7} {'Mtok/s':>7} "
    f"{'raw s':>7} {'raw MB/s':>9} {'vs raw':>7} {'peak RSS MB':>12}"
)


def print_row(fmt: str, row: dict) -> None:
    prep, raw, mb = row["prepare"], row["raw"], row["text_bytes"] / 1e6
    print(
        f"{fmt:8} {row['file_mb']:8.1f} {mb:8.1f} {prep['tokens']:12,} {prep['seconds']:10.2f} "
        f"{mb / prep['seconds']:7.2f} {prep['tokens'] / 1e6 / prep['seconds']:7.2f} {raw['seconds']:7.2f} "
        f"{mb / raw['seconds']:9.2f} {raw['seconds'] / prep['seconds']:6.2f}x {prep['rss_mb']:12.0f}"
    )


def per_byte_ratio(small: dict, large: dict, kind: str) -> float:
    """Seconds per text byte at the larger size over those at the smaller."""
    return (large[kind]["seconds"] / large["text_bytes"]) / (small[kind]["seconds"] / small["text_bytes"])


@dataclass
class Options:
    sizes_mb: list[float] = option(default_factory=lambda: [14.0, 56.0], help="the two corpus sizes, in MB")
    repeats: int = option(3, "runs per measurement (the fastest is reported)")
    formats: list[str] = option(default_factory=lambda: list(FORMATS), help=f"some of {', '.join(FORMATS)}")
    tokenizer: str = option(str(GPT2_RANKS) if GPT2_RANKS.is_file() else "gpt2", "the tokenizer spec")
    source: str = option(str(SHAKESPEARE), "the text to repeat")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_prepare.py", lambda: run(parse(Options, argv, "bench_prepare.py", __doc__)))


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    if len(args.sizes_mb) != 2 or any(f not in FORMATS for f in args.formats):
        raise ValueError(f"--sizes_mb takes two sizes and --formats some of {', '.join(FORMATS)}")
    args.source = Path(args.source)
    formats = list(args.formats)
    if "parquet" in formats and importlib.util.find_spec("pyarrow") is None:
        formats.remove("parquet")
        print("parquet: skipped (pyarrow is not installed: pip install -e '.[data]')")
    enc = get_tokenizer(args.tokenizer).enc
    enc.encode_ordinary("warm up: tiktoken's first call sets up its regex")
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_prepare_") as tmp:
        tmp = Path(tmp)
        source_path = args.source if args.source.is_file() else download(URL, tmp / "tinyshakespeare.txt")
        source = source_path.read_text(encoding="utf-8")
        print(
            f"corpus: {source_path.name} repeated; tokenizer {Path(args.tokenizer).name}; {default_workers()} cores; "
            f"best of {args.repeats}; load average before: {os.getloadavg()[0]:.2f}"
        )
        print("prepare: the whole command in a fresh process; raw: tiktoken encode_ordinary, one thread, same texts\n")
        print(HEADER)
        for fmt in formats:
            small, large = (measure(fmt, size, source, tmp, enc, args) for size in args.sizes_mb)
            print_row(fmt, small)
            print_row(fmt, large)
            print(
                f"{'':8} per byte, {args.sizes_mb[1]:g} MB / {args.sizes_mb[0]:g} MB: "
                f"prepare {per_byte_ratio(small, large, 'prepare'):.2f}, raw {per_byte_ratio(small, large, 'raw'):.2f}"
            )

        small_file = tmp / "small.txt"
        small_file.write_text(source[: source.rfind("\n", 0, 100_000) + 1], encoding="utf-8")
        run = best([run_prepare(small_file, tmp / "out", args.tokenizer) for _ in range(args.repeats)])
        print(
            f"\n100 KB text file: the whole command {run['seconds']:.2f} s (target <= 0.8 s), "
            f"peak RSS {run['rss_mb']:.0f} MB"
        )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
