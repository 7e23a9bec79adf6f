"""Preparation's tokenizing: batches of pieces encoded in this process or in a pool of worker processes (forked on
Linux with the tokenizer already built, spawned elsewhere), in input order, with a bounded number in flight; and each
batch's tokens given to the train or val split."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gptlite.prepare.sources import Piece, piece_texts
from gptlite.tokenizer import Tokenizer, load_tokenizer

IN_FLIGHT_PER_WORKER = 2  # batches queued per worker: enough to keep it busy, few enough to bound memory
SPLITS = ("train", "val")
Job = tuple[str, object, bool, tuple]  # what a worker needs of a piece: kind, data, starts_doc, origin
Encoded = tuple[np.ndarray, np.ndarray, int]  # a piece's tokens, tokens per document, replaced byte sequences


def encode_batch(tokenizer: Tokenizer, jobs: list[Job], field: str, dtype: np.dtype) -> list[Encoded]:
    """Per piece: its tokens, how many belong to each document, and its replaced byte sequences. Every document
    (a text block only when it starts its file) starts with the end-of-text token, if the tokenizer has one."""
    encoded = []
    for kind, data, starts_doc, origin in jobs:
        texts = list(piece_texts(kind, data, origin, field))
        tokens, lengths = tokenizer.encode_documents([t for t, _ in texts], starts_doc and tokenizer.eot_id is not None)
        encoded.append((tokens.astype(dtype), lengths, sum(bad for _, bad in texts)))
    return encoded


_worker: dict = {}  # a worker process's tokenizer, text field and dtype, set once by _start_worker


_worker: dict = {}  # a worker process's tokenizer, text field and dtype, set once by _start_worker


def _start_worker(tokenizer: Tokenizer | str, field: str, dtype: str) -> None:
    # Ctrl-C and SIGTERM to the process group are the main process's to handle: it stops the pool cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a forked worker has the main process's tokenizer already; a spawned one reads it from its file (a pipe
    # write of its megabytes of ranks would stall the main process until each worker had started)
    tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _worker.update(tokenizer=tokenizer, field=field, dtype=np.dtype(dtype))


def _encode_in_worker(jobs: list[Job]) -> list[Encoded]:
    return encode_batch(_worker["tokenizer"], jobs, _worker["field"], _worker["dtype"])


def jobs(batch: list[Piece]) -> list[Job]:
    """What a worker needs of a batch."""
    return [(p.kind, p.data, p.starts_doc, p.origin) for p in batch]


def tokenize(
    batches: Iterable[list[Piece]], tokenizer: Tokenizer, tokenizer_file: Path, field: str, dtype: np.dtype,
    workers: int,
) -> Iterator[tuple[list[Piece], list[Encoded]]]:
    """(batch, its pieces encoded) in input order. With several workers, at most IN_FLIGHT_PER_WORKER batches
    per worker are queued (Pool.imap would read the whole input ahead). On Linux the workers are forked and
    start at once with this process's tokenizer; elsewhere (no safe fork) they are spawned and each loads
    tokenizer_file, which costs a few tenths of a second."""
    if workers == 1:
        for batch in batches:
            yield batch, encode_batch(tokenizer, jobs(batch), field, dtype)
        return
    fork = sys.platform == "linux"
    context = multiprocessing.get_context("fork" if fork else "spawn")
    args = (tokenizer if fork else str(tokenizer_file), field, dtype.str)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=args) as pool:
        queued: deque = deque()
        try:
            for batch in batches:
                queued.append((batch, pool.submit(_encode_in_worker, jobs(batch))))
                if len(queued) >= IN_FLIGHT_PER_WORKER * workers:
                    batch, future = queued.popleft()
                    yield batch, future.result()
            while queued:
                batch, future = queued.popleft()
                yield batch, future.result()
        finally:
            for _, future in queued:
                future.cancel()


def val_documents(first: int, count: int, val_fraction: float) -> np.ndarray:
    """Which of record documents first, ..., first + count - 1 (numbered from 0 over all sources) are val: those
    that complete another val_fraction of a document, the 10th, 20th, ... for 0.1."""
    index = np.arange(first, first + count, dtype=np.float64)
    return np.floor((index + 1) * val_fraction) > np.floor(index * val_fraction)  # int((i + 1) * f) > int(i * f)


def split_batch(
    batch: list[Piece], encoded: list[Encoded], records: int, val_fraction: float
) -> tuple[dict[str, list[np.ndarray]], int]:
    """A batch's tokens per split, in input order, and how many records it held; `records` came before it.
    Vectorized: the main process's work grows with the batches, not with the documents in them."""
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    first = records
    for piece, (tokens, lengths, _) in zip(batch, encoded):
        if piece.kind == "text":
            parts[piece.split].append(tokens)
            continue
        in_val = np.repeat(val_documents(records, len(lengths), val_fraction), lengths)  # per token
        parts["train"].append(tokens[~in_val])
        parts["val"].append(tokens[in_val])
        records += len(lengths)
    return parts, records - first


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
