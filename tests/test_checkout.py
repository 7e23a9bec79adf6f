"""The checkout a user clones: following the README leaves `git status` clean (what the commands write is
ignored, and nothing generated is tracked)."""

import subprocess

import pytest

from gptlite.prepare import prepare
from tests.conftest import ROOT

# what the README's commands write inside the checkout: prepared data, downloads, runs, plots
GENERATED = [
    "data/shakespeare_char/train_000000.bin",
    "data/shakespeare_char/manifest.json",
    "data/shakespeare_gpt2/tokenizer.json",
    "data/shakespeare/input.txt",
    "data/python_stdlib_char/progress.json",
    "data/mycorpus/downloads/book.txt",
    "data/fineweb10B/fineweb_val_000000.bin",
    "data/hellaswag/hellaswag_val.jsonl",
    "out/char/ckpt_000250.pt",
    "out/finetune_hf/model.safetensors",
    "loss.png",
]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_what_the_readme_commands_write_is_ignored_and_the_scripts_are_not():
    ignored = git("check-ignore", "--no-index", *GENERATED).stdout.split()
    assert sorted(ignored) == sorted(GENERATED)
    scripts = ["data/prepare.py", "data/shakespeare/prepare.py", "data/fineweb/download.py"]
    assert git("check-ignore", "--no-index", *scripts).stdout == ""


def test_nothing_generated_is_tracked():
    tracked = git("ls-files", "data").stdout.split()
    assert tracked and all(path.endswith(".py") for path in tracked), tracked


def test_a_failed_download_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "data" / "mycorpus"
    with pytest.raises(ConnectionError, match=r"could not download http://127\.0\.0\.1:9/book\.txt"):
        prepare(["http://127.0.0.1:9/book.txt"], "byte", out, log=lambda *a: None)  # port 9: nothing listens
    assert not (tmp_path / "data").exists()
