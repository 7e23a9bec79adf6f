"""Preparation's inputs: files, folders, globs and URLs resolved into sources; each source cut into pieces (text
blocks, blocks of whole JSONL lines, Arrow columns of Parquet or Hugging Face records) by the main process; and the
pieces decoded and parsed into document texts, in the workers. Errors name the file and the line or row."""

from __future__ import annotations

import functools
import glob
import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gptlite.data.download import download
from gptlite.extras import need

BLOCK_BYTES = 1 << 20  # inputs are read in blocks of about 1 MiB (text, whole JSONL lines, Parquet/HF rows)
RECORD_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}  # any other file is text


# ---------------------------------------------------------------------------------------------------------
# inputs


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
    pq = need("pyarrow.parquet", "data", "Parquet input")
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


def hub_unresolved() -> str | None:
    """Why the Hugging Face Hub's host (HF_ENDPOINT's) cannot be reached, where its name does not resolve (offline);
    else None. Asked before a dataset is streamed from the Hub: huggingface_hub retries a name that does not resolve
    for tens of seconds before it gives up."""
    from huggingface_hub import constants

    host = urllib.parse.urlparse(constants.ENDPOINT).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror as e:
        return f"{host} cannot be resolved: {e.strerror}"
    return None


def hub_unreachable(name: str, why: str) -> ConnectionError:
    return ConnectionError(
        f"could not reach Hugging Face dataset '{name}' ({why}); check the name and the network, or download its "
        "files and pass them with --input"
    )


def load_hf_dataset(source: dict):
    """A Hugging Face dataset in streaming mode (data_files, if given, are local JSONL/Parquet files)."""
    datasets = need("datasets", "data", "Hugging Face input")
    data_files = [f["path"] for f in source.get("data_files", [])] or None
    name = source["dataset"]
    # a dataset of the Hub's, streamed: offline (HF_HUB_OFFLINE) datasets says so at once, itself
    from_hub = data_files is None and not os.path.isdir(name) and not datasets.config.HF_HUB_OFFLINE
    why = hub_unresolved() if from_hub else None
    if why:
        raise hub_unreachable(name, why)
    try:
        return datasets.load_dataset(name, source["name"], split=source["split"], data_files=data_files, streaming=True)
    except ConnectionError as e:
        raise hub_unreachable(name, str(e)) from None
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
    pc = need("pyarrow.compute", "data", "Arrow input")
    try:
        return pc.sum(pc.binary_length(column)).as_py() or 0
    except NotImplementedError:  # pyarrow.ArrowNotImplementedError: not a string or binary column
        return column.nbytes


def arrow_runs(batches: Iterable[tuple[object, int]]) -> Iterator[tuple[object, int, int]]:
    """Consecutive column batches joined into runs of about BLOCK_BYTES of text: (array, text bytes, position after)."""
    pa = need("pyarrow", "data", "Arrow input")
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
                batches = read_parquet(source["path"], position, text_field)
                origin = ("row", source["path"])
            else:
                batches = read_hf(source, position, text_field)
                origin = ("record", source["dataset"])
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
    raise TypeError(
        f"{where()}: field '{field}' holds {type(value).__name__}, not text; pass --text_field with the field that "
        "holds the text"
    )


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


def jsonl_records(
    block: bytes, field: str, origin: tuple, flag: str = "--text_field"
) -> Iterator[tuple[object, int, int]]:
    """(the field's value, replaced byte sequences, line index in the block) per non-blank line of a block of whole
    JSONL lines; `flag` is the option that names the field, for the error of a record without it."""
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
            raise ValueError(
                f"{record_name(origin, i)} has no field '{field}' (found: {found}); pass {flag} with the "
                "field that holds it"
            )
        yield record[field], (replaced[i] if replaced else 0), i


def jsonl_texts(block: bytes, field: str, origin: tuple) -> Iterator[tuple[str, int]]:
    """(text, replaced) per non-blank line of a block of whole JSONL lines."""
    for value, replaced, i in jsonl_records(block, field, origin):
        text, bad = field_text(value, field, functools.partial(record_name, origin, i))
        yield text, bad + replaced


def piece_records(kind: str, data, origin: tuple, field: str) -> Iterator[tuple[object, Callable[[], str]]]:
    """(the field's value, a function naming the record) per record of a JSONL or Arrow piece (a chat preparation's
    conversations; a text file holds none)."""
    if kind == "text":
        raise ValueError(
            "--chat reads records (JSONL, Parquet or a Hugging Face dataset) whose field holds the "
            "messages; a text file holds no conversations"
        )
    if kind == "jsonl":
        for value, _, i in jsonl_records(data, field, origin, "--messages_field"):
            yield value, (lambda i=i: record_name(origin, i))
    else:
        for i, value in enumerate(arrow_values(data)):
            yield value, (lambda i=i: record_name(origin, i))


def arrow_values(column) -> list:
    """The values of an Arrow column as Python objects. A string column holding invalid UTF-8 (pyarrow's JSON
    reader lets it through) comes as bytes, so its undecodable sequences are replaced and counted as elsewhere."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pa = need("pyarrow", "data", "Arrow input")
        return column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()).to_pylist()


def piece_texts(kind: str, data, origin: tuple, field: str) -> Iterator[tuple[str, int]]:
    """(text, replaced) per document of a piece (a text block is one, or part of one); empty records are skipped."""
    if kind == "text":
        yield decode(data)
        return
    if kind == "jsonl":
        texts = jsonl_texts(data, field, origin)
    else:
        texts = (
            field_text(value, field, functools.partial(record_name, origin, i))
            for i, value in enumerate(arrow_values(data))
        )
    for text, replaced in texts:
        if text:
            yield text, replaced


def check_sources(sources: list[dict], field: str, chat: bool = False) -> None:
    """Fail before any work if an input cannot be read or a record input lacks the field (the first record of
    each is parsed here, the rest in the workers); a chat preparation takes records only, and checks the first
    one's messages."""
    from gptlite.tokenizer.chat import check_messages

    for source in sources:
        if source["format"] == "text" and not chat:
            with open_input(source["path"]) as f:
                f.read(1)
            continue
        if source["format"] == "text":
            raise ValueError(
                f"--chat reads records (JSONL, Parquet or a Hugging Face dataset) whose '{field}' holds the "
                f"messages; {source['path']} is a text file"
            )
        piece = next(iter_pieces([source], START, 0.1, field), None)  # (val_fraction: text only)
        if piece is not None and chat:
            value, where = next(piece_records(piece.kind, piece.data, piece.origin, field), (None, None))
            if where is not None:
                check_messages(value, where())
        elif piece is not None:
            next(piece_texts(piece.kind, piece.data, piece.origin, field), None)


def document_texts(sources: list[dict], text_field: str) -> Iterator[str]:
    """The text of every document, parsed in this process (the char tokenizer learns its vocabulary from them)."""
    for piece in iter_pieces(sources, START, 0.1, text_field):  # (val_fraction only moves text blocks' ends)
        for text, _ in piece_texts(piece.kind, piece.data, piece.origin, text_field):
            yield text


def input_bytes(sources: list[dict], text_field: str) -> int | None:
    """What the progress bar counts to, in the units the pieces report: file bytes, and for Parquet the
    uncompressed size of the text column (near its text bytes); unknown for a Hugging Face stream."""
    if any(s["format"] == "hf" for s in sources):
        return None
    return sum(parquet_text_bytes(s["path"], text_field) if s["format"] == "parquet" else s["bytes"] for s in sources)


def parquet_text_bytes(path: str, field: str) -> int:
    """Uncompressed bytes of a Parquet file's `field` column, from its metadata."""
    meta = need("pyarrow.parquet", "data", "Parquet input").ParquetFile(path).metadata
    groups = (meta.row_group(g) for g in range(meta.num_row_groups))
    return sum(
        c.total_uncompressed_size
        for g in groups
        for c in map(g.column, range(g.num_columns))
        if c.path_in_schema == field
    )
