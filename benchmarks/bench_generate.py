"""Generation speed, in one process: gptlite's KV-cache engine against the naive full-recompute loop on the
same weights and against Hugging Face `transformers` GPT-2 `generate` on a same-size model.

    pip install -e ".[bench]"     # transformers, for the Hugging Face rows (or: pip install transformers)
    python benchmarks/bench_generate.py                       # every model and batch, the device's default dtype
    python benchmarks/bench_generate.py --dtype=bfloat16 --models=gpt2 --batch_sizes=1
    python benchmarks/bench_generate.py --compile=false,true --json=gen.json   # both paths, figures as JSON
    python benchmarks/bench_generate.py --models=gpt2 --batch_sizes=1 --num_beams=4  # beam search against HF's

All models have random weights and decode greedily from a random 16-token prompt for 256 new tokens;
tokens/s counts every generated token of the batch over the whole call (prefill included), the median of
`--repeats` timed runs after a warm-up. Shapes:
    gpt2   GPT-2 124M: 12 layers, 12 heads, 768 wide, vocab 50,304, block 1,024 (HF: GPT2LMHeadModel)
    char   nanoGPT's Shakespeare-char CPU model: 4 layers, 4 heads, 128 wide, vocab 65, block 64
The char model's window is smaller than prompt + new tokens, so its rows slide (see gptlite.generate);
the naive loop crops to the last block_size tokens at every step instead, as nanoGPT does. This is a
script that prints a table, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.generate import generate  # noqa: E402

MODELS = {
    "gpt2": {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "char": {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
}


@torch.no_grad()
def naive_generate(model: GPT, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """nanoGPT's loop: run the whole (cropped) context through the model for every new token."""
    for _ in range(max_new_tokens):
        logits = model.lm_head(model.hidden(idx[:, -model.config.block_size :])[:, -1])  # (B, V)
        idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx


def hf_model(shape: dict, dtype: torch.dtype, device: str):
    """A GPT-2 of the same size with random weights, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=shape["vocab_size"], n_positions=shape["block_size"],
                                     n_embd=shape["n_embd"], n_layer=shape["n_layer"], n_head=shape["n_head"])
    return transformers.GPT2LMHeadModel(config).to(device, dtype).eval()


def hf_generate(model, idx: torch.Tensor, max_new_tokens: int, num_beams: int = 1) -> torch.Tensor:
    return model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, num_beams=num_beams)


def timed(fn: Callable[[], torch.Tensor], repeats: int, device: str, warmup: Callable | None = None) -> tuple[float, torch.Tensor]:
    """Median seconds of `repeats` calls of fn after one warm-up call (of fn unless given), and fn's output."""
    (warmup or fn)()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,char", help="comma-separated: gpt2, char")
    parser.add_argument("--batch_sizes", default="1,8")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one, else cpu), cpu, cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights of every model; auto = bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--hf_dtype", default="same", choices=["same", "float32", "bfloat16", "float16"],
                        help="Hugging Face model's weights (same = --dtype)")
    parser.add_argument("--compile", default="true",
                        help="torch.compile gptlite's decode step: true, false, or false,true for a row of each "
                             "(compiling is not timed: the warm-up run does it)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is shown)")
    parser.add_argument("--naive_repeats", type=int, default=1, help="timed runs of the naive loop (slow)")
    parser.add_argument("--naive_max_batch", type=int, default=1,
                        help="skip the naive loop above this batch size for gpt2 (it takes minutes)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads on the CPU (0 = torch's default)")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams (no naive loop); "
                        "tokens/s counts the returned sequence's tokens")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if any(m not in ("true", "false") for m in args.compile.split(",")):
        parser.error(f"--compile={args.compile!r}: give true, false, or both as false,true")
    modes = [m == "true" for m in args.compile.split(",")]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = getattr(torch, ("bfloat16" if device.startswith("cuda") else "float32") if args.dtype == "auto" else args.dtype)
    hf_dtype = dtype if args.hf_dtype == "same" else getattr(torch, args.hf_dtype)

    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, gptlite and naive in {dtype_name(dtype)}, HF in {dtype_name(hf_dtype)}, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{f'beam search with {args.num_beams} beams, ' if args.num_beams > 1 else ''}median of {args.repeats} runs")
    header = (f"{'model':6} {'batch':>5} {'compiled':>8} {'gptlite tok/s':>14} {'naive tok/s':>12} {'HF tok/s':>10} "
              f"{'vs naive':>9} {'vs HF':>7}")
    print(header)
    print("-" * len(header))
    results = []
    for model_name in args.models.split(","):
        shape = MODELS[model_name]
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape)).to(device, dtype).eval()
        hf = hf_model(shape, hf_dtype, device) if model_name == "gpt2" else None
        for batch in map(int, args.batch_sizes.split(",")):
            idx = torch.randint(0, shape["vocab_size"], (batch, args.prompt_len), device=device)
            tokens = batch * args.new_tokens
            baselines = {}  # naive and HF, measured once for every compile mode
            beams = {"num_beams": args.num_beams} if args.num_beams > 1 else {}
            if not beams and (model_name != "gpt2" or batch <= args.naive_max_batch):
                t_naive, naive = timed(partial(naive_generate, model, idx, args.new_tokens), args.naive_repeats, device,
                                       warmup=partial(naive_generate, model, idx, 4))
                baselines["naive"] = tokens / t_naive
            if hf is not None:
                baselines["hf"] = tokens / timed(partial(hf_generate, hf, idx, args.new_tokens, args.num_beams), args.repeats,
                                                 device)[0]
            for compile in modes:
                t_cached, cached = timed(partial(generate, model, idx, args.new_tokens, temperature=0, compile=compile,
                                                 **beams), args.repeats, device)
                row = {"gptlite": tokens / t_cached, **baselines}
                if "naive" in baselines:
                    same = (cached == naive).float().mean().item()
                    if same < 1:  # greedy ties can flip in low precision; in float32 they agree exactly
                        print(f"  note: cached and naive greedy tokens agree on {same:.1%} of positions")
                cells = [f"{row[k]:.1f}" if k in row else "-" for k in ("gptlite", "naive", "hf")]
                ratios = [f"{row['gptlite'] / row[k]:.1f}x" if k in row else "-" for k in ("naive", "hf")]
                print(f"{model_name:6} {batch:>5} {'yes' if compile else 'no':>8} {cells[0]:>14} {cells[1]:>12} "
                      f"{cells[2]:>10} {ratios[0]:>9} {ratios[1]:>7}", flush=True)
                results.append({"model": model_name, "batch": batch, "compiled": compile, "dtype": dtype_name(dtype),
                                "num_beams": args.num_beams,
                                "tokens_per_s": row, "vs_hf": row["gptlite"] / row["hf"] if "hf" in row else None})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": results}, indent=1))
    if "gpt2" in args.models and hf_model(MODELS["char"], dtype, "cpu") is None:
        print('Hugging Face rows need transformers: pip install -e ".[bench]" (or pip install transformers)')


if __name__ == "__main__":
    main()
