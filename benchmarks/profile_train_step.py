"""Where a training step's GPU time goes: the GPT-2 124M step as train.py takes it (bf16 autocast, torch.compile,
the chunked head + loss or all logits at once, gradient clipping, fused AdamW), on random tokens, profiled.

    python benchmarks/profile_train_step.py [--batch_size=64] [--chunked_loss=false] [--json=profile.json]
    python benchmarks/profile_train_step.py --device=cpu --tiny       # checks the script itself (figures mean nothing)

Prints the bare step's time and MFU (CUDA events over --steps steps after the compile, nothing read by the host in
between: the ceiling of train.py's loop), then the kernels of --profile_steps steps under torch.profiler grouped by
what they do (matrix products, attention, the inductor's fused kernels by the operations they fuse, the optimizer,
copies), each as milliseconds per step and its share of the step, the time the GPU ran no kernel, and the ten
longest kernels. MFU counts 6N + 12LCT FLOPs per token (GPT.flops_per_token) over the data sheet's dense bf16 peak
(gptlite.train.metrics.PEAK_FLOPS).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import TrainConfig, option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_text  # noqa: E402
from gptlite.train.metrics import mfu, peak_flops  # noqa: E402
from gptlite.train.optim import configure_optimizers  # noqa: E402

GPT2_SHAPE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304, "pos_emb": "learned"}
TINY_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "pos_emb": "learned"}

# kernel-name pattern -> its group; the first that matches wins (names as CUDA reports them on an H100/H200).
# The inductor's kernels first: their names list the operations they fuse (a loss kernel names clamp_min).
GROUPS = (
    (r"triton.*(log_softmax|logsumexp|nll|cross_entropy|softmax)", "inductor: loss and softmax"),
    (r"triton.*(layer_norm|native_layer_norm|rms)", "inductor: norms"),
    (r"triton.*(silu|gelu|tanh|sigmoid|relu)", "inductor: activations"),
    (r"triton.*(embedding|index|gather|scatter)", "inductor: embeddings"),
    (r"triton", "inductor: other fused"),
    (r"flash|fmha|sdpa|attention|cudnn", "attention (SDPA)"),
    (r"gemm|nvjet|xmma|cutlass|cublas|wgmma|matmul|addmm|bmm|\bmm\b", "matrix products"),
    (r"adam", "optimizer (fused AdamW)"),
    (r"multi_tensor|foreach|norm_kernel|clamp", "gradient norm and clip (foreach)"),
    (r"memcpy|memset|copy", "copies"),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for pattern, group in GROUPS if re.search(pattern, lowered)), "other")


@dataclass
class Options:
    batch_size: int = option(64, "windows per step")
    block_size: int = option(1024, "tokens per window")
    chunked_loss: bool = option(True, "the head + loss a chunk of tokens at a time (train.py's default)")
    compile: bool = option(True, "torch.compile the model, as train.py --compile")
    steps: int = option(10, "timed steps, after the warm-up")
    profile_steps: int = option(3, "profiled steps")
    device: str = option("cuda", "cuda, or cpu with --tiny")
    tiny: bool = option(False, "a 2-layer model: checks the script on any device; its figures mean nothing")
    json: str = option("", "also write the results here")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("profile_train_step.py", lambda: profile(parse(Options, argv, "profile_train_step.py", __doc__)))


def profile(args: Options) -> int:
    print(machine_line(), flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device=cuda, but CUDA is not available here; --device=cpu --tiny checks the script")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py
    shape = TINY_SHAPE if args.tiny else GPT2_SHAPE
    B, T = (4, 128) if args.tiny else (args.batch_size, args.block_size)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, block_size=T, dropout=0.0)).to(args.device)
    cfg = TrainConfig(batch_size=B, compile=args.compile, chunked_loss=args.chunked_loss)
    optimizers = configure_optimizers(model, cfg, args.device.split(":")[0])
    train_model = torch.compile(model) if args.compile else model
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randint(0, shape["vocab_size"], (B, T), device=args.device)
    y = torch.randint(0, shape["vocab_size"], (B, T), device=args.device)

    def step() -> None:
        with torch.autocast(args.device.split(":")[0], dtype=dtype, enabled=cuda):
            _, loss = train_model(x, y, return_logits=not args.chunked_loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    started = time.perf_counter()
    for _ in range(3):  # the first compiles
        step()
    synchronize(cuda)
    print(f"warm-up (compile included): {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(cuda)
    step_ms = (time.perf_counter() - started) * 1000 / args.steps
    flops = model.flops_per_token()
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else None
    step_mfu = mfu(flops, B * T / (step_ms / 1000), peak)
    mfu_text = "n/a" if step_mfu is None else f"{100 * step_mfu:.1f}%"
    print(f"bare step: {step_ms:.1f} ms, {B * T / step_ms * 1000:,.0f} tok/s, MFU {mfu_text} (batch {B}x{T})")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        synchronize(cuda)
    kernels = kernel_times(prof, cuda)  # name -> microseconds over the profiled steps
    per_step = {name: us / 1000 / args.profile_steps for name, us in kernels.items()}  # ms
    groups: dict[str, float] = defaultdict(float)
    for name, ms in per_step.items():
        groups[group_of(name)] += ms
    busy = sum(per_step.values())
    groups["(no kernel running)"] = max(0.0, step_ms - busy) if cuda else 0.0
    print(f"\n{'group':40s} {'ms/step':>8s} {'share':>6s}")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{group:40s} {ms:8.2f} {100 * ms / step_ms:5.1f}%")
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:10]
    print("\nlongest kernels (ms/step):")
    for name, ms in top:
        print(f"{ms:8.2f}  {name[:110]}")
    if args.json:
        write_text(  # whole or not at all: gpu_report.py reads it
            Path(args.json),
            json.dumps(
                {
                    "batch_size": B,
                    "block_size": T,
                    "chunked_loss": args.chunked_loss,
                    "step_ms": step_ms,
                    "mfu": step_mfu,
                    "groups_ms": dict(groups),
                    "top_kernels_ms": dict(top),
                },
                indent=1,
            )
            + "\n",
        )
    return 0


def kernel_times(prof: torch.profiler.profile, cuda: bool) -> dict[str, float]:
    """Each kernel's (on a CPU: each operator's) own time in microseconds, summed over its calls."""
    times = {}
    for event in prof.key_averages():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us and not math.isnan(us):
            times[event.key] = times.get(event.key, 0.0) + us
    return times


def synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
