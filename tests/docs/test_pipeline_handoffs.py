"""The user's whole path at toy size, each stage fed by the previous one's run folder: gptlite's own BPE -> prepare
-> pretrain -> LoRA SFT on conversations (--init_from=the pretrained run, its tokenizer already holding the chat
markers) -> DPO (--init_from=the LoRA run, merged) -> RL (--init_from=the DPO run) -> sample and evaluate the RL run
-> export to Hugging Face and to GGUF files of two types in one folder -> serve it. Every hop takes a run folder as
it is, with no export in between, and the hand-offs agree: one end-of-turn token everywhere, evaluate's figures are
train.py's, and shards of another tokenizer are refused."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from gptlite.checkpoint import load_checkpoint, load_source, source_fingerprint
from gptlite.tokenizer import load_tokenizer
from tests.conftest import ROOT, run_train, shared_file
from tests.helpers.serving import free_port

SHAPE = dict(pos_emb="rope", norm="rmsnorm", n_layer=2, n_head=2, n_embd=64, block_size=64, device="cpu")
STEPS = dict(eval_iters=1, log_interval=1, warmup_iters=2)
EVERY_WINDOW = dict(STEPS, eval_iters=0)  # runs whose last val figures evaluate must give again


def command(*args, stdin: str | None = None, code: int = 0) -> subprocess.CompletedProcess:
    """A gptlite command as a user runs it, from the repository's root, which must exit with `code`."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, input=stdin)
    assert done.returncode == code, f"{args}\n{done.stderr}"
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
                    **SHAPE, **EVERY_WINDOW)  # fmt: skip
    assert sft.code == 0, sft.err

    pairs = [{"prompt": q, "chosen": a, "rejected": str(int(a) + 1)} for q, a in sums(60, 1)]
    write_jsonl(root / "pairs.jsonl", pairs)
    command(ROOT / "data/prepare.py", f"--input={root / 'pairs.jsonl'}", "--preference", f"--tokenizer={root / 'sft'}",
            "--block_size=64", f"--out_dir={root / 'pairs'}")  # fmt: skip
    dpo = run_train(f"--init_from={root / 'sft'}", f"--data_dir={root / 'pairs'}", f"--out_dir={root / 'dpo'}",
                    max_iters=3, eval_interval=3, batch_size=4, learning_rate=1e-4,
                    **SHAPE, **EVERY_WINDOW)  # fmt: skip
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
        ROOT / "sample.py", f"--model={chain / 'rl'}", "--chat", "--max_new_tokens=4", stdin="What is 1 plus 2?\n"
    )
    assert chat.stdout  # a reply, streamed
    scores = tmp_path / "scores.json"
    command("-m", "gptlite.evaluate", f"--model={chain / 'rl'}", f"--json={scores}")
    assert json.loads(scores.read_text())
    command("-m", "gptlite.hf", "export", f"--model={chain / 'rl'}", f"--out={tmp_path / 'hf'}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # one end of sequence for the chat model everywhere: the end of a turn first, then the end of text
    im_end = 2  # the BPE trainer's id for <|im_end|>
    eot = 0  # and for <|endoftext|>
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == [im_end, eot]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<|im_end|>"
    ours = load_source(str(chain / "rl"))
    idx = torch.tensor([[1, 5, 9, 30]])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], rtol=1e-4, atol=1e-4)
    for kind in ("f16", "q8_0"):
        out = tmp_path / "gguf" / f"rl-{kind}.gguf"
        command(
            "-m", "gptlite.hf", "export", "--format=gguf", f"--model={chain / 'rl'}", f"--out={out}", f"--type={kind}"
        )
    import gguf

    assert gguf.GGUFReader(tmp_path / "gguf" / "rl-f16.gguf").fields["tokenizer.ggml.eos_token_id"].contents() == im_end
    assert 'PARAMETER stop "<|im_end|>"' in (tmp_path / "gguf" / "rl-f16.Modelfile").read_text()
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [
        "rl-f16.Modelfile", "rl-f16.gguf", "rl-q8_0.Modelfile", "rl-q8_0.gguf"
    ]  # fmt: skip


def last_evaluation(run) -> dict:
    """The last row of a run's metrics.jsonl that holds its val figures."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "val_loss" in row][-1]


def test_evaluate_scores_what_training_scored(chain, tmp_path):
    # the LoRA SFT run on conversations: the assistant's tokens alone, as train.py's val loss of the same split
    sft_scores = tmp_path / "sft.json"
    command("-m", "gptlite.evaluate", f"--model={chain / 'sft'}", f"--json={sft_scores}")
    val = json.loads(sft_scores.read_text())["val"]
    trained = last_evaluation(chain / "sft")
    assert val["data"] == "conversations" and "assistant's tokens" in val["scored"]
    assert val["loss"] == pytest.approx(trained["val_loss"], rel=1e-4)
    assert val["bpb"] == pytest.approx(trained["val_bpb"], rel=1e-4)
    # every token of the same conversations, as the text they are, scores otherwise (by far more than the tolerance)
    everything = load_source(str(chain / "sft"))
    from gptlite.data.loader import find_shards, read_shard
    from gptlite.evaluate import evaluate_windows

    streams = [torch.from_numpy(read_shard(p).astype("int64")) for p in find_shards(chain / "chat", "val")]
    assert abs(evaluate_windows(everything, streams)[0] - val["loss"]) > 10 * 1e-4 * val["loss"]

    # the DPO run on preference pairs: DPO's loss, accuracy and margin against the model it started from
    dpo_scores = tmp_path / "dpo.json"
    done = command("-m", "gptlite.evaluate", f"--model={chain / 'dpo'}", f"--json={dpo_scores}")
    val = json.loads(dpo_scores.read_text())["val"]
    trained = last_evaluation(chain / "dpo")
    assert val["data"] == "pairs" and "val accuracy" in done.stdout and "val margin" in done.stdout
    for name in ("loss", "rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected"):
        assert val[name] == pytest.approx(trained[f"val_{name}"], rel=1e-3, abs=1e-5), name

    # preference pairs have no score for a model that is not a DPO run: no reference to measure it against
    done = command("-m", "gptlite.evaluate", f"--model={chain / 'pre'}", f"--data_dir={chain / 'pairs'}", code=2)
    assert "holds preference pairs" in done.stderr and "is not a DPO run" in done.stderr


def test_every_file_names_the_tokenizer_and_another_ones_shards_are_refused(chain, tmp_path):
    tokenizer = load_tokenizer(chain / "text")
    fingerprint = tokenizer.fingerprint()
    assert json.loads((chain / "text" / "manifest.json").read_text())["tokenizer_fingerprint"] == fingerprint
    for run in ("pre", "sft", "dpo", "rl"):  # the chat markers were the BPE's own: one tokenizer all along
        assert load_checkpoint(chain / run)["meta"]["tokenizer"] == {
            "fingerprint": fingerprint,
            "vocab_size": tokenizer.vocab_size,
        }

    # another BPE of the same size, trained on other text: its shards fit the model's vocabulary and mean other pieces
    corpus = tmp_path / "other.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[500_000:600_000].upper())
    tok = tmp_path / "tok"
    command("-m", "gptlite.tokenizer", "train", f"--input={corpus}", "--vocab_size=400", f"--out_dir={tok}")
    command(ROOT / "data/prepare.py", f"--input={corpus}", f"--tokenizer={tok}",
            f"--out_dir={tmp_path / 'other'}")  # fmt: skip
    other = load_tokenizer(tmp_path / "other")
    assert other.vocab_size == tokenizer.vocab_size and other.fingerprint() != fingerprint
    refused = run_train(f"--init_from={chain / 'pre'}", f"--data_dir={tmp_path / 'other'}",
                        f"--out_dir={tmp_path / 'tuned'}", max_iters=1, **SHAPE, **STEPS)  # fmt: skip
    assert refused.code == 2 and len(refused.err.strip().splitlines()) == 1
    assert (
        f"the data in {tmp_path / 'other'} was tokenized with another tokenizer than {chain / 'pre'}'s" in refused.err
    )
    assert other.fingerprint() in refused.err and fingerprint in refused.err
    assert not (tmp_path / "tuned").exists()  # refused before the run folder was made
    done = command("-m", "gptlite.evaluate", f"--model={chain / 'pre'}", f"--data_dir={tmp_path / 'other'}", code=2)
    assert "was tokenized with another tokenizer" in done.stderr and other.fingerprint() in done.stderr

    # a run's tokenizer.json replaced by another is refused where the run is read
    run = tmp_path / "run"
    run.mkdir()
    for path in (chain / "pre").iterdir():
        if path.name.startswith("ckpt") or path.name == "config.json":
            (run / path.name).symlink_to(path)
    other.save(run / "tokenizer.json")
    done = command(ROOT / "sample.py", f"--model={run}", "--max_new_tokens=2", code=2)
    assert f"{run / 'tokenizer.json'} is not the tokenizer the run in {run} trained with" in done.stderr


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def test_the_server_answers_as_the_export_does(chain, tmp_path):
    """The last hop: the RL run served as a user starts the server, its greedy reply the HF export's generate()
    reply, and its end of turn the export's eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    command("-m", "gptlite.hf", "export", f"--model={chain / 'rl'}", f"--out={tmp_path / 'hf'}")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(prompt, torch.Tensor):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    out = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
    expected = hf_tokenizer.decode([i for i in out if i not in hf.generation_config.eos_token_id])

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "gptlite.serve", f"--model={chain / 'rl'}", f"--port={port}", "--device=cpu"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                info = get(url + "/tokenizer_info")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        assert info["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
        reply = post(
            url + "/v1/chat/completions",
            {"model": "rl", "messages": messages, "max_tokens": 12, "temperature": 0},
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            log, _ = server.communicate(timeout=15)
        finally:
            server.kill()
    assert "Traceback" not in log
    assert reply["choices"][0]["message"]["content"] == expected
    stopped = len(out) < 12 or out[-1] in hf.generation_config.eos_token_id
    assert reply["choices"][0]["finish_reason"] == ("stop" if stopped else "length")
