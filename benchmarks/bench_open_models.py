"""Today's open models, measured on a SmolLM2-360M-shaped checkpoint (random weights from transformers: hidden 960,
32 layers, 15 heads, 5 key/value heads, SwiGLU 2,560, vocabulary 49,152, tied), or with --family=gemma3 on a Gemma 3
270M-shaped one (Gemma3ForCausalLM: hidden 640, 18 layers, 4 heads, 1 key/value head of width 256, GeGLU 2,048,
vocabulary 262,144, tied; 5 sliding-window layers of 512 positions to each global one, as google/gemma-3-270m), with
--family=qwen35 on a Qwen3.5-0.8B-shaped one (Qwen3_5ForCausalLM, the text tower of Qwen/Qwen3.5-0.8B's config.json:
hidden 1024, 24 layers, three Gated DeltaNet layers to each full-attention one (full_attention_interval 4); the linear
layers 16 key and 16 value heads of width 128, a convolution of kernel 4; the full ones 8 heads, 2 key/value heads of
width 256, RoPE theta 1e7 on a quarter of each head, gated on their output; SwiGLU 3,584, vocabulary 248,320, tied),
or with --family=lfm2 on an LFM2-350M-shaped one (Lfm2ForCausalLM, LiquidAI/LFM2-350M's config.json: hidden 1024, 16
layers, attention at layers 2, 5, 8, 10, 12 and 14 and gated short convolutions (a state of 3 tokens) at the other
10; 16 heads, 8 key/value heads, RoPE theta 1e6; block_ff_dim 6,656 auto-adjusted to a SwiGLU of 4,608; vocabulary
65,536, tied; transformers' Lfm2Config defaults are a larger LFM2's). --tiny keeps a family's layer kinds at width 64
and a few layers: to check that every part runs, never to time.

1. loading: each loader in a fresh process, the wall time of the load and the peak RSS of loading plus one forward
   pass above the RSS after the imports, against the loaded model's bytes, in bfloat16 and float32 (ours:
   GPT.from_pretrained with dtype=None; transformers: AutoModelForCausalLM.from_pretrained with dtype="auto");
2. decode tokens/s at batch 1 and 8, greedy, in --dtype: the model against the same weights with n_kv_head =
   n_head (k and v heads repeated: the same function, a larger cache; for families whose every layer attends), and
   against transformers' generate at its defaults; and how many of the model's blocks decoded in one call of the
   compiled CPU kernels (gptlite.inference.cpu.blocks' NativeBlock: every kind of attention block the families use,
   where each of its matrices took the compiled kernel).
3. logits: the largest logit difference against transformers on --family's own float32 checkpoint, then for each
   family of the tests (their tiny random models).
4. kvcache: the bytes of the KV cache of the Gemma 3 270M shape at batch 1 in bfloat16, at --contexts: gptlite's
   KVCache allocated (every layer holds the whole context; a local layer's window is a mask) against a cache whose
   local layers hold their window only (computed from the same shape, as transformers' sliding-window layers do).
5. train: one training step in float32 on --family's checkpoint, --train_batch x --train_tokens tokens, gptlite's
   forward with targets and backward against transformers' forward with labels and backward, the medians of
   --rounds rounds taken in turn after one untimed step of each.
With --device=cuda, loading also moves the model to the GPU (the table adds the peak GPU memory torch allocated,
over the model's bytes) and decoding runs there, in --dtype.

    python benchmarks/bench_open_models.py [--parts=memory,decode,logits,kvcache] [--prompt=512] [--new_tokens=32]
    python benchmarks/bench_open_models.py --family=gemma3 --parts=memory,decode --batch_sizes=1
    python benchmarks/bench_open_models.py --parts=memory,decode --device=cuda --dtype=bfloat16 --json=open.json
    python benchmarks/bench_open_models.py --family=qwen35 --parts=logits,memory,decode,train --prompt=256
    python benchmarks/bench_open_models.py --family=lfm2 --tiny=true --parts=memory,decode,train,logits --prompt=70
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402

SMOLLM2 = dict(
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
GEMMA3_270M = dict(  # google/gemma-3-270m's config.json; layer_types left to transformers: 5 sliding to 1 full
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    sliding_window=512,
    query_pre_attn_scalar=256,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN35_08B = dict(  # Qwen/Qwen3.5-0.8B's config.json, its text_config (the text tower Qwen3_5ForCausalLM takes)
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,  # layer_types left to transformers: full_attention_interval 4, three linear to one full
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
LFM2_350M = dict(  # LiquidAI/LFM2-350M's config.json (transformers' Lfm2Config defaults are a larger LFM2's)
    hidden_size=1024,
    intermediate_size=6656,  # its block_ff_dim; block_auto_adjust_ff_dim makes the feed-forward 4,608 wide
    block_auto_adjust_ff_dim=True,
    block_ffn_dim_multiplier=1.0,
    block_multiple_of=256,
    num_hidden_layers=16,
    full_attn_idxs=[2, 5, 8, 10, 12, 14],  # 10 gated short-convolution layers, 6 attention layers
    num_attention_heads=16,
    num_key_value_heads=8,
    conv_L_cache=3,
    vocab_size=65536,
    max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    norm_eps=1e-5,
    tie_word_embeddings=True,
)
SHAPES = {  # --family -> (transformers' model class, its config class, the shape)
    "smollm2": ("LlamaForCausalLM", "LlamaConfig", SMOLLM2),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3_270M),
    "qwen35": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", QWEN35_08B),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", LFM2_350M),
}
TINY = {  # --tiny: each shape's changes to a few layers of width 64, its layer kinds kept, to check the script runs
    "smollm2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "gemma3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        vocab_size=512,
    ),
    "qwen35": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        vocab_size=512,
        rope_parameters={**QWEN35_08B["rope_parameters"], "mrope_section": [2, 1, 1]},  # 4 rotated pairs
    ),
    "lfm2": dict(
        hidden_size=64,
        intermediate_size=96,
        block_multiple_of=32,
        num_hidden_layers=4,
        full_attn_idxs=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
LOAD = """
import resource, sys, time, torch
{imports}
def rss():
    fields = (line.split(":") for line in open("/proc/self/status"))
    return {{k: int(v.split()[0]) for k, v in fields if k in ("VmRSS", "VmHWM")}}
base = rss()["VmRSS"]
start = time.perf_counter()
model = {load}.to(sys.argv[2])
seconds = time.perf_counter() - start
with torch.no_grad():
    model(torch.randint(0, int(sys.argv[3]), (1, 64), device=sys.argv[2]))
nbytes = sum(p.numel() * p.element_size() for p in {{id(p): p for p in model.parameters()}}.values())
gpu = torch.cuda.max_memory_allocated() // 1024 if sys.argv[2].startswith("cuda") else 0
print(rss()["VmHWM"] - base, nbytes // 1024, gpu, seconds)
"""
LOADERS = {
    "gptlite": ("from gptlite import GPT", "GPT.from_pretrained(sys.argv[1])"),
    "transformers": (
        "import transformers",
        "transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype='auto').eval()",
    ),
}


@dataclass
class Options:
    parts: str = option("memory,decode,logits", "comma-separated: memory, decode, logits, kvcache, train")
    family: str = option("smollm2", "memory, decode, logits, train: the checkpoint's shape", choices=tuple(SHAPES))
    tiny: bool = option(False, "the family's layer kinds at a tiny width and depth: to check the script, not to time")
    contexts: str = option("2048,8192,32768", "kvcache: context lengths")
    prompt: int = option(512, "decode: prompt tokens")
    new_tokens: int = option(32, "decode: new tokens per row")
    batch_sizes: str = option("1,8", "decode: batch sizes")
    device: str = option("cpu", "where the models run: cpu or cuda")
    dtype: str = option("float32", "decode: float32 or bfloat16", choices=("float32", "bfloat16"))
    train_batch: int = option(4, "train: rows per step")
    train_tokens: int = option(256, "train: tokens per row")
    rounds: int = option(5, "train: rounds, each timing one step of gptlite and one of transformers in turn")
    json: str = option("", "also write the results here")


def family_shape(family: str, tiny: bool) -> dict:
    """The family's config.json values, with TINY's changes under --tiny."""
    shape = SHAPES[family][2]
    return {**shape, **TINY[family]} if tiny else shape


def save_checkpoints(folder: Path, family: str, shape: dict) -> dict[str, Path]:
    """The family's shape in bfloat16 and float32, random weights saved by transformers."""
    import torch
    import transformers

    model_class, config_class = SHAPES[family][:2]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**shape)).eval()
    out = {"float32": folder / "float32", "bfloat16": folder / "bfloat16"}
    model.save_pretrained(out["float32"])
    model.to(torch.bfloat16).save_pretrained(out["bfloat16"])
    return out


def memory(dirs: dict[str, Path], device: str, vocab_size: int) -> list[dict]:
    gpu = device.startswith("cuda")
    print(
        f"{'loader':14} {'dtype':9} {'load s':>7} {'model MB':>9} {'peak above imports MB':>22} {'ratio':>6}"
        + (f" {'GPU peak MB':>12} {'ratio':>6}" if gpu else "")
    )
    rows = []
    for dtype, directory in dirs.items():
        for name, (imports, load) in LOADERS.items():
            code = LOAD.format(imports=imports, load=load)
            out = subprocess.run(
                [sys.executable, "-c", code, str(directory), device, str(vocab_size)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=True,
            ).stdout.split()
            peak, model, gpu_peak = (int(n) / 1024 for n in out[:3])
            seconds = float(out[3])
            print(
                f"{name:14} {dtype:9} {seconds:7.2f} {model:9.0f} {peak:22.0f} {peak / model:6.2f}x"
                + (f" {gpu_peak:12.0f} {gpu_peak / model:5.2f}x" if gpu else ""),
                flush=True,
            )
            rows.append(
                {
                    "loader": name,
                    "dtype": dtype,
                    "load_s": seconds,
                    "model_mb": model,
                    "peak_rss_mb": peak,
                    "gpu_peak_mb": gpu_peak if gpu else None,
                }
            )
    return rows


def decode(directory: Path, args: Options) -> list[dict]:
    import torch
    import transformers

    from gptlite import GPT
    from gptlite.inference.generate import generate

    dtype, device = getattr(torch, args.dtype), args.device
    gqa = GPT.from_pretrained(str(directory), torch.float32)
    full = None  # widening repeats attention's key/value rows: for models whose every layer attends
    if gqa.config.attention_layer_ids == frozenset(range(gqa.config.n_layer)):
        full = widened(GPT.from_pretrained(str(directory), torch.float32)).to(device, dtype)
    gqa = gqa.to(device, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    print(
        f"\ndecode, {args.dtype} on {device}, prompt {args.prompt}, {args.new_tokens} new tokens, tokens/s "
        "(the best of 2 calls)"
    )
    rows = []
    gqa_name = f"GQA ({gqa.config.kv_heads} kv heads)"
    print(f"{'batch':>5} {gqa_name:>17} {'n_kv_head = n_head':>19} {'transformers':>13} {'one-call blocks':>16}")
    for batch in map(int, args.batch_sizes.split(",")):
        seed = torch.Generator().manual_seed(0)
        idx = torch.randint(0, gqa.config.vocab_size, (batch, args.prompt), generator=seed).to(device)  # (B, T)
        calls = {
            "gqa": lambda idx=idx: generate(gqa, idx, args.new_tokens, temperature=0),
            "full": lambda idx=idx: generate(full, idx, args.new_tokens, temperature=0),
            "hf": lambda idx=idx: hf.generate(
                idx, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
            ),
        }
        if full is None:
            del calls["full"]
        rates = {name: 0.0 for name in calls}
        for _ in range(2):  # in turn
            for name, call in calls.items():
                sync()
                start = time.perf_counter()
                with torch.no_grad():
                    call()
                sync()
                rates[name] = max(rates[name], batch * args.new_tokens / (time.perf_counter() - start))
        one_call = one_call_blocks(gqa, batch)
        blocks = f"{one_call} of {gqa.config.n_layer}"
        full_rate = f"{rates['full']:19.1f}" if full is not None else f"{'-':>19}"
        print(f"{batch:>5} {rates['gqa']:17.1f} {full_rate} {rates['hf']:13.1f} {blocks:>16}", flush=True)
        rows.append(
            {
                "batch": batch,
                "dtype": args.dtype,
                "gqa": rates["gqa"],
                "full_kv_heads": rates.get("full"),
                "hf": rates["hf"],
                "one_call_blocks": one_call,
            }
        )
    return rows


def one_call_blocks(model, batch: int) -> int:
    """How many of `model`'s blocks its decode steps at `batch` rows ran in one call of the compiled CPU kernels: the
    NativeBlocks of the CPU decode view generate used (none on other devices and dtypes, or where a matrix of a block
    measured faster on another kernel: GPTLITE_CPU_LINEAR=native forces the compiled one)."""
    from gptlite.inference.cpu.blocks import NativeBlock
    from gptlite.inference.cpu.decode import packed_for_cpu

    view = packed_for_cpu(model, batch)
    return sum(isinstance(block, NativeBlock) for block in view.blocks)


def widened(model):
    """The same function with n_kv_head = n_head: each key/value head's rows repeated for its query heads."""
    import dataclasses

    import torch

    from gptlite import GPT

    config = model.config
    wide = GPT(dataclasses.replace(config, n_kv_head=None))
    state = model.state_dict()
    group, q = config.n_head // config.kv_heads, config.n_head * config.head_width
    for i in range(config.n_layer):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        k, v = (
            t.view(config.kv_heads, config.head_width, -1).repeat_interleave(group, 0).flatten(0, 1)
            for t in w[q:].chunk(2)
        )
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([w[:q], k, v])
    wide.load_state_dict(state)
    return wide.eval()


def checkpoint_logits(directory: Path, vocab_size: int) -> float:
    """The largest |logit difference| between gptlite and transformers on the benchmark's own float32 checkpoint,
    2 x 80 tokens (past the Gated DeltaNet's first chunk of 64): that the models timed compute the same function."""
    import torch
    import transformers

    from gptlite import GPT

    idx = torch.randint(0, vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))  # (B, T)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return (GPT.from_pretrained(str(directory))(idx)[0] - hf(idx).logits).abs().max().item()


def logits() -> None:
    import torch

    from gptlite import GPT
    from tests.hf.test_families import FAMILIES, ids, randomized

    print("\nlargest |logit difference| against transformers, float32, 2 x 40 tokens")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cls, config) in FAMILIES.items():
            hf = randomized(cls(config))
            hf.save_pretrained(Path(tmp) / name)
            with torch.no_grad():
                diff = (GPT.from_pretrained(str(Path(tmp) / name))(ids())[0] - hf(ids()).logits).abs().max().item()
            print(f"  {name:14} {diff:.2e}")


def train(directory: Path, args: Options) -> dict:
    """One training step in float32 on the same weights, the medians of --rounds rounds taken in turn: gptlite's
    forward with targets as train.py runs it (the output head and the loss a chunk of tokens at a time) and
    backward, against transformers' forward with labels and backward."""
    import statistics

    import torch
    import transformers

    from gptlite import GPT

    ours = GPT.from_pretrained(str(directory), torch.float32).train()
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    seed = torch.Generator().manual_seed(0)
    idx = torch.randint(0, ours.config.vocab_size, (args.train_batch, args.train_tokens), generator=seed)  # (B, T)
    targets = torch.roll(idx, -1, dims=1)  # (B, T): the next token, as transformers' labels=idx shift it

    def step_ours() -> None:
        _, loss = ours(idx, targets, return_logits=False)
        loss.backward()

    def step_hf() -> None:
        hf(idx, labels=idx).loss.backward()

    steps = {"gptlite": (ours, step_ours), "transformers": (hf, step_hf)}
    for model, step in steps.values():  # a first step of each, untimed: allocations, and the chunked forms' set-up
        step()
        model.zero_grad(set_to_none=True)
    seconds = {name: [] for name in steps}
    for _ in range(args.rounds):  # in turn, so that a slower stretch of a shared machine falls on both
        for name, (model, step) in steps.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    tokens = args.train_batch * args.train_tokens
    print(f"\ntraining step, float32, {args.train_batch} x {args.train_tokens} tokens, median of {args.rounds} rounds")
    print(f"{'':14} {'s/step':>8} {'tokens/s':>9}")
    for name, median in medians.items():
        print(f"{name:14} {median:8.3f} {tokens / median:9.0f}", flush=True)
    return {"batch": args.train_batch, "tokens": args.train_tokens, "rounds": args.rounds, "seconds": medians}


def kvcache(contexts: list[int]) -> list[dict]:
    """The KV cache of the Gemma 3 270M shape at batch 1 in bfloat16 (its checkpoint's dtype) at each context:
    gptlite's KVCache allocated, its key and value buffers' bytes counted, against the bytes of a cache whose local
    layers keep their window only (the same shape's numbers: what gptlite's cache does not do)."""
    import torch
    import transformers

    from gptlite.hf.pretrained import pretrained_config
    from gptlite.inference.kvcache import KVCache

    with tempfile.TemporaryDirectory() as tmp:
        transformers.Gemma3TextConfig(**GEMMA3_270M).save_pretrained(tmp)  # config.json alone: no weights needed
        config = pretrained_config(tmp)
    local = {int(i) for i in config.window_layers.split(",")}
    slot = 2 * config.kv_heads * config.head_width * torch.bfloat16.itemsize  # one position's k and v, one layer
    print(
        f"\nKV cache, Gemma 3 270M shape ({config.n_layer} layers, {len(local)} of them local with a window of "
        f"{config.sliding_window}; {config.kv_heads} kv head of width {config.head_width}), batch 1, bfloat16"
    )
    print(f"{'context':>8} {'gptlite KVCache MiB':>20} {'window-only MiB':>16} {'ratio':>6}")
    rows = []
    for context in contexts:
        cache = KVCache(config, 1, context, torch.bfloat16, torch.device("cpu"))
        ours = sum(t.nbytes for t in (*cache.k, *cache.v))
        del cache
        kept = [min(context, config.sliding_window) if i in local else context for i in range(config.n_layer)]
        window = slot * sum(kept)
        print(f"{context:>8} {ours / 2**20:20.1f} {window / 2**20:16.1f} {ours / window:5.2f}x", flush=True)
        rows.append({"context": context, "gptlite_bytes": ours, "window_only_bytes": window})
    return rows


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    parts, results = args.parts.split(","), {"device": args.device}
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_open_models_") as tmp:
        shape = family_shape(args.family, args.tiny)
        if {"memory", "decode", "logits", "train"} & set(parts):
            dirs = save_checkpoints(Path(tmp), args.family, shape)
            print(args.family + (" (tiny)" if args.tiny else ""), json.dumps(shape))
        if "memory" in parts:
            results["memory"] = memory(dirs, args.device, shape["vocab_size"])
        if "decode" in parts:
            results["decode"] = decode(dirs["float32"], args)
        if "train" in parts:
            results["train"] = train(dirs["float32"], args)
        if "logits" in parts:
            results["logits"] = checkpoint_logits(dirs["float32"], shape["vocab_size"])
            print(f"\nlargest |logit difference| against transformers on this checkpoint: {results['logits']:.2e}")
    if "logits" in parts:
        logits()
    if "kvcache" in parts:
        results["kvcache"] = kvcache(list(map(int, args.contexts.split(","))))
    if args.json:
        write_json(Path(args.json), results)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_open_models.py", lambda: run(parse(Options, argv, "bench_open_models.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
