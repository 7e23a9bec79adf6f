"""train.py's resume, fault handling and observability, through the train.py command on a tiny model (in this
process, and in processes of their own for signals and kill -9): exact resume across an epoch boundary, gradient
accumulation, non-finite steps, bad inputs, out-of-memory advice, the compile fallback, the time budget, the metrics
file and its plot, wandb."""

import contextlib
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlite import plot
from gptlite.checkpoint import load_checkpoint, step_files, verify_checkpoint
from gptlite.data.loader import make_loaders, write_shard
from gptlite.device import compile_unavailable, pick_device
from gptlite.evaluate import evaluate_loader
from gptlite.gpt import GPT
from gptlite.train.metrics import mfu, peak_flops, read_metrics
from gptlite.train.run_config import resolve_config
from tests.conftest import ROOT, VARIANTS, FullDisk, run_train, shared_file

VOCAB = 128  # the corpus is ASCII bytes
TINY = dict(
    vocab_size=VOCAB,
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    batch_size=8,
    learning_rate=3e-3,
    min_lr=3e-4,
    warmup_iters=3,
    eval_iters=2,
    log_interval=1,
    device="cpu",
)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the subprocesses get (OMP_NUM_THREADS=1): on a small shared CPU a larger pool
    stalls, and runs compared bit for bit must use the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_corpus(root: Path, train_sizes: tuple[int, ...] = (900, 700, 500), val_size: int = 600) -> Path:
    """Shards of tiny Shakespeare's bytes: three small train shards (an epoch is about 16 steps of 8 windows
    of 16 tokens) and one val shard."""
    text = np.frombuffer(shared_file("data/tinyshakespeare.txt").read_bytes()[:100_000], dtype=np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, n in enumerate(train_sizes):
        write_shard(root / f"train_{i:06d}.bin", text[start : start + n], VOCAB)
        start += n
    write_shard(root / "val_000000.bin", text[start : start + val_size], VOCAB)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


def config(data: Path, out: Path, **overrides) -> list[str]:
    """train.py's arguments for a run of the tiny model on `data` into `out`."""
    values = {**TINY, "data_dir": data, "out_dir": out, **overrides}
    return [f"--{k}={v}" for k, v in values.items()]


def resume(out: Path, *args: str) -> list[str]:
    return [f"--out_dir={out}", "--resume", *args]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


# ---------------------------------------------------------------------------------------------
# exact resume, gradient accumulation


def test_resume_matches_an_uninterrupted_run_exactly_across_an_epoch_boundary(data, tmp_path):
    kw = dict(dropout=0.1, eval_interval=5, lr_decay_iters=30)  # dropout: the RNG states must come back too
    straight = run_train(*config(data, tmp_path / "straight", max_iters=30, **kw))
    first = run_train(*config(data, tmp_path / "resumed", max_iters=10, **kw))
    assert load_checkpoint(tmp_path / "resumed")["loader"]["epoch"] == 0
    second = run_train(*resume(tmp_path / "resumed", "--max_iters=30"))
    assert load_checkpoint(tmp_path / "resumed")["loader"]["epoch"] >= 1  # the resumed part crossed an epoch

    assert first["history"] + second["history"] == straight["history"]  # bit for bit
    assert first["val_history"] + second["val_history"] == straight["val_history"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["loader"] == b["loader"] and a["step"] == b["step"] == 30


def test_a_run_ends_with_its_peak_memory(data, tmp_path, capsys):
    summary = run_train(*config(data, tmp_path / "run", max_iters=2))
    peak = re.search(r"^done at step 2 \| peak memory ([\d,]+) MiB resident$", capsys.readouterr().out, re.M)
    assert peak and int(peak[1].replace(",", "")) == summary["peak_memory_mb"] > 50  # torch alone is more


def test_gradient_accumulation_equals_one_batch_k_times_larger(data, tmp_path):
    """A step of k micro-batches of 8 / k windows (the same 8 windows) has the loss, the gradient norm and the
    update of one batch of 8."""
    for k in (1, 4):
        run_train(*config(data, tmp_path / f"k{k}", batch_size=8 // k, total_batch_size=8 * 16, max_iters=1))
    (row_1,), (row_4,) = ([r for r in read_metrics(tmp_path / f"k{k}" / "metrics.jsonl") if "lr" in r] for k in (1, 4))
    assert row_4["loss"] == pytest.approx(row_1["loss"], rel=1e-6)
    assert row_4["grad_norm"] == pytest.approx(row_1["grad_norm"], rel=1e-5)
    weights_1, weights_4 = (load_checkpoint(tmp_path / f"k{k}")["model"] for k in (1, 4))
    for name, w1 in weights_1.items():  # AdamW's first update, lr * g / (|g| + eps), is touchy where g is near eps
        torch.testing.assert_close(weights_4[name], w1, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# faults


@pytest.fixture
def nan_loss_at(monkeypatch):
    """Make the training loss NaN at the given steps (one micro-step per step)."""

    def install(*steps: int) -> None:
        real_forward, calls = GPT.forward, [0]

        def forward(self, idx, targets=None, **kwargs):
            logits, loss = real_forward(self, idx, targets, **kwargs)
            if self.training:
                calls[0] += 1
                if calls[0] in steps:
                    loss = loss * float("nan")
            return logits, loss

        monkeypatch.setattr(GPT, "forward", forward)

    return install


def test_a_nonfinite_step_is_skipped_and_logged(data, tmp_path, nan_loss_at, capsys):
    nan_loss_at(4)
    summary = run_train(*config(data, tmp_path, max_iters=6, eval_interval=3))
    assert summary["step"] == 6 and summary["skipped_steps"] == 1
    assert [s for s, _ in summary["history"]] == [1, 2, 3, 5, 6]
    out = capsys.readouterr().out
    assert "step 4: loss nan, gradient norm nan are not finite; skipped this update (on_nan=skip)" in out
    event = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" in r]
    assert len(event) == 1 and event[0]["step"] == 4 and event[0]["event"] == "nonfinite" and np.isnan(event[0]["loss"])
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 6 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_on_nan_stop_raises_without_saving(data, tmp_path, nan_loss_at):
    nan_loss_at(4)
    run = run_train(*config(data, tmp_path, max_iters=6, eval_interval=3, on_nan="stop"))
    assert run.code == 1 and re.search(
        r"step 4: loss nan, gradient norm nan are not finite; stopped without "
        r"saving \(on_nan=stop\)\. The latest good checkpoint is in .*; resume with --resume",
        run.error,
    )
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000003.pt"]
    # a NaN before the first checkpoint: nothing to resume from, and the message says so
    nan_loss_at(4)  # counting afresh
    run = run_train(*config(data, tmp_path / "early", max_iters=6, eval_interval=5, on_nan="stop"))
    assert run.code == 1 and "step 4: loss nan" in run.error and "stopped before any checkpoint was saved" in run.error
    assert "--resume" not in run.error and not step_files(tmp_path / "early")


@pytest.mark.parametrize("on_nan", ["skip", "stop"])
def test_the_update_decided_on_the_device_trains_as_the_host_s(data, tmp_path, nan_loss_at, monkeypatch, on_nan):
    """GPTLITE_UPDATE=device forces the GPU's way on the CPU (gptlite.train.update: fused AdamW's found_inf skips a
    non-finite step, the figures are read a step late): the same losses, events, messages and checkpoint as the
    host's way, bit for bit, a NaN at step 4 skipped (or stopped on) in both."""
    runs = {}
    for way in ("host", "device"):
        monkeypatch.setenv("GPTLITE_UPDATE", way)
        nan_loss_at(4)
        out = tmp_path / way
        runs[way] = run_train(*config(data, out, max_iters=7, eval_interval=3, log_interval=2, on_nan=on_nan))
        monkeypatch.undo()  # the NaN and the variable, before the other way's run
    host, device = runs["host"], runs["device"]
    assert host.code == device.code == (0 if on_nan == "skip" else 1)
    if on_nan == "stop":  # the device reads step 4 while step 5 runs: the same refusal, the same checkpoint kept
        assert "step 4: loss nan, gradient norm nan are not finite; stopped without saving" in device.error
        assert host.error.replace("host", "device") == device.error
        assert load_checkpoint(tmp_path / "device")["step"] == load_checkpoint(tmp_path / "host")["step"] == 3
        return
    assert device.history == host.history and [s for s, _ in host.history] == [2, 6, 7]
    assert device.val_history == host.val_history and device.skipped_steps == host.skipped_steps == 1

    def figures(way: str) -> list[dict]:
        timing = ("ms_per_step", "tokens_per_s", "mfu")
        rows = read_metrics(tmp_path / way / "metrics.jsonl")
        return [
            {k: v for k, v in r.items() if k not in timing and not (isinstance(v, float) and math.isnan(v))}
            for r in rows
        ]

    assert figures("device") == figures("host")
    saved = {way: load_checkpoint(tmp_path / way) for way in runs}
    for name, tensor in saved["host"]["model"].items():
        assert torch.equal(saved["device"]["model"][name], tensor), name
    host_state, device_state = (saved[w]["optimizer"]["state"] for w in ("host", "device"))  # by parameter name
    assert host_state.keys() == device_state.keys() and host_state
    for name, state in host_state.items():  # moments and step counts: the skipped step left them as they were
        assert all(torch.equal(device_state[name][k], v) for k, v in state.items()), name


def test_an_unknown_or_impossible_forced_update_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLITE_UPDATE", "gpu")
    run = run_train(*config(data, tmp_path / "a", max_iters=2))
    assert run.code == 2 and "GPTLITE_UPDATE='gpu' must be host or device; unset it" in run.error
    monkeypatch.setenv("GPTLITE_UPDATE", "device")
    run = run_train(*config(data, tmp_path / "b", max_iters=2, optimizer="muon"))
    assert run.code == 2 and "GPTLITE_UPDATE=device needs every optimizer to be a fused AdamW" in run.error


def test_nonfinite_weights_are_never_saved_over_a_good_checkpoint(data, tmp_path, monkeypatch, capsys):
    real_step, calls = torch.optim.AdamW.step, [0]

    def poisoning_step(self, *args, **kwargs):  # as if a bad kernel wrote NaN into the weights at step 3
        result = real_step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoning_step)
    summary = run_train(*config(data, tmp_path, max_iters=4, eval_interval=2))
    assert summary["skipped_steps"] == 1  # step 4's loss is NaN
    assert "step 4: not saving a checkpoint, the weights are not finite (tok_emb.weight" in capsys.readouterr().out
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000002.pt"]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(tmp_path)["model"].values())


def test_out_of_memory_on_the_first_step_names_the_micro_batch(data, tmp_path, monkeypatch):
    real_forward, calls = GPT.forward, [0]

    def forward(self, idx, targets=None, **kwargs):
        calls[0] += 1
        if calls[0] in oom_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_forward(self, idx, targets, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward)
    oom_at = {1}
    assert re.search(
        r"^out of memory in the first step, on a micro-batch of batch_size=8 x "
        r"block_size=16 tokens per device; try --batch_size=4 \(add --total_batch_size=128 to keep",
        run_train(*config(data, tmp_path, max_iters=2)).error,
    )
    calls[0] = 0
    assert re.search(
        r"try --batch_size=4 \(total_batch_size stays, gradient accumulation",
        run_train(*config(data, tmp_path, max_iters=2, total_batch_size=256)).error,
    )
    calls[0], oom_at = 0, {3}  # later in the run it is a real error, not a configuration problem
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_train(*config(data, tmp_path, max_iters=4, eval_interval=10))


def bad_data(root: Path, case: str) -> Path:
    write_corpus(root)
    if case == "empty shard":
        write_shard(root / "train_000003.bin", [], VOCAB)
    elif case == "small val":
        write_shard(root / "val_000000.bin", list(range(10)), VOCAB)
    elif case == "no val":
        (root / "val_000000.bin").unlink()
    return root


@pytest.mark.parametrize("case, overrides, message", [
    ("empty shard", {}, r"shard .*train_000003\.bin holds no tokens; delete it or prepare the data again"),
    ("small val", {}, r"val split: 10 tokens in 1 shard\(s\) .* make 0 windows of block_size\+1=17 tokens, fewer "
                      r"than one batch of 1; use more data, or a smaller --block_size"),
    ("no val", {}, r"no val shards found at .*; expected \*val\*\.bin files there"),
    ("ids", {"vocab_size": 100}, r"shard .*train_000000\.bin holds token id \d+ but the model's vocab_size is 100"),
    ("batch", {"total_batch_size": 100}, r"total_batch_size=100 is not a multiple of "
                                         r"batch_size\*block_size\*world_size=8\*16\*1=128"),
])  # fmt: skip
def test_bad_data_fails_before_the_first_step(tmp_path, case, overrides, message):
    data = bad_data(tmp_path / "data", case)
    assert re.search(message, run_train(*config(data, tmp_path / "out", **overrides)).error)
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("args, message", [
    (["--on_nan=maybe"], r"on_nan='maybe' must be one of skip, stop"),
    (["--keep_last=0"], r"keep_last=0 must be > 0"),
    (["--max_minutes=-1"], r"max_minutes=-1\.0 must be >= 0"),
    (["--fsdp=true", "--dtype=float16"], r"fsdp=true trains in bfloat16 or float32, not float16"),
    (["--max_minuts=5"], r"unknown config key 'max_minuts'; did you mean 'max_minutes'\?"),
])  # fmt: skip
def test_bad_fault_options_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        resolve_config(["--data_dir=x", f"--vocab_size={VOCAB}", *args])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch._dynamo's imports
def test_compile_unavailable_warns_and_trains_uncompiled(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "no-such-compiler")
    summary = run_train(*config(data, tmp_path, max_iters=2, eval_interval=2, compile=True))
    assert summary["step"] == 2
    assert (
        "warning: torch.compile is unavailable (no C++ compiler 'no-such-compiler' for its CPU kernels (set CXX)); "
        "training uncompiled"
    ) in capsys.readouterr().out
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: False)
    assert compile_unavailable("cuda") == "Triton is not installed"
    monkeypatch.setattr("torch._dynamo.is_dynamo_supported", lambda: False)
    assert compile_unavailable("cpu").startswith("not supported on Python")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch._dynamo's imports
@pytest.mark.parametrize(
    "cxx, why",
    [
        ("/bin/true", "the C++ compiler '/bin/true' exited 0 on a one-line program but wrote no library"),
        ("/bin/false", "the C++ compiler '/bin/false' failed on a one-line program (exit status 1)"),
    ],
)
def test_a_broken_cpu_compiler_warns_and_trains_uncompiled(cxx, why, data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", cxx)
    summary = run_train(*config(data, tmp_path, max_iters=2, eval_interval=2, compile=True))
    assert summary["step"] == 2
    line = f"warning: torch.compile is unavailable ({why}; set CXX to a working C++ compiler); training uncompiled"
    assert line in capsys.readouterr().out.splitlines()


def test_a_cuda_device_always_gets_an_index(monkeypatch):
    """torch.cuda.set_device refuses a plain 'cuda' (the first GPU run failed on it)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.delenv("RANK", raising=False)
    assert pick_device("auto", 0) == pick_device("cuda", 0) == "cuda:0"
    assert pick_device("cuda:1", 0) == "cuda:1"
    monkeypatch.setenv("RANK", "3")
    assert pick_device("cuda", 3) == "cuda:3"  # under torchrun: cuda:LOCAL_RANK
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cuda but CUDA is not available here; use --device=cpu"):
        pick_device("cuda", 0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_trains_and_resumes_exactly(data, tmp_path, name):
    kw = dict(VARIANTS[name], dropout=0.1, eval_interval=3, lr_decay_iters=6)
    straight = run_train(*config(data, tmp_path / "straight", max_iters=6, **kw))
    run_train(*config(data, tmp_path / "resumed", max_iters=3, **kw))
    resumed = run_train(*resume(tmp_path / "resumed", "--max_iters=6"))
    assert resumed["history"] == straight["history"][3:]
    assert straight["history"][-1][1] < straight["history"][0][1]
    assert {k: v for k, v in load_checkpoint(tmp_path / "resumed")["config"].items() if k in kw} == kw


def test_resume_refuses_another_architecture(data, tmp_path):
    run_train(*config(data, tmp_path, max_iters=1, eval_interval=1, pos_emb="rope"))
    for change in ("--norm=rmsnorm", "--ffn=gelu", "--rope_theta=500", "--pos_emb=learned"):
        refused = rf"cannot change the model shape on --resume .*{change[2:]}.*; drop those flags to go on with the run"
        with pytest.raises(ValueError, match=refused + r"'s own, or start a new run in another --out_dir$"):
            resolve_config(resume(tmp_path, change))


def test_resume_past_a_damaged_checkpoint_moves_it_aside(data, tmp_path, capsys):
    run_train(*config(data, tmp_path, max_iters=6, eval_interval=2, keep_last=2))
    (tmp_path / "ckpt_000006.pt").write_bytes(b"cut short")
    run_train(*resume(tmp_path, "--max_iters=5"))
    out = capsys.readouterr().out
    assert "ckpt_000006.pt is damaged" in out and f"; loaded {tmp_path / 'ckpt_000004.pt'} instead" in out
    assert (
        f"moved {tmp_path / 'ckpt_000006.pt'} aside to ckpt_000006.pt.damaged: it is newer than the checkpoint" in out
    )
    assert (tmp_path / "ckpt_000006.pt.damaged").read_bytes() == b"cut short"  # kept, under another name
    # the damaged file does not push the intact step 4 out of the newest keep_last=2, nor stay behind best.pt
    assert [p.name for p in step_files(tmp_path)] == ["ckpt_000005.pt", "ckpt_000004.pt"]
    assert not (tmp_path / "best.pt").exists() or load_checkpoint(tmp_path / "best.pt")["step"] == 5


@pytest.mark.parametrize("damage", ["emptied", "edited", "crlf", "deleted"])
def test_resume_goes_on_from_a_whole_checkpoint_whose_checksum_file_is_in_error(data, tmp_path, damage):
    """Issue 84: an emptied checksum file made the resume fall back to step 2 and delete the intact step 4."""
    from tests.test_checkpoint import sidecar_damage

    run_train(*config(data, tmp_path, max_iters=4, eval_interval=2, keep_last=3))
    newest = tmp_path / "ckpt_000004.pt"
    weights = load_checkpoint(newest)["model"]
    sidecar_damage(tmp_path / "ckpt_000004.pt.sha256", damage)
    run = run_train(*resume(tmp_path, "--max_iters=5"))
    assert run.code == 0 and f"resumed from {tmp_path} at step 4" in run.out
    (line,) = [line for line in run.out.splitlines() if "ckpt_000004.pt.sha256" in line]  # one line says it
    assert line.startswith(f"{newest} is whole though ") and line.endswith("rewrote ckpt_000004.pt.sha256")
    assert "is damaged" not in run.out
    assert verify_checkpoint(newest) is None  # the checksum file is the file's again
    assert all(torch.equal(load_checkpoint(newest)["model"][k], v) for k, v in weights.items())
    assert not list(tmp_path.glob("*.damaged*"))


def test_max_minutes_ends_the_run_with_a_checkpoint(data, tmp_path, capsys):
    summary = run_train(*config(data, tmp_path, max_iters=50, eval_interval=20, max_minutes=1e-9))
    assert summary["step"] == 1 and summary["stopped"] == "max_minutes=1e-09" and summary["signal"] is None
    assert (
        f"stopped after step 1 (max_minutes=1e-09) with a checkpoint in {tmp_path}; continue with: "
        f"python train.py --out_dir={tmp_path} --resume"
    ) in capsys.readouterr().out
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 1 and ckpt["val_loss"] == summary["val_history"][-1][1]  # a last evaluation
    assert run_train(*resume(tmp_path, "--max_minutes=0", "--max_iters=3"))["step"] == 3


def test_time_schedule_decays_the_lr_over_the_time_budget(data, tmp_path, monkeypatch):
    clock = iter(range(10**6))  # every reading of the clock is one second later
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    summary = run_train(
        *config(
            data,
            tmp_path,
            max_iters=10**6,
            eval_interval=10**5,
            log_interval=1,
            warmup_iters=0,
            lr_schedule="time",
            max_minutes=0.5,
            learning_rate=1e-3,
            min_lr=1e-4,
        )
    )
    # the schedule ended with the budget: the run is done, with a last evaluation, not stopped to be resumed
    assert summary["stopped"] is None and summary["val_history"][-1][0] == summary["step"]
    assert f"step {summary['step']:5d} | the time budget (max_minutes=0.5) is spent: the run is done" in summary.out
    assert "continue with" not in summary.out
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if "lr" in r]
    assert 10 < len(lrs) < 40 and lrs[0] == 1e-3 and all(a >= b for a, b in pairwise(lrs))
    assert lrs[-1] < 1.1e-4  # close to min_lr when the budget runs out


# ---------------------------------------------------------------------------------------------
# observability


def test_metrics_file_and_the_plot_of_several_runs(data, tmp_path, capsys):
    runs = [tmp_path / "a", tmp_path / "b"]
    run_train(*config(data, runs[0], max_iters=6, eval_interval=3, log_interval=2))
    run_train(*config(data, runs[1], max_iters=4, eval_interval=2, log_interval=2, batch_size=4))
    rows = read_metrics(runs[0] / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert set(train_rows[0]) == {"step", "tokens", "loss", "lr", "grad_norm", "ms_per_step", "tokens_per_s", "mfu"}
    assert train_rows[0]["mfu"] is None and train_rows[0]["tokens_per_s"] > 0  # no known peak for a CPU
    assert train_rows[0]["tokens"] == 2 * 8 * 16  # steps x batch_size x block_size
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [3, 6] and all(r["val_bpb"] is None for r in val_rows)  # no tokenizer

    result = subprocess.run(
        [sys.executable, "-m", "gptlite.plot", str(runs[0])], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == f"wrote {runs[0] / 'loss.png'}", result.stderr
    out = tmp_path / "both.png"
    assert plot.main([*map(str, runs), "--x=tokens", "--log", f"--out={out}"]) == 0
    for png in (runs[0] / "loss.png", out):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    from matplotlib.image import imread

    assert imread(out).shape[:2] == (500, 800)  # 8 x 5 inches at 100 dpi: one panel, no bits per byte
    assert plot.main([*map(str, runs)]) == 0  # several runs, no --out: beside them, never where the command runs
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not Path("loss.png").exists()

    assert plot.main([str(tmp_path / "nowhere")]) == 2
    assert f"gptlite.plot: error: {tmp_path / 'nowhere' / 'metrics.jsonl'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert plot.main([str(tmp_path / "empty.jsonl"), f"--out={tmp_path / 'x.png'}"]) == 2
    assert "has no finite loss values to plot" in capsys.readouterr().err
    (tmp_path / "old.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert plot.main([str(tmp_path / "old.jsonl"), "--x=tokens", f"--out={tmp_path / 'x.png'}"]) == 2
    assert "have no token counts" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_wandb_that_cannot_start_is_one_line_before_anything_is_written(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key anywhere
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    try:
        run = run_train(*config(data, tmp_path / "out", max_iters=2, eval_interval=2, wandb_log=True))
    finally:
        import wandb

        wandb.teardown()  # wandb keeps its settings in the process: the next test's run must not inherit them
    assert re.fullmatch(r"wandb_log=true, but wandb cannot start a run \(.*\); run `wandb login`, set "
                        r"WANDB_MODE=offline, or drop --wandb_log", run.error)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]  # no metrics, no tokenizer copy


def test_tensorboard_gets_the_metrics_and_a_resumed_run_goes_on_in_them(data, tmp_path):
    """--tensorboard: TensorBoard's own reader finds every figure of metrics.jsonl at its step, across a resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    run_train(*config(data, out, max_iters=4, eval_interval=2, tensorboard=True))
    resumed = run_train(*config(data, out, max_iters=6, eval_interval=2, tensorboard=True, resume=True))
    assert resumed.code == 0 and "resumed from" in resumed.out
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = read_metrics(out / "metrics.jsonl")
    for tag in ("loss", "lr", "grad_norm", "val_loss"):
        want = [(r["step"], r[tag]) for r in rows if r.get(tag) is not None]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 3, tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag


def test_tensorboard_without_its_package_is_one_line_before_anything_is_written(data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    run = run_train(*config(data, tmp_path / "out", max_iters=2, tensorboard=True))
    assert run.code == 2
    assert run.error.strip() == (
        'tensorboard=true needs the tensorboard package: pip install -e ".[tensorboard]" (or pip install '
        "tensorboard); or drop --tensorboard"
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_wandb_offline_run_gets_the_metrics(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_train(*config(data, tmp_path / "out", max_iters=2, eval_interval=2, wandb_log=True))
    run_id = load_checkpoint(tmp_path / "out")["meta"]["wandb_run_id"]
    logs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(logs) == 1 and b"val_loss" in logs[0].read_bytes() and b"grad_norm" in logs[0].read_bytes()


def test_mfu_against_known_peaks():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("NVIDIA L40S") == 362e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("Some Future GPU") is None
    assert mfu(6e9, 1e5, 1e15) == pytest.approx(0.6)
    assert mfu(6e9, 1e5, None) is None


# ---------------------------------------------------------------------------------------------
# signals and kill -9 on a real training process


def start_training(data: Path, out: Path, **overrides) -> subprocess.Popen:
    values = {**TINY, "data_dir": data, "out_dir": out, **overrides}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *(f"--{k}={v}" for k, v in values.items())],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def wait_until(condition, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120  # a safety net only: the test's outcome never depends on timing
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the training process made no progress"
        time.sleep(0.02)


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_finishes_the_step_saves_and_says_how_to_resume(data, tmp_path, sig):
    out = tmp_path / "run"
    proc = start_training(data, out, max_iters=100_000, eval_interval=1000, lr_decay_iters=40)
    wait_until(lambda: len(losses(out)) >= 3, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert stderr == ""
    step = load_checkpoint(out)["step"]
    assert f"step {step:5d} | saved {out / f'ckpt_{step:06d}.pt'}" in stdout
    assert (
        f"stopped after step {step} ({sig.name}) with a checkpoint in {out}; "
        f"continue with: python train.py --out_dir={out} --resume"
    ) in stdout
    # the checkpoint continues the run as if nothing had happened
    run_train(*resume(out, f"--max_iters={step + 3}"))
    run_train(*config(data, tmp_path / "straight", max_iters=step + 3, eval_interval=1000, lr_decay_iters=40))
    assert losses(out) == losses(tmp_path / "straight")


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_kill_9_at_any_moment_then_resume_matches_an_uninterrupted_run(data, tmp_path):
    out = tmp_path / "run"
    proc = start_training(data, out, max_iters=100_000, eval_interval=2, lr_decay_iters=40, keep_last=2)
    wait_until(lambda: len(step_files(out)) >= 2, proc)
    proc.kill()  # SIGKILL, wherever it is: mid-step, mid-evaluation or mid-write
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    step = load_checkpoint(out)["step"]
    run_train(*resume(out, f"--max_iters={step + 4}"))
    run_train(*config(data, tmp_path / "straight", max_iters=step + 4, eval_interval=2, lr_decay_iters=40))
    assert losses(out) == losses(tmp_path / "straight")  # rows the killed run logged past its checkpoint are gone


def test_eval_iters_0_evaluates_every_val_window_once(data, tmp_path):
    """The full evaluation equals the token-weighted mean loss over every block_size window of the val shards."""
    cfg = resolve_config(config(data, tmp_path, max_iters=1))
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    _, val_loader = make_loaders(cfg, 0, 1)
    full, bpb = evaluate_loader(
        model, val_loader, 0, "cpu", contextlib.nullcontext(), torch.ones(VOCAB, dtype=torch.long)
    )
    T, total, count = cfg.model.block_size, 0.0, 0
    for tokens in val_loader.shards:
        for i in range(0, len(tokens) - T, T):
            window = torch.from_numpy(tokens[i : i + T + 1].astype(np.int64))[None]
            _, loss = model(window[:, :-1], window[:, 1:])
            total, count = total + loss.item() * T, count + T
    assert count > cfg.batch_size * T  # more than one batch, with a short last one
    assert full == pytest.approx(total / count, rel=1e-5)
    assert bpb == pytest.approx(full / math.log(2), rel=1e-6)  # one byte per token


# ---------------------------------------------------------------------------------------------
# one run, one folder; faults of the disk


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_a_second_train_on_one_out_dir_is_refused_naming_the_first(data, tmp_path):
    out = tmp_path / "run"
    first = start_training(data, out, max_iters=100_000, eval_interval=1000, lr_decay_iters=40)
    wait_until(lambda: len(losses(out)) >= 1, first)  # it holds the lock from before its first step
    try:
        values = {**TINY, "data_dir": data, "out_dir": out, "resume": True}
        second = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *(f"--{k}={v}" for k, v in values.items())],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"train.py: error: out_dir {out} is in use by process {first.pid} on " in second.stderr, second.stderr
    finally:
        first.kill()  # kill -9: the OS frees the lock with the process
        first.communicate(timeout=60)
    assert run_train(*config(data, out, max_iters=2, resume=True))["step"] == 2  # the folder is free again


def test_a_fresh_run_into_an_earlier_runs_folder_is_refused_or_moves_it_aside(data, tmp_path, capsys):
    out = tmp_path / "run"
    run_train(*config(data, out, max_iters=2, eval_interval=2))
    earlier = sorted(p.name for p in out.iterdir())
    assert re.search(
        rf"out_dir {re.escape(str(out))} holds an earlier run \(ckpt_000002.pt, "
        r"ckpt_000002.pt.sha256, ckpt.pt, \.\.\.\); continue it with --resume, "
        r"choose another --out_dir, or pass --overwrite",
        run_train(*config(data, out, max_iters=2, n_embd=64)).error,
    )
    assert sorted(p.name for p in out.iterdir()) == earlier  # nothing moved or deleted
    capsys.readouterr()
    run_train(*config(data, out, max_iters=3, eval_interval=3, n_embd=64, overwrite=True))
    assert "moved the earlier run's 5 files into " in capsys.readouterr().out  # checkpoint, checksum, 2 links, metrics
    previous = next(out.glob("previous-*"))
    assert load_checkpoint(previous)["config"]["n_embd"] == 32 and (previous / "metrics.jsonl").stat().st_size > 0
    assert load_checkpoint(out)["config"]["n_embd"] == 64 and load_checkpoint(out)["step"] == 3


def test_leftover_temporary_files_are_deleted_when_a_run_starts(data, tmp_path, capsys):
    run_train(*config(data, tmp_path, max_iters=2, eval_interval=2))
    (tmp_path / "ckpt_000004.pt.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "ckpt_000004.pt.sha256.tmp").write_text("0" * 64)
    run_train(*resume(tmp_path, "--max_iters=3"))
    assert (
        f"deleted {tmp_path / 'ckpt_000004.pt.tmp'}, a temporary file an interrupted save left"
        in capsys.readouterr().out
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_an_out_dir_that_is_a_file_or_read_only_is_one_line(data, tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    values = {**TINY, "data_dir": data, "out_dir": a_file}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *(f"--{k}={v}" for k, v in values.items())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == f"train.py: error: out_dir {a_file} is a file, not a folder; choose another path\n"

    def read_only(self, *args, **kwargs):  # root writes through file modes: the file system refuses instead
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert re.search(
        r"^cannot create out_dir .*: read-only file system; use a writable folder$",
        run_train(*config(data, tmp_path / "new", max_iters=1)).error,
    )


def test_a_full_disk_while_saving_stops_in_one_line_and_the_run_resumes(data, tmp_path, monkeypatch):
    from gptlite import checkpoint

    run_train(*config(data, tmp_path, max_iters=2, eval_interval=2))
    real_init = checkpoint._HashingWriter.__init__
    monkeypatch.setattr(checkpoint._HashingWriter, "__init__", lambda self, f: real_init(self, FullDisk(f, 20_000)))
    assert re.search(
        r"^step 4: could not save checkpoint .*ckpt_000004\.pt: no space left on device; "
        r"free space or use a folder on another disk; the latest good checkpoint stays in "
        r".*: fix that, then continue with --resume$",
        run_train(*resume(tmp_path, "--max_iters=4")).error,
    )
    assert not list(tmp_path.glob("*.tmp")) and load_checkpoint(tmp_path)["step"] == 2
    monkeypatch.setattr(checkpoint._HashingWriter, "__init__", real_init)  # space freed
    assert run_train(*resume(tmp_path, "--max_iters=4"))["step"] == 4
