"""The preparation pipeline: worker processes, bounded read-ahead, interrupt and resume, token dtypes, the
manifest's checksums and their verification."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gptlite.data.prepare
from gptlite.data.loader import read_shard, verify_manifest, write_shard
from gptlite.data.prepare import pipeline, prepare
from tests.conftest import ROOT, shared_file

TEXT = "".join(f"Line {i}: all the world's a stage — 舞台 {i * 7}.\n" for i in range(400))  # ~20 kB


def quiet(*args, **kwargs):
    pass


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 256 bytes, batches of two: a 20 kB corpus makes dozens of batches."""
    monkeypatch.setattr(gptlite.data.prepare.sources, "BLOCK_BYTES", 256)
    monkeypatch.setattr(pipeline, "BATCH_BLOCKS", 2)


def corpus(tmp_path: Path) -> list[str]:
    """Two text files and a JSONL file: blocks, whole documents and records."""
    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / "a.txt").write_text(TEXT)
    (tmp_path / "in" / "b.txt").write_text(TEXT[:3000])
    (tmp_path / "in" / "c.jsonl").write_text(
        "".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()[:60])
    )
    return [str(tmp_path / "in")]


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_worker_processes_write_the_same_files(tmp_path, small_blocks):
    gpt2 = str(shared_file("tokenizers/gpt2.tiktoken"))
    inputs, logged = corpus(tmp_path), []
    one = prepare(inputs, gpt2, tmp_path / "one", shard_tokens=1000, workers=1, log=quiet)
    two = prepare(inputs, gpt2, tmp_path / "two", shard_tokens=1000, workers=2, log=logged.append)
    assert "in 2 process(es)" in logged[0]
    assert one == two and len(one["shards"]) > 4
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


@pytest.mark.parametrize("workers", [1, 2])
def test_reading_stays_at_most_a_few_batches_ahead(tmp_path, small_blocks, monkeypatch, workers):
    """Memory is bounded: the reader never runs more than IN_FLIGHT_PER_WORKER batches per worker ahead of the
    writer."""
    read, written, ahead = [0], [0], []
    batched, save_progress = pipeline.batched, pipeline.save_progress

    def counting_batches(*args):
        for batch in batched(*args):
            read[0] += 1
            yield batch

    def counting_saves(*args):
        written[0] += 1
        ahead.append(read[0] - written[0])
        save_progress(*args)

    monkeypatch.setattr(pipeline, "batched", counting_batches)
    monkeypatch.setattr(pipeline, "save_progress", counting_saves)
    prepare(corpus(tmp_path), "byte", tmp_path / "out", workers=workers, log=quiet)
    assert written[0] > 30
    assert max(ahead) <= (gptlite.data.prepare.workers.IN_FLIGHT_PER_WORKER * workers if workers > 1 else 0)


# ---------------------------------------------------------------------------------------------
# interrupt and resume


class Interrupt(Exception):
    pass


def interrupt_after(monkeypatch, checkpoints: int, where: str) -> None:
    """Make prepare stop like a Ctrl-C or a crash, at the given point of the checkpoint after `checkpoints` batches."""
    save_progress, commit, count = pipeline.save_progress, pipeline.ShardWriter.commit, [0]

    def save(out_dir, progress, writers):
        count[0] += 1
        if count[0] > checkpoints and where == "before_checkpoint":  # tokens written, progress not saved
            raise Interrupt
        save_progress(out_dir, progress, writers)
        if count[0] > checkpoints and where == "after_checkpoint":
            raise Interrupt

    def commit_or_crash(self):
        if (
            count[0] > checkpoints and where == "before_rename" and self.pending
        ):  # progress lists shards not yet renamed
            raise Interrupt
        commit(self)

    monkeypatch.setattr(pipeline, "save_progress", save)
    monkeypatch.setattr(pipeline.ShardWriter, "commit", commit_or_crash)


@pytest.mark.parametrize(
    "where, workers",
    [
        ("before_checkpoint", 1),
        ("after_checkpoint", 1),
        ("before_rename", 1),
        ("after_checkpoint", 2),
    ],
)
def test_resume_after_an_interruption_writes_what_an_uninterrupted_run_does(
    tmp_path, small_blocks, monkeypatch, where, workers
):
    inputs = corpus(tmp_path)
    whole = prepare(inputs, "byte", tmp_path / "whole", shard_tokens=2000, workers=1, log=quiet)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 20, where)
        with pytest.raises(Interrupt):
            prepare(inputs, "byte", out, shard_tokens=2000, workers=workers, log=quiet)
    assert not (out / "manifest.json").exists() and (out / "progress.json").is_file()
    for shard in out.glob("*.bin"):  # a file under its final name is complete
        assert len(read_shard(shard)) == 2000
    progress = json.loads((out / "progress.json").read_text())
    assert progress["bytes"] > 8000

    logged, reread = [], []
    batched = pipeline.batched
    monkeypatch.setattr(pipeline, "batched", lambda *args: (reread.append(b) or b for b in batched(*args)))
    resumed = prepare(inputs, "byte", out, shard_tokens=2000, workers=workers, log=logged.append)
    assert logged[0].startswith(f"resuming {out} after ")
    total = sum(p.stat().st_size for p in Path(inputs[0]).iterdir())
    assert sum(piece.n_bytes for batch in reread for piece in batch) == total - progress["bytes"]  # only the rest
    assert resumed == whole
    assert files_of(out) == files_of(tmp_path / "whole")  # progress.json and every .tmp are gone


@pytest.mark.parametrize("hf_dataset", [None, "parquet"])
def test_resume_in_the_middle_of_a_parquet_row_group(tmp_path, monkeypatch, hf_dataset):
    """Rows are read in batches of 1,024; a resume point can fall inside a row group (Parquet) or a stream
    (Hugging Face)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "rows.parquet"
    texts = [f"row {i}: {'abc ' * (i % 7)}" for i in range(3000)]
    pq.write_table(pa.table({"text": texts}), src, row_group_size=3000)
    monkeypatch.setattr(
        gptlite.data.prepare.sources, "BLOCK_BYTES", 2000
    )  # a batch of 1,024 rows is a batch of its own
    kwargs = {"shard_tokens": 5000, "workers": 1, "hf_dataset": hf_dataset, "log": quiet}
    whole = prepare([str(src)], "byte", tmp_path / "whole", **kwargs)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 0, "after_checkpoint")
        with pytest.raises(Interrupt):
            prepare([str(src)], "byte", out, **kwargs)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["cursor"] == {"source": 0, "position": 1024, "records": 1024}
    assert prepare([str(src)], "byte", out, **kwargs) == whole
    assert files_of(out) == files_of(tmp_path / "whole")


def test_resume_starts_afresh_when_settings_change_or_files_are_damaged(tmp_path, small_blocks, monkeypatch):
    inputs = corpus(tmp_path)
    whole = prepare(inputs, "byte", tmp_path / "whole", shard_tokens=2000, workers=1, log=quiet)
    out = tmp_path / "out"

    def interrupted(**kwargs):
        with monkeypatch.context() as m:
            interrupt_after(m, 20, "after_checkpoint")
            with pytest.raises(Interrupt):
                prepare(inputs, "byte", out, workers=1, log=quiet, **kwargs)

    interrupted(shard_tokens=3000)
    logged = []
    assert prepare(inputs, "byte", out, shard_tokens=2000, workers=1, log=logged.append) == whole  # other settings
    assert "starting afresh" in logged[0]

    interrupted(shard_tokens=2000, overwrite=True)  # out_dir was complete: start again
    open_shard = next(out.glob("*.tmp"))
    open_shard.write_bytes(open_shard.read_bytes()[:1100])  # the open shard lost tokens (a power cut)
    logged = []
    assert prepare(inputs, "byte", out, shard_tokens=2000, workers=1, log=logged.append) == whole
    assert "starting afresh" in logged[0]

    interrupted(shard_tokens=2000, overwrite=True)
    (out / "progress.json").write_text('{"settings": ')  # damaged
    logged = []
    assert prepare(inputs, "byte", out, shard_tokens=2000, workers=1, log=logged.append) == whole
    assert "starting afresh" in logged[0]

    (out / "manifest.json").write_text("")  # a damaged manifest is not a finished preparation
    assert prepare(inputs, "byte", out, shard_tokens=2000, workers=1, log=quiet) == whole

    interrupted(shard_tokens=2000, overwrite=True)
    logged = []
    assert prepare(inputs, "byte", out, shard_tokens=2000, workers=1, overwrite=True, log=logged.append) == whole
    assert not any(line.startswith("resuming") or "unfinished preparation" in line for line in logged)
    assert files_of(out) == files_of(tmp_path / "whole")


# ---------------------------------------------------------------------------------------------
# token dtype


def test_dtype_follows_the_vocabulary_or_is_chosen(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    manifest = prepare([str(src)], "byte", tmp_path / "auto", log=quiet)
    assert manifest["token_dtype"] == "uint16" and read_shard(tmp_path / "auto" / "train_000000.bin").dtype == np.uint16
    manifest = prepare([str(src)], "byte", tmp_path / "wide", dtype="uint32", log=quiet)
    shard = tmp_path / "wide" / "train_000000.bin"
    assert manifest["token_dtype"] == "uint32" and np.frombuffer(shard.read_bytes()[:8], "<i4").tolist() == [
        20240801,
        7,
    ]
    assert bytes(read_shard(shard).tolist()) == TEXT.encode()[: manifest["train_tokens"]]


def test_vocabulary_too_large_for_the_dtype(tmp_path, monkeypatch):
    from gptlite.tokenizer import ByteTokenizer

    class Wide(ByteTokenizer):
        vocab_size = 100_277

    monkeypatch.setattr(pipeline, "get_tokenizer", lambda spec: Wide())
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    with pytest.raises(
        ValueError, match=r"the tokenizer's 100,277 ids do not fit uint16 \(at most 65,536\); use dtype uint32 or auto"
    ):
        prepare([str(src)], "cl100k_base", tmp_path / "out", dtype="uint16", log=quiet)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "int8"}, r"dtype='int8' must be auto, uint16 or uint32"),
        ({"workers": 0}, r"workers=0 must be >= 1"),
    ],
)
def test_bad_options(tmp_path, kwargs, message):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    with pytest.raises(ValueError, match=message):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet, **kwargs)


# ---------------------------------------------------------------------------------------------
# the manifest: checksums, verification, the summary


def test_manifest_checksums_and_verification(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    manifest = prepare([str(src)], "byte", out, shard_tokens=5000, log=quiet)
    assert sorted(manifest["sha256"]) == sorted(s["file"] for s in manifest["shards"])
    assert verify_manifest(out) == manifest

    shard = out / "train_000001.bin"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 1  # one flipped bit
    shard.write_bytes(bytes(data))
    verify_manifest(out, checksums=False)  # counts still match
    with pytest.raises(ValueError, match=r"shard .*train_000001\.bin does not match its sha256 in the manifest"):
        verify_manifest(out)

    write_shard(shard, [1, 2, 3], 256)
    with pytest.raises(ValueError, match=r"train_000001\.bin holds 3 tokens but the manifest says 5,000"):
        verify_manifest(out)

    write_shard(out / "train_000099.bin", [1, 2, 3], 256)
    with pytest.raises(ValueError, match=r"holds shards its manifest does not list \(train_000099\.bin\)"):
        verify_manifest(out)

    (out / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no manifest\.json: its preparation did not finish"):
        verify_manifest(out)


def test_cli_verify(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    prepare([str(src)], "byte", out, log=quiet)
    run = [sys.executable, str(ROOT / "data" / "prepare.py"), "--verify", "--out_dir", str(out)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 shards match manifest.json" in r.stdout, r.stderr
    (out / "val_000000.bin").write_bytes(b"")
    r = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "val_000000.bin is truncated" in r.stderr


def test_summary(tmp_path):
    gpt2 = str(shared_file("tokenizers/gpt2.tiktoken"))
    inputs = corpus(tmp_path)
    logged = []
    manifest = prepare(inputs, gpt2, tmp_path / "out", shard_tokens=3000, log=logged.append)
    tokens = manifest["train_tokens"] + manifest["val_tokens"]
    assert manifest["documents"] == 2 + 60
    assert logged[-1].startswith(f"62 documents, {tokens:,} tokens ({tokens / 62:,.1f} per document; ")
    assert f" in {len(manifest['shards']) - 1} train + 1 val shard(s); " in logged[-1] and "MB/s" in logged[-1]


# ---------------------------------------------------------------------------------------------
# the tokenizers' array path


@pytest.mark.parametrize("spec", ["byte", "char", "gpt2"])
def test_encode_to_numpy_equals_encode(spec):
    from gptlite.tokenizer import get_tokenizer

    texts = ["", TEXT[:500], "special strings are text: <|endoftext|>", "a lone surrogate \ud800 from a JSON escape"]
    if spec == "char":
        tokenizer = get_tokenizer("char", "".join(texts[:3]))
        texts = texts[:3]
    else:
        tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")) if spec == "gpt2" else spec)
        if spec == "byte":
            texts = texts[:3]  # UTF-8 has no lone surrogates
    for text in texts:
        ids = tokenizer.encode_to_numpy(text)
        assert ids.dtype == np.uint32 and ids.tolist() == tokenizer.encode(text)


@pytest.mark.parametrize("eot", [True, False])
def test_encode_documents_equals_encoding_text_by_text(eot):
    """The one-call path (texts joined by <|endoftext|>, special allowed) gives each text's encode_ordinary ids,
    after an end-of-text token each: across trailing spaces and newlines (GPT-2's pattern ends a text with its
    own space rule), a text that ends or starts with part of the special string, one that holds all of it, and a
    lone surrogate."""
    from gptlite.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    eot_ids = [tokenizer.eot_id] if eot else []
    cases = [
        ["hello  \n", " world's  ", "\n\n", "a<|endoftext", "|>b", "  trailing   ", "ünïcödé 123 4567", TEXT[:300]],
        ["plain", "special strings are text: <|endoftext|>", "after"],
        ["a lone surrogate \ud800 from a JSON escape", "next"],
        [],
    ]
    for texts in cases:
        tokens, lengths = tokenizer.encode_documents(texts, eot)
        want = [eot_ids + tokenizer.encode_to_numpy(t).tolist() for t in texts]
        assert tokens.dtype == np.uint32 and tokens.tolist() == [i for ids in want for i in ids]
        assert lengths.tolist() == [len(ids) for ids in want]


@pytest.mark.parametrize(
    "signum,to_group",
    [("SIGINT", True), ("SIGTERM", True), ("SIGINT", False), ("SIGTERM", False)],
    ids=["ctrl-c", "term-group", "int-main-only", "term-main-only"],
)
def test_cli_interrupted_then_the_same_command_continues(tmp_path, signum, to_group):
    """SIGINT or SIGTERM, to the whole process group (a terminal's Ctrl-C) or to the main process alone (kill,
    timeout, a scheduler), stops with one line and 128 + the signal number, leaving no worker behind; the same
    command then resumes and writes what an uninterrupted run writes."""
    import os
    import signal
    import time

    src = tmp_path / "corpus.txt"
    src.write_text(TEXT * 1500)  # ~30 MB: several seconds of work at the byte level
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "data" / "prepare.py"),
        "--input",
        str(src),
        "--tokenizer",
        "byte",
        "--out_dir",
        str(out),
        "--shard_tokens",
        "4000000",
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    deadline = time.time() + 60
    while not (out / "progress.json").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    number = getattr(signal, signum)
    (os.killpg if to_group else os.kill)(proc.pid, number)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + number, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"prepare.py: interrupted ({signum}); run the same command again to continue in {out}"
    )
    assert not (out / "manifest.json").exists()
    deadline = time.time() + 30  # the workers end with the pool: the process group empties
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("worker processes were left running")

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"resuming {out} after ")
    whole = prepare([str(src)], "byte", tmp_path / "whole", shard_tokens=4_000_000, log=quiet)
    assert json.loads((out / "manifest.json").read_text()) == whole
