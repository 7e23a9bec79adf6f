"""Document sources: JSONL, Parquet and Hugging Face (streaming, on local files), the record val split,
text fields, undecodable bytes and each bad input's message."""

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gptlite.data.prepare
from gptlite.data.loader import find_shards, read_shard
from gptlite.data.prepare import pipeline, prepare
from gptlite.tokenizer import load_tokenizer
from tests.conftest import ROOT, shared_file

EOT = 50256
DOCS = [f"Document {i}: {'naïve café — ' * (i % 4)}the {i}th story.\n" for i in range(30)]


def quiet(*args, **kwargs):
    pass


def gpt2() -> str:
    return str(shared_file("tokenizers/gpt2.tiktoken"))


def tokens_of(out: Path, split: str) -> list[int]:
    return [t for f in find_shards(out, split) for t in read_shard(f).tolist()]


def documents(out: Path, split: str) -> list[str]:
    """The documents of a split, cut at the end-of-text token that starts each."""
    tokens, tok = tokens_of(out, split), load_tokenizer(out / "tokenizer.json")
    assert tokens[0] == EOT
    starts = [i for i, t in enumerate(tokens) if t == EOT]
    return [tok.decode(tokens[s + 1 : e]) for s, e in zip(starts, starts[1:] + [len(tokens)], strict=True)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=7)  # several row groups
    return path


def records(field: str = "text") -> list[dict]:
    return [{"id": i, field: text} for i, text in enumerate(DOCS)]


# ---------------------------------------------------------------------------------------------
# records: one document each, every tenth to val


def test_jsonl_records_are_documents_and_every_tenth_is_val(tmp_path):
    lines = records()
    lines.insert(5, {"id": -1, "text": ""})  # an empty document is skipped
    src = write_jsonl(tmp_path / "docs.jsonl", lines)
    with open(src, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    manifest = prepare([str(src)], gpt2(), tmp_path / "out", log=quiet)
    assert documents(tmp_path / "out", "val") == [DOCS[9], DOCS[19], DOCS[29]]
    assert documents(tmp_path / "out", "train") == [d for i, d in enumerate(DOCS) if i not in (9, 19, 29)]
    assert manifest["documents"] == 30 and manifest["sources"][0]["format"] == "jsonl"
    assert manifest["replaced"] == 0


def test_parquet_and_hugging_face_streaming_give_the_same_shards_as_jsonl(tmp_path):
    """The Hugging Face path (datasets in streaming mode) runs on local files, as offline users and these tests do."""
    jsonl = write_jsonl(tmp_path / "docs.jsonl", records("content"))
    parquet = write_parquet(tmp_path / "docs.parquet", {"id": list(range(30)), "content": DOCS})
    runs = {
        "jsonl": prepare([str(jsonl)], gpt2(), tmp_path / "jsonl", text_field="content", log=quiet),
        "parquet": prepare([str(parquet)], gpt2(), tmp_path / "parquet", text_field="content", log=quiet),
        "hf_json": prepare(
            [str(jsonl)], gpt2(), tmp_path / "hf_json", text_field="content", hf_dataset="json", log=quiet
        ),
        "hf_parquet": prepare(
            [str(parquet)], gpt2(), tmp_path / "hf_parquet", text_field="content", hf_dataset="parquet", log=quiet
        ),
    }
    assert (
        runs["parquet"]["sha256"]
        == runs["jsonl"]["sha256"]
        == runs["hf_json"]["sha256"]
        == runs["hf_parquet"]["sha256"]
    )
    assert runs["hf_json"]["sources"][0]["format"] == "hf" and runs["hf_json"]["sources"][0]["dataset"] == "json"
    assert documents(tmp_path / "hf_parquet", "val") == [DOCS[9], DOCS[19], DOCS[29]]
    again = prepare(
        [str(parquet)], gpt2(), tmp_path / "hf_parquet", text_field="content", hf_dataset="parquet", log=quiet
    )
    assert again == runs["hf_parquet"]  # complete: returns at once
    # the progress bar's total for Parquet: the text column's uncompressed size, its text plus per-row and per-page
    # overhead
    text_bytes = len("".join(DOCS).encode())
    assert (
        text_bytes <= gptlite.data.prepare.sources.input_bytes(runs["parquet"]["sources"], "content") < 2 * text_bytes
    )


def test_text_files_and_records_together(tmp_path):
    """Text splits at its last 10% of bytes, records by document, each in input order."""
    text = tmp_path / "book.txt"
    text.write_text("A long book.\n" * 100)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", records()[:10])
    prepare([str(text), str(jsonl)], "byte", tmp_path / "out", log=quiet)
    train, val = bytes(tokens_of(tmp_path / "out", "train")), bytes(tokens_of(tmp_path / "out", "val"))
    assert train == text.read_bytes()[:1170] + "".join(DOCS[:9]).encode()
    assert val == text.read_bytes()[1170:] + DOCS[9].encode()


def test_record_corpus_too_small_for_a_val_document(tmp_path):
    src = write_jsonl(tmp_path / "few.jsonl", records()[:5])
    with pytest.raises(ValueError, match=r"too small to split with val_fraction=0.1"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)
    prepare([str(src)], "byte", tmp_path / "ok", val_fraction=0.2, log=quiet)  # the 5th document is val


@pytest.mark.parametrize("fraction", [0.1, 0.05, 0.3, 1 / 3, 0.001])
def test_val_documents_follow_the_rule_for_every_index(fraction):
    """The vectorized val choice equals document i being val when int((i + 1) * f) > int(i * f)."""
    for first in (0, 12_345, 10**9 + 7):
        expected = [int((i + 1) * fraction) > int(i * fraction) for i in range(first, first + 2000)]
        assert gptlite.data.prepare.workers.val_documents(first, 2000, fraction).tolist() == expected


@pytest.mark.parametrize(
    "line",
    [
        '{"a": 1}',
        ' {"a": 1}',
        '{"a": 1}\r',
        '{"a": 1} x',
        '\ufeff{"a": 1}',
        "1, 2",
        "[1",
        "{}{}",
        '"s"  ',
        '{"a": "x\ty"}',
        "",
    ],
)
def test_parse_json_answers_as_json_loads(line):
    def answer(parse):
        try:
            return parse(line)
        except json.JSONDecodeError as e:
            return str(e)

    assert answer(gptlite.data.prepare.sources.parse_json) == answer(json.loads)


def test_records_longer_than_a_read_block_are_whole(tmp_path, monkeypatch):
    """JSONL is read in blocks of whole lines; a line longer than a block is a block of its own."""
    docs = [f"{i}: " + "long " * (i * 7 % 40) + "\n" for i in range(60)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    whole = prepare([str(src)], gpt2(), tmp_path / "whole", log=quiet)
    monkeypatch.setattr(gptlite.data.prepare.sources, "BLOCK_BYTES", 64)
    monkeypatch.setattr(pipeline, "BATCH_BLOCKS", 2)
    small = prepare([str(src)], gpt2(), tmp_path / "small", log=quiet)
    assert small["sha256"] == whole["sha256"] and small["documents"] == 60
    assert documents(tmp_path / "small", "train") == [d for i, d in enumerate(docs) if i % 10 != 9]


def test_the_main_process_parses_only_the_first_record(tmp_path, monkeypatch):
    """With worker processes, the main process reads JSONL as blocks of bytes: it parses the first record (to
    check the text field before any work) and no other, so its work does not grow with the number of records."""
    docs = [f"Record {i}: {'short text ' * (i % 5)}\n" for i in range(400)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    parsed, parse_json = [], gptlite.data.prepare.sources.parse_json
    monkeypatch.setattr(
        gptlite.data.prepare.sources, "parse_json", lambda line: parsed.append(line) or parse_json(line)
    )
    monkeypatch.setattr(gptlite.data.prepare.sources, "BLOCK_BYTES", 1024)
    logged = []
    manifest = prepare([str(src)], gpt2(), tmp_path / "out", workers=2, log=logged.append)
    assert "in 2 process(es)" in logged[0]
    assert len(parsed) == 1 and manifest["documents"] == 400
    assert documents(tmp_path / "out", "val") == docs[9::10]


# ---------------------------------------------------------------------------------------------
# undecodable bytes: replaced and counted, never fatal


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes("café\n".encode("latin-1") * 3 + b"ok \xff\xfe end\n" + b"fine\n" * 20)
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(
        b'{"text": "bad \xc3 byte"}\n' + "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:9]).encode()
    )
    logged = []
    manifest = prepare([str(text), str(jsonl)], gpt2(), tmp_path / "out", log=logged.append)
    assert manifest["replaced"] == 3 + 2 + 1
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    all_text = tok.decode(
        [t for t in tokens_of(tmp_path / "out", "train") + tokens_of(tmp_path / "out", "val") if t != EOT]
    )
    assert all_text.startswith("caf\ufffd\n" * 3 + "ok \ufffd\ufffd end\n") and "bad \ufffd byte" in all_text
    assert "replaced 6 undecodable byte sequence(s) with U+FFFD" in logged[-1]


def test_hugging_face_json_replaces_undecodable_bytes_as_jsonl_does(tmp_path):
    """pyarrow's JSON reader lets invalid UTF-8 into a string column; it is replaced and counted, not fatal."""
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "bad \xc3 byte"}\n' + "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:9]).encode())
    jsonl = prepare([str(src)], gpt2(), tmp_path / "jsonl", log=quiet)
    hf = prepare([str(src)], gpt2(), tmp_path / "hf", hf_dataset="json", log=quiet)
    assert hf["sha256"] == jsonl["sha256"] and hf["replaced"] == jsonl["replaced"] == 1


# ---------------------------------------------------------------------------------------------
# bad input: one clear message each, before any output exists


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_json"])
def test_wrong_text_field(tmp_path, kind):
    if kind == "parquet":
        src = write_parquet(tmp_path / "docs.parquet", {"id": list(range(30)), "content": DOCS})
    else:
        src = write_jsonl(tmp_path / "docs.jsonl", records("content"))
    hf = {"hf_dataset": "json"} if kind == "hf_json" else {}
    with pytest.raises(ValueError, match=r"has no (field|column) 'text' \(found: id, content\); pass --text_field"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet, **hf)
    assert not (tmp_path / "out").exists()


def test_field_missing_from_a_later_record(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", records()[:3] + [{"id": 3, "body": "x"}])
    with pytest.raises(ValueError, match=r"docs\.jsonl line 4 has no field 'text' \(found: id, body\)"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)


def test_field_that_is_not_text(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": 12}])
    with pytest.raises(TypeError, match=r"docs\.jsonl line 1: field 'text' holds int, not text"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)


def test_line_that_is_not_json(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    with pytest.raises(
        ValueError, match=r"docs\.jsonl line 3 is not JSON \(Expecting value\); fix or remove that line"
    ):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"text": oops}', r"line 150 is not JSON \(Expecting value\); fix or remove that line"),
        ('{"id": 149, "body": "x"}', r"line 150 has no field 'text' \(found: id, body\)"),
        ('{"text": ["a list"]}', r"line 150: field 'text' holds list, not text"),
    ],
)
def test_a_bad_line_found_by_a_worker_is_named_by_its_number(tmp_path, monkeypatch, bad, message):
    """The workers parse the lines; an error deep in the file, in a later block, still names file and line."""
    lines = [json.dumps({"id": i, "text": f"record {i}"}) for i in range(200)]
    lines[149] = bad
    lines[40] = ""  # a blank line counts as a line
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(gptlite.data.prepare.sources, "BLOCK_BYTES", 512)
    with pytest.raises((ValueError, TypeError), match=r"docs\.jsonl " + message):
        prepare([str(src)], gpt2(), tmp_path / "out", workers=2, log=quiet)


def test_file_that_is_not_parquet(tmp_path):
    src = tmp_path / "docs.parquet"
    src.write_text("not parquet at all")
    with pytest.raises(ValueError, match=r"docs\.parquet is not a readable Parquet file"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)


def test_unreadable_file(tmp_path, monkeypatch):
    src = tmp_path / "secret.txt"
    src.write_text("some text\n")

    def denied(path, *args, **kwargs):
        if Path(path) == src:
            raise PermissionError(13, "Permission denied")  # as open() does for a file without read permission
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(gptlite.data.prepare.sources, "open", denied, raising=False)
    with pytest.raises(
        PermissionError,
        match=r"cannot read input .*secret\.txt \(Permission denied\); check that it is a readable file",
    ):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()


def test_missing_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(
        ImportError, match=r'Hugging Face input needs the datasets package: pip install -e "\.\[data\]"'
    ):
        prepare([], "byte", tmp_path / "out", hf_dataset="HuggingFaceFW/fineweb-edu", hf_name="sample-10BT", log=quiet)


def test_no_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"no inputs: pass text/JSONL/Parquet files"):
        prepare([], "byte", tmp_path / "out", log=quiet)


# ---------------------------------------------------------------------------------------------
# the command line


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "data" / "prepare.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare.py: error: "), r.stderr
    return lines[0]


def test_cli_jsonl_with_a_text_field(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", records("content"))
    r = run("--input", str(src), "--text_field", "content", "--tokenizer", "byte", "--out_dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "30 documents" in r.stdout
    assert bytes(tokens_of(tmp_path / "out", "val")) == (DOCS[9] + DOCS[19] + DOCS[29]).encode()


def test_cli_wrong_text_field_is_one_line(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", records("content"))
    line = one_line_error(run("--input", str(src), "--tokenizer", "byte", "--out_dir", str(tmp_path / "out")))
    assert "has no field 'text'" in line and "--text_field" in line


def test_cli_hugging_face_offline_is_one_line(tmp_path):
    r = run(
        "--hf_dataset",
        "roneneldan/TinyStories",
        "--tokenizer",
        "byte",
        "--out_dir",
        str(tmp_path / "out"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    line = one_line_error(r)
    assert "could not reach Hugging Face dataset 'roneneldan/TinyStories'" in line and "--input" in line


def test_cli_needs_an_input():
    r = run("--out_dir", "anywhere")
    assert r.returncode == 2 and "give --input files or --hf_dataset" in r.stderr


def test_hugging_face_offline_fails_at_once_where_the_hubs_name_does_not_resolve(tmp_path, monkeypatch):
    """Offline, huggingface_hub retried a host whose name does not resolve for 26 s before the clear error; the
    name is asked first, and the same error comes at once, nothing streamed. A dataset of local files asks nothing."""
    datasets = pytest.importorskip("datasets")
    import socket

    from gptlite.data.prepare import sources

    def unresolved(host, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    def no_stream(*args, **kwargs):
        raise AssertionError("streamed from the Hub")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    monkeypatch.setattr(datasets, "load_dataset", no_stream)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    said = (
        r"^could not reach Hugging Face dataset 'roneneldan/TinyStories' \(\S+ cannot be resolved: Name or service not "
        r"known\); check the name and the network, or download its files and pass them with --input$"
    )
    with pytest.raises(ConnectionError, match=said):
        prepare([], "byte", tmp_path / "out", hf_dataset="roneneldan/TinyStories", log=quiet)
    assert sources.hub_unresolved().endswith("cannot be resolved: Name or service not known")
    monkeypatch.undo()
    src = write_jsonl(tmp_path / "docs.jsonl", records("content"))
    monkeypatch.setattr(socket, "getaddrinfo", unresolved)  # a dataset of local files streams on without the Hub
    manifest = prepare([str(src)], "byte", tmp_path / "local", text_field="content", hf_dataset="json", log=quiet)
    assert manifest["sources"][0]["dataset"] == "json"
