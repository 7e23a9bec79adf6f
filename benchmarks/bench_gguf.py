"""GGUF export: time and file size at GPT-2 124M's and SmolLM2-360M's shapes for each type, and llama.cpp's decoding
speed on the q8_0 file against gptlite's own generation (what sample.py runs) on the same model, batch 1.

    python benchmarks/bench_gguf.py [--shapes=gpt2,smollm2_360m] [--types=f32,f16,bf16,q8_0] [--new_tokens=128]

Random weights (greedy decoding of random weights: the speed is the same as a trained model's); a 16-token prompt;
tokens/s counts the new tokens over the whole call (prefill included), best of `rounds` calls of each, in turns.
gptlite runs in float32 (sample.py's default on a CPU) and with --quantize=int8; llama.cpp on the q8_0 file with as
many threads as torch. The 360M shape needs a tokenizer of its own: a BPE trained on tiny Shakespeare (the model's
vocabulary is padded past it). Needs llama-cpp-python and gguf (pip install -e ".[test]").
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.hf.gguf import GGUF_TYPES, export_gguf  # noqa: E402
from gptlite.inference.generate import generate  # noqa: E402

SHAPES = {
    "gpt2": dict(
        vocab_size=50304,
        block_size=1024,
        n_layer=12,
        n_head=12,
        n_embd=768,
        pos_emb="learned",
        norm="layernorm",
        ffn="gelu",
        bias=True,
    ),
    "smollm2_360m": dict(
        vocab_size=49152,
        block_size=2048,
        n_layer=32,
        n_head=15,
        n_kv_head=5,
        n_embd=960,
        ffn_hidden=2560,
        pos_emb="rope",
        rope_theta=100000.0,
        norm="rmsnorm",
        ffn="swiglu",
    ),
}


@dataclass
class Options:
    shapes: str = option("gpt2,smollm2_360m", f"comma-separated: {', '.join(SHAPES)}")
    types: str = option(",".join(GGUF_TYPES), "comma-separated GGUF types to export and time")
    new_tokens: int = option(128, "tokens to generate per timed call")
    rounds: int = option(3, "timed calls of each kind, in turn (the best counts)")
    corpus: str = option(str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "text for the 360M's BPE")
    gpt2_tokenizer: str = option(str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"), "GPT-2's BPE ranks")


def tokenizer_for(shape: str, args: Options):
    if shape == "gpt2":
        from gptlite.tokenizer import tokenizer_from_spec

        return tokenizer_from_spec(args.gpt2_tokenizer)
    from gptlite.tokenizer.trainer import train_bpe

    return train_bpe([Path(args.corpus).read_text(encoding="utf-8")], vocab_size=8192)


def export_table(shape: str, model: GPT, tokenizer, args: Options, folder: Path) -> Path | None:
    q8 = None
    for kind in args.types.split(","):
        out = folder / f"{shape}-{kind}.gguf"
        start = time.perf_counter()
        export_gguf(model, out, tokenizer, kind)
        seconds = time.perf_counter() - start
        print(f"| {shape} | {kind} | {seconds:.1f} s | {out.stat().st_size / 2**20:,.0f} MiB |", flush=True)
        q8 = out if kind == "q8_0" else q8
    return q8


def gptlite_tokens_per_s(model: GPT, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    out = generate(model, [prompt], n, temperature=0.0)
    assert len(out[0]) >= n
    return n / (time.perf_counter() - start)


def llama_tokens_per_s(llm, prompt: list[int], n: int) -> float:
    llm.reset()
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
        if i + 1 == n:
            break
    return n / (time.perf_counter() - start)


def speed_table(shape: str, model: GPT, q8: Path, args: Options) -> None:
    import llama_cpp

    from gptlite.inference.quantize import quantize

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(q8), n_ctx=256, n_threads=threads, n_batch=64, verbose=False)
    int8 = quantize(copy_of(model), "int8")
    prompt = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {
        "gptlite float32 (sample.py)": lambda: gptlite_tokens_per_s(model, prompt, args.new_tokens),
        "gptlite int8 (--quantize=int8)": lambda: gptlite_tokens_per_s(int8, prompt, args.new_tokens),
        "llama.cpp q8_0": lambda: llama_tokens_per_s(llm, prompt, args.new_tokens),
    }
    best = dict.fromkeys(runs, 0.0)
    for _ in range(args.rounds):
        for name, run in runs.items():
            best[name] = max(best[name], run())
    base = best["gptlite float32 (sample.py)"]
    for name, tokens_per_s in best.items():
        print(f"| {shape} | {name} | {tokens_per_s:.1f} | {tokens_per_s / base:.2f}x |", flush=True)


def copy_of(model: GPT) -> GPT:
    twin = GPT(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    torch.manual_seed(0)
    print(f"CPU threads: {torch.get_num_threads()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        print("| shape | type | export | file |\n|---|---|---|---|")
        for shape in args.shapes.split(","):
            model = GPT(GPTConfig(**SHAPES[shape])).eval()
            q8 = export_table(shape, model, tokenizer_for(shape, args), args, Path(tmp))
            models[shape] = (model, q8)
        print(
            f"\n| shape | decoding, batch 1, {args.new_tokens} new tokens | tokens/s | vs float32 |\n|---|---|---|---|"
        )
        for shape, (model, q8) in models.items():
            if q8 is not None:
                speed_table(shape, model, q8, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_gguf", lambda: run(parse(Options, argv, "benchmarks/bench_gguf.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
