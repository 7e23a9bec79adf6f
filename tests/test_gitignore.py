"""The checkout a user clones: following the README leaves `git status` clean (what the commands write is
ignored, and nothing generated is tracked), and scripts/setup.sh takes torch's CPU build when asked."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from gptlite.data.prepare import prepare
from tests.conftest import ROOT

# what the README's (and docs/pipeline.md's) commands write inside the checkout: prepared data, downloads, runs, plots
GENERATED = [
    "data/shakespeare_char/train_000000.bin",
    "data/shakespeare_char/manifest.json",
    "data/shakespeare_gpt2/tokenizer.json",
    "data/shakespeare/input.txt",
    "data/pipeline/corpus.txt",
    "data/pipeline/chats.jsonl",
    "data/python_stdlib_char/progress.json",
    "data/mycorpus/downloads/book.txt",
    "data/fineweb10B/fineweb_val_000000.bin",
    "data/hellaswag/hellaswag_val.jsonl",
    "data/eval_bundle/core.yaml",
    "out/char/ckpt_000250.pt",
    "out/finetune_hf/model.safetensors",
    "loss.png",
    "tok/tokenizer.json",
    "models/SmolLM2-135M/model.safetensors",
]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_what_the_readme_commands_write_is_ignored_and_the_scripts_are_not():
    ignored = git("check-ignore", "--no-index", *GENERATED).stdout.split()
    assert sorted(ignored) == sorted(GENERATED)
    scripts = ["data/prepare.py", "data/shakespeare/prepare.py", "data/fineweb/download.py", "data/pipeline/inputs.py"]
    assert git("check-ignore", "--no-index", *scripts).stdout == ""


def test_nothing_generated_is_tracked():
    tracked = git("ls-files", "data").stdout.split()
    assert tracked and all(path.endswith(".py") for path in tracked), tracked


def test_a_failed_download_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "data" / "mycorpus"
    with pytest.raises(ConnectionError, match=r"could not download http://127\.0\.0\.1:9/book\.txt"):
        prepare(["http://127.0.0.1:9/book.txt"], "byte", out, log=lambda *a: None)  # port 9: nothing listens
    assert not (tmp_path / "data").exists()


def test_the_shakespeare_download_says_how_to_pass_a_copy(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("shakespeare_prepare", ROOT / "data" / "shakespeare" / "prepare.py")
    shakespeare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shakespeare)
    monkeypatch.setattr(shakespeare, "URL", "http://127.0.0.1:9/input.txt")  # nothing listens: as offline
    monkeypatch.setattr(shakespeare, "ROOT", ROOT / "out" / "no-such-checkout")  # no earlier download found
    assert shakespeare.main([]) == 2
    assert capsys.readouterr().err.strip().endswith("download it elsewhere and pass the local file instead with "
                                                    "--input=PATH")  # fmt: skip


def fake_venv(root: Path, log: Path) -> None:
    """A .venv whose python logs its arguments and has no torch, so that setup.sh installs it."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\ncase "$*" in "-c import torch") exit 1;; esac\nexit 0\n')
    python.chmod(0o755)


@pytest.mark.parametrize("cpu", [False, True], ids=["default", "TORCH_CPU=1"])
def test_setup_takes_the_cpu_build_of_torch_when_asked(tmp_path, cpu):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    log = tmp_path / "calls.log"
    fake_venv(tmp_path, log)
    env = {**os.environ, "TORCH_CPU": "1" if cpu else "0"}
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (install,) = [line for line in log.read_text().splitlines() if "torch==2.13.0" in line]
    assert ("--index-url https://download.pytorch.org/whl/cpu" in install) == cpu


def test_setup_says_nothing_of_torchs_build_where_the_venv_has_torch(tmp_path):
    """A .venv that already has torch keeps it: set-up neither asks PyTorch's CPU index nor names a build it will not
    install (once: "on PyPI its default build, with CUDA's libraries", printed where the CPU build stayed)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    log = tmp_path / "calls.log"
    fake_venv(tmp_path, log)
    python = tmp_path / ".venv" / "bin" / "python"
    # torch imports; the CPU index (setup.sh's `python - URL`) would not answer
    python.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\ncase "$*" in "- "*) exit 1;; esac\nexit 0\n')
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPU"}
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    calls = log.read_text()
    assert result.returncode == 0, result.stderr
    assert "torch==2.13.0" not in calls and "whl/cpu" not in calls
    assert "setup:" not in result.stdout
