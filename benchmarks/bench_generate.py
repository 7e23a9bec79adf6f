"""Generation speed, one table per process: gptlite's paths against Hugging Face `transformers` GPT-2 `generate`
on a same-size model (and the naive full-recompute loop), timed in turn, call for call.

    pip install -e ".[bench]"     # transformers, for the Hugging Face rows (or: pip install transformers)
    python benchmarks/bench_generate.py                       # every path, model and batch size
    python benchmarks/bench_generate.py --paths=default --models=gpt2 --batch_sizes=1,8 --json=gen.json
    python benchmarks/bench_generate.py --dtype=bfloat16 --models=gpt2 --batch_sizes=1
    python benchmarks/bench_generate.py --models=gpt2 --batch_sizes=1 --paths=default,compile --num_beams=4

Paths (`--paths`):
    default   `generate(model, ...)` with no flags: what sample.py does unless told otherwise
    compile   compile=True: the decode step through torch.compile
    int8      the model after `quantize(model, "int8")` (weight-only int8, gptlite.inference.quantize), eager
    int8+compile   both
Every path's first call in this process is timed on its own ("first call": for compile, compiling it), then
the median of `--repeats` calls ("steady"). The process starts with a new, empty inductor cache folder (cold,
as a user's very first sample.py); with compile among the paths, a second process then times its own
first compiled call against the cache the first process filled ("compile, 2nd process").

All models have random weights and decode greedily from a random 16-token prompt; tokens/s counts every
generated token of the batch over the whole call (prefill included). Shapes:
    gpt2   GPT-2 124M: 12 layers, 12 heads, 768 wide, vocab 50,304, block 1,024 (HF: GPT2LMHeadModel)
    char   nanoGPT's Shakespeare-char CPU model: 4 layers, 4 heads, 128 wide, vocab 65, block 64
The char model's window is smaller than prompt + new tokens, so its rows slide (see gptlite.inference.generate);
the naive loop crops to the last block_size tokens at every step instead, as nanoGPT does. This is a
script that prints a table, not a test.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line, pick_dtype  # noqa: E402
from gptlite.inference.generate import generate  # noqa: E402

MODELS = {
    "gpt2": {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "char": {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
}


@torch.no_grad()
def naive_generate(model: GPT, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """nanoGPT's loop: run the whole (cropped) context through the model for every new token."""
    for _ in range(max_new_tokens):
        logits = model.head(model.hidden(idx[:, -model.config.block_size :])[:, -1])  # (B, V)
        idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx


def hf_model(shape: dict, dtype: torch.dtype, device: str):
    """A GPT-2 of the same size with random weights, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=shape["vocab_size"],
        n_positions=shape["block_size"],
        n_embd=shape["n_embd"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
    )
    return transformers.GPT2LMHeadModel(config).to(device, dtype).eval()


def hf_generate(model, idx: torch.Tensor, max_new_tokens: int, num_beams: int = 1) -> torch.Tensor:
    return model.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        num_beams=num_beams,
    )


def seconds(fn: Callable[[], torch.Tensor], device: str) -> tuple[float, torch.Tensor]:
    """Wall seconds of one call of fn (the device synchronised), and its output."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


PATHS = ("default", "compile", "int8", "int8+compile")


@dataclass
class Options:
    models: str = option("gpt2,char", "comma-separated: gpt2, char")
    batch_sizes: str = option("1,8", "comma-separated batch sizes")
    paths: str = option(",".join(PATHS), f"comma-separated: {', '.join(PATHS)}")
    prompt_len: int = option(16, "prompt tokens")
    new_tokens: int = option(128, "new tokens per row")
    device: str = option("auto", "auto (cuda if there is one, else cpu), cpu, cuda")
    dtype: str = option(
        "auto",
        "weights of every model; auto = bfloat16 on CUDA, float32 on the CPU",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    hf_dtype: str = option(
        "same", "Hugging Face model's weights (same = --dtype)", choices=("same", "float32", "bfloat16", "float16")
    )
    repeats: int = option(3, "timed steady calls per path (the median is shown)")
    naive_max_batch: int = option(
        1, "time the naive loop (once) up to this batch size for gpt2 (it takes minutes); 0 = never"
    )
    threads: int = option(0, "torch.set_num_threads on the CPU (0 = torch's default)")
    num_beams: int = option(
        1, "beam search with this many beams (no naive loop); tokens/s counts the returned sequence's tokens"
    )
    cache_dir: str = option("", "inductor cache folder (default: a new, empty one)")
    json: str | None = option(None, "also write the rows to this JSON file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_generate.py", lambda: run(parse(Options, argv, "bench_generate.py", __doc__)))


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    paths = args.paths.split(",")
    if any(p not in PATHS for p in paths):
        raise ValueError(f"--paths={args.paths!r}: choose from {', '.join(PATHS)}")
    if not args.cache_dir:
        args.cache_dir = tempfile.mkdtemp(prefix="bench_generate_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir  # read when something compiles
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = getattr(torch, pick_dtype(args.dtype, device))
    hf_dtype = dtype if args.hf_dtype == "same" else getattr(torch, args.hf_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {where}, gptlite and naive in {dtype_name(dtype)}, HF in {dtype_name(hf_dtype)}, "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
        f"{f'beam search with {args.num_beams} beams, ' if args.num_beams > 1 else ''}"
        f"steady = median of {args.repeats} calls, inductor cache {args.cache_dir}"
    )
    header = (
        f"{'model':6} {'batch':>5} {'path':>20} {'first call s':>12} {'steady tok/s':>12} {'HF tok/s':>9} "
        f"{'vs HF':>6} {'naive tok/s':>11} {'vs naive':>8}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for model_name in args.models.split(","):
        results += measure_model(args, model_name, paths, device, dtype, hf_dtype)
    if "compile" in paths and not os.environ.get("BENCH_GENERATE_SECOND_PROCESS"):
        results += second_process(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": results}, indent=1))
    if "gpt2" in args.models and hf_model(MODELS["char"], dtype, "cpu") is None:
        print('Hugging Face rows need transformers: pip install -e ".[bench]" (or pip install transformers)')
    return 0


def measure_model(
    args: Options, model_name: str, paths: list[str], device: str, dtype: torch.dtype, hf_dtype: torch.dtype
) -> list[dict]:
    """Every path at every batch size for one model shape, taking turns with HF; prints a row each."""
    shape = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape)).to(device, dtype).eval()
    models = {"default": model, "compile": model}
    if any(p.startswith("int8") for p in paths):
        int8 = copy.deepcopy(model).quantize("int8")
        models |= {"int8": int8, "int8+compile": int8}
    hf = hf_model(shape, hf_dtype, device) if model_name == "gpt2" else None
    beams = {"num_beams": args.num_beams} if args.num_beams > 1 else {}
    bound = memory_bound(model, args.repeats) if device == "cpu" else None
    results = []
    for batch in map(int, args.batch_sizes.split(",")):
        idx = torch.randint(0, shape["vocab_size"], (batch, args.prompt_len), device=device)
        tokens = batch * args.new_tokens
        calls = {
            p: partial(generate, models[p], idx, args.new_tokens, temperature=0, compile="compile" in p, **beams)
            for p in paths
        }
        if hf is not None:
            calls["hf"] = partial(hf_generate, hf, idx, args.new_tokens, args.num_beams)
        first = {name: seconds(call, device)[0] for name, call in calls.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        outputs = {}
        for _ in range(args.repeats):  # in turn, so that a slower or faster spell of the machine hits them all
            for name, call in calls.items():
                t, outputs[name] = seconds(call, device)
                times[name].append(t)
        rate = {name: tokens / statistics.median(t) for name, t in times.items() if t}
        naive = None
        if not beams and (model_name != "gpt2" or batch <= args.naive_max_batch):
            naive_generate(model, idx, 4)  # warm-up
            t, out = seconds(partial(naive_generate, model, idx, args.new_tokens), device)
            naive = tokens / t
            if "default" in outputs and not torch.equal(outputs["default"], out):
                same = (outputs["default"] == out).float().mean().item()  # greedy ties can flip in low precision
                print(f"  note: default and naive greedy tokens agree on {same:.1%} of positions")
        for p in paths:
            row = {
                "model": model_name,
                "batch": batch,
                "path": p,
                "compiled": "compile" in p,
                "dtype": dtype_name(dtype),
                "num_beams": args.num_beams,
                "first_call_s": first[p],
                "tokens_per_s": {"gptlite": rate.get(p), "hf": rate.get("hf"), "naive": naive},
            }
            row["vs_hf"] = rate[p] / rate["hf"] if p in rate and "hf" in rate else None
            row["memory_bound_tokens_per_s"] = bound * batch if bound and batch == 1 else None
            results.append(row)
            print_row(row)
        if "hf" in rate:
            print(f"{model_name:6} {batch:>5} {'HF generate':>20} {first['hf']:>12.1f} {rate['hf']:>12.1f}")
        if bound and batch == 1:
            shares = ", ".join(f"{name} {100 * r / bound:.0f}%" for name, r in rate.items() if "compile" not in name)
            print(f"{model_name:6} {batch:>5} {'memory bound':>20} {'':>12} {bound:>12.1f}   ({shares} of it)")
    return results


def memory_bound(model: GPT, repeats: int) -> float:
    """Tokens/s at batch 1 if a token cost nothing but reading each weight once: one over the time of a plain pass
    (a sum) over every parameter's bytes, the median of `repeats` passes (at least 3) after one to warm up. The
    model's weights are far larger than the CPU's caches, so each pass streams them from memory, as decoding does."""
    weights = [p.detach() for p in model.parameters()]
    passes = []
    for i in range(max(3, repeats) + 1):
        start = time.perf_counter()
        for w in weights:
            w.sum()
        if i:
            passes.append(time.perf_counter() - start)
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    seconds = statistics.median(passes)
    print(f"memory bound: a sum over the {gb:.2f} GB of weights took {seconds * 1000:.1f} ms ({gb / seconds:.1f} GB/s)")
    return 1 / seconds


def print_row(row: dict) -> None:
    rates = row["tokens_per_s"]
    steady = f"{rates['gptlite']:.1f}" if rates["gptlite"] else "-"
    hf = f"{rates['hf']:.1f}" if rates["hf"] else "-"
    vs_hf = f"{row['vs_hf']:.2f}x" if row["vs_hf"] else "-"
    naive = f"{rates['naive']:.1f}" if rates["naive"] else "-"
    vs_naive = f"{rates['gptlite'] / rates['naive']:.1f}x" if rates["naive"] and rates["gptlite"] else "-"
    print(
        f"{row['model']:6} {row['batch']:>5} {row['path']:>20} {row['first_call_s']:>12.1f} {steady:>12} {hf:>9} "
        f"{vs_hf:>6} {naive:>11} {vs_naive:>8}",
        flush=True,
    )


def second_process(args: Options) -> list[dict]:
    """Each batch size's first compiled call in a new process that finds this one's inductor cache."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "second.json"
        command = [
            sys.executable,
            __file__,
            f"--models={args.models}",
            f"--batch_sizes={args.batch_sizes}",
            "--paths=compile",
            "--repeats=0",
            "--naive_max_batch=0",
            f"--prompt_len={args.prompt_len}",
            f"--new_tokens={args.new_tokens}",
            f"--device={args.device}",
            f"--dtype={args.dtype}",
            f"--num_beams={args.num_beams}",
            f"--threads={args.threads}",
            f"--cache_dir={args.cache_dir}",
            f"--json={out}",
        ]
        result = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "BENCH_GENERATE_SECOND_PROCESS": "1"}
        )
        if result.returncode != 0:
            print(f"second process failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:]}")
            return []
        rows = [r for r in json.loads(out.read_text())["rows"] if r["path"] == "compile"]
    for row in rows:
        row["path"] = "compile, 2nd process"
        row["tokens_per_s"] = {"gptlite": None, "hf": None, "naive": None}
        print_row(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
