"""Dataset preparation: stream text inputs, tokenize them in parallel, write train/val token shards.

Each input file is one document. With a tokenizer that has an end-of-text token, every document is
prefixed by it (llm.c and modded-nanogpt's convention), so documents are always separated. The last
`val_fraction` of the input bytes (in input order) becomes the validation split. Files are read in
blocks cut at line ends, so a 10 GB corpus never sits in RAM; blocks are encoded by tiktoken's
threaded batch encoder. A `manifest.json` written last marks the output complete: a re-run with the
same inputs and tokenizer returns at once.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gptlite.data import UINT16_VOCAB, write_shard
from gptlite.tokenizer import get_tokenizer

BLOCK_BYTES = 1 << 20  # text is read and tokenized in blocks of about 1 MiB
BATCH_BLOCKS = 16  # blocks per tiktoken batch call, encoded in parallel threads
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"


def download(url: str, dest: Path) -> Path:
    """Download url to dest (atomically) unless it is already there."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConnectionError(f"could not download {url} ({e}); download it elsewhere and pass the local file instead") from None
    os.replace(tmp, dest)
    return dest


def resolve_inputs(inputs: list[str], download_dir: Path) -> list[Path]:
    """Expand files, directories (every file inside, recursively, sorted), globs and URLs into files."""
    files: list[Path] = []
    for spec in inputs:
        if spec.startswith(("http://", "https://")):
            files.append(download(spec, download_dir / (spec.rstrip("/").rsplit("/", 1)[-1] or "download.txt")))
        elif os.path.isdir(spec):
            found = sorted(p for p in Path(spec).rglob("*") if p.is_file() and not p.name.startswith("."))
            if not found:
                raise FileNotFoundError(f"input directory {spec} holds no files")
            files += found
        elif os.path.isfile(spec):
            files.append(Path(spec))
        else:
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"input {spec} is not a file, directory, glob with matches, or URL")
            files += found
    return files


def is_continuation(byte: int) -> bool:
    """True for the 2nd..4th bytes of a UTF-8 character (0b10xxxxxx)."""
    return (byte & 0xC0) == 0x80


def last_char_start(buf: bytes) -> int:
    """Index where the last UTF-8 character of buf starts (a cut there splits no character)."""
    i = len(buf) - 1
    while i > 0 and is_continuation(buf[i]):
        i -= 1
    return i or len(buf)


def read_blocks(files: list[Path], boundary: int) -> Iterator[tuple[str, str, bool, int]]:
    """Yield (split, text, starts_document, n_bytes) blocks. The split changes from train to val at byte
    `boundary` of the concatenated inputs (moved to the next UTF-8 character boundary); blocks otherwise
    end at a line end."""
    seen = 0
    for path in files:
        with open(path, "rb") as f:
            first, carry = True, b""
            while True:
                data = f.read(BLOCK_BYTES)
                buf = carry + data
                if not buf:
                    break
                cut = len(buf) if not data else buf.rfind(b"\n") + 1 or last_char_start(buf)
                if seen < boundary < seen + cut:  # the train/val split falls inside this block
                    cut = boundary - seen
                    while cut < len(buf) and is_continuation(buf[cut]):  # never split a character
                        cut += 1
                block, carry = buf[:cut], buf[cut:]
                split = "train" if seen < boundary else "val"
                seen += len(block)
                if block:
                    yield split, block.decode("utf-8", errors="replace"), first, len(block)
                    first = False
                if not data and not carry:
                    break


class ShardWriter:
    """Collects tokens of one split and writes `{split}_{i:06d}.bin` shards of shard_tokens tokens."""

    def __init__(self, out_dir: Path, split: str, vocab_size: int, shard_tokens: int):
        self.out_dir, self.split, self.vocab_size = out_dir, split, vocab_size
        dtype = np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.fill, self.shards, self.tokens = 0, [], 0

    def add(self, tokens: list[int]) -> None:
        arr = np.asarray(tokens, dtype=self.buf.dtype)
        while len(arr):
            n = min(len(arr), len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + n] = arr[:n]
            self.fill, arr = self.fill + n, arr[n:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self) -> None:
        if self.fill:
            path = self.out_dir / f"{self.split}_{len(self.shards):06d}.bin"
            write_shard(path, self.buf[: self.fill], self.vocab_size)
            self.shards.append({"file": path.name, "tokens": int(self.fill)})
            self.tokens += self.fill
            self.fill = 0


def prepare(
    inputs: list[str],
    tokenizer_spec: str,
    out_dir: str | Path,
    val_fraction: float = 0.1,
    shard_tokens: int = 100_000_000,
    overwrite: bool = False,
    log=print,
) -> dict:
    """Tokenize inputs into out_dir/{train,val}_*.bin plus tokenizer.json; returns the manifest."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    out_dir = Path(out_dir)
    files = resolve_inputs(inputs, out_dir / "downloads")
    sources = [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime": p.stat().st_mtime} for p in files]
    settings = {"sources": sources, "tokenizer": tokenizer_spec, "val_fraction": val_fraction, "shard_tokens": shard_tokens}
    manifest_path = out_dir / MANIFEST
    if manifest_path.is_file() and not overwrite:
        old = json.loads(manifest_path.read_text())
        if {k: old.get(k) for k in settings} == settings and all((out_dir / s["file"]).is_file() for s in old["shards"]):
            log(f"{out_dir} is already prepared from these inputs ({old['train_tokens']:,} train, {old['val_tokens']:,} val tokens); nothing to do")
            return old
    total = sum(s["bytes"] for s in sources)
    if total == 0:
        raise ValueError(f"the inputs ({', '.join(inputs)}) are empty; there is no text to tokenize")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [manifest_path, *out_dir.glob("train_*.bin"), *out_dir.glob("val_*.bin")]:
        stale.unlink(missing_ok=True)

    boundary = int(total * (1.0 - val_fraction))  # as nanoGPT: the first 90% trains
    if tokenizer_spec == "char":  # the vocabulary is every character of the corpus: one extra pass
        tokenizer = get_tokenizer("char", (text for _, text, _, _ in read_blocks(files, boundary)))
    else:
        tokenizer = get_tokenizer(tokenizer_spec)
    writers = {s: ShardWriter(out_dir, s, tokenizer.vocab_size, shard_tokens) for s in ("train", "val")}
    log(f"tokenizing {len(files)} file(s), {total / 1e6:.1f} MB, with {tokenizer_spec} (vocab {tokenizer.vocab_size:,}) into {out_dir}")

    start, done = time.perf_counter(), 0
    batch: list[tuple[str, str, bool, int]] = []

    def encode_batch() -> None:
        nonlocal done
        for (split, _, starts_doc, n_bytes), tokens in zip(batch, tokenizer.encode_batch([b[1] for b in batch])):
            if starts_doc and tokenizer.eot_id is not None:
                writers[split].add([tokenizer.eot_id])
            writers[split].add(tokens)
            done += n_bytes
        batch.clear()
        rate = done / 1e6 / max(1e-9, time.perf_counter() - start)
        print(f"\r  {done / 1e6:8.1f} / {total / 1e6:.1f} MB | {rate:6.1f} MB/s", end="", file=sys.stderr, flush=True)

    for item in read_blocks(files, boundary):
        batch.append(item)
        if len(batch) == BATCH_BLOCKS:
            encode_batch()
    encode_batch()
    print(file=sys.stderr)
    for w in writers.values():
        w.flush()
    if not writers["val"].tokens or not writers["train"].tokens:
        raise ValueError(f"the corpus is too small to split with val_fraction={val_fraction}; add text or change it")

    tokenizer.save(out_dir / TOKENIZER_FILE)
    manifest = {
        **settings,
        "vocab_size": tokenizer.vocab_size,
        "shards": writers["train"].shards + writers["val"].shards,
        "train_tokens": writers["train"].tokens,
        "val_tokens": writers["val"].tokens,
    }
    tmp = manifest_path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)
    log(f"wrote {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} val tokens in {time.perf_counter() - start:.1f}s")
    return manifest

