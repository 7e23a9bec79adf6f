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
from typing import NamedTuple

import numpy as np

from gptlite.data.prepare.sources import Piece, piece_records, piece_texts
from gptlite.data.shards import START, TARGET
from gptlite.tokenizer import Tokenizer, load_tokenizer
from gptlite.tokenizer.chat import check_messages

IN_FLIGHT_PER_WORKER = 2  # batches queued per worker: enough to keep it busy, few enough to bound memory
SPLITS = ("train", "val")
Job = tuple[str, object, bool, tuple]  # what a worker needs of a piece: kind, data, starts_doc, origin


class Encoded(NamedTuple):
    """A piece, tokenized."""

    tokens: np.ndarray
    lengths: np.ndarray  # tokens per record (0 for a conversation left out)
    replaced: int  # undecodable byte sequences replaced by U+FFFD
    roles: np.ndarray | None = None  # a conversation's roles per token (see gptlite.data.shards.ROLES_MAGIC)
    counts: dict | None = None  # conversations kept, cut, and left out (too long, no assistant turn)


def encode_batch(
    tokenizer: Tokenizer, jobs: list[Job], field: str, dtype: np.dtype, chat: dict | None = None
) -> list[Encoded]:
    """Per piece: its tokens, how many belong to each document, and its replaced byte sequences. Every document
    (a text block only when it starts its file) starts with the end-of-text token, if the tokenizer has one. With
    `chat` ({"block_size", "too_long"}) the records are conversations (see encode_conversations)."""
    encoded = []
    for kind, data, starts_doc, origin in jobs:
        if chat is not None:
            encoded.append(encode_conversations(tokenizer, piece_records(kind, data, origin, field), chat, dtype))
            continue
        texts = list(piece_texts(kind, data, origin, field))
        tokens, lengths = tokenizer.encode_documents([t for t, _ in texts], starts_doc and tokenizer.eot_id is not None)
        encoded.append(Encoded(tokens.astype(dtype), lengths, sum(bad for _, bad in texts)))
    return encoded


def encode_conversations(tokenizer: Tokenizer, records, chat: dict, dtype: np.dtype) -> Encoded:
    """Each record's messages rendered with the tokenizer's chat template; roles mark the first token (START) and
    the assistant's turns (TARGET). A conversation longer than block_size + 1 tokens is cut to it or left out
    (chat["too_long"]); one with nothing to learn (no assistant turn, or none left after the cut) is left out."""
    limit = chat["block_size"] + 1 if chat["block_size"] else None
    counts = {"kept": 0, "cut": 0, "too_long": 0, "no_assistant": 0}
    tokens, roles, lengths = [], [], []
    for messages, where in records:
        ids, targets = tokenizer.chat_targets(check_messages(messages, where()))
        cut = bool(limit) and len(ids) > limit
        if cut and chat["too_long"] == "drop":
            counts["too_long"] += 1
            lengths.append(0)
            continue
        ids, targets = (ids[:limit], targets[:limit]) if cut else (ids, targets)
        if not any(targets[1:]):  # nothing to learn (the first token is never predicted)
            counts["no_assistant"] += 1
            lengths.append(0)
            continue
        counts["kept"] += 1
        counts["cut"] += cut
        tokens.append(np.array(ids, dtype=dtype))
        roles.append(
            np.array([START, *([0] * (len(ids) - 1))], dtype=np.uint8) | np.array(targets, dtype=np.uint8) * TARGET
        )
        lengths.append(len(ids))
    join = lambda parts, t: np.concatenate(parts) if parts else np.empty(0, dtype=t)  # noqa: E731
    return Encoded(join(tokens, dtype), np.array(lengths, dtype=np.int64), 0, join(roles, np.uint8), counts)


_worker: dict = {}  # a worker process's tokenizer, text field and dtype, set once by _start_worker


def _start_worker(tokenizer: Tokenizer | str, field: str, dtype: str, chat: dict | None) -> None:
    # Ctrl-C and SIGTERM to the process group are the main process's to handle: it stops the pool cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a forked worker has the main process's tokenizer already; a spawned one reads it from its file (a pipe
    # write of its megabytes of ranks would stall the main process until each worker had started)
    tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _worker.update(tokenizer=tokenizer, field=field, dtype=np.dtype(dtype), chat=chat)


def _encode_in_worker(jobs: list[Job]) -> list[Encoded]:
    return encode_batch(_worker["tokenizer"], jobs, _worker["field"], _worker["dtype"], _worker["chat"])


def jobs(batch: list[Piece]) -> list[Job]:
    """What a worker needs of a batch."""
    return [(p.kind, p.data, p.starts_doc, p.origin) for p in batch]


def tokenize(
    batches: Iterable[list[Piece]],
    tokenizer: Tokenizer,
    tokenizer_file: Path,
    field: str,
    dtype: np.dtype,
    workers: int,
    chat: dict | None = None,
) -> Iterator[tuple[list[Piece], list[Encoded]]]:
    """(batch, its pieces encoded) in input order. With several workers, at most IN_FLIGHT_PER_WORKER batches
    per worker are queued (Pool.imap would read the whole input ahead). On Linux the workers are forked and
    start at once with this process's tokenizer; elsewhere (no safe fork) they are spawned and each loads
    tokenizer_file, which costs a few tenths of a second."""
    if workers == 1:
        for batch in batches:
            yield batch, encode_batch(tokenizer, jobs(batch), field, dtype, chat)
        return
    fork = sys.platform == "linux"
    context = multiprocessing.get_context("fork" if fork else "spawn")
    args = (tokenizer if fork else str(tokenizer_file), field, dtype.str, chat)
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
) -> tuple[dict[str, list[np.ndarray]], dict[str, list[np.ndarray]], int]:
    """A batch's tokens and roles (conversations only) per split, in input order, and how many records it held;
    `records` came before it. Vectorized: the main process's work grows with the batches, not with the documents."""
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    roles: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    first = records
    for piece, e in zip(batch, encoded, strict=True):
        if piece.kind == "text":
            parts[piece.split].append(e.tokens)
            continue
        in_val = np.repeat(val_documents(records, len(e.lengths), val_fraction), e.lengths)  # per token
        parts["train"].append(e.tokens[~in_val])
        parts["val"].append(e.tokens[in_val])
        if e.roles is not None:
            roles["train"].append(e.roles[~in_val])
            roles["val"].append(e.roles[in_val])
        records += len(e.lengths)
    return parts, roles, records - first


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
