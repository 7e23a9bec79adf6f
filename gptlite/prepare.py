"""Dataset preparation: stream documents from text, JSONL, Parquet or Hugging Face inputs, tokenize them in
parallel worker processes, and write train/val token shards that survive interruption.

Documents. A text file is one document; a JSONL line, a Parquet row or a Hugging Face record is one document
(its `text_field`). With a tokenizer that has an end-of-text token, every document starts with it, as in
llm.c and modded-nanogpt: documents are always separated, and a window that starts at a document sees the
delimiter first. Undecodable bytes become U+FFFD and are counted; they never stop a run.

Validation split. Text files: the last `val_fraction` of their bytes, in input order (nanoGPT's split: tiny
Shakespeare at char level gives 1,003,854 train and 111,540 val tokens). Records: every (1 / val_fraction)-th
document (the 10th, 20th, ... for 0.1), because a stream's length is not known in advance, and interleaving
draws val from the same mix as train.

Pipeline. The main process only cuts the inputs into pieces of about 1 MiB, neither decoding nor parsing them:
text in blocks cut at line ends, JSONL in blocks of whole lines, Parquet and Hugging Face records as Arrow arrays of
their text column. It hands them in batches to `workers` processes (forked on Linux, with the tokenizer already
built; spawned elsewhere, each loading tokenizer.json), at most two batches per worker in flight, which decode,
parse and tokenize (a piece's records in one call into tiktoken, see Tokenizer.encode_documents): the
main process's work grows with the batches, not with the documents in them, so it never holds the workers back,
however short the records. Tokens come back in input order with each record's token count; the main process gives
records to train or val by their index and appends the tokens to the open shard file of their split, so memory is
bounded by the batches in flight, whatever the corpus or shard size.

Interruption. A shard is written as `{split}_{i:06d}.bin.tmp` and takes its final name when full; after
every batch `progress.json` records the input position, the finished shards and the tokens of the open
ones. Running the same command again continues from there and writes the same files as an uninterrupted
run; `overwrite=True` starts afresh. `manifest.json`, written last, records the sources, tokenizer, shards,
token counts and sha256 checksums; while it matches, a re-run returns at once.

Nothing here imports torch (the shard format is `gptlite.shards`, numpy only): the command and any spawned
workers, which import this module, start in a fraction of a second (the `datasets` package, for Hugging Face
input, imports torch itself where it is installed).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import json
import math
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gptlite.files import make_dir
from gptlite.shards import FORMATS, HEADER_BYTES, HEADER_INTS, MANIFEST, PROGRESS, file_sha256, read_shard
from gptlite.tokenizer import Tokenizer, get_tokenizer, load_tokenizer

BLOCK_BYTES = 1 << 20  # inputs are read in blocks of about 1 MiB (text, whole JSONL lines, Parquet/HF rows)
BATCH_BLOCKS = 1  # a batch for one worker holds at most this many blocks' worth (small: the last batches end together)
WORKER_BATCHES = 4  # a worker costs a few tenths of a second to start: one per this many batches of input at most
IN_FLIGHT_PER_WORKER = 2  # batches queued per worker: enough to keep it busy, few enough to bound memory
SHARD_TOKENS = 100_000_000
TOKENIZER_FILE = "tokenizer.json"
RECORD_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}  # any other file is text
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------------------------
# inputs


def download(url: str, dest: Path) -> Path:
    """Download url to dest (atomically) unless it is already there."""
    import urllib.request  # here, not at the top: every spawned worker imports this module

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


def file_source(path: Path) -> dict:
    """A local input as the manifest records it: path, format, size and mtime (a change means prepare again)."""
    stat = path.stat()
    fmt = RECORD_FORMATS.get(path.suffix.lower(), "text")
    return {"path": str(path.resolve()), "format": fmt, "bytes": stat.st_size, "mtime": stat.st_mtime}


def resolve_sources(
    inputs: list[str], download_dir: Path, hf_dataset: str | None, hf_name: str | None, hf_split: str
) -> list[dict]:
    """The inputs as sources: local files, or one Hugging Face dataset (whose data_files are the inputs)."""
    files = [file_source(p) for p in resolve_inputs(inputs, download_dir)]
    if hf_dataset is None:
        return files
    source = {"format": "hf", "dataset": hf_dataset, "name": hf_name, "split": hf_split}
    return [{**source, "data_files": files} if files else source]


def open_input(path: str | Path):
    """Open an input file for binary reading; failure names the file."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise type(e)(f"cannot read input {path} ({e.strerror or e}); check that it is a readable file") from None


def optional_import(module: str, what: str):
    """Import a module of the `data` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs the {module.split('.')[0]} package: pip install -e '.[data]'") from None


# ---------------------------------------------------------------------------------------------------------
# reading: the main process only cuts the inputs into pieces, each with the position just after it; decoding,
# parsing and tokenizing happen in the workers, so the main process does no work per document


def is_continuation(byte: int) -> bool:
    """True for the 2nd..4th bytes of a UTF-8 character (0b10xxxxxx)."""
    return (byte & 0xC0) == 0x80


def last_char_start(buf: bytes) -> int:
    """Index where the last UTF-8 character of buf starts (a cut there splits no character)."""
    i = len(buf) - 1
    while i > 0 and is_continuation(buf[i]):
        i -= 1
    return i or len(buf)


def decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text of data, and how many undecodable byte sequences became U+FFFD."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")


def read_text(path: str, offset: int, seen: int, boundary: int) -> Iterator[tuple[bytes, int]]:
    """(block, offset after it) for a text file from byte `offset`. A block holds at most BLOCK_BYTES and
    ends at a line end (else a character start); `seen` text bytes of all inputs precede `offset`, and no
    block crosses text byte `boundary`, the train/val split. A block depends only on where it starts, so a
    resumed run cuts the same blocks (and BPE sees the same text) as an uninterrupted one."""
    with open_input(path) as f:
        while True:
            f.seek(offset)
            buf = f.read(BLOCK_BYTES)
            if not buf:
                return
            cut = len(buf)
            if len(buf) == BLOCK_BYTES:  # more may follow: end at a line end
                cut = buf.rfind(b"\n") + 1 or last_char_start(buf)
            if seen < boundary < seen + cut:
                cut = boundary - seen
                while cut < len(buf) and is_continuation(buf[cut]):  # never split a character
                    cut += 1
            offset, seen = offset + cut, seen + cut
            yield buf[:cut], offset


def read_lines(path: str, offset: int) -> Iterator[tuple[bytes, int]]:
    """(block, offset after it) for a JSONL file from byte `offset`: about BLOCK_BYTES of whole lines (a longer
    line is a block of its own), not parsed. A block ends where a record does, so its end is a resume point."""
    with open_input(path) as f:
        while True:
            f.seek(offset)
            block = f.read(BLOCK_BYTES)
            if not block:
                return
            if len(block) == BLOCK_BYTES:  # more may follow: end at a line end
                cut = block.rfind(b"\n") + 1
                block = block[:cut] if cut else block + f.readline()
            offset += len(block)
            yield block, offset


def read_parquet(path: str, row: int, field: str) -> Iterator[tuple[object, int]]:
    """(Arrow array of the `field` column of up to 1,024 rows, row after them) for a Parquet file from row `row`."""
    pq = optional_import("pyarrow.parquet", "Parquet input")
    with open_input(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except (ValueError, OSError) as e:  # pyarrow.ArrowInvalid (a ValueError) for a file that is not Parquet
            raise ValueError(f"{path} is not a readable Parquet file ({e})") from None
        if field not in pf.schema_arrow.names:
            raise ValueError(
                f"{path} has no column '{field}' (found: {', '.join(pf.schema_arrow.names)}); "
                "pass --text_field with the column that holds the text"
            )
        group, end = 0, 0  # skip whole row groups before `row`
        while group < pf.num_row_groups and end + pf.metadata.row_group(group).num_rows <= row:
            end += pf.metadata.row_group(group).num_rows
            group += 1
        for batch in pf.iter_batches(batch_size=1024, row_groups=range(group, pf.num_row_groups), columns=[field]):
            end += batch.num_rows
            if end > row:
                yield batch.column(0).slice(max(0, row - (end - batch.num_rows))), end


def load_hf_dataset(source: dict):
    """A Hugging Face dataset in streaming mode (data_files, if given, are local JSONL/Parquet files)."""
    datasets = optional_import("datasets", "Hugging Face input")
    data_files = [f["path"] for f in source.get("data_files", [])] or None
    name = source["dataset"]
    try:
        return datasets.load_dataset(name, source["name"], split=source["split"], data_files=data_files, streaming=True)
    except ConnectionError as e:
        raise ConnectionError(
            f"could not reach Hugging Face dataset '{name}' ({e}); check the name and the network, or download "
            "its files and pass them with --input"
        ) from None
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"could not load Hugging Face dataset '{name}' ({e})") from None


def read_hf(source: dict, start: int, field: str) -> Iterator[tuple[object, int]]:
    """(Arrow array of the `field` column of up to 1,024 records, records read after them) for a Hugging Face
    dataset, after the first `start` records. The records stay in Arrow's columns: no Python dict per record."""
    ds = load_hf_dataset(source)
    if ds.features is not None and field not in ds.features:
        raise ValueError(
            f"Hugging Face dataset '{source['dataset']}' has no field '{field}' (found: {', '.join(ds.features)}); "
            "pass --text_field with the field that holds the text"
        )
    for table in (ds.skip(start) if start else ds).with_format("arrow").iter(batch_size=1024):
        if field not in table.column_names:
            raise ValueError(
                f"record {start + 1} of '{source['dataset']}' has no field '{field}' "
                f"(found: {', '.join(table.column_names)}); pass --text_field with the field that holds the text"
            )
        start += table.num_rows
        yield table.column(field).combine_chunks(), start


def text_bytes(column) -> int:
    """UTF-8 bytes of an Arrow text column (for a column of another type, the size of its buffers: the workers
    then reject its first value, naming the row)."""
    import pyarrow.compute as pc

    try:
        return pc.sum(pc.binary_length(column)).as_py() or 0
    except NotImplementedError:  # pyarrow.ArrowNotImplementedError: not a string or binary column
        return column.nbytes


def arrow_runs(batches: Iterable[tuple[object, int]]) -> Iterator[tuple[object, int, int]]:
    """Consecutive column batches joined into runs of about BLOCK_BYTES of text: (array, text bytes, position after)."""
    import pyarrow as pa

    run, size, end = [], 0, 0
    for column, end in batches:
        run.append(column)
        size += text_bytes(column)
        if size >= BLOCK_BYTES:
            yield pa.concat_arrays(run), size, end
            run, size = [], 0
    if run:
        yield pa.concat_arrays(run), size, end


class Piece(NamedTuple):
    """A block of a text file, or a run of whole records (JSONL lines, Parquet or Hugging Face rows) as read, not
    decoded or parsed; and where the inputs stand just after it."""

    kind: str  # "text", "jsonl" or "arrow"
    data: object  # bytes, or an Arrow array of the text field's values
    split: str | None  # a text block's split; a record's is known only once the records before it are counted
    starts_doc: bool  # a text block that starts its file (every record starts a document)
    n_bytes: int
    origin: tuple  # where its first record is, for error messages: see `record_name`
    cursor: dict  # {"source", "position"}: where to continue after this piece


START = {"source": 0, "position": 0, "records": 0}


def iter_pieces(sources: list[dict], cursor: dict, val_fraction: float, text_field: str) -> Iterator[Piece]:
    """The pieces of all sources in order, from `cursor` on; text blocks are assigned to train or val here,
    records once their workers have counted them (`val_documents`)."""
    text_starts = np.cumsum([0] + [s["bytes"] if s["format"] == "text" else 0 for s in sources]).tolist()
    boundary = int(text_starts[-1] * (1.0 - val_fraction))  # as nanoGPT: the first 90% of the text trains
    for i in range(cursor["source"], len(sources)):
        source, position = sources[i], cursor["position"] if i == cursor["source"] else 0
        if source["format"] == "text":
            for block, end in read_text(source["path"], position, text_starts[i] + position, boundary):
                split = "train" if text_starts[i] + position < boundary else "val"
                yield Piece("text", block, split, position == 0, len(block), (), {"source": i, "position": end})
                position = end
        elif source["format"] == "jsonl":
            for block, end in read_lines(source["path"], position):
                origin = ("line", source["path"], position)
                yield Piece("jsonl", block, None, True, len(block), origin, {"source": i, "position": end})
                position = end
        else:
            if source["format"] == "parquet":
                batches, origin = read_parquet(source["path"], position, text_field), ("row", source["path"])
            else:
                batches, origin = read_hf(source, position, text_field), ("record", source["dataset"])
            for column, n_bytes, end in arrow_runs(batches):
                yield Piece("arrow", column, None, True, n_bytes, (*origin, position), {"source": i, "position": end})
                position = end


def batched(pieces: Iterable[Piece], max_bytes: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into batches of at most max_bytes (or of one larger piece)."""
    batch, size = [], 0
    for piece in pieces:
        if batch and size + piece.n_bytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += piece.n_bytes
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------------------
# decoding and parsing, in the workers


def line_number(path: str, offset: int) -> int:
    """1-based number of the line that starts at byte `offset` (for error messages only: it reads the file)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def record_name(origin: tuple, index: int) -> str:
    """How an error names the `index`-th line or row (from 0) of a piece from `origin`: ("line", path, byte offset),
    ("row", path, rows before) or ("record", dataset, records before)."""
    kind, name, start = origin
    if kind == "line":
        return f"{name} line {line_number(name, start) + index}"
    if kind == "row":
        return f"{name} row {start + index + 1}"
    return f"record {start + index + 1} of '{name}'"


def field_text(value, field: str, where: Callable[[], str]) -> tuple[str, int]:
    """A record's text (and replaced byte sequences, for a bytes value); errors name `where()`, called only then."""
    if isinstance(value, str):
        return value, 0
    if isinstance(value, bytes):
        return decode(value)
    raise TypeError(f"{where()}: field '{field}' holds {type(value).__name__}, not text; pass --text_field with the field that holds the text")


ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() removes: a JSONL line of only these is blank
JSON_SPACE = " \t\n\r"  # what JSON allows around a value
_scan_json = json.JSONDecoder().scan_once  # json.loads's C scanner, without json.loads's per-call Python steps


def parse_json(line: str):
    """json.loads(line), at half the cost for the usual line (a value with nothing but JSON space after it); any
    other line goes to json.loads, whose error (or value, for a line that starts with a space) is the answer."""
    try:
        value, end = _scan_json(line, 0)
        if end == len(line) or not line[end:].strip(JSON_SPACE):
            return value
    except (StopIteration, ValueError):  # no value at 0, or a malformed one
        pass
    return json.loads(line)


def jsonl_texts(block: bytes, field: str, origin: tuple) -> Iterator[tuple[str, int]]:
    """(text, replaced) per non-blank line of a block of whole JSONL lines."""
    try:
        lines, replaced = block.decode("utf-8").split("\n"), None
    except UnicodeDecodeError:  # rare: decode line by line, so that each record counts its own
        decoded = [decode(line) for line in block.split(b"\n")]
        lines, replaced = [text for text, _ in decoded], [n for _, n in decoded]
    for i, line in enumerate(lines):
        if not line.strip(ASCII_SPACE):
            continue
        try:
            record = parse_json(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{record_name(origin, i)} is not JSON ({e.msg}); fix or remove that line") from None
        if not isinstance(record, dict) or field not in record:
            found = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise ValueError(f"{record_name(origin, i)} has no field '{field}' (found: {found}); pass --text_field with the field that holds the text")
        text, bad = field_text(record[field], field, lambda: record_name(origin, i))
        yield text, bad + (replaced[i] if replaced else 0)


def arrow_values(column) -> list:
    """The values of an Arrow column as Python objects. A string column holding invalid UTF-8 (pyarrow's JSON
    reader lets it through) comes as bytes, so its undecodable sequences are replaced and counted as elsewhere."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        import pyarrow as pa

        return column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()).to_pylist()


def piece_texts(kind: str, data, origin: tuple, field: str) -> Iterator[tuple[str, int]]:
    """(text, replaced) per document of a piece (a text block is one, or part of one); empty records are skipped."""
    if kind == "text":
        yield decode(data)
        return
    if kind == "jsonl":
        texts = jsonl_texts(data, field, origin)
    else:
        texts = (field_text(value, field, lambda: record_name(origin, i)) for i, value in enumerate(arrow_values(data)))
    for text, replaced in texts:
        if text:
            yield text, replaced


def check_sources(sources: list[dict], text_field: str) -> None:
    """Fail before any work if an input cannot be read or a record input lacks the text field (the first
    record of each is parsed here, the rest in the workers)."""
    for source in sources:
        if source["format"] == "text":
            with open_input(source["path"]) as f:
                f.read(1)
        else:
            piece = next(iter_pieces([source], START, 0.1, text_field), None)  # (val_fraction: text only)
            if piece is not None:
                next(piece_texts(piece.kind, piece.data, piece.origin, text_field), None)


def document_texts(sources: list[dict], text_field: str) -> Iterator[str]:
    """The text of every document, parsed in this process (the char tokenizer learns its vocabulary from them)."""
    for piece in iter_pieces(sources, START, 0.1, text_field):  # (val_fraction only moves text blocks' ends)
        for text, _ in piece_texts(piece.kind, piece.data, piece.origin, text_field):
            yield text


# ---------------------------------------------------------------------------------------------------------
# tokenizing, in this process or in spawned workers

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


# ---------------------------------------------------------------------------------------------------------
# shards


def token_dtype(vocab_size: int, dtype: str = "auto") -> np.dtype:
    """uint16 for vocabularies up to 65,536 ids, else uint32; an explicit dtype must hold every id."""
    name = ("uint16" if vocab_size <= 2**16 else "uint32") if dtype == "auto" else dtype
    limit = 2 ** (8 * DTYPES[name].itemsize)
    if vocab_size > limit:
        raise ValueError(f"the tokenizer's {vocab_size:,} ids do not fit {name} (at most {limit:,}); use dtype uint32 or auto")
    return DTYPES[name]


class ShardWriter:
    """Appends one split's tokens to its open shard, `{split}_{i:06d}.bin.tmp`. A full shard gets its
    header, is synced and checksummed, and takes its final name at `commit()`, once progress.json lists it."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, state: dict | None = None):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        magic = next(m for m, (_, d) in FORMATS.items() if d == dtype)
        self.header = np.zeros(HEADER_INTS, dtype="<i4")  # llm.c's: magic, version, token count, zeros
        self.header[:2] = magic, FORMATS[magic][0]
        state = state or {"shards": [], "open_tokens": 0}
        self.shards: list[dict] = list(state["shards"])  # finished: {"file", "tokens", "sha256"}
        self.pending: list[dict] = []  # finished, final name not yet taken
        self.fill, self.file = state["open_tokens"], None
        if self.fill:  # continue the open shard, dropping tokens written after the last checkpoint
            self.file = open(self.tmp_path(len(self.shards)), "r+b")
            self.file.truncate(self.header.nbytes + self.fill * dtype.itemsize)
            self.file.seek(0, os.SEEK_END)

    def header_bytes(self, count: int) -> bytes:
        self.header[2] = count
        return self.header.tobytes()

    def tmp_path(self, index: int) -> Path:
        return self.out_dir / f"{self.split}_{index:06d}.bin.tmp"

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards + self.pending) + self.fill

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.file is None:
                self.file = open(self.tmp_path(len(self.shards) + len(self.pending)), "wb")
                self.file.write(self.header_bytes(0))  # the count is filled in when the shard is full
            n = min(len(tokens), self.shard_tokens - self.fill)
            self.file.write(tokens[:n].tobytes())
            self.fill, tokens = self.fill + n, tokens[n:]
            if self.fill == self.shard_tokens:
                self.close_shard()

    def close_shard(self) -> None:
        self.file.seek(0)
        self.file.write(self.header_bytes(self.fill))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        tmp = Path(self.file.name)
        self.pending.append({"file": tmp.name.removesuffix(".tmp"), "tokens": self.fill, "sha256": file_sha256(tmp)})
        self.file, self.fill = None, 0

    def state(self) -> dict:
        """What progress.json records: finished shards (renamed or not) and the open shard's token count."""
        if self.file is not None:
            self.file.flush()  # so the recorded count is on disk if this process dies
        return {"shards": self.shards + self.pending, "open_tokens": self.fill}

    def commit(self) -> None:
        """Give finished shards their final names (after progress.json has recorded them)."""
        for shard in self.pending:
            os.replace(self.out_dir / (shard["file"] + ".tmp"), self.out_dir / shard["file"])
        self.shards += self.pending
        self.pending = []

    def finish(self) -> None:
        """Close the last, partly filled shard (its final name comes at the next commit)."""
        if self.fill:
            self.close_shard()


# ---------------------------------------------------------------------------------------------------------
# progress, resume and the manifest


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def settings_key(settings: dict) -> str:
    """A short fingerprint of the settings (progress.json is rewritten often; the source list can be long)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def read_state(path: Path) -> dict | None:
    """A manifest.json or progress.json of ours, or None if it is missing or damaged (then: start afresh)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def finished_manifest(out_dir: Path, settings: dict) -> dict | None:
    """The manifest of a complete preparation with these settings, if out_dir holds one and all its shards."""
    manifest = read_state(out_dir / MANIFEST)
    if manifest is None or {k: manifest.get(k) for k in settings} != settings:
        return None
    return manifest if all((out_dir / s["file"]).is_file() for s in manifest["shards"]) else None


def shard_files(out_dir: Path) -> list[Path]:
    """Every shard and temporary shard of a preparation in out_dir."""
    return [p for split in SPLITS for pattern in ("_*.bin", "_*.bin.tmp") for p in out_dir.glob(split + pattern)]


def restore(out_dir: Path, progress: dict) -> bool:
    """Bring out_dir back to the state progress.json records: finish renames that an interruption cut short,
    remove shards written after it, cut the open shards back to their recorded length. False (and nothing
    changed) if the files on disk cannot give that state; then the preparation starts afresh."""
    keep: dict[Path, Path | None] = {}  # file to keep -> name to move it to
    for split in SPLITS:
        shards, open_tokens = progress[split]["shards"], progress[split]["open_tokens"]
        for shard in shards:
            final = out_dir / shard["file"]
            tmp = final.with_name(final.name + ".tmp")
            if final.is_file():
                keep[final] = None
            elif tmp.is_file():
                keep[tmp] = final
            else:
                return False
        if open_tokens:
            tmp = out_dir / f"{split}_{len(shards):06d}.bin.tmp"
            if not tmp.is_file() or tmp.stat().st_size < HEADER_BYTES + open_tokens * np.dtype(progress["dtype"]).itemsize:
                return False
            keep[tmp] = None
    for path in shard_files(out_dir):
        if path not in keep:
            path.unlink()
    for path, final in keep.items():
        if final is not None:
            os.replace(path, final)
    return True


def resumable(out_dir: Path, key: str, log) -> dict | None:
    """progress.json's state if out_dir holds an interrupted preparation with these settings whose files can be
    brought back to it (see `restore`), else None; nothing is deleted here unless it is resumed."""
    path = out_dir / PROGRESS
    if not path.is_file():
        return None
    progress = read_state(path)
    if progress and progress.get("settings") == key and (out_dir / TOKENIZER_FILE).is_file() and restore(out_dir, progress):
        return progress
    log(f"{out_dir} holds an unfinished preparation with other settings or damaged files; starting afresh")
    return None


def clear_preparation(out_dir: Path, log) -> None:
    """Delete out_dir's shards, manifest and progress (called once the new preparation's inputs and tokenizer
    are known to be good), saying so first if there was an earlier preparation."""
    earlier = [p for p in (out_dir / MANIFEST, out_dir / PROGRESS) if p.is_file()] + shard_files(out_dir)
    if earlier:
        log(f"replacing the earlier preparation in {out_dir} ({len(earlier)} files: manifest, progress and shards) "
            "made with other inputs or settings")
    for stale in earlier:
        stale.unlink(missing_ok=True)


def build_tokenizer(spec: str, sources: list[dict], text_field: str) -> Tokenizer:
    """The tokenizer for spec; `char` learns its vocabulary in one extra pass over the inputs."""
    if spec == "char":
        return get_tokenizer("char", document_texts(sources, text_field))
    return get_tokenizer(spec)


def progress_bar(total: int | None, initial: int):
    """Bytes read, MB/s and ETA (unknown for a Hugging Face stream), with documents and tokens alongside."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="tokenizing", smoothing=0.05, dynamic_ncols=True)


def input_bytes(sources: list[dict], text_field: str) -> int | None:
    """What the progress bar counts to, in the units the pieces report: file bytes, and for Parquet the
    uncompressed size of the text column (near its text bytes); unknown for a Hugging Face stream."""
    if any(s["format"] == "hf" for s in sources):
        return None
    return sum(parquet_text_bytes(s["path"], text_field) if s["format"] == "parquet" else s["bytes"] for s in sources)


def parquet_text_bytes(path: str, field: str) -> int:
    """Uncompressed bytes of a Parquet file's `field` column, from its metadata."""
    meta = optional_import("pyarrow.parquet", "Parquet input").ParquetFile(path).metadata
    groups = (meta.row_group(g) for g in range(meta.num_row_groups))
    return sum(c.total_uncompressed_size for g in groups for c in map(g.column, range(g.num_columns)) if c.path_in_schema == field)


# ---------------------------------------------------------------------------------------------------------
# the whole preparation


def prepare(
    inputs: list[str],
    tokenizer_spec: str,
    out_dir: str | Path,
    val_fraction: float = 0.1,
    shard_tokens: int = SHARD_TOKENS,
    overwrite: bool = False,
    log=print,
    *,
    text_field: str = "text",
    workers: int | None = None,
    dtype: str = "auto",
    hf_dataset: str | None = None,
    hf_name: str | None = None,
    hf_split: str = "train",
) -> dict:
    """Tokenize the inputs into out_dir/{train,val}_*.bin, tokenizer.json and manifest.json; return the manifest.

    inputs: text, .jsonl/.ndjson or .parquet files, directories, globs or URLs; with hf_dataset, the local
    data files of that dataset (e.g. hf_dataset="json" and a list of .jsonl files), else may be empty.
    workers: tokenizing processes (default: one per core; never more than there are batches of input).
    dtype: "auto" (uint16 up to 65,536 ids, else uint32), "uint16" or "uint32".
    An interrupted run continues where it stopped when called again with the same arguments.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be auto, {' or '.join(DTYPES)}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (or None for one per core)")
    if not inputs and hf_dataset is None:
        raise ValueError("no inputs: pass text/JSONL/Parquet files, directories, globs or URLs, or a Hugging Face dataset")
    out_dir = Path(out_dir)
    sources = resolve_sources(inputs, out_dir / "downloads", hf_dataset, hf_name, hf_split)
    settings = {
        "sources": sources,
        "tokenizer": tokenizer_spec,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "dtype": dtype,
    }
    manifest = finished_manifest(out_dir, settings)
    if manifest is not None and not overwrite:
        log(f"{out_dir} is already prepared from these inputs ({manifest['train_tokens']:,} train, {manifest['val_tokens']:,} val tokens); nothing to do")
        return manifest
    check_sources(sources, text_field)
    total = input_bytes(sources, text_field)
    if total == 0:
        raise ValueError(f"the inputs ({', '.join(inputs)}) are empty; there is no text to tokenize")

    key = settings_key(settings)
    progress = None if overwrite else resumable(out_dir, key, log)
    if progress is None:
        # the tokenizer and its dtype are checked before anything earlier in out_dir is deleted
        tokenizer = build_tokenizer(tokenizer_spec, sources, text_field)
        tokens_dtype = token_dtype(tokenizer.vocab_size, dtype)
        make_dir(out_dir)
        clear_preparation(out_dir, log)
        tokenizer.save(out_dir / TOKENIZER_FILE)
        progress = new_progress(key, tokens_dtype)
    else:
        tokenizer, tokens_dtype = load_tokenizer(out_dir / TOKENIZER_FILE), np.dtype(progress["dtype"])
        log(f"resuming {out_dir} after {progress['bytes'] / 1e6:.1f} MB and {progress['documents']:,} documents")
    writers = {s: ShardWriter(out_dir, s, tokens_dtype, shard_tokens, progress[s]) for s in SPLITS}
    workers = workers or default_workers()
    if total is not None:  # a worker only where it has enough batches to repay its start
        batches = (total - progress["bytes"]) / (BLOCK_BYTES * BATCH_BLOCKS)
        workers = max(1, min(workers, math.ceil(batches / WORKER_BATCHES)))
    log(
        f"tokenizing {len(sources)} source(s), {'?' if total is None else f'{total / 1e6:.1f}'} MB, with {tokenizer_spec} "
        f"(vocab {tokenizer.vocab_size:,}, {tokens_dtype.name}) in {workers} process(es) into {out_dir}"
    )
    start, bytes_before = time.perf_counter(), progress["bytes"]
    pieces = iter_pieces(sources, progress["cursor"], val_fraction, text_field)
    tokenize_into_shards(
        pieces, tokenizer, workers, writers, progress, out_dir, total, val_fraction=val_fraction, text_field=text_field
    )
    seconds = time.perf_counter() - start

    counts = {s: writers[s].tokens for s in SPLITS}
    if not counts["train"] and not counts["val"]:
        raise ValueError(f"the inputs ({', '.join(inputs) or hf_dataset}) hold no text; there is nothing to tokenize")
    if not counts["train"] or not counts["val"]:
        raise ValueError(f"the corpus is too small to split with val_fraction={val_fraction}; add text or change it")
    manifest = build_manifest(settings, tokenizer, writers, progress)
    write_json(out_dir / MANIFEST, manifest)
    (out_dir / PROGRESS).unlink()
    log_summary(log, manifest, progress["bytes"] - bytes_before, seconds)
    return manifest


def new_progress(key: str, dtype: np.dtype) -> dict:
    """The state of a preparation that has not read anything yet."""
    progress = {"settings": key, "dtype": dtype.str, "cursor": START, "documents": 0, "bytes": 0, "replaced": 0}
    return progress | {split: {"shards": [], "open_tokens": 0} for split in SPLITS}


def tokenize_into_shards(
    pieces: Iterator[Piece], tokenizer: Tokenizer, workers: int, writers: dict[str, ShardWriter], progress: dict,
    out_dir: Path, total: int | None, *, val_fraction: float, text_field: str,
) -> None:
    """Tokenize the pieces batch by batch into the writers, checkpointing progress after each batch."""
    batches = batched(pieces, BLOCK_BYTES * BATCH_BLOCKS)
    dtype = writers["train"].dtype
    with progress_bar(total, progress["bytes"]) as bar:
        for batch, encoded in tokenize(batches, tokenizer, out_dir / TOKENIZER_FILE, text_field, dtype, workers):
            records = progress["cursor"]["records"]
            parts, n_records = split_batch(batch, encoded, records, val_fraction)
            for split in SPLITS:
                for tokens in parts[split]:
                    writers[split].write(tokens)
            n_bytes = sum(p.n_bytes for p in batch)
            progress["cursor"] = {**batch[-1].cursor, "records": records + n_records}
            progress["documents"] += n_records + sum(p.starts_doc for p in batch if p.kind == "text")
            progress["bytes"] += n_bytes
            progress["replaced"] += sum(replaced for _, _, replaced in encoded)
            save_progress(out_dir, progress, writers)
            bar.set_postfix(docs=f"{progress['documents']:,}", tokens=f"{sum(w.tokens for w in writers.values()):,}", refresh=False)
            bar.update(n_bytes)
    for writer in writers.values():
        writer.finish()
    save_progress(out_dir, progress, writers)


def build_manifest(settings: dict, tokenizer: Tokenizer, writers: dict[str, ShardWriter], progress: dict) -> dict:
    """What manifest.json records: the settings, the tokenizer, every shard with its tokens and sha256, counts."""
    shards = writers["train"].shards + writers["val"].shards
    return {
        **settings,
        "vocab_size": tokenizer.vocab_size,
        "token_dtype": writers["train"].dtype.name,
        "eot_id": tokenizer.eot_id,
        "shards": [{"file": s["file"], "tokens": s["tokens"]} for s in shards],
        "sha256": {s["file"]: s["sha256"] for s in shards},
        "train_tokens": writers["train"].tokens,
        "val_tokens": writers["val"].tokens,
        "documents": progress["documents"],
        "replaced": progress["replaced"],
    }


def save_progress(out_dir: Path, progress: dict, writers: dict[str, ShardWriter]) -> None:
    """Checkpoint after a batch: record the state, then give finished shards their final names."""
    progress.update({split: writer.state() for split, writer in writers.items()})
    write_json(out_dir / PROGRESS, progress)
    for writer in writers.values():
        writer.commit()


def log_summary(log, manifest: dict, n_bytes: int, seconds: float) -> None:
    tokens, docs = manifest["train_tokens"] + manifest["val_tokens"], manifest["documents"]
    n_train = sum(s["file"].startswith("train") for s in manifest["shards"])
    replaced = f"; replaced {manifest['replaced']:,} undecodable byte sequence(s) with U+FFFD" if manifest["replaced"] else ""
    log(
        f"{docs:,} documents, {tokens:,} tokens ({tokens / max(docs, 1):,.1f} per document; {manifest['train_tokens']:,} train, "
        f"{manifest['val_tokens']:,} val) in {n_train} train + {len(manifest['shards']) - n_train} val shard(s); "
        f"{n_bytes / 1e6:.1f} MB in {seconds:.1f}s ({n_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s){replaced}"
    )


# ---------------------------------------------------------------------------------------------------------
# ready-made GPT-2 token shards (llm.c's format), as modded-nanogpt downloads them

TOKEN_SHARDS = {  # name -> (Hugging Face dataset repository, file prefix, train shards of 100M tokens)
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "finewebedu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}


def download_token_shards(
    name: str, out_dir: str | Path, train_shards: int, tokenizer_spec: str = "gpt2", revision: str | None = None, log=print
) -> dict:
    """Download the val shard and the first `train_shards` train shards of a TOKEN_SHARDS dataset into out_dir
    (files already there are kept, so an interrupted download continues), check their headers, and write
    tokenizer.json and manifest.json as `prepare` does; return the manifest."""
    if name not in TOKEN_SHARDS:
        raise ValueError(f"unknown token-shard dataset '{name}'; choose one of {', '.join(TOKEN_SHARDS)}")
    repo, prefix, available = TOKEN_SHARDS[name]
    if not 1 <= train_shards <= available:
        raise ValueError(f"train_shards={train_shards} must be between 1 and {available} for {name} (100M tokens each)")
    hub = optional_import("huggingface_hub", "Downloading token shards")
    tokenizer = get_tokenizer(tokenizer_spec)  # before gigabytes of download: fails fast offline
    out_dir = Path(out_dir)
    files = [f"{prefix}_val_000000.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, train_shards + 1)]
    for file in files:
        if (out_dir / file).is_file():
            continue
        log(f"downloading {file} from huggingface.co/datasets/{repo}")
        try:  # huggingface_hub writes to a temporary file and renames it when complete
            hub.hf_hub_download(repo_id=repo, filename=file, repo_type="dataset", revision=revision, local_dir=out_dir)
        except OSError as e:  # huggingface_hub's HTTP, offline and not-found errors are OSErrors
            raise ConnectionError(
                f"could not download {file} from huggingface.co/datasets/{repo} ({type(e).__name__}); check the "
                "network (or HF_ENDPOINT) and run again: the files already downloaded are kept"
            ) from None
    tokens = {file: read_shard(out_dir / file) for file in files}  # checks each header; maps, reads nothing
    shards = [{"file": file, "tokens": len(t)} for file, t in tokens.items()]
    tokenizer.save(out_dir / TOKENIZER_FILE)
    manifest = {
        "sources": [{"format": "hf_hub", "repo": repo, "revision": revision}],
        "tokenizer": tokenizer_spec,
        "vocab_size": tokenizer.vocab_size,
        "token_dtype": tokens[files[0]].dtype.name,
        "eot_id": tokenizer.eot_id,
        "shards": shards,
        "sha256": {file: file_sha256(out_dir / file) for file in files},
        "train_tokens": sum(s["tokens"] for s in shards[1:]),
        "val_tokens": shards[0]["tokens"],
    }
    write_json(out_dir / MANIFEST, manifest)
    log(f"{out_dir}: {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} val tokens of {name}, ready to train")
    return manifest
