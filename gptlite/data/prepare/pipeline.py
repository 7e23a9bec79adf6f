"""Dataset preparation's orchestrator (`prepare`): stream documents from text, JSONL, Parquet or Hugging Face inputs,
tokenize them in parallel worker processes, and write train/val token shards that survive interruption.

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

Nothing here imports torch (the shard format is `gptlite.data.shards`, numpy only): the command and any spawned
workers, which import this package, start in a fraction of a second (the `datasets` package, for Hugging Face
input, imports torch itself where it is installed).
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gptlite.data.prepare import sources as reading  # reading.BLOCK_BYTES, looked up when used (tests change it)
from gptlite.data.prepare.progress import clear_preparation, finished_manifest, resumable, settings_key
from gptlite.data.prepare.sources import (
    START,
    Piece,
    batched,
    check_sources,
    document_texts,
    input_bytes,
    iter_pieces,
    resolve_sources,
)
from gptlite.data.prepare.workers import SPLITS, default_workers, split_batch, tokenize
from gptlite.data.shards import DTYPES, MANIFEST, PROGRESS, RolesWriter, ShardWriter, token_dtype
from gptlite.files import fault, make_dir, write_json
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, get_tokenizer, load_tokenizer

BATCH_BLOCKS = 1  # a batch for one worker holds at most this many blocks' worth (small: the last batches end together)
WORKER_BATCHES = 4  # a worker costs a few tenths of a second to start: one per this many batches of input at most
SHARD_TOKENS = 100_000_000


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
    chat: bool = False,
    messages_field: str = "messages",
    block_size: int = 0,
    too_long: str = "drop",
) -> dict:
    """Tokenize the inputs into out_dir/{train,val}_*.bin, tokenizer.json and manifest.json; return the manifest.

    inputs: text, .jsonl/.ndjson or .parquet files, directories, globs or URLs; with hf_dataset, the local
    data files of that dataset (e.g. hf_dataset="json" and a list of .jsonl files), else may be empty.
    workers: tokenizing processes (default: one per core; never more than there are batches of input).
    dtype: "auto" (uint16 up to 65,536 ids, else uint32), "uint16" or "uint32".
    chat: the records' `messages_field` holds conversations, rendered with the tokenizer's chat template (ChatML
    for a tokenizer without one); a roles file beside each shard marks the assistant's tokens, which alone are
    trained on (see gptlite.data.loader.ChatLoader). A conversation longer than block_size + 1 tokens (0: no limit) is
    cut to it or dropped (too_long="cut" or "drop"); one without an assistant turn is left out; both are counted.
    An interrupted run continues where it stopped when called again with the same arguments.
    """
    check_settings(inputs, val_fraction, shard_tokens, dtype, workers, hf_dataset)
    chat_options = check_chat(chat, tokenizer_spec, block_size, too_long)
    field = messages_field if chat else text_field
    out_dir = Path(out_dir)
    sources = resolve_sources(inputs, out_dir / "downloads", hf_dataset, hf_name, hf_split)
    check_out_dir(inputs, sources, out_dir)
    settings = {
        "sources": sources,
        "tokenizer": tokenizer_spec,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "text_field": field,
        "dtype": dtype,
        "chat": chat_options,
    }
    manifest = finished_manifest(out_dir, settings)
    if manifest is not None and not overwrite:
        log(
            f"{out_dir} is already prepared from these inputs ({manifest['train_tokens']:,} train, "
            f"{manifest['val_tokens']:,} val tokens); nothing to do"
        )
        return manifest
    check_sources(sources, field, chat)
    total = input_bytes(sources, field)
    if total == 0:
        raise ValueError(f"the inputs ({', '.join(inputs)}) are empty; there is no text to tokenize")

    tokenizer, progress = start_or_resume(out_dir, settings, overwrite, log)
    tokens_dtype = np.dtype(progress["dtype"])
    writers = {s: ShardWriter(out_dir, s, tokens_dtype, shard_tokens, progress[s]) for s in SPLITS}
    if chat:
        writers |= {f"{s}_roles": RolesWriter(out_dir, s, shard_tokens, progress.get(f"{s}_roles")) for s in SPLITS}
    workers = workers or default_workers()
    if total is not None:  # a worker only where it has enough batches to repay its start
        batches = (total - progress["bytes"]) / (reading.BLOCK_BYTES * BATCH_BLOCKS)
        workers = max(1, min(workers, math.ceil(batches / WORKER_BATCHES)))
    log(
        f"tokenizing {len(sources)} source(s), {'?' if total is None else f'{total / 1e6:.1f}'} MB, with "
        f"{tokenizer_spec} (vocab {tokenizer.vocab_size:,}, {tokens_dtype.name}) in {workers} process(es) "
        f"into {out_dir}"
    )
    start, bytes_before = time.perf_counter(), progress["bytes"]
    pieces = iter_pieces(sources, progress["cursor"], val_fraction, field)
    try:
        write_batches(pieces, tokenizer, workers, writers, progress, out_dir, total, val_fraction, field, chat_options)
    except OSError as e:  # a full disk is one line, and the same command then resumes
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise fault(e, f"could not write the shards in {out_dir} (the same command resumes)") from None
    seconds = time.perf_counter() - start

    counts = {s: writers[s].tokens for s in SPLITS}
    if not counts["train"] and not counts["val"]:
        what = "conversation with an assistant turn" if chat else "text"
        raise ValueError(f"the inputs ({', '.join(inputs) or hf_dataset}) hold no {what}; there is nothing to tokenize")
    if not counts["train"] or not counts["val"]:
        raise ValueError(f"the corpus is too small to split with val_fraction={val_fraction}; add text or change it")
    manifest = build_manifest(settings, tokenizer, writers, progress)
    write_json(out_dir / MANIFEST, manifest)
    (out_dir / PROGRESS).unlink()
    log_summary(log, manifest, progress["bytes"] - bytes_before, seconds)
    return manifest


def check_out_dir(inputs: list[str], sources: list[dict], out_dir: Path) -> None:
    """Refuse an input inside out_dir (other than the downloads this command made there), which a preparation
    would delete or read back, and an out_dir inside an input folder, whose shards a later run would read as text."""
    if out_dir.exists() and not out_dir.is_dir():
        return  # make_dir says so
    out = out_dir.resolve()
    for spec in inputs:
        if Path(spec).is_dir() and out.is_relative_to(Path(spec).resolve()):
            raise ValueError(
                f"--out_dir {out_dir} lies inside the input folder {spec}: a later run would read its "
                "shards as text; choose an --out_dir outside it"
            )
    for source in sources:
        for file in source.get("data_files", [source]):
            path = Path(file.get("path", "/"))
            if path.is_relative_to(out) and not path.is_relative_to(out / "downloads"):
                raise ValueError(
                    f"input {path} lies inside --out_dir {out_dir}, whose files a preparation replaces; "
                    "move it out or choose another --out_dir"
                )


def check_chat(chat: bool, tokenizer_spec: str, block_size: int, too_long: str) -> dict | None:
    """A chat preparation's settings, checked."""
    if not chat:
        return None
    if tokenizer_spec == "char":
        raise ValueError(
            "--chat needs a tokenizer that encodes any text (byte, a BPE or a model's tokenizer.json); "
            "char learns only the characters of its corpus"
        )
    if block_size < 0 or too_long not in ("cut", "drop"):
        raise ValueError(f"block_size={block_size} must be >= 0 (0: no limit) and too_long={too_long!r} cut or drop")
    return {"block_size": block_size, "too_long": too_long}


def check_settings(
    inputs: list[str], val_fraction: float, shard_tokens: int, dtype: str, workers: int | None, hf_dataset: str | None
) -> None:
    """The arguments of `prepare` that need no file, checked first."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be auto, {' or '.join(DTYPES)}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (or None for one per core)")
    if not inputs and hf_dataset is None:
        raise ValueError(
            "no inputs: pass text/JSONL/Parquet files, directories, globs or URLs, or a Hugging Face dataset"
        )


def start_or_resume(out_dir: Path, settings: dict, overwrite: bool, log) -> tuple[Tokenizer, dict]:
    """(tokenizer, progress): an unfinished preparation with these settings continues; otherwise the tokenizer and
    its token dtype are checked before anything earlier in out_dir is deleted, then the preparation starts afresh."""
    key = settings_key(settings)
    progress = None if overwrite else resumable(out_dir, key, log)
    if progress is not None:
        log(f"resuming {out_dir} after {progress['bytes'] / 1e6:.1f} MB and {progress['documents']:,} documents")
        return load_tokenizer(out_dir / TOKENIZER_FILE), progress
    tokenizer = build_tokenizer(settings["tokenizer"], settings["sources"], settings["text_field"])
    if settings["chat"]:
        tokenizer.use_default_template()  # ChatML's markers, if it has no template: recorded in tokenizer.json
    tokens_dtype = token_dtype(tokenizer.vocab_size, settings["dtype"])
    make_dir(out_dir)
    clear_preparation(out_dir, log)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    return tokenizer, new_progress(key, tokens_dtype)


def new_progress(key: str, dtype: np.dtype) -> dict:
    """The state of a preparation that has not read anything yet."""
    progress = {"settings": key, "dtype": dtype.str, "cursor": START, "documents": 0, "bytes": 0, "replaced": 0}
    return progress | {split: {"shards": [], "open_tokens": 0} for split in SPLITS}


def write_batches(
    pieces: Iterator[Piece],
    tokenizer: Tokenizer,
    workers: int,
    writers: dict[str, ShardWriter],
    progress: dict,
    out_dir: Path,
    total: int | None,
    val_fraction: float,
    text_field: str,
    chat: dict | None,
) -> None:
    """The pieces in batches through the workers, their tokens appended to the writers, progress saved after each."""
    batches = batched(pieces, reading.BLOCK_BYTES * BATCH_BLOCKS)
    dtype = writers["train"].dtype
    with progress_bar(total, progress["bytes"]) as bar:
        for batch, encoded in tokenize(batches, tokenizer, out_dir / TOKENIZER_FILE, text_field, dtype, workers, chat):
            records = progress["cursor"]["records"]
            parts, roles, n_records = split_batch(batch, encoded, records, val_fraction)
            for split in SPLITS:
                for tokens in parts[split]:
                    writers[split].write(tokens)
                for r in roles[split]:
                    writers[f"{split}_roles"].write(r)
            if chat:
                for e in encoded:
                    progress["conversations"] = {
                        k: progress.get("conversations", {}).get(k, 0) + v for k, v in e.counts.items()
                    }
            n_bytes = sum(p.n_bytes for p in batch)
            progress["cursor"] = {**batch[-1].cursor, "records": records + n_records}
            progress["documents"] += n_records + sum(p.starts_doc for p in batch if p.kind == "text")
            progress["bytes"] += n_bytes
            progress["replaced"] += sum(e.replaced for e in encoded)
            save_progress(out_dir, progress, writers)
            tokens = sum(writers[split].tokens for split in SPLITS)  # not the roles files' bytes, one per token
            bar.set_postfix(docs=f"{progress['documents']:,}", tokens=f"{tokens:,}", refresh=False)
            bar.update(n_bytes)
    for writer in writers.values():
        writer.finish()
    save_progress(out_dir, progress, writers)


def build_manifest(settings: dict, tokenizer: Tokenizer, writers: dict[str, ShardWriter], progress: dict) -> dict:
    """What manifest.json records: the settings, the tokenizer, every shard with its tokens and sha256, counts."""
    shards = writers["train"].shards + writers["val"].shards
    roles = writers["train_roles"].shards + writers["val_roles"].shards if "train_roles" in writers else []
    return {
        **settings,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint(),  # its identity by content (Tokenizer.fingerprint)
        "token_dtype": writers["train"].dtype.name,
        "eot_id": tokenizer.eot_id,
        "shards": [{"file": s["file"], "tokens": s["tokens"]} for s in shards],
        "sha256": {s["file"]: s["sha256"] for s in shards + roles},
        "train_tokens": writers["train"].tokens,
        "val_tokens": writers["val"].tokens,
        "documents": progress["documents"],
        "replaced": progress["replaced"],
        **({"conversations": progress.get("conversations", {})} if roles else {}),
    }


def save_progress(out_dir: Path, progress: dict, writers: dict[str, ShardWriter]) -> None:
    """Checkpoint after a batch: record the state, then give finished shards their final names."""
    progress.update({split: writer.state() for split, writer in writers.items()})
    write_json(out_dir / PROGRESS, progress)
    for writer in writers.values():
        writer.commit()


def log_summary(log, manifest: dict, n_bytes: int, seconds: float) -> None:
    tokens = manifest["train_tokens"] + manifest["val_tokens"]
    docs = manifest["documents"]  # the records read; for conversations, those written are the ones kept
    what = "documents"
    if "conversations" in manifest:
        docs = manifest["conversations"].get("kept", 0)
        what = "conversations"
    n_train = sum(s["file"].startswith("train") for s in manifest["shards"])
    replaced = (
        f"; replaced {manifest['replaced']:,} undecodable byte sequence(s) with U+FFFD" if manifest["replaced"] else ""
    )
    if "conversations" in manifest:
        c = manifest["conversations"]
        log(
            f"{c.get('kept', 0):,} conversations kept ({c.get('cut', 0):,} cut to block_size), "
            f"{c.get('too_long', 0):,} left out as too long, {c.get('no_assistant', 0):,} without an assistant turn"
        )
    log(
        f"{docs:,} {what}, {tokens:,} tokens ({tokens / max(docs, 1):,.1f} per {what[:-1]}; "
        f"{manifest['train_tokens']:,} train, "
        f"{manifest['val_tokens']:,} val) in {n_train} train + {len(manifest['shards']) - n_train} val shard(s); "
        f"{n_bytes / 1e6:.1f} MB in {seconds:.1f}s ({n_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s){replaced}"
    )


def build_tokenizer(spec: str, sources: list[dict], text_field: str) -> Tokenizer:
    """The tokenizer for spec; `char` learns its vocabulary in one extra pass over the inputs."""
    if spec == "char":
        return get_tokenizer("char", document_texts(sources, text_field))
    return get_tokenizer(spec)


def progress_bar(total: int | None, initial: int):
    """Bytes read, MB/s and ETA (unknown for a Hugging Face stream), with documents and tokens alongside."""
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, unit="B", unit_scale=True, desc="tokenizing", smoothing=0.05, dynamic_ncols=True
    )
