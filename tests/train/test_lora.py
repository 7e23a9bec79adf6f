"""LoRA: adapters on a frozen pretrained model, checkpoints of adapters alone, resume, the merged model, and the
PEFT adapter that peft loads with equal logits."""

import json
import subprocess
import sys

import peft
import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.checkpoint import load_checkpoint, lora_model, model_from_checkpoint
from gptlite.data.prepare import prepare
from gptlite.train.lora import LoRALinear, add_lora, merge_lora
from gptlite.train.run_config import resolve_config
from tests.conftest import DEVICE, ROOT, run_train
from tests.test_hf import CHARS, hf_gpt2, hf_llama

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for name, make in (("llama", hf_llama), ("gpt2", hf_gpt2)):
        directory = tmp_path_factory.mktemp(name)
        make().save_pretrained(directory)
        out[name] = directory
    return out


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "text.txt"
    corpus.write_text(CHARS * 300)  # every one of the 97 characters the tiny models know
    data = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", data, log=lambda *a: None)
    return data


@pytest.mark.device
def test_adapters_start_at_the_base_model_and_merge_exactly(bases):
    base = GPT.from_pretrained(str(bases["llama"])).to(DEVICE)
    model = add_lora(GPT.from_pretrained(str(bases["llama"])).to(DEVICE), rank=4, alpha=8.0)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"blocks.{i}.{layer}.{ab}"
        for i in range(2)
        for layer in ("attn.qkv", "attn.out_proj", "ffn.fc", "ffn.out_proj")
        for ab in ("lora_A", "lora_B")
    }
    assert set(base.state_dict()) <= set(model.state_dict())  # the base weights keep their names
    idx = torch.randint(0, 97, (2, 12), device=DEVICE)
    torch.testing.assert_close(model(idx)[0], base(idx)[0])  # B starts at zero
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            torch.nn.init.normal_(layer.lora_B, std=0.1)
    with torch.no_grad():
        adapted = model(idx)[0]
        assert not torch.allclose(adapted, base(idx)[0])
        torch.testing.assert_close(merge_lora(model)(idx)[0], adapted, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def lora_args(base, data, out, *extra: str) -> list[str]:
    return [
        f"--init_from={base}",
        f"--data_dir={data}",
        f"--out_dir={out}",
        "--lora_rank=4",
        "--lora_alpha=8",
        "--block_size=32",
        "--batch_size=4",
        "--learning_rate=1e-2",
        "--warmup_iters=2",
        "--eval_iters=2",
        "--log_interval=2",
        "--device=cpu",
        "--lr_decay_iters=8",
        *extra,
    ]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_lora_run_trains_adapters_only_saves_them_alone_and_resumes_exactly(bases, char_data, tmp_path, family):
    base = bases[family]
    straight = run_train(*lora_args(base, char_data, tmp_path / "a", "--max_iters=8", "--eval_interval=4"))
    ckpt = load_checkpoint(tmp_path / "a")
    assert set(ckpt["model"]) == {k for k in ckpt["model"] if k.endswith(("lora_A", "lora_B"))} and ckpt["model"]
    assert ckpt["lora"]["base"] == str(base) and ckpt["lora"]["rank"] == 4
    saved = sum(t.numel() for t in ckpt["model"].values())
    assert saved < 0.5 * GPT.from_pretrained(str(base)).num_params()  # rank 4 of 32-wide layers; megabytes of gigabytes
    moments = [t for state in ckpt["optimizer"]["state"].values() for t in state.values() if t.dim() > 0]
    assert sum(t.numel() for t in moments) == 2 * saved  # AdamW's two moments, of the adapters only
    pretrained, merged = GPT.from_pretrained(str(base), block_size=32), model_from_checkpoint(ckpt)
    unmerged = lora_model(ckpt, merge=False)
    for name, p in pretrained.state_dict().items():  # frozen: the adapters hold all that changed
        torch.testing.assert_close(unmerged.state_dict()[name], p, atol=0, rtol=0)
    assert not torch.equal(
        merged.state_dict()["blocks.0.attn.qkv.weight"], pretrained.state_dict()["blocks.0.attn.qkv.weight"]
    )
    run_train(*lora_args(base, char_data, tmp_path / "b", "--max_iters=4", "--eval_interval=4"))
    resumed = run_train(f"--out_dir={tmp_path / 'b'}", "--resume", "--max_iters=8")
    assert resumed["history"] == [h for h in straight["history"] if h[0] > 4]


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_loads_the_adapter_and_transformers_the_merged_model_with_equal_logits(bases, char_data, tmp_path, family):
    base, run = bases[family], tmp_path / "run"
    run_train(*lora_args(base, char_data, run, "--max_iters=4", "--eval_interval=4"))
    for extra, hf_dir in ((["--adapter"], tmp_path / "adapter"), ([], tmp_path / "merged")):
        result = subprocess.run(
            [sys.executable, "-m", "gptlite.hf", "export", f"--out_dir={run}", f"--hf_dir={hf_dir}", *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    ours = model_from_checkpoint(load_checkpoint(run)).eval()
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    ).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        logits = ours(idx)[0]
        assert not torch.allclose(logits, GPT.from_pretrained(str(base))(idx)[0], atol=1e-3)  # the adapters did train
        torch.testing.assert_close(adapted(idx).logits, logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(merged(idx).logits, logits, atol=1e-4, rtol=0)


def test_bad_lora_settings_are_one_line(bases, char_data, tmp_path):
    base = bases["llama"]
    for extra, message in [
        (["--lora_rank=0"], "lora_rank=0 must be >= 1"),
        (["--lora_rank=33"], "lora_rank=33 must be between 1 and 32"),
        (["--lora_targets=attn.qkv,nothing"], "lora_targets: nothing name no linear layer"),
        (["--lora_targets="], "lora_targets='' names no layer; choose among attn.qkv"),
    ]:
        args = [
            a for a in lora_args(base, char_data, tmp_path / "x", "--max_iters=1") if not a.startswith("--lora_rank")
        ]
        if not any(e.startswith("--lora_rank") for e in extra):
            args.append("--lora_rank=4")
        result = run_train(*args, *extra)
        assert result.code == 2 and message in result.error, result.err  # .error: one line, no traceback
    with pytest.raises(ValueError, match="lora_rank needs --init_from"):
        resolve_config([f"--data_dir={char_data}", f"--out_dir={tmp_path / 'y'}", "--lora_rank=4"])


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_a_lora_run_whose_base_changed_or_went_is_refused(bases, char_data, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for f in bases["llama"].iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    run = tmp_path / "run"
    run_train(*lora_args(base, char_data, run, "--max_iters=2", "--eval_interval=2"))
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + b"\0\0\0\0")
    assert "are not the ones this LoRA run" in run_train(f"--out_dir={run}", "--resume", "--max_iters=4").error
    with pytest.raises(ValueError, match="are not the ones this LoRA run was trained on"):
        model_from_checkpoint(load_checkpoint(run))
    weights.unlink()
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), f"--out_dir={run}", "--device=cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "base model" in result.stderr and "Traceback" not in result.stderr, result.stderr
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlite.hf",
            "export",
            f"--out_dir={tmp_path / 'run'}",
            f"--hf_dir={tmp_path / 'a'}",
            "--adapter",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
