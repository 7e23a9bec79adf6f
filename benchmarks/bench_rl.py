"""Reinforcement learning on verifiable rewards, measured: (1) the toy task of tests/train/test_rl.py (continue "1234="
with the digits reversed, rewarded by exact match) end to end: a tiny model taught the format by a few direct steps, its
held-out mean reward and greedy pass@1 before and after `train.py --rl`, the steps and the command's wall time;
(2) the samples per second of the RL step's generation (gptlite.train.rl.sample_group, the KV cache's batched decoding)
at GPT-2-124M's shape with random weights: prompts x samples rows, every row decoding max_new_tokens tokens.

    python benchmarks/bench_rl.py [--rl_steps=500] [--prompts=8] [--samples=8] [--max_new_tokens=64] [--device=cpu]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.checkpoint import load_model  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.data.prepare import prepare  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.hf import export_hf  # noqa: E402
from gptlite.tokenizer import CharTokenizer  # noqa: E402
from gptlite.train.rl import Prompt, load_reward, read_prompts, sample_group, score_prompts  # noqa: E402

DIGITS = CharTokenizer("0123456789=\n")


@dataclass
class Options:
    rl_steps: int = option(500, "train.py --rl steps on the toy task")
    teach_steps: int = option(80, "direct steps that teach the toy model the answer's format first")
    prompts: int = option(8, "throughput: prompts per generation")
    samples: int = option(8, "throughput: samples per prompt")
    prompt_tokens: int = option(32, "throughput: tokens per prompt")
    max_new_tokens: int = option(64, "throughput: tokens each row decodes")
    device: str = option("cpu", "cpu or cuda")


def digit_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = "".join(rng.choice("0123456789") for _ in range(4))
        out.append({"prompt": s + "=", "answer": s[::-1]})
    return out


def teach(steps: int) -> GPT:
    """tests/train/test_rl.py's teach_format: the answer's tokens alone are targets."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=DIGITS.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32, pos_emb="rope", norm="rmsnorm"
    )
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    records = digit_records(steps * 32, 100)
    for i in range(steps):
        ids = torch.tensor([DIGITS.encode(r["prompt"] + r["answer"] + "\n") for r in records[i * 32 : (i + 1) * 32]])
        targets = ids[:, 1:].clone()
        targets[:, :4] = -1
        _, loss = model(ids[:, :-1], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def toy_task(args: Options, folder: Path) -> dict:
    model = teach(args.teach_steps)
    export_hf(model, folder / "sft")
    (folder / "corpus.txt").write_text("".join(f"{r['prompt']}{r['answer']}\n" for r in digit_records(300, 3)))
    prepare([str(folder / "corpus.txt")], "char", folder / "data", log=lambda *a: None)
    for name, n, seed in (("train", 2000, 1), ("held_out", 64, 2)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in digit_records(n, seed)))
    held_out = read_prompts(folder / "held_out.jsonl", DIGITS)
    reward = load_reward("exact")
    before = score_prompts(model, DIGITS, held_out, reward, 8, 4, 1.0)
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        f"--init_from={folder / 'sft'}",
        f"--data_dir={folder / 'data'}",
        f"--out_dir={folder / 'rl'}",
        "--rl",
        f"--rl_prompts={folder / 'train.jsonl'}",
        "--reward=exact",
        "--rl_samples=16",
        "--rl_max_new_tokens=4",
        "--batch_size=8",
        "--block_size=16",
        "--learning_rate=1e-3",
        "--min_lr=1e-3",
        "--warmup_iters=0",
        "--weight_decay=0",
        "--beta2=0.99",
        f"--max_iters={args.rl_steps}",
        f"--eval_interval={args.rl_steps}",
        "--eval_iters=1",
        "--log_interval=50",
        f"--device={args.device}",
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = score_prompts(load_model(folder / "rl", "", "")[0], DIGITS, held_out, reward, 8, 4, 1.0)
    return {"steps": args.rl_steps, "train_py_seconds": seconds, "before": before, "after": after}


def throughput(args: Options) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024)).to(args.device).eval()  # GPT-2-124M's shape
    rng = random.Random(0)
    prompts = [
        Prompt("", [rng.randrange(50257) for _ in range(args.prompt_tokens)], {}, f"prompt {i}")
        for i in range(args.prompts)
    ]

    class NoStops:  # random weights: no row stops early, every row decodes max_new_tokens tokens
        vocab_size = 50257
        eot_id = None
        end_of_turn_id = None

        def decode(self, ids: list[int]) -> str:
            return ""

    generator = torch.Generator(device=args.device).manual_seed(0)
    sample_group(model, NoStops(), prompts[:1], 2, 4, 1.0, generator)  # warm-up
    start = time.perf_counter()
    group = sample_group(model, NoStops(), prompts, args.samples, args.max_new_tokens, 1.0, generator)
    seconds = time.perf_counter() - start
    rows = len(group.lengths)
    return {
        "rows": rows,
        "new_tokens_per_row": args.max_new_tokens,
        "seconds": seconds,
        "samples_per_s": rows / seconds,
        "tokens_per_s": sum(group.lengths) / seconds,
    }


def main() -> int:
    args = parse(Options, sys.argv[1:], "python benchmarks/bench_rl.py", __doc__)
    with tempfile.TemporaryDirectory() as tmp:
        toy = toy_task(args, Path(tmp))
    print(json.dumps({"machine": machine_line(), "toy": toy, "throughput": throughput(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("bench_rl.py", main, "nothing was measured"))
