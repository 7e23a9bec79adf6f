"""The download of ready-made GPT-2 token shards (data/fineweb/download.py), against a stand-in for the Hub."""

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest

from gptlite.data.download import download_token_shards
from gptlite.data.loader import read_shard, verify_manifest, write_shard
from gptlite.tokenizer import load_tokenizer
from tests.conftest import ROOT, shared_file


def quiet(*args, **kwargs):
    pass


@pytest.fixture
def hub(monkeypatch):
    """hf_hub_download writing small llm.c shards (100 + 10 * i tokens) instead of fetching them; records calls."""
    calls = []

    def fake_download(repo_id, filename, repo_type, revision, local_dir):
        calls.append((repo_id, filename, repo_type))
        n = 100 + 10 * int(filename[-10:-4])
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        write_shard(Path(local_dir) / filename, np.arange(n) % 50257, 50257)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    return calls


def test_download_writes_shards_tokenizer_and_manifest(tmp_path, hub):
    gpt2 = str(shared_file("tokenizers/gpt2.tiktoken"))
    manifest = download_token_shards("fineweb10B", tmp_path, 2, gpt2, log=quiet)
    files = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert hub == [("kjj0/fineweb10B-gpt2", f, "dataset") for f in files]
    assert [s["file"] for s in manifest["shards"]] == files
    assert manifest["val_tokens"] == 100 and manifest["train_tokens"] == 110 + 120
    assert manifest["token_dtype"] == "uint16" and manifest["vocab_size"] == 50257
    assert verify_manifest(tmp_path) == manifest
    assert load_tokenizer(tmp_path / "tokenizer.json").eot_id == 50256

    hub.clear()
    (tmp_path / files[1]).unlink()  # an interrupted download: only the missing file is fetched again
    download_token_shards("fineweb10B", tmp_path, 2, gpt2, log=quiet)
    assert hub == [("kjj0/fineweb10B-gpt2", files[1], "dataset")]
    assert len(read_shard(tmp_path / files[1])) == 110


def test_download_rejects_a_file_that_is_not_a_shard(tmp_path, hub):
    (tmp_path / "finewebedu_train_000001.bin").write_bytes(b"<html>rate limited</html>")
    with pytest.raises(ValueError, match=r"finewebedu_train_000001\.bin is truncated|has bad magic"):
        download_token_shards("finewebedu10B", tmp_path, 1, str(shared_file("tokenizers/gpt2.tiktoken")), log=quiet)


@pytest.mark.parametrize(
    "name, shards, message",
    [
        ("fineweb100B", 1, r"unknown token-shard dataset 'fineweb100B'; choose one of fineweb10B, finewebedu10B"),
        ("fineweb10B", 0, r"train_shards=0 must be between 1 and 103 for fineweb10B"),
        ("finewebedu10B", 100, r"train_shards=100 must be between 1 and 99 for finewebedu10B"),
    ],
)
def test_bad_dataset_or_shard_count(tmp_path, name, shards, message):
    with pytest.raises(ValueError, match=message):
        download_token_shards(name, tmp_path, shards, "byte", log=quiet)


def test_missing_huggingface_hub(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(
        ImportError, match=r'Downloading token shards needs the huggingface_hub package: pip install -e "\.\[data\]"'
    ):
        download_token_shards("fineweb10B", tmp_path, 1, "byte", log=quiet)


def test_cli_offline_is_a_one_line_error(tmp_path):
    """The real huggingface_hub, offline: one line naming the file and the repository, exit status 2."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data" / "fineweb" / "download.py"),
            "--train_shards",
            "1",
            "--out_dir",
            str(tmp_path),
            "--tokenizer",
            str(shared_file("tokenizers/gpt2.tiktoken")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(
        "fineweb/download.py: error: could not download fineweb_val_000000.bin from "
        "huggingface.co/datasets/kjj0/fineweb10B-gpt2"
    )
