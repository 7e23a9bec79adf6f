"""Batch-1 CPU decoding against llama.cpp on the same weights: gptlite's float32, int8 and int4 paths (eager, no
compile) and llama.cpp on GGUF files that gptlite's own writer exported from those weights (f32, q8_0, q4_0), with
the memory bound beside them; and, given a trained run, what each quantization costs in accuracy.

    pip install -e ".[test]"      # llama-cpp-python and gguf
    python benchmarks/bench_cpu_decode.py                                   # speed, GPT-2 124M shape
    python benchmarks/bench_cpu_decode.py --shape=smollm2-135m              # speed, SmolLM2-135M's shape
    python benchmarks/bench_cpu_decode.py --trained=out/gpt2 --data_dir=data/shakespeare_gpt2   # ... and accuracy
    python benchmarks/bench_cpu_decode.py --parts=accuracy --trained=RUN --data_dir=DATA --json=acc.json

Speed: one model shape (`--shape`, SHAPES) with random weights (greedy decoding of random weights costs what a
trained model's does), a 16-token prompt, `--new_tokens` greedy tokens; tokens/s counts the new tokens over the whole
call (prefill included). The shapes, each its model's published configuration:
    gpt2-124m      GPT-2 124M: 12 layers, 768 wide, 12 heads, vocabulary 50,304, GELU MLP with biases, learned
                   positions, LayerNorm (the default)
    smollm2-135m   SmolLM2-135M: 30 layers, 576 wide, 9 query heads on 3 key/value heads, SwiGLU 1536 wide, RoPE
                   (base 100,000), RMSNorm, tied embeddings, vocabulary 49,152
    qwen3-0.6b     Qwen3-0.6B: 28 layers, 1024 wide, 16 query heads on 8 key/value heads of 128, SwiGLU 3072 wide,
                   RMSNorm on each head's q and k, RoPE (base 1,000,000), tied, vocabulary 151,936
    gemma3-270m    Gemma 3 270M: 18 layers, 640 wide, 4 query heads on 1 key/value head of 256, GeGLU 2048 wide,
                   RMSNorm before and after each branch scaling by 1 + weight, q/k norms, a sliding window of 512
                   positions in 5 of every 6 layers (RoPE base 10,000 there, 1,000,000 in the others), embeddings
                   times sqrt(640), tied, vocabulary 262,144
The GGUF files carry GPT-2's tokenizer for GPT-2's shape, and for the others a byte-level BPE of 8,192 ids learnt from
`--corpus` (GPT-2's 50,257 ids do not fit SmolLM2's vocabulary; ids past a tokenizer's are unused tokens); the
prompt's ids are random ones the tokenizer has. Each path runs `--rounds`
times, the paths taking turns within each round, each of gptlite's beside llama.cpp's twin of it (which of the two
goes first alternates), and the table gives the median with the slowest and fastest round, and for gptlite's paths
the median of the rounds' ratios to the twin (the machine's memory bandwidth drifts over minutes; two runs seconds
apart share it). gptlite runs in this process, as `generate(model, ...)` (what sample.py runs): float32, then the
model after `quantize("int8")` and `quantize("int4")` (the int4 GGUF twin is q4_0: the same rule, groups of 32).
The first call of each gptlite path is not timed: it measures the kernels for this CPU (kept in the choices file,
see gptlite.inference.cpu.decode) as a user's first sample.py does once.

llama.cpp (llama-cpp-python, as many threads as torch, its other settings at their defaults) runs in a child
process per file, so that a crash in its native code (on Intel CPUs with AMX its repacking path dies: docs/hf.md)
names itself and the benchmark goes on.
Its first row per type is llama.cpp as its users run it (defaults: weights repacked for the CPU); where that
crashes, the row says so and a second row runs it with `--no-repack` (extra buffer types off), named as such.

The memory bound: the passes a second of a plain `torch.sum` over the same float32 weights (every matrix, as a
decode step reads them once), in this process, in turn with the rest.

Accuracy (`--trained=RUN`, a run trained with a BPE tokenizer that GGUF takes): the run's float32 weights, int8 and
int4 in gptlite, and f32, q8_0 and q4_0 files of the same weights in llama.cpp; for each, the validation loss on
the run's val shard (`--eval_windows` windows of the run's block_size) and greedy agreement with its own float32
(gptlite's quantizations against gptlite float32, llama.cpp's against llama.cpp f32): over `--prompts` prompts
taken from the val tokens, the share of `--agree_tokens` greedy tokens that match before the first difference.
This is a script that prints tables, not a test.
"""

from __future__ import annotations

import copy
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gguf import SHAPES as GGUF_SHAPES  # noqa: E402
from benchmarks.bench_gguf import llama_tokens_per_s  # noqa: E402
from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import cpu_extensions, machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402
from gptlite.hf.gguf import export_gguf  # noqa: E402
from gptlite.inference.generate import generate  # noqa: E402

# each shape's gptlite configuration (the models' config.json values; random weights); block_size only bounds the
# positions a run may reach
SHAPES = {
    "gpt2-124m": GGUF_SHAPES["gpt2"],  # GPT-2 124M, as bench_gguf exports it
    "smollm2-135m": dict(
        vocab_size=49152,
        block_size=2048,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        ffn_hidden=1536,
        pos_emb="rope",
        rope_theta=100000.0,
        norm="rmsnorm",
        norm_eps=1e-5,
        ffn="swiglu",
        tie_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        block_size=2048,
        n_layer=28,
        n_head=16,
        n_kv_head=8,
        head_dim=128,
        n_embd=1024,
        ffn_hidden=3072,
        pos_emb="rope",
        rope_theta=1000000.0,
        norm="rmsnorm",
        norm_eps=1e-6,
        ffn="swiglu",
        qk_norm=True,
        tie_embeddings=True,
    ),
    "gemma3-270m": dict(
        vocab_size=262144,
        block_size=2048,
        n_layer=18,
        n_head=4,
        n_kv_head=1,
        head_dim=256,
        n_embd=640,
        ffn_hidden=2048,
        pos_emb="rope",
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        sliding_window=512,
        window_layers=",".join(str(i) for i in range(18) if (i + 1) % 6),  # every 6th layer (5, 11, 17) global
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_position="both",
        norm_unit_offset=True,
        qk_norm=True,
        ffn="geglu",
        embed_scale=640**0.5,
        tie_embeddings=True,
    ),
}
TYPES = ("f32", "q8_0", "q4_0")
QUANTIZATIONS = {"f32": "", "q8_0": "int8", "q4_0": "int4"}  # each GGUF type beside gptlite's twin of it


@dataclass
class Options:
    shape: str = option("gpt2-124m", "speed: the model's shape", choices=tuple(SHAPES))
    parts: str = option("speed,accuracy", "comma-separated: speed, accuracy (accuracy needs --trained)")
    rounds: int = option(5, "speed: timed calls of each path, in turn")
    new_tokens: int = option(128, "speed: greedy tokens per timed call")
    trained: str = option("", "accuracy: a run folder trained with a BPE tokenizer (its newest checkpoint)")
    data_dir: str = option("", "accuracy: the token shards the run trained on (their val split is scored)")
    prompts: int = option(8, "accuracy: prompts from the val tokens")
    agree_tokens: int = option(64, "accuracy: greedy tokens compared per prompt")
    eval_windows: int = option(16, "accuracy: val windows scored")
    tokenizer: str = option(str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"), "speed: GPT-2's ranks")
    corpus: str = option(
        str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "speed: the text the other shapes' BPE learns"
    )
    json: str = option("", "also write the results here")
    child: str = option("", "internal: the llama.cpp child's request file")


# ---------------------------------------------------------------------------------------------
# llama.cpp, in a child process of its own


class LlamaCpp:
    """One GGUF file loaded by llama.cpp in a child process that answers requests on its stdin, a JSON line each:
    {"kind": "speed", "prompt": ids, "n": n} -> tokens/s of n greedy tokens; {"kind": "greedy", ...} -> the
    tokens; {"kind": "nll", "ids": ids} -> the summed negative log-likelihood of ids[1:]. `repack=False` turns
    llama.cpp's extra buffer types off (what --no-repack does); `every_logit=True` keeps the logits of every
    position (llama-cpp-python's logits_all, which "nll" needs; its default keeps the last one's only)."""

    def __init__(self, path: Path, repack: bool, n_ctx: int, every_logit: bool = False):
        request = {
            "path": str(path),
            "repack": repack,
            "n_ctx": n_ctx,
            "threads": torch.get_num_threads(),
            "every_logit": every_logit,
        }
        self.process = subprocess.Popen(
            [sys.executable, __file__, f"--child={json.dumps(request)}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.ask({"kind": "ready"})

    def ask(self, request: dict):
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            name = signal.Signals(-code).name if code < 0 else f"exit code {code}"
            raise ChildProcessError(f"llama.cpp died ({name}) on {cpu_extensions()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def child(request_json: str) -> int:
    """The child's side of LlamaCpp."""
    import llama_cpp
    import llama_cpp.llama_cpp as api

    request = json.loads(request_json)
    if not request["repack"]:
        defaults = api.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params = without_extra_buffers
    llm = llama_cpp.Llama(
        model_path=request["path"],
        n_ctx=request["n_ctx"],
        n_batch=request["n_ctx"],
        n_threads=request["threads"],
        logits_all=request["every_logit"],
        verbose=False,
    )
    for line in sys.stdin:
        request = json.loads(line)
        kind = request["kind"]
        if kind == "ready":
            answer = True
        elif kind == "speed":
            answer = llama_tokens_per_s(llm, request["prompt"], request["n"])
        elif kind == "greedy":
            answer = greedy_tokens(llm, request["prompt"], request["n"])
        else:
            answer = summed_nll(llm, request["ids"])
        print(json.dumps(answer), flush=True)
    return 0


def greedy_tokens(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == n:
            break
    return tokens


def summed_nll(llm, ids: list[int]) -> float:
    """The negative log-likelihood of ids[1:] given what comes before each, summed, from llama.cpp's logits."""
    llm.reset()
    llm.eval(ids[:-1])
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # (T-1, V)
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return float((log_z - logits[np.arange(len(ids) - 1), ids[1:]]).sum())


def open_llama(path: Path, n_ctx: int, log, every_logit: bool = False) -> tuple[LlamaCpp, str]:
    """llama.cpp on `path` at its defaults, or, where that dies, with --no-repack; and the row's name."""
    try:
        llm = LlamaCpp(path, repack=True, n_ctx=n_ctx, every_logit=every_logit)
        llm.ask(
            {"kind": "speed", "prompt": [1, 2, 3, 4], "n": 2}
        )  # the first evaluation is where the AMX repack path dies
        return llm, "defaults"
    except ChildProcessError as error:
        log(f"llama.cpp at its defaults on {path.name}: {error}; measured with --no-repack instead")
        return LlamaCpp(path, repack=False, n_ctx=n_ctx, every_logit=every_logit), "--no-repack (defaults crash here)"


# ---------------------------------------------------------------------------------------------
# speed


def gptlite_tokens_per_s(model: GPT, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    out = generate(model, [prompt], n, temperature=0.0)
    assert len(out[0]) >= len(prompt) + n
    return n / (time.perf_counter() - start)


def weight_sums_per_s(matrices: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in matrices:
        w.sum()
    return 1 / (time.perf_counter() - start)


def speed_tokenizer(args: Options):
    """The tokenizer the shape's GGUF files carry: GPT-2's for GPT-2's shape, else a byte-level BPE of 8,192 ids
    learnt from `--corpus` (see the module docstring)."""
    if args.shape == "gpt2-124m":
        from gptlite.tokenizer import tokenizer_from_spec

        return tokenizer_from_spec(args.tokenizer)
    from gptlite.tokenizer.trainer import train_bpe

    return train_bpe([Path(args.corpus).read_text(encoding="utf-8")], vocab_size=8192)


def speed(args: Options, tokenizer, folder: Path, log) -> dict:
    """tokens/s of every path, each round's figures kept: gptlite's paths each beside llama.cpp's twin of it, the
    two taking turns (which of them goes first alternates from round to round), so that the ratio of each round
    compares two runs seconds apart on a machine whose memory bandwidth drifts over minutes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPES[args.shape])).eval()
    ids = min(tokenizer.vocab_size, model.config.vocab_size, 50000)
    prompt = torch.randint(0, ids, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    pairs = []  # ((gptlite's name, its call), (llama.cpp's twin's name, its call)) per GGUF type
    children = []
    for kind, mode in QUANTIZATIONS.items():
        path = export_gguf(model, folder / f"{args.shape}-{kind}.gguf", tokenizer, kind)
        ours = copy.deepcopy(model).quantize(mode) if mode else model
        ours_name = f"gptlite {mode} (eager)" if mode else "gptlite float32 (default)"
        ours_call = partial(gptlite_tokens_per_s, ours, prompt, args.new_tokens)
        ours_call()  # the first call measures this CPU's kernels (once per machine) and warms up
        llm, how = open_llama(path, len(prompt) + args.new_tokens + 8, log)
        children.append(llm)
        theirs_call = partial(llm.ask, {"kind": "speed", "prompt": prompt, "n": args.new_tokens})
        pairs.append(((ours_name, ours_call), (f"llama.cpp {kind}, {how}", theirs_call)))
    matrices = [p.detach() for p in model.parameters()]
    bound = "memory bound: sum over the float32 weights (passes/s)"
    figures = {name: [] for pair in pairs for name, _ in pair}
    figures[bound] = []
    try:
        for round_ in range(args.rounds):
            for pair in pairs:
                for name, call in pair if round_ % 2 == 0 else reversed(pair):
                    figures[name].append(call())
            figures[bound].append(weight_sums_per_s(matrices))
    finally:
        for llm in children:
            llm.close()
    results = {name: {"rounds": v, "twin": None} for name, v in figures.items()}
    for (ours_name, _), (theirs_name, _) in pairs:
        results[ours_name]["twin"] = theirs_name
    return results


def speed_table(results: dict, args: Options) -> str:
    """Medians of the rounds, with the slowest and fastest, and for gptlite's paths the median of the rounds'
    ratios to llama.cpp's twin, with the lowest and highest."""
    lines = [
        f"| {args.shape}, batch 1, 16-token prompt, {args.new_tokens} greedy tokens | tokens/s (median) | "
        "slowest - fastest | vs llama.cpp's twin, per round: median (lowest - highest) |",
        "|---|---:|---:|---:|",
    ]
    for name, v in results.items():
        rounds = v["rounds"]
        ratio = ""
        if v["twin"]:
            twin = v["twin"].split(",")[0].removeprefix("llama.cpp ")
            ratios = [a / b for a, b in zip(rounds, results[v["twin"]]["rounds"], strict=True)]
            ratio = f"{statistics.median(ratios):.2f}x {twin} ({min(ratios):.2f} - {max(ratios):.2f})"
        lines.append(f"| {name} | {statistics.median(rounds):.1f} | {min(rounds):.1f} - {max(rounds):.1f} | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# accuracy


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The mean share of each row's tokens equal to the reference's before the first difference."""
    shares = []
    for want, got in zip(reference, other, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        shares.append(same / len(want))
    return sum(shares) / len(shares)


@torch.no_grad()
def gptlite_nll(model: GPT, windows: list[list[int]]) -> float:
    total = 0.0
    for ids in windows:
        logits = model(torch.tensor([ids[:-1]]))[0].float()[0]  # (T-1, V)
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
    return total


def accuracy(args: Options, folder: Path, log) -> dict:
    from gptlite.checkpoint import load_model
    from gptlite.data.shards import find_shards, read_shard

    run = Path(args.trained)
    model, tokenizer = load_model(init_from=str(run))
    model = model.float().eval()
    val = np.asarray(read_shard(find_shards(args.data_dir, "val")[0]), dtype=np.int64)
    T = model.config.block_size
    windows = [val[i * T : (i + 1) * T + 1].tolist() for i in range(args.eval_windows)]
    step = len(val) // (args.prompts + 1)
    prompts = [val[i * step : i * step + 16].tolist() for i in range(1, args.prompts + 1)]
    n = min(args.agree_tokens, T - 16)
    results = {}
    gptlite_reference = None
    for mode in QUANTIZATIONS.values():
        quantized = copy.deepcopy(model).quantize(mode) if mode else model
        tokens = [row[16:] for row in generate(quantized, prompts, n, temperature=0.0)]
        gptlite_reference = tokens if not mode else gptlite_reference
        nll = gptlite_nll(quantized, windows) / (len(windows) * T)
        results[f"gptlite {mode or 'float32'}"] = {"val_loss": nll, "agreement": agreement(gptlite_reference, tokens)}
    llama_reference = None
    for kind in TYPES:
        path = export_gguf(model, folder / f"trained-{kind}.gguf", tokenizer, kind)
        llm, how = open_llama(path, T + 8, log, every_logit=True)
        try:
            tokens = [llm.ask({"kind": "greedy", "prompt": p, "n": n}) for p in prompts]
            nll = sum(llm.ask({"kind": "nll", "ids": w}) for w in windows) / (len(windows) * T)
        finally:
            llm.close()
        llama_reference = tokens if kind == "f32" else llama_reference
        results[f"llama.cpp {kind} ({how})"] = {"val_loss": nll, "agreement": agreement(llama_reference, tokens)}
    return results


def accuracy_table(results: dict, args: Options) -> str:
    lines = [
        f"| weights | val loss (nats/token) | greedy agreement with its own float32 ({args.prompts} prompts x "
        f"{args.agree_tokens} tokens) |",
        "|---|---:|---:|",
    ]
    for name, v in results.items():
        lines.append(f"| {name} | {v['val_loss']:.4f} | {100 * v['agreement']:.1f}% |")
    return "\n".join(lines)


def run(args: Options) -> int:
    parts = args.parts.split(",")
    if "accuracy" in parts and not (args.trained and args.data_dir):
        if args.parts != "speed,accuracy":
            raise ValueError("--parts=accuracy needs --trained=RUN and --data_dir=ITS_SHARDS (a BPE-tokenized run)")
        parts.remove("accuracy")
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    results = {"machine": machine_line(), "shape": args.shape}
    with tempfile.TemporaryDirectory() as tmp:
        if "speed" in parts:
            results["speed"] = speed(args, speed_tokenizer(args), Path(tmp), print)
            print(speed_table(results["speed"], args), flush=True)
        if "accuracy" in parts:
            results["accuracy"] = accuracy(args, Path(tmp), print)
            print(accuracy_table(results["accuracy"], args), flush=True)
    if args.json:
        write_json(Path(args.json), results)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("--child="):
        return child(argv[0].removeprefix("--child="))
    return run_command("bench_cpu_decode", lambda: run(parse(Options, argv, "benchmarks/bench_cpu_decode.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
