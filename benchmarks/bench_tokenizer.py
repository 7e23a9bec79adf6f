"""Your own tokenizer, measured: training time and peak memory against nanochat's rustbpe (pip install rustbpe) on
the same file, each a whole command in a fresh process, in turn; bytes per token on held-out text against GPT-2's;
data preparation with a trained tokenizer against raw one-thread encoding of the same text.

    python benchmarks/bench_tokenizer.py [--corpus=FILE] [--vocab_sizes 8192 32768] [--repeats=3]

The default corpus is about 20 MB of Python's standard-library source, the last 10% held out; tiny Shakespeare
(../shared or --shakespeare) is the second held-out test. A script that prints tables, not a test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.tokenizer import get_tokenizer, load_tokenizer  # noqa: E402

RUSTBPE = """import sys, rustbpe
text = open(sys.argv[1], encoding="utf-8").read()
tok = rustbpe.Tokenizer()
tok.train_from_iterator((text[i:i + (1 << 20)] for i in range(0, len(text), 1 << 20)), int(sys.argv[2]))
"""


@dataclass
class Options:
    corpus: str = option("", "the training text (default: ~20 MB of Python's standard-library source)")
    shakespeare: str = option(str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "tiny Shakespeare")
    gpt2: str = option(str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"), "GPT-2's ranks, or gpt2")
    vocab_sizes: list[int] = option(default_factory=lambda: [8192, 32768], help="the vocabularies to train")
    repeats: int = option(3, "timed runs of each trainer, in turn (min and median are shown)")


def stdlib_corpus(path: Path, size: int = 20_000_000) -> None:
    """About `size` bytes of Python's standard library, file after file in name order."""
    root, n = Path(sysconfig.get_paths()["stdlib"]), 0
    with open(path, "w", encoding="utf-8") as out:
        for p in sorted(root.rglob("*.py")):
            if "site-packages" in p.parts or n > size:
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(text + "\n")
            n += len(text.encode())


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of a command in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({status})")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def split(path: Path, tmp: Path, name: str) -> tuple[Path, str]:
    """The first 90% of a text as a training file, the rest as held-out text."""
    text = path.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1
    (tmp / f"{name}_train.txt").write_text(text[:cut], encoding="utf-8")
    return tmp / f"{name}_train.txt", text[cut:]


def train_command(corpus: Path, vocab: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gptlite.tokenizer",
        "train",
        "--input",
        str(corpus),
        f"--vocab_size={vocab}",
        f"--out_dir={out}",
        "--overwrite",
    ]


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_tokenizer_") as tmp:
        tmp = Path(tmp)
        corpus = Path(args.corpus) if args.corpus else tmp / "stdlib.txt"
        if not args.corpus:
            stdlib_corpus(corpus)
        print(f"corpus {corpus.name}: {corpus.stat().st_size / 1e6:.1f} MB; {args.repeats} runs each, in turn\n")
        print(f"{'trainer':10} {'vocab':>6} {'min s':>7} {'median s':>9} {'peak MB':>8}")
        for vocab in args.vocab_sizes[:1]:
            times = {"gptlite": [], "rustbpe": []}
            for _ in range(args.repeats):
                times["gptlite"].append(timed(train_command(corpus, vocab, tmp / "tok")))
                times["rustbpe"].append(timed([sys.executable, "-c", RUSTBPE, str(corpus), str(vocab)]))
            for name, runs in times.items():
                walls = sorted(t for t, _ in runs)
                print(
                    f"{name:10} {vocab:>6} {walls[0]:7.2f} {walls[len(walls) // 2]:9.2f} {max(m for _, m in runs):8.0f}"
                )
        gpt2 = get_tokenizer(args.gpt2)
        print(
            f"\nbytes per token on held-out text (train on the first 90%)\n{'text':18} {'GPT-2':>6}"
            + "".join(f" {v:>13}" for v in args.vocab_sizes)
        )
        for name, path in (("Python source", corpus), ("tiny Shakespeare", Path(args.shakespeare))):
            train_file, held = split(path, tmp, name.split()[0])
            row = f"{name:18} {len(held.encode()) / len(gpt2.encode(held)):6.2f}"
            for vocab in args.vocab_sizes:
                subprocess.run(
                    train_command(train_file, vocab, tmp / f"{name[0]}{vocab}"), check=True, capture_output=True
                )
                tok = load_tokenizer(tmp / f"{name[0]}{vocab}")
                row += f" {len(held.encode()) / len(tok.encode(held)):6.2f} ({tok.vocab_size:>5})"
            print(row)
        prepare_against_raw(corpus, tmp / f"P{args.vocab_sizes[-1]}", tmp)
    return 0


def prepare_against_raw(corpus: Path, tokenizer: Path, tmp: Path) -> None:
    """data/prepare.py (the whole command) against one thread encoding the same text with the same tokenizer."""
    tok = load_tokenizer(tokenizer)
    text = corpus.read_text(encoding="utf-8")
    start = time.perf_counter()
    for i in range(0, len(text), 1 << 20):
        tok.encode(text[i : i + (1 << 20)])
    raw = time.perf_counter() - start
    wall, _ = timed(
        [
            sys.executable,
            str(ROOT / "data" / "prepare.py"),
            "--input",
            str(corpus),
            "--tokenizer",
            str(tokenizer),
            f"--out_dir={tmp / 'prepared'}",
        ]
    )
    print(
        f"\ndata/prepare.py with the trained {tok.vocab_size:,}-id tokenizer: {wall:.2f} s; raw one-thread encoding "
        f"({'tiktoken path' if tok.fast else 'tokenizers'}): {raw:.2f} s; prepare is {raw / wall:.2f}x raw"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_tokenizer.py", lambda: run(parse(Options, argv, "bench_tokenizer.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
