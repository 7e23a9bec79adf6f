"""Dataset preparation: shards, split point, documents, re-runs, errors and the two CLI scripts."""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gptlite.data.prepare
from gptlite.data.loader import find_shards, read_shard
from gptlite.data.prepare import pipeline, prepare
from gptlite.tokenizer import load_tokenizer
from tests.conftest import shared_file

ROOT = Path(__file__).resolve().parents[2]
EOT = 50256
TEXT = "".join(f"Line {i}: to be, or not to be, that is the question.\n" for i in range(40))  # 2,070 ASCII bytes
UNICODE_TEXT = "Ça va? Größe — 日本語のテキスト 🙂 naïve café\n" * 12


def quiet(*args, **kwargs):
    pass


def tokens_of(out_dir: Path, split: str) -> list[int]:
    return [t for f in find_shards(out_dir, split) for t in read_shard(f).tolist()]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    return path


def mtimes(out_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out_dir.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# outputs and round trips


@pytest.mark.parametrize("spec", ["byte", "char", "gpt2"])
def test_prepare_writes_shards_and_tokenizer(tmp_path, spec):
    src = write(tmp_path / "corpus.txt", TEXT)
    out = tmp_path / "out"
    tokenizer_spec = str(gpt2_ranks()) if spec == "gpt2" else spec
    manifest = prepare([str(src)], tokenizer_spec, out, log=quiet)

    assert [p.name for p in sorted(out.glob("*.bin"))] == ["train_000000.bin", "val_000000.bin"]
    assert (out / "tokenizer.json").is_file() and (out / "manifest.json").is_file()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    train, val = tokens_of(out, "train"), tokens_of(out, "val")
    assert manifest["train_tokens"] == len(train) > 0 and manifest["val_tokens"] == len(val) > 0
    assert manifest["shards"] == [
        {"file": "train_000000.bin", "tokens": len(train)},
        {"file": "val_000000.bin", "tokens": len(val)},
    ]
    tok = load_tokenizer(out / "tokenizer.json")
    assert manifest["vocab_size"] == tok.vocab_size
    assert max(train + val) < tok.vocab_size
    if spec == "gpt2":
        assert tok.vocab_size == 50257 and tok.eot_id == EOT
        assert train[0] == EOT and train.count(EOT) == 1 and EOT not in val
    else:
        assert tok.eot_id is None
    # the tokens, train then val, are the text again
    assert tok.decode([t for t in train + val if t != tok.eot_id]) == TEXT
    if spec == "byte":
        assert bytes(train + val) == TEXT.encode()
    if spec == "char":
        assert tok.vocab_size == len(set(TEXT))


@pytest.mark.parametrize("spec", ["byte", "char"])
def test_split_is_at_90_percent_of_the_bytes(tmp_path, spec):
    src = write(tmp_path / "corpus.txt", TEXT)
    manifest = prepare([str(src)], spec, tmp_path / "out", log=quiet)
    n = len(TEXT.encode())
    assert manifest["train_tokens"] == int(n * 0.9) == 1863  # nanoGPT: data[: int(n * 0.9)]
    assert manifest["val_tokens"] == n - int(n * 0.9)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert tok.decode(tokens_of(tmp_path / "out", "train")) == TEXT[: int(n * 0.9)]
    assert tok.decode(tokens_of(tmp_path / "out", "val")) == TEXT[int(n * 0.9) :]


def test_val_fraction_moves_the_split(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT)
    manifest = prepare([str(src)], "byte", tmp_path / "out", val_fraction=0.25, log=quiet)
    assert manifest["train_tokens"] == int(len(TEXT) * 0.75)


@pytest.mark.parametrize("spec", ["byte", "char"])
def test_split_never_cuts_a_character(tmp_path, spec):
    text = "日本語" * 37  # 333 bytes of 3-byte characters; int(333 * 0.9) = 299 falls inside one
    n = len(text.encode())
    assert int(n * 0.9) % 3 != 0
    src = write(tmp_path / "jp.txt", text)
    prepare([str(src)], spec, tmp_path / "out", log=quiet)
    train, val = tokens_of(tmp_path / "out", "train"), tokens_of(tmp_path / "out", "val")
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    train_text, val_text = tok.decode(train), tok.decode(val)
    assert "\ufffd" not in train_text + val_text
    assert train_text + val_text == text
    assert len(train_text.encode()) == 300  # moved forward to the next character start
    if spec == "byte":
        bytes(train).decode("utf-8")  # strict: each split is valid UTF-8 on its own
        bytes(val).decode("utf-8")


@pytest.mark.parametrize("block_bytes", [5, 16, 64])
def test_small_read_blocks_keep_text_exact(tmp_path, monkeypatch, block_bytes):
    """Blocks cut at line ends or character starts, many of them: the text still comes back byte for byte."""
    monkeypatch.setattr(gptlite.data.prepare.sources, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(pipeline, "BATCH_BLOCKS", 3)
    text = UNICODE_TEXT + "no newline at the end: 🙂🙂🙂 日本"
    src = write(tmp_path / "u.txt", text)
    for i, spec in enumerate(["byte", "char", str(gpt2_ranks())]):
        out = tmp_path / f"out_{i}"
        prepare([str(src)], spec, out, log=quiet)
        tok = load_tokenizer(out / "tokenizer.json")
        train, val = tokens_of(out, "train"), tokens_of(out, "val")
        assert tok.decode([t for t in train if t != tok.eot_id]) + tok.decode(val) == text
        n_train_bytes = len(tok.decode([t for t in train if t != tok.eot_id]).encode())
        assert int(len(text.encode()) * 0.9) <= n_train_bytes < int(len(text.encode()) * 0.9) + 4


def test_documents_each_start_with_eot(tmp_path):
    docs = {
        "a.txt": "The first document.\n",
        "b.txt": "Second — with ümlauts.\n" * 3,
        "sub/c.txt": "Third one, in a subdirectory.\n" * 4,
    }
    corpus = tmp_path / "corpus"
    for name, text in docs.items():
        write(corpus / name, text)
    write(corpus / ".hidden", "never read")
    ordered = [docs["a.txt"], docs["b.txt"], docs["sub/c.txt"]]  # sorted paths

    def documents(out: Path) -> list[str]:
        tokens = tokens_of(out, "train") + tokens_of(out, "val")
        assert tokens[0] == EOT
        tok = load_tokenizer(out / "tokenizer.json")
        starts = [i for i, t in enumerate(tokens) if t == EOT]
        return [tok.decode(tokens[s + 1 : e]) for s, e in zip(starts, starts[1:] + [len(tokens)], strict=True)]

    manifest = prepare([str(corpus)], str(gpt2_ranks()), tmp_path / "dir_out", log=quiet)
    assert documents(tmp_path / "dir_out") == ordered
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["a.txt", "b.txt", "c.txt"]

    prepare([str(corpus / "*.txt")], str(gpt2_ranks()), tmp_path / "glob_out", log=quiet)
    assert documents(tmp_path / "glob_out") == ordered[:2]

    # several specs at once, in the order given; the split falls inside the last document
    prepare([str(corpus / "sub" / "c.txt"), str(corpus / "a.txt")], str(gpt2_ranks()), tmp_path / "two_out", log=quiet)
    assert documents(tmp_path / "two_out") == [docs["sub/c.txt"], docs["a.txt"]]
    assert tokens_of(tmp_path / "two_out", "train").count(EOT) == 2
    assert EOT not in tokens_of(tmp_path / "two_out", "val")


def test_byte_documents_are_concatenated_without_separator(tmp_path):
    a, b = write(tmp_path / "a.txt", "abc\n" * 30), write(tmp_path / "b.txt", "xyz\n" * 30)
    prepare([str(a), str(b)], "byte", tmp_path / "out", log=quiet)
    tokens = tokens_of(tmp_path / "out", "train") + tokens_of(tmp_path / "out", "val")
    assert bytes(tokens) == b"abc\n" * 30 + b"xyz\n" * 30
    assert len(tokens_of(tmp_path / "out", "train")) == int(240 * 0.9)


def test_small_shards_concatenate_to_the_whole(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT)
    out = tmp_path / "out"
    manifest = prepare([str(src)], "byte", out, shard_tokens=300, log=quiet)
    train_files, val_files = find_shards(out, "train"), find_shards(out, "val")
    assert [p.name for p in train_files] == [f"train_{i:06d}.bin" for i in range(7)]  # 1,863 tokens
    assert [p.name for p in val_files] == ["val_000000.bin"]  # 207 tokens
    assert [len(read_shard(p)) for p in train_files] == [300] * 6 + [63]
    assert [s["tokens"] for s in manifest["shards"]] == [300] * 6 + [63, 207]
    assert bytes(np.concatenate([read_shard(p) for p in train_files + val_files]).tolist()) == TEXT.encode()


def test_uint32_shards_for_a_large_vocabulary(tmp_path, monkeypatch):
    """A tokenizer with more than 65,536 ids writes llm.c's uint32 shards (magic 20240801, version 7)."""
    from gptlite.tokenizer import ByteTokenizer

    class Wide(ByteTokenizer):
        vocab_size = 70000

        def encode(self, text):
            return [69999 - b for b in text.encode()]

        def _token_bytes(self, ids):  # every id a piece of its own (the manifest records their fingerprint)
            return b"".join(b"<%d>" % i for i in ids)

    monkeypatch.setattr(pipeline, "get_tokenizer", lambda spec: Wide())
    src = write(tmp_path / "corpus.txt", TEXT)
    prepare([str(src)], "wide", tmp_path / "out", log=quiet)
    shard = tmp_path / "out" / "train_000000.bin"
    assert np.frombuffer(shard.read_bytes()[:8], "<i4").tolist() == [20240801, 7]
    assert read_shard(shard).dtype == np.uint32
    assert read_shard(shard)[:3].tolist() == [69999 - b for b in TEXT.encode()[:3]]


# ---------------------------------------------------------------------------------------------
# re-runs


def test_rerun_returns_the_manifest_without_rewriting(tmp_path, monkeypatch):
    src = write(tmp_path / "corpus.txt", TEXT)
    out = tmp_path / "out"
    first = prepare([str(src)], "char", out, shard_tokens=500, log=quiet)
    for p in out.iterdir():
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))  # an old mtime, so any rewrite shows
    before = mtimes(out)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a complete output must not be tokenized again")

    with monkeypatch.context() as m:
        m.setattr(pipeline, "get_tokenizer", no_tokenizing)
        logged = []
        again = prepare([str(src)], "char", out, shard_tokens=500, log=logged.append)
    assert again == first
    assert mtimes(out) == before
    assert "already prepared" in logged[0] and "nothing to do" in logged[0]

    # overwrite=True prepares again: same content, new files
    third = prepare([str(src)], "char", out, shard_tokens=500, overwrite=True, log=quiet)
    assert third == first
    after = mtimes(out)
    assert set(after) == set(before)
    assert all(after[name] != before[name] for name in before)


def test_changed_settings_or_inputs_prepare_again(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT)
    out = tmp_path / "out"
    prepare([str(src)], "byte", out, shard_tokens=300, log=quiet)
    assert len(find_shards(out, "train")) == 7
    manifest = prepare([str(src)], "byte", out, log=quiet)  # another shard size: stale shards are removed
    assert [p.name for p in sorted(out.glob("*.bin"))] == ["train_000000.bin", "val_000000.bin"]
    assert manifest["shard_tokens"] == 100_000_000
    write(src, TEXT + TEXT)  # new content
    manifest = prepare([str(src)], "byte", out, log=quiet)
    assert manifest["train_tokens"] + manifest["val_tokens"] == 2 * len(TEXT)


def folder_bytes(out_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir()) if p.is_file()}


@pytest.mark.parametrize("bad", ["gtp2", "empty.tiktoken", "incomplete.tiktoken", "no_such_file.tiktoken"])
def test_a_failed_rerun_leaves_the_finished_folder_as_it_was(tmp_path, bad):
    """A re-run whose tokenizer is wrong (a typo, an empty or incomplete ranks file) stops with one line before
    anything of the earlier preparation is deleted."""
    src = write(tmp_path / "a.txt", TEXT)
    out = tmp_path / "out"
    prepare([str(src)], str(shared_file("tokenizers/gpt2.tiktoken")), out, log=quiet)
    before = folder_bytes(out)
    (tmp_path / "empty.tiktoken").write_text("")
    ranks = shared_file("tokenizers/gpt2.tiktoken").read_text().splitlines()
    (tmp_path / "incomplete.tiktoken").write_text("\n".join(ranks[300:]) + "\n")  # no single-byte tokens
    spec = bad if bad == "gtp2" else str(tmp_path / bad)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data" / "prepare.py"),
            "--input",
            str(src),
            "--tokenizer",
            spec,
            "--out_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and "panicked" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    message = {
        "gtp2": "unknown tokenizer 'gtp2'",
        "empty.tiktoken": "is incomplete: 0 tokens",
        "incomplete.tiktoken": "is incomplete: 49956 tokens, 0 of the 256 single bytes",
        "no_such_file.tiktoken": "does not exist",
    }[bad]
    assert message in result.stderr
    assert folder_bytes(out) == before


def test_a_rerun_that_replaces_a_preparation_says_so_first(tmp_path):
    src = write(tmp_path / "a.txt", TEXT)
    out = tmp_path / "out"
    prepare([str(src)], "byte", out, log=quiet)
    logged = []
    prepare([str(src)], "char", out, log=logged.append)
    assert (
        logged[0].startswith(f"replacing the earlier preparation in {out} (")
        and "other inputs or settings" in logged[0]
    )


@pytest.mark.parametrize("where", ["a file", "read-only"])
def test_an_out_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, where):
    src = write(tmp_path / "a.txt", TEXT)
    out = tmp_path / "out"
    if where == "a file":
        out.write_text("not a folder")
        message = f"folder {out} is a file, not a folder; choose another path"
    else:  # root writes through file modes, so the read-only file system is made by the mkdir that fails

        def read_only(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "mkdir", read_only)
        message = f"cannot create folder {out}: read-only file system; use a writable folder"
    with pytest.raises(OSError, match=re.escape(message)):
        prepare([str(src)], "byte", out, log=quiet)


def test_missing_shard_triggers_a_rerun(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT)
    out = tmp_path / "out"
    prepare([str(src)], "byte", out, log=quiet)
    (out / "val_000000.bin").unlink()
    prepare([str(src)], "byte", out, log=quiet)
    assert len(read_shard(out / "val_000000.bin")) == len(TEXT) - int(len(TEXT) * 0.9)


# ---------------------------------------------------------------------------------------------
# errors


def test_empty_input(tmp_path):
    src = write(tmp_path / "empty.txt", "")
    with pytest.raises(ValueError, match=r"the inputs \(.*empty\.txt\) are empty; there is no text to tokenize"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()


def test_empty_directory(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match=r"input directory .*nothing holds no files"):
        prepare([str(tmp_path / "nothing")], "byte", tmp_path / "out", log=quiet)


@pytest.mark.parametrize("name", ["missing.txt", "missing_*.txt", "no/such/dir"])
def test_missing_input(tmp_path, name):
    message = rf"input .*{re.escape(name)} is not a file, directory, glob with matches, or URL"
    with pytest.raises(FileNotFoundError, match=message):
        prepare([str(tmp_path / name)], "byte", tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_val_fraction_out_of_range(tmp_path, fraction):
    src = write(tmp_path / "corpus.txt", TEXT)
    with pytest.raises(ValueError, match=rf"val_fraction={fraction} must be between 0 and 1"):
        prepare([str(src)], "byte", tmp_path / "out", val_fraction=fraction, log=quiet)


def test_shard_tokens_must_be_positive(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT)
    with pytest.raises(ValueError, match=r"shard_tokens=0 must be >= 1"):
        prepare([str(src)], "byte", tmp_path / "out", shard_tokens=0, log=quiet)


def test_corpus_too_small_to_split(tmp_path):
    src = write(tmp_path / "tiny.txt", "hi\n")  # int(3 * 0.9) = 2 train bytes, 1 val byte: fine
    prepare([str(src)], "byte", tmp_path / "ok", log=quiet)
    src = write(tmp_path / "one.txt", "h")  # int(1 * 0.9) = 0: no train split
    with pytest.raises(ValueError, match=r"too small to split with val_fraction=0.1"):
        prepare([str(src)], "byte", tmp_path / "out", log=quiet)


# ---------------------------------------------------------------------------------------------
# the command-line scripts


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_cli_prepare(tmp_path):
    a = write(tmp_path / "in" / "a.txt", TEXT)
    write(tmp_path / "in" / "b.txt", UNICODE_TEXT)
    out = tmp_path / "out"
    r = run(
        "data/prepare.py",
        "--input",
        str(a),
        str(tmp_path / "in" / "b.*"),
        "--tokenizer",
        str(gpt2_ranks()),
        "--out_dir",
        str(out),
        "--val_fraction",
        "0.2",
        "--shard_tokens",
        "400",
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["val_fraction"] == 0.2 and manifest["shard_tokens"] == 400 and manifest["vocab_size"] == 50257
    assert len(manifest["sources"]) == 2
    assert len(find_shards(out, "train")) >= 2 and find_shards(out, "val")
    tok = load_tokenizer(out / "tokenizer.json")
    tokens = tokens_of(out, "train") + tokens_of(out, "val")
    assert tokens.count(EOT) == 2
    assert tok.decode([t for t in tokens if t != EOT]) == TEXT + UNICODE_TEXT


def test_cli_shakespeare_with_local_input(tmp_path):
    src = write(tmp_path / "tiny_shakespeare.txt", TEXT)
    out = tmp_path / "shakespeare_char"
    r = run("data/shakespeare/prepare.py", f"--input={src}", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr
    assert (out / "train_000000.bin").is_file() and (out / "val_000000.bin").is_file()
    tok = load_tokenizer(out / "tokenizer.json")
    assert tok.kind == "char"
    assert len(read_shard(out / "train_000000.bin")) == int(len(TEXT) * 0.9)
    assert tok.decode(tokens_of(out, "train") + tokens_of(out, "val")) == TEXT


@pytest.mark.parametrize("script", ["data/prepare.py", "data/shakespeare/prepare.py"])
def test_cli_missing_input_is_a_one_line_error(tmp_path, script):
    missing = tmp_path / "does_not_exist.txt"
    r = run(script, "--input", str(missing), "--tokenizer", "byte", "--out_dir", str(tmp_path / "out"))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error:" in lines[0] and "does_not_exist.txt" in lines[0]
    assert not (tmp_path / "out").exists()


def gpt2_ranks():
    """The GPT-2 BPE ranks file of ../shared (fails in CI if missing, skips elsewhere)."""
    return shared_file("tokenizers/gpt2.tiktoken")


def test_preparation_never_imports_torch(tmp_path):
    """data/prepare.py (and so its workers, which import the same modules) starts without torch's seconds."""
    src = tmp_path / "corpus.txt"
    src.write_text("To be, or not to be: that is the question.\n" * 50)
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['prepare.py', '--input', {str(src)!r}, '--tokenizer', 'byte', "
        f"'--out_dir', {str(tmp_path / 'out')!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'data' / 'prepare.py')!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "manifest.json").is_file()
