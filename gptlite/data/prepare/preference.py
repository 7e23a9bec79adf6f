"""Preparation of preference pairs (data/prepare.py --preference): JSONL or Parquet records of a prompt with a chosen
and a rejected answer -> train/val token shards whose roles files mark each pair for gptlite.data.loader.PairLoader.

Records use TRL's preference fields: `prompt` (text, or a list of {role, content} messages) and `chosen` and
`rejected` (text, or the assistant's messages, TRL's conversational format); other field names are options. A
pair is written as its prompt once, then the chosen answer, then the rejected one (see gptlite.data.shards.ANSWER).

Rendering. With messages, or with a tokenizer that has a chat template of its own, the prompt is rendered with the
template and a generation prompt, and each answer is what the template adds after it, up to its end-of-turn marker
(a tokenizer without a template gets ChatML, as --chat does); text records with a tokenizer without a template are
taken as plain text, each answer ending with the end-of-text token where there is one (as TRL appends EOS). The
prompt and the answers are tokenized apart, as TRL does.

What is refused and what is counted. A record without one of the three fields, or whose field holds neither text nor
messages, or nothing (an empty answer or prompt), stops the preparation with one line naming the file and line (or
row) and the fix: the data is not what the options say. Pairs that are well-formed but teach nothing are left out
and counted, the first of each kind named in the summary: identical answers (the DPO gradient of such a pair is
zero), and a prompt of block_size tokens or more (no answer token would fit the window). An answer that does not fit
after its prompt is cut to block_size + 1 tokens in all, and counted as cut.

Every (1 / val_fraction)-th record goes to val, as records do in gptlite.data.prepare. Preference sets are small (tens
of thousands of pairs): they are read and tokenized in this one process, twice (every record is checked before the
folder is touched), and a run starts afresh each time (a complete one with the same settings returns at once).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gptlite.data.prepare.progress import clear_preparation, finished_manifest
from gptlite.data.prepare.sources import resolve_sources
from gptlite.data.prepare.workers import SPLITS, val_documents
from gptlite.data.shards import ANSWER, MANIFEST, START, TARGET, RolesWriter, ShardWriter, token_dtype
from gptlite.extras import need
from gptlite.files import make_dir, read_jsonl, write_json
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, get_tokenizer
from gptlite.tokenizer.chat import check_messages, render

FIELDS = ("prompt", "chosen", "rejected")  # TRL's names; data/prepare.py's --prompt_field, --chosen_field, ...


def prepare_preference(
    inputs: list[str],
    tokenizer_spec: str,
    out_dir: str | Path,
    val_fraction: float = 0.1,
    shard_tokens: int = 100_000_000,
    overwrite: bool = False,
    log=print,
    *,
    fields: tuple[str, str, str] = FIELDS,
    block_size: int = 0,
    dtype: str = "auto",
) -> dict:
    """Tokenize the preference records of `inputs` (JSONL or Parquet files, directories, globs or URLs) into
    out_dir/{train,val}_*.bin with their .roles files, tokenizer.json and manifest.json; return the manifest.
    fields: the records' (prompt, chosen, rejected) fields. block_size: the training window (0: no limit)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if block_size < 0:
        raise ValueError(f"block_size={block_size} must be >= 0 (0: no limit)")
    if tokenizer_spec == "char":
        raise ValueError(
            "--preference needs a tokenizer that encodes any text (byte, a BPE or a model's tokenizer.json); "
            "char learns only the characters of its corpus"
        )
    out_dir = Path(out_dir)
    sources = resolve_sources(inputs, out_dir / "downloads", None, None, "train")
    for source in sources:
        if source["format"] == "text":
            raise ValueError(
                f"--preference reads JSONL or Parquet records with {', '.join(fields)} fields; {source['path']} is "
                "a text file"
            )
    settings = {
        "sources": sources,
        "tokenizer": tokenizer_spec,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "dtype": dtype,
        "preference": {"fields": list(fields), "block_size": block_size},
    }
    manifest = finished_manifest(out_dir, settings)
    if manifest is not None and not overwrite:
        log(f"{out_dir} is already prepared from these inputs ({pairs_line(manifest['pairs'])}); nothing to do")
        return manifest

    tokenizer = get_tokenizer(tokenizer_spec)
    records = read_records(sources, fields)
    first = next(records, None)
    if first is None:
        raise ValueError(f"the inputs ({', '.join(inputs)}) hold no records; there are no pairs to prepare")
    template = tokenizer.chat_template is not None or isinstance(first[0][0], list)
    if template:
        tokenizer.use_default_template()  # ChatML's markers, if it has no template: recorded in tokenizer.json
    # every record is read and encoded once before anything is written or cleared: a malformed one (in the last line
    # as in the first) stops the preparation with the folder as it was, an earlier preparation's data included
    for values, where in itertools.chain([first], records):
        encode_pair(tokenizer, values, fields, template, where)
    records = read_records(sources, fields)
    first = next(records)
    tokens_dtype = token_dtype(tokenizer.vocab_size, dtype)
    make_dir(out_dir)
    clear_preparation(out_dir, log)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    writers = {s: ShardWriter(out_dir, s, tokens_dtype, shard_tokens) for s in SPLITS}
    roles_writers = {s: RolesWriter(out_dir, s, shard_tokens) for s in SPLITS}
    counts = {"kept": 0, "cut": 0, "identical": 0, "prompt_too_long": 0, "pairs": {s: 0 for s in SPLITS}}
    first_dropped: dict[str, str] = {}
    start = time.perf_counter()
    for index, (values, where) in enumerate(itertools.chain([first], records)):  # the first record again
        prompt, chosen, rejected = encode_pair(tokenizer, values, fields, template, where)
        if block_size and len(prompt) >= block_size:
            counts["prompt_too_long"] += 1
            first_dropped.setdefault("prompt_too_long", where)
            continue
        limit = block_size + 1 - len(prompt) if block_size else None  # answer tokens that fit after the prompt
        cut = limit is not None and max(len(chosen), len(rejected)) > limit
        chosen = chosen[:limit]
        rejected = rejected[:limit]
        if chosen == rejected:
            counts["identical"] += 1
            first_dropped.setdefault("identical", where)
            continue
        counts["kept"] += 1
        counts["cut"] += cut
        split = "val" if val_documents(index, 1, val_fraction)[0] else "train"
        counts["pairs"][split] += 1
        ids = prompt + chosen + rejected
        roles = np.zeros(len(ids), dtype=np.uint8)
        roles[0] |= START
        roles[len(prompt) :] |= TARGET
        roles[len(prompt)] |= ANSWER
        roles[len(prompt) + len(chosen)] |= ANSWER
        writers[split].write(np.array(ids, dtype=tokens_dtype))
        roles_writers[split].write(roles)
    for writer in (*writers.values(), *roles_writers.values()):
        writer.finish()
        writer.commit()
    seconds = time.perf_counter() - start

    counts["first_dropped"] = first_dropped
    log(pairs_line(counts))
    if not counts["kept"]:
        raise ValueError(f"no pair of the inputs ({', '.join(inputs)}) is left to train on; see the counts above")
    if not counts["pairs"]["train"] or not counts["pairs"]["val"]:
        raise ValueError(
            f"{counts['kept']} pair(s) are too few to split with val_fraction={val_fraction}; add pairs or change it"
        )
    shards = writers["train"].shards + writers["val"].shards
    roles = roles_writers["train"].shards + roles_writers["val"].shards
    manifest = {
        **settings,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint(),  # its identity by content (Tokenizer.fingerprint)
        "token_dtype": tokens_dtype.name,
        "eot_id": tokenizer.eot_id,
        "shards": [{"file": s["file"], "tokens": s["tokens"]} for s in shards],
        "sha256": {s["file"]: s["sha256"] for s in shards + roles},
        "train_tokens": writers["train"].tokens,
        "val_tokens": writers["val"].tokens,
        "documents": index + 1,
        "replaced": 0,
        "pairs": counts,
    }
    write_json(out_dir / MANIFEST, manifest)
    tokens = manifest["train_tokens"] + manifest["val_tokens"]
    log(
        f"{counts['pairs']['train']:,} train and {counts['pairs']['val']:,} val pairs, {tokens:,} tokens, in "
        f"{len(shards)} shard(s) of {out_dir} in {seconds:.1f}s"
    )
    return manifest


def pairs_line(counts: dict) -> str:
    """The summary of a preparation's counts, naming the first pair dropped for each reason."""
    first = counts.get("first_dropped", {})
    line = (
        f"{counts['kept']:,} pairs kept ({counts['cut']:,} cut to block_size), {counts['identical']:,} dropped with "
        f"identical answers, {counts['prompt_too_long']:,} dropped whose prompt fills block_size"
    )
    if "identical" in first:
        line += f"; first with identical answers: {first['identical']} (nothing to learn from it)"
    if "prompt_too_long" in first:
        line += (
            f"; first with a prompt of block_size tokens or more: {first['prompt_too_long']} (raise --block_size "
            "or shorten the prompts)"
        )
    return line


def read_records(sources: list[dict], fields: tuple[str, str, str]) -> Iterator[tuple[list, str]]:
    """(the record's values of `fields`, how errors name it: "FILE line N" or "FILE row N") per record. A record
    without a field is a ValueError naming it and the option that names the field."""
    flags = ("--prompt_field", "--chosen_field", "--rejected_field")
    for source in sources:
        path = source["path"]
        if source["format"] == "parquet":
            pq = need("pyarrow.parquet", "data", "Parquet input")
            table = pq.read_table(path)
            missing = [(f, flag) for f, flag in zip(fields, flags, strict=True) if f not in table.column_names]
            if missing:
                raise ValueError(
                    f"{path} has no column '{missing[0][0]}' (found: {', '.join(table.column_names)}); pass "
                    f"{missing[0][1]} with the column that holds it"
                )
            columns = [table.column(f).to_pylist() for f in fields]
            for row, values in enumerate(zip(*columns, strict=True)):
                yield list(values), f"{path} row {row + 1}"
            continue
        for where, record in read_jsonl(path, "fix or remove that line", errors="replace"):
            found = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            for name, flag in zip(fields, flags, strict=True):
                if not isinstance(record, dict) or name not in record:
                    raise ValueError(
                        f"{where} has no field '{name}' (found: {found}); a preference record needs a prompt, "
                        f"a chosen and a rejected answer: pass {flag} with the field that holds it, or fix the "
                        "record"
                    )
            yield [record[name] for name in fields], where


def encode_pair(
    tokenizer: Tokenizer, values: list, fields: tuple[str, str, str], template: bool, where: str
) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of one record (see the module's docstring for how each is rendered)."""
    for value, name in zip(values, fields, strict=True):
        if not isinstance(value, (str, list)):
            raise ValueError(
                f"{where}: field '{name}' holds {type(value).__name__}, not text or a list of messages; fix the "
                "record, or pass the option that names the right field"
            )
        if not value or (isinstance(value, str) and not value.strip()):
            raise ValueError(
                f"{where}: field '{name}' is empty; a pair needs a prompt and two answers with text in each (to "
                "prefer saying nothing, write the answer that says so), so fix or drop the record"
            )
    prompt, chosen, rejected = values
    if not template:
        if any(isinstance(v, list) for v in values):
            raise ValueError(
                f"{where} holds messages, but the first record holds text and the tokenizer has no chat template; "
                "write every record the same way"
            )
        eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
        return eot + tokenizer.encode(prompt), tokenizer.encode(chosen) + eot, tokenizer.encode(rejected) + eot
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    special = tokenizer.special_texts()
    before = render(tokenizer.chat_template, check_messages(messages, where), True, special)
    answers = []
    for answer in (chosen, rejected):
        turn = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
        through = render(tokenizer.chat_template, check_messages(messages + turn, where), False, special)
        if not through.startswith(before):
            raise ValueError(
                f"{where}: the chat template does not render the prompt as a prefix of the prompt and its answer, so "
                "the answer cannot be told apart; use a tokenizer whose template renders conversations in order"
            )
        text = through[len(before) :]
        cuts = [text.rindex(end) + len(end) for end in tokenizer.turn_ends() if end and end in text]
        text = text[: max(cuts, default=len(text))]  # up to its end-of-turn marker, as --chat's targets
        answers.append(tokenizer.encode_special(text)[0])
    return tokenizer.encode_special(before)[0], answers[0], answers[1]
