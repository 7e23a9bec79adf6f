"""The user's whole path at toy size, each stage fed by the previous one's run folder: gptlite's own BPE -> prepare
-> pretrain -> LoRA SFT on conversations (--init_from=the pretrained run, its tokenizer already holding the chat
markers) -> DPO (--init_from=the LoRA run, merged) -> RL (--init_from=the DPO run) -> sample and evaluate the RL run
-> export to Hugging Face and to GGUF files of two types in one folder. Every hop takes a run folder as it is, with
no export in between."""

import json
import random
import subprocess
import sys

import pytest
import torch

from gptlite.checkpoint import load_checkpoint, load_source, source_fingerprint
from tests.conftest import ROOT, run_train, shared_file

SHAPE = dict(pos_emb="rope", norm="rmsnorm", n_layer=2, n_head=2, n_embd=64, block_size=64, device="cpu")
STEPS = dict(eval_iters=1, log_interval=1, warmup_iters=2)


def command(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A gptlite command as a user runs it, from the repository's root."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, input=stdin)
    assert done.returncode == 0, f"{args}\n{done.stderr}"
    return done


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sums(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        out.append((f"What is {a} plus {b}?", str(a + b)))
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Every stage's folder, run once for the tests below."""
    root = tmp_path_factory.mktemp("pipeline")
    corpus = root / "corpus.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:100_000])
    command("-m", "gptlite.tokenizer", "train", f"--input={corpus}", "--vocab_size=400", f"--out_dir={root / 'tok'}")
    command(ROOT / "data/prepare.py", f"--input={corpus}", f"--tokenizer={root / 'tok'}", f"--out_dir={root / 'text'}")
    pre = run_train(f"--data_dir={root / 'text'}", f"--out_dir={root / 'pre'}", max_iters=6, eval_interval=6,
                    batch_size=8, **SHAPE, **STEPS)  # fmt: skip
    assert pre.code == 0, pre.err

    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in sums(60, 0)
    ]
    write_jsonl(root / "chats.jsonl", chats)
    command(ROOT / "data/prepare.py", f"--input={root / 'chats.jsonl'}", "--chat", f"--tokenizer={root / 'pre'}",
            "--block_size=64", f"--out_dir={root / 'chat'}")  # fmt: skip
    sft = run_train(f"--init_from={root / 'pre'}", f"--data_dir={root / 'chat'}", f"--out_dir={root / 'sft'}",
                    "--lora_rank=4", "--lora_alpha=8", max_iters=4, eval_interval=4, batch_size=4, learning_rate=1e-3,
                    **SHAPE, **STEPS)  # fmt: skip
    assert sft.code == 0, sft.err

    pairs = [{"prompt": q, "chosen": a, "rejected": str(int(a) + 1)} for q, a in sums(60, 1)]
    write_jsonl(root / "pairs.jsonl", pairs)
    command(ROOT / "data/prepare.py", f"--input={root / 'pairs.jsonl'}", "--preference", f"--tokenizer={root / 'sft'}",
            "--block_size=64", f"--out_dir={root / 'pairs'}")  # fmt: skip
    dpo = run_train(f"--init_from={root / 'sft'}", f"--data_dir={root / 'pairs'}", f"--out_dir={root / 'dpo'}",
                    max_iters=3, eval_interval=3, batch_size=4, learning_rate=1e-4, **SHAPE, **STEPS)  # fmt: skip
    assert dpo.code == 0, dpo.err

    write_jsonl(
        root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in sums(20, 2)]
    )
    rl = run_train(f"--init_from={root / 'dpo'}", f"--data_dir={root / 'chat'}", f"--out_dir={root / 'rl'}", "--rl",
                   f"--rl_prompts={root / 'prompts.jsonl'}", "--reward=exact", "--rl_samples=2",
                   "--rl_max_new_tokens=4", max_iters=2, eval_interval=2, batch_size=2, learning_rate=1e-5, min_lr=0,
                   **SHAPE, **STEPS)  # fmt: skip
    assert rl.code == 0, rl.err
    return root


def test_each_stage_starts_from_the_last_ones_run_folder(chain):
    pre, sft, dpo, rl = (load_checkpoint(chain / name) for name in ("pre", "sft", "dpo", "rl"))
    assert sft["config"]["init_from"] == str(chain / "pre") and "lora" in sft
    assert sft["lora"]["sha256"] == source_fingerprint(str(chain / "pre"))  # the base it adapts, checked on load
    assert dpo["config"]["init_from"] == str(chain / "sft") and rl["config"]["init_from"] == str(chain / "dpo")
    assert sft["config"]["vocab_size"] == pre["config"]["vocab_size"]  # the markers were the BPE's: no rows added
    # the DPO run started from the LoRA run's weights, merged: its reference is the SFT model
    merged = load_source(str(chain / "sft"))
    base = load_source(str(chain / "pre"))
    assert not torch.equal(
        merged.state_dict()["blocks.0.attn.qkv.weight"], base.state_dict()["blocks.0.attn.qkv.weight"]
    )


def test_the_last_run_samples_evaluates_and_exports(chain, tmp_path):
    chat = command(
        ROOT / "sample.py", f"--init_from={chain / 'rl'}", "--chat", "--max_new_tokens=4", stdin="What is 1 plus 2?\n"
    )
    assert chat.stdout  # a reply, streamed
    scores = tmp_path / "scores.json"
    command("-m", "gptlite.evaluate", f"--out_dir={chain / 'rl'}", f"--json={scores}")
    assert json.loads(scores.read_text())
    command("-m", "gptlite.hf", "export", f"--out_dir={chain / 'rl'}", f"--hf_dir={tmp_path / 'hf'}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # one end of sequence for the chat model everywhere: the end of a turn first, then the end of text
    im_end, eot = 2, 0  # the BPE trainer's ids for <|im_end|> and <|endoftext|>
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == [im_end, eot]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<|im_end|>"
    ours = load_source(str(chain / "rl"))
    idx = torch.tensor([[1, 5, 9, 30]])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], rtol=1e-4, atol=1e-4)
    for kind in ("f16", "q8_0"):
        out = tmp_path / "gguf" / f"rl-{kind}.gguf"
        command(
            "-m", "gptlite.hf", "export", "--format=gguf", f"--out_dir={chain / 'rl'}", f"--out={out}", f"--type={kind}"
        )
    import gguf

    assert gguf.GGUFReader(tmp_path / "gguf" / "rl-f16.gguf").fields["tokenizer.ggml.eos_token_id"].contents() == im_end
    assert 'PARAMETER stop "<|im_end|>"' in (tmp_path / "gguf" / "rl-f16.Modelfile").read_text()
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [
        "rl-f16.Modelfile", "rl-f16.gguf", "rl-q8_0.Modelfile", "rl-q8_0.gguf"
    ]  # fmt: skip
