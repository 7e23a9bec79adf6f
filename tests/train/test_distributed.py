"""Data-parallel training in real processes: torchrun with 2 CPU processes on gloo, against 1-process runs of
the same global batch (DDP and FSDP), checkpoints that resume at another world size, and ranks reading
disjoint windows."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gptlite.checkpoint import load_checkpoint, model_from_checkpoint
from gptlite.data.loader import ShardLoader, find_shards, write_shard
from tests.conftest import ROOT, run_train
from tests.test_train import TINY, config, losses, one_thread, resume, write_corpus  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # torchrun processes: left out by -m 'not slow'

# 256 tokens per optimizer step = 16 windows of 16 tokens: 2 ranks x 4 x 2 micro-steps, 1 x 8 x 2, or 1 x 16 x 1
RUN = dict(total_batch_size=256, eval_interval=4, lr_decay_iters=12)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )


def train_two_processes(data, out, **overrides) -> subprocess.CompletedProcess:
    values = {**TINY, **RUN, "data_dir": data, "out_dir": out, "batch_size": 4, **overrides}
    result = torchrun(str(ROOT / "train.py"), *(f"--{k}={v}" for k, v in values.items()))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """12 steps in one process, batch_size 8 x 2 micro-steps: the same windows per micro-step as 2 x 4."""
    out = tmp_path_factory.mktemp("one")
    run_train(*config(data, out, batch_size=8, max_iters=12, **RUN))
    return out


def assert_same_curve(got, expected):
    assert [s for s, _ in got] == [s for s, _ in expected]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in expected], rtol=1e-5, atol=1e-6)


def val_losses(out):
    return [(r["step"], r["val_loss"]) for r in map(json.loads, (out / "metrics.jsonl").open()) if "val_loss" in r]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_train_like_one_with_the_same_global_batch(data, one_process, tmp_path, fsdp):
    two = tmp_path / "two"
    result = train_two_processes(data, two, max_iters=8, fsdp=fsdp)
    # only rank 0 logs and writes
    assert result.stdout.count("model:") == 1 and result.stdout.count("| saved") == 2
    assert f"| world 2{' (fsdp)' if fsdp else ''} | 256 tokens/step = 2 micro-steps of 4x16 per rank" in result.stdout
    assert_same_curve(losses(two), losses(one_process)[:8])
    assert_same_curve(val_losses(two), val_losses(one_process)[:2])

    # the checkpoint holds plain full tensors: it loads into a GPT anywhere, and resumes in one process
    ckpt = load_checkpoint(two)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    model_from_checkpoint(ckpt)
    run_train(*resume(two, "--max_iters=12"))
    assert_same_curve(losses(two), losses(one_process))


def test_fsdp_trains_the_other_variants_like_one_process(data, tmp_path):
    """RoPE, RMSNorm, GELU MLP and biases, sharded: the same curve as one process on the same global batch."""
    arch = dict(pos_emb="rope", norm="rmsnorm", ffn="gelu", bias=True)
    run_train(*config(data, tmp_path / "one", batch_size=8, max_iters=4, **RUN, **arch))
    train_two_processes(data, tmp_path / "two", max_iters=4, fsdp=True, **arch)
    assert_same_curve(losses(tmp_path / "two"), losses(tmp_path / "one"))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_muon_in_two_processes_trains_like_one(data, tmp_path, fsdp):
    """Muon orthogonalises whole matrices: each DDP replica does it on its copy; under FSDP every rank gathers
    the sharded update, orthogonalises it and keeps its rows. The same curve as one process, also after a
    resume in the other setting (the momentum buffers are gathered into the checkpoint and sharded again).
    Orthogonalising the fused qkv and SwiGLU matrices whole instead moves the losses by 2e-3 by step 8."""
    arch = {"optimizer": "muon", **({"pos_emb": "rope", "norm": "rmsnorm", "bias": True} if fsdp else {})}
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    run_train(*config(data, one, batch_size=8, max_iters=8, **RUN, **arch))
    result = train_two_processes(data, two, max_iters=4, fsdp=fsdp, **arch)
    assert f"| world 2{' (fsdp)' if fsdp else ''} |" in result.stdout
    assert_same_curve(losses(two), losses(one)[:4])
    run_train(*resume(two, "--max_iters=8"))  # the two processes' checkpoint, in one
    assert_same_curve(losses(two), losses(one))
    run_train(*config(data, resumed, batch_size=8, max_iters=4, **RUN, **arch))
    train_two_processes(data, resumed, max_iters=8, fsdp=fsdp, resume=True)  # one process's checkpoint, in two
    assert_same_curve(losses(resumed), losses(one))


def test_a_refusal_on_rank_0_ends_every_rank_in_one_line(data, one_process):
    """Rank 0 finds the out_dir taken by an earlier run: every rank stops with its line, none waits in a collective."""
    values = {**TINY, **RUN, "data_dir": data, "out_dir": one_process, "batch_size": 4, "max_iters": 2}
    result = torchrun(str(ROOT / "train.py"), *(f"--{k}={v}" for k, v in values.items()))
    assert result.returncode != 0 and 'train.py", line' not in result.stderr  # torchrun's own report only
    # every rank stops; rank 0 alone prints the line (the same on every rank), not one copy per process
    assert result.stderr.count(f"train.py: error: out_dir {one_process} holds an earlier run") == 1, result.stderr[
        -3000:
    ]
    missing = one_process.parent / "no-data"
    result = torchrun(str(ROOT / "train.py"), f"--data_dir={missing}", f"--out_dir={missing / 'out'}")
    line = f"train.py: error: data_dir {missing} does not exist or is not a folder"
    assert result.stderr.count(line) == 1 and "python data/fineweb/download.py" in result.stderr, result.stderr[-3000:]


def test_one_large_batch_trains_like_accumulated_micro_batches(data, one_process, tmp_path):
    run_train(*config(data, tmp_path, batch_size=16, max_iters=12, **RUN))
    assert_same_curve(losses(tmp_path), losses(one_process))


def test_ranks_never_read_the_same_window(tmp_path):
    rng = np.random.default_rng(0)  # random ids from a large vocabulary: every window's content is unique
    for i, n in enumerate((400, 300, 250)):
        write_shard(tmp_path / f"train_{i:06d}.bin", rng.integers(0, 50_000, n), 50_000)
    write_shard(tmp_path / "val_000000.bin", rng.integers(0, 50_000, 200), 50_000)
    steps = 30  # about 19 global batches of 6 windows per epoch: reaches into the second epoch
    result = torchrun(
        str(ROOT / "tests" / "helpers" / "distributed_worker.py"), str(tmp_path), str(tmp_path), str(steps)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"windows_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    one = ShardLoader(find_shards(tmp_path, "train"), batch_size=6, block_size=8, seed=1337)
    seen = {0: set(), 1: set()}
    for step in range(steps):
        mine = [[tuple(row) for row in r["batches"][step]["rows"]] for r in ranks]
        assert len(mine[0]) == len(mine[1]) == 3
        assert not set(mine[0]) & set(mine[1])  # disjoint within every step
        assert mine[0] + mine[1] == [tuple(row) for row in one.next_batch()[0].tolist()]  # = one process's batch
        before, after = ranks[0]["batches"][step]["epochs"]
        if before == after:  # a step wholly inside one epoch: no window read twice in that epoch
            assert not seen[after] & set(mine[0] + mine[1])
            seen[after] |= set(mine[0] + mine[1])
    assert len(seen[0]) > 100 and seen[1]
