"""A run folder that an older gptlite wrote resumes under this one with the losses that gptlite gave: the checkpoint
format is read back as it was written (tests/fixtures/run_8a92e84, README.md there says how it was made)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from gptlite.checkpoint import load_checkpoint
from gptlite.train.metrics import read_metrics
from tests.conftest import run_train

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_8a92e84"


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the fixture's runs had: float32 sums over another thread count round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("run", ["text", "lora"])  # text: dropout and the weight average; lora: adapters on base/
def test_a_run_written_by_8a92e84_resumes_with_its_losses(tmp_path, monkeypatch, run):
    expected = json.loads((FIXTURE / "expected_losses.json").read_text())[run]
    folder = tmp_path / "fixture"
    shutil.copytree(FIXTURE, folder, symlinks=True)
    monkeypatch.chdir(folder)  # the runs recorded their paths (data/, base/, the run) relative to the fixture
    assert load_checkpoint(run)["step"] == expected["resumed_from"]

    resumed = run_train(f"--out_dir={run}", "--resume")

    assert resumed.code == 0, resumed.err
    rows = [r for r in read_metrics(folder / run / "metrics.jsonl") if r["step"] > expected["resumed_from"]]
    # Exactly what 8a92e84 gave on the machine that wrote the fixture. A CPU whose float32 kernels round otherwise
    # would differ from the start of the run in the last bits, which the relative 1e-5 allows; a resume that lost
    # a part of the state (the data position, dropout's random streams, the average, the adapters) is off by more.
    losses = {r["step"]: r["loss"] for r in rows if "lr" in r}
    val_losses = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert losses == pytest.approx(dict(expected["loss"]), rel=1e-5, abs=0)
    assert val_losses == pytest.approx(dict(expected["val_loss"]), rel=1e-5, abs=0)
