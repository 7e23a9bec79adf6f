"""End to end: prepare a corpus -> train (loss falls) -> checkpoint -> resume -> sample.py prints text."""

import json
import subprocess
import sys
from itertools import pairwise

import pytest
import torch

from gptlite import load_checkpoint, model_from_checkpoint
from gptlite.config import build_config
from gptlite.data.prepare import prepare
from gptlite.gpt import GPT
from gptlite.train.optim import configure_optimizers, lr_at
from gptlite.train.run_config import resolve_config
from tests.conftest import DEVICE, ROOT, run_train, shared_file

TINY = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    block_size=32,
    batch_size=8,
    learning_rate=1e-2,
    min_lr=1e-3,
    warmup_iters=5,
    eval_iters=4,
    log_interval=1,
    device=DEVICE,
)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:200_000])
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


def run_cli(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.device
def test_train_resume_sample(char_data, tmp_path):
    out = tmp_path / "run"
    args = [
        f"--data_dir={char_data}",
        f"--out_dir={out}",
        "--max_iters=40",
        "--eval_interval=20",
        *(f"--{k}={v}" for k, v in TINY.items()),
    ]
    cfg = resolve_config(args)
    assert cfg.model.vocab_size == json.loads((char_data / "tokenizer.json").read_text())["vocab_size"] > 50
    summary = run_train(*args)
    losses = [loss for _, loss in summary["history"]]
    assert summary["step"] == 40
    assert losses[-1] < losses[0] - 0.6, losses
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["step"] == 40 and ckpt["loader"]["index"] > 0
    assert not any(k.startswith(("_orig_mod", "module.")) for k in ckpt["model"])
    assert (out / "tokenizer.json").is_file()

    # resume: continues from step 40 with the saved weights, optimizer and data position
    resumed_args = [f"--out_dir={out}", "--resume", "--max_iters=50"]
    resumed_cfg = resolve_config(resumed_args)
    assert resumed_cfg.model == cfg.model and resumed_cfg.data_dir == str(char_data)
    resumed = run_train(*resumed_args)
    assert resumed["step"] == 50
    assert [s for s, _ in resumed["history"]] == list(range(41, 51))
    assert resumed["history"][-1][1] < losses[0] - 0.6
    assert load_checkpoint(out)["step"] == 50

    # the checkpoint rebuilds the same model
    model = model_from_checkpoint(load_checkpoint(out))
    assert model.lm_head.weight is model.tok_emb.weight

    result = run_cli(
        "sample.py",
        f"--out_dir={out}",
        "--start=ROMEO:",
        "--num_samples=2",
        "--max_new_tokens=40",
        f"--device={DEVICE}",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ROMEO:") == 2
    assert len(result.stdout) > 2 * (6 + 40)


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_train_cli_end_to_end_and_errors(char_data, tmp_path):
    out = tmp_path / "cli"
    ok = run_cli(
        "train.py",
        str(ROOT / "configs" / "shakespeare_char_cpu.toml"),
        f"--data_dir={char_data}",
        f"--out_dir={out}",
        "--max_iters=4",
        "--eval_interval=2",
        "--eval_iters=1",
        "--log_interval=2",
        "--n_layer=1",
        "--n_embd=32",
        "--n_head=2",
    )
    assert ok.returncode == 0, ok.stderr
    assert "step     4 | val loss" in ok.stdout and (out / "ckpt.pt").is_file()

    for args, message in [
        ([f"--data_dir={char_data}", "--n_layr=2"], "unknown config key 'n_layr'; did you mean 'n_layer'?"),
        ([f"--data_dir={char_data}", "--batch_size=abc"], "batch_size='abc' is not an integer"),
        ([f"--data_dir={char_data}", "--n_embd=100", "--n_head=3"], "n_embd=100 is not divisible by n_head=3"),
        ([f"--data_dir={tmp_path / 'nowhere'}", "--vocab_size=65"], f"data {tmp_path / 'nowhere'} does not exist"),
        ([f"--data_dir={tmp_path / 'nowhere'}"], f"data_dir {tmp_path / 'nowhere'} does not exist or is not a folder"),
        ([f"--data_dir={tmp_path}", "--vocab_size=65"], "no train shards found"),
        (
            [f"--data_dir={char_data}", "--vocab_size=50"],
            "but the model's vocab_size is 50; set --vocab_size to at least",
        ),
        (["missing.toml"], "config file missing.toml does not exist"),
    ]:
        # the command in this process (run_train): the same exit code and one line, without a Python start each
        result = run_train(*args, f"--out_dir={tmp_path / 'x'}")
        assert result.code == 2, (args, result.out, result.err)
        assert message in result.error, (args, result.err)  # .error: exactly one line, no traceback


def test_resume_refuses_a_different_model_shape(char_data, tmp_path):
    out = tmp_path / "run"
    run_train(
        f"--data_dir={char_data}",
        f"--out_dir={out}",
        "--max_iters=2",
        "--eval_interval=2",
        *(f"--{k}={v}" for k, v in TINY.items()),
    )
    with pytest.raises(
        ValueError, match=r"cannot change the model shape on --resume .* block_size=64 \(checkpoint has 32\)"
    ):
        resolve_config([f"--out_dir={out}", "--resume", "--block_size=64"])


def test_sample_errors(tmp_path):
    result = run_cli("sample.py", f"--out_dir={tmp_path}")
    assert result.returncode == 2 and "checkpoint" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    result = run_cli("sample.py", f"--out_dir={tmp_path}")
    assert result.returncode == 2 and "is damaged" in result.stderr and "not a gptlite checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_sample_rejects_a_prompt_the_tokenizer_cannot_encode(char_data, tmp_path):
    out = tmp_path / "run"
    run_train(
        f"--data_dir={char_data}",
        f"--out_dir={out}",
        "--max_iters=1",
        "--eval_interval=1",
        *(f"--{k}={v}" for k, v in TINY.items()),
    )
    result = run_cli("sample.py", f"--out_dir={out}", "--start=日本", "--device=cpu")
    assert result.returncode == 2 and "'日' is not in this char tokenizer's vocabulary" in result.stderr
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("KING:")
    result = run_cli(
        "sample.py",
        f"--out_dir={out}",
        f"--start=FILE:{prompt}",
        "--num_samples=1",
        "--max_new_tokens=5",
        "--temperature=0",
        "--device=cpu",
    )
    assert result.returncode == 0 and result.stdout.startswith("KING:")


def test_lr_schedule():
    cfg = build_config(
        {"data_dir": "x", "vocab_size": 10, "learning_rate": 1.0, "min_lr": 0.1, "warmup_iters": 10, "max_iters": 110}
    )
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # halfway through the cosine
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in pairwise(lrs[9:]))


def test_learning_rate_0_stays_0_and_nanogpts_init_from_values_mean_the_same(tmp_path):
    cfg = build_config({"data_dir": "x", "vocab_size": 10, "learning_rate": 0, "warmup_iters": 10, "max_iters": 100})
    assert {lr_at(s, cfg) for s in (0, 5, 50, 99, 200)} == {0.0}
    base = [f"--data_dir={tmp_path}", "--vocab_size=10", f"--out_dir={tmp_path}"]
    assert resolve_config([*base, "--init_from=scratch"]).init_from == ""
    resumed = resolve_config([*base, "--init_from=resume"])  # no checkpoint there yet: starts from scratch
    assert resumed.resume and resumed.init_from == ""


def test_time_lr_schedule_decays_over_the_time_budget():
    cfg = build_config(
        {
            "data_dir": "x",
            "vocab_size": 10,
            "learning_rate": 1.0,
            "min_lr": 0.1,
            "warmup_iters": 10,
            "max_iters": 10**9,
            "lr_schedule": "time",
            "max_minutes": 2.0,
        }
    )
    assert lr_at(4, cfg, minutes=1.0) == pytest.approx(0.5)  # warmup still counts steps
    assert lr_at(500, cfg, minutes=1.0) == pytest.approx(0.55)  # half the budget: halfway down the cosine
    assert lr_at(500, cfg, minutes=2.0) == pytest.approx(0.1)
    assert lr_at(9000, cfg, minutes=2.5) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="set max_minutes > 0"):
        build_config({"data_dir": "x", "lr_schedule": "time"})
    with pytest.raises(ValueError, match="lr_schedule='cosine' must be one of steps, time"):
        build_config({"data_dir": "x", "lr_schedule": "cosine"})


def test_weight_decay_groups():
    cfg = build_config(
        {"data_dir": "x", "vocab_size": 10, "n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 8, "bias": True}
    )
    model = GPT(cfg.model)
    (opt,) = configure_optimizers(model, cfg, "cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()
    assert torch.is_tensor(decayed["params"][0])
