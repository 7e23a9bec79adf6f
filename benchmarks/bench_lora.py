"""LoRA against full fine-tuning: the peak RSS of train.py fine-tuning a SmolLM2-360M-shaped model (random weights
from transformers, float32, block 1024, batch 1, a few steps on bytes of tiny Shakespeare), each a whole command in
a fresh process, and its time per step; with and without --activation_checkpointing (which on the CPU also fixes
glibc's mmap threshold at 1 MiB: see train.return_freed_memory). With --device=cuda: bfloat16 autocast, and the
peak is the GPU memory torch allocated (train.py's last line).

    python benchmarks/bench_lora.py [--steps=3] [--lora_rank=8] [--corpus=tinyshakespeare.txt] [--device=cuda]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402

SHAPE = dict(
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


@dataclass
class Options:
    steps: int = option(3, "optimizer steps per run")
    lora_rank: int = option(8, "the adapters' rank")
    corpus: str = option(str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "the text to fine-tune on")
    device: str = option("cpu", "cpu (float32, peak RSS) or cuda (bfloat16, peak GPU memory)")
    batch_size: int = option(1, "sequences of 1,024 tokens per step")
    json: str = option("", "also write the results here")


def measured(command: list[str]) -> tuple[float, str]:
    """(peak RSS in MB, stdout) of a command in a fresh process."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{out[-2000:]}")
    return usage.ru_maxrss / 1024, out


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    import torch
    import transformers

    from gptlite.data.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="gptlite_bench_lora_") as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(tmp / "base")
        prepare([args.corpus], "byte", tmp / "data", log=lambda *a: None)
        cuda = args.device.startswith("cuda")
        common = [
            sys.executable,
            "train.py",
            f"--init_from={tmp / 'base'}",
            f"--data_dir={tmp / 'data'}",
            "--block_size=1024",
            f"--batch_size={args.batch_size}",
            "--total_batch_size=0",
            f"--max_iters={args.steps}",
            f"--eval_interval={args.steps}",
            "--eval_iters=1",
            "--log_interval=1",
            "--warmup_iters=0",
            f"--device={args.device}",
            f"--dtype={'bfloat16' if cuda else 'float32'}",
            f"--out_dir={tmp / 'out'}",
            "--overwrite",
        ]
        print(
            f"SmolLM2-360M shape, {'bfloat16' if cuda else 'float32'} on {args.device}, block 1024, batch "
            f"{args.batch_size}, {args.steps} steps; peak "
            + ("GPU memory allocated" if cuda else "RSS of the whole command")
        )
        print(
            f"{'activations':28} {'full MB':>8} {'LoRA MB':>8} {'LoRA/full':>10} {'full s/step':>12} "
            f"{'LoRA s/step':>12}"
        )
        rows = []
        for checkpointing in (False, True):
            extra = ["--activation_checkpointing"] if checkpointing else []
            peaks, steps = [], []
            for lora in ([], [f"--lora_rank={args.lora_rank}"]):
                rss, out = measured([*common, *extra, *lora])
                peaks.append(float(re.findall(r"peak memory ([\d,]+) MiB", out)[-1].replace(",", "")) if cuda else rss)
                steps.append(float(re.findall(r"\| +([\d.]+) ms/step", out)[-1]) / 1000)
            name = "recomputed (--activation_checkpointing)" if checkpointing else "kept"
            print(
                f"{name:28} {peaks[0]:8.0f} {peaks[1]:8.0f} {peaks[1] / peaks[0]:9.2f}x {steps[0]:12.2f} "
                f"{steps[1]:12.2f}",
                flush=True,
            )
            rows.append(
                {
                    "activation_checkpointing": checkpointing,
                    "full_mb": peaks[0],
                    "lora_mb": peaks[1],
                    "full_s_per_step": steps[0],
                    "lora_s_per_step": steps[1],
                }
            )
    if args.json:
        write_json(Path(args.json), {"device": args.device, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_lora.py", lambda: run(parse(Options, argv, "bench_lora.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
