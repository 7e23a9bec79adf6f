"""Training-step throughput, side by side in one process: gptlite vs Hugging Face GPT-2 vs a naive GPT; with
--optimizers, AdamW against Muon: the losses after the same number of tokens.

    pip install -e ".[bench]"            # transformers, for the Hugging Face model only
    python benchmarks/bench_train.py [--shapes tiny,124m] [--steps 10] [--dtypes float32,bfloat16]
    python benchmarks/bench_train.py --optimizers adamw,muon [--tokens 1000000] [--muon_lr 0.02]

A step is forward + backward + AdamW (as each model's users run it, see ADAMW) on random tokens. Every model
has the same shape (layers, heads, width, vocabulary, block) and about the same parameter count, random
weights, no dropout. The figure is
the median tokens/s over `--steps` timed steps after warm-up, the models taking turns step by step;
ratios are against the other models measured in this same run. Prints a table; asserts nothing.

--optimizers trains the char model of configs/shakespeare_char_cpu.toml on data/shakespeare_char (prepared
by data/shakespeare/prepare.py) with the train.py command, once per optimizer, for the same `--tokens` (same seed,
same batches, the schedule over the whole budget), AdamW at the config's learning rate and, with Muon, for
everything but the matrices inside the blocks. It prints the mean train loss of the last 10 steps, the val loss
on the whole val split and the wall-clock time of each run.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import autocast, machine_line  # noqa: E402
from gptlite.train.metrics import METRICS_FILE, read_metrics  # noqa: E402
from gptlite.train.run_config import resolve_config  # noqa: E402

SHAPES = {  # name: (n_layer, n_head, n_embd, vocab_size, block_size, batch_size)
    "tiny": (4, 4, 128, 65, 64, 12),
    "124m": (12, 12, 768, 50304, 256, 4),
}


class NaiveBlock(nn.Module):
    """The classic tutorial block: one Linear per head for q, k and v, an explicit mask, softmax, GELU MLP."""

    def __init__(self, n_head: int, n_embd: int, block_size: int):
        super().__init__()
        d = n_embd // n_head
        self.q = nn.ModuleList(nn.Linear(n_embd, d, bias=False) for _ in range(n_head))
        self.k = nn.ModuleList(nn.Linear(n_embd, d, bias=False) for _ in range(n_head))
        self.v = nn.ModuleList(nn.Linear(n_embd, d, bias=False) for _ in range(n_head))
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        h = self.ln1(x)
        heads = []
        for q, k, v in zip(self.q, self.k, self.v, strict=True):
            qh, kh, vh = q(h), k(h), v(h)
            att = qh @ kh.transpose(-2, -1) / math.sqrt(kh.size(-1))
            att = att.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
            heads.append(F.softmax(att, dim=-1) @ vh)
        x = x + self.proj(torch.cat(heads, dim=-1))
        return x + self.mlp(self.ln2(x))


class NaiveGPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab_size, block_size):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[NaiveBlock(n_head, n_embd, block_size) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_models(shape: str) -> dict[str, tuple[nn.Module, callable]]:
    """name -> (model, loss function(model, x, y))."""
    L, H, C, V, T, _ = SHAPES[shape]
    models = {}
    # ffn_hidden = 8C/3 (unrounded) gives SwiGLU the parameter count of the others' 4x GELU MLP
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, ffn_hidden=int(8 * C / 3))
    models["gptlite"] = (GPT(cfg), lambda m, x, y: m(x, y)[1])
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_cfg = GPT2Config(
            vocab_size=V,
            n_positions=T,
            n_embd=C,
            n_layer=L,
            n_head=H,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
        models["hf-gpt2"] = (GPT2LMHeadModel(hf_cfg), lambda m, x, y: m(input_ids=x, labels=y).loss)
    except ImportError:
        print("transformers is not installed (pip install -e '.[bench]'); skipping Hugging Face", file=sys.stderr)
    models["naive"] = (NaiveGPT(L, H, C, V, T), lambda m, x, y: m(x, y))
    return models


# train.py and Hugging Face's Trainer (default optim "adamw_torch_fused" with torch >= 2.8) use the fused
# AdamW; the tutorials' loop calls torch.optim.AdamW(model.parameters(), lr=...) (the for-each version)
ADAMW = {"gptlite": {"fused": True}, "hf-gpt2": {"fused": True}, "naive": {}}


def time_steps(
    models: dict[str, tuple[nn.Module, callable]], shape: str, dtype: torch.dtype, steps: int, warmup: int
) -> dict[str, float]:
    """Median tokens/s of a training step for every model. The models take turns, one step each, so that
    a change in the machine's load (a shared VM) falls on all of them alike. Each model gets the AdamW its
    users get by default (`ADAMW`)."""
    *_, V, T, B = SHAPES[shape]
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, **ADAMW[name]) for name, (m, _) in models.items()}
    amp = autocast("cpu", dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(warmup + steps):
        for name, (model, loss_fn) in models.items():
            t0 = time.perf_counter()
            with amp:
                loss = loss_fn(model, x, x)
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: B * T / statistics.median(t) for name, t in times.items()}


def compare_optimizers(names: list[str], tokens: int, muon_lr: float) -> None:
    """Train the char model once per optimizer for `tokens` tokens; print the train and val losses (see above)."""
    base = [str(ROOT / "configs" / "shakespeare_char_cpu.toml"), f"--data_dir={ROOT / 'data' / 'shakespeare_char'}"]
    cfg = resolve_config(base)
    steps = max(1, tokens // (cfg.batch_size * cfg.model.block_size))
    print(
        f"char model {cfg.model.n_layer}x{cfg.model.n_embd}, {steps} steps of {cfg.batch_size}x{cfg.model.block_size}"
        f" = {steps * cfg.batch_size * cfg.model.block_size} tokens, AdamW lr {cfg.learning_rate:g}"
    )
    print(f"{'optimizer':10s} {'peak lr':>8s} {'train loss':>11s} {'val loss':>9s} {'seconds':>8s}")
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            command = [
                sys.executable,
                str(ROOT / "train.py"),
                *base,
                f"--out_dir={out}",
                f"--optimizer={name}",
                f"--muon_lr={muon_lr}",
                f"--max_iters={steps}",
                "--lr_decay_iters=0",
                f"--eval_interval={steps}",
                "--eval_iters=0",
                "--log_interval=1",
                "--keep_last=1",
            ]
            t0 = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - t0
            rows = read_metrics(Path(out) / METRICS_FILE)
        train_loss = statistics.mean([r["loss"] for r in rows if "lr" in r][-10:])
        val_loss = [r["val_loss"] for r in rows if "val_loss" in r][-1]
        peak = muon_lr if name == "muon" else cfg.learning_rate
        print(f"{name:10s} {peak:8g} {train_loss:11.4f} {val_loss:9.4f} {seconds:8.1f}")


@dataclass
class Options:
    shapes: str = option("tiny,124m", "comma list: tiny, 124m")
    dtypes: str = option("float32", "comma list: float32, bfloat16 (CPU autocast)")
    steps: int = option(0, "timed steps (default: 30 tiny, 5 124m)")
    optimizers: str = option("", "comma list (adamw, muon): compare losses instead")
    tokens: int = option(1_000_000, "training tokens per optimizer (--optimizers)")
    muon_lr: float = option(0.02, "Muon's peak learning rate (--optimizers)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_train.py", lambda: run(parse(Options, argv, "bench_train.py", __doc__)))


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.optimizers:
        compare_optimizers(args.optimizers.split(","), args.tokens, args.muon_lr)
        return 0
    for shape in args.shapes.split(","):
        steps = args.steps or (30 if shape == "tiny" else 5)
        warmup = 5 if shape == "tiny" else 1
        L, H, C, V, T, B = SHAPES[shape]
        print(f"\n{shape}: {L} layers, {H} heads, {C} wide, vocab {V}, block {T}, batch {B}; median of {steps} steps")
        torch.manual_seed(0)
        models = build_models(shape)
        print(f"{'model':10s} {'dtype':9s} {'params':>9s} {'tokens/s':>10s} {'vs hf-gpt2':>11s} {'vs naive':>9s}")
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            rates = time_steps(models, shape, dtype, steps, warmup)
            for name, rate in rates.items():
                params = sum(p.numel() for p in models[name][0].parameters()) / 1e6
                vs_hf = f"{rate / rates['hf-gpt2']:.2f}x" if "hf-gpt2" in rates else "n/a"
                print(
                    f"{name:10s} {dtype_name:9s} {params:8.2f}M {rate:10.0f} {vs_hf:>11s} {rate / rates['naive']:8.2f}x"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
