"""DPO against SFT: the peak RSS and time per step of train.py at the SmolLM2-360M shape (random weights from
transformers, float32), each run a whole command in a fresh process, as benchmarks/bench_lora.py measures LoRA.

DPO trains on --batch_size pairs of tiny Shakespeare bytes (a prompt and two answers, each row prompt + answer of
--tokens tokens), so a step runs 2 x batch_size sequences through the model twice: the policy with gradients, the
reference without. SFT's step runs the same number of sequences of the same length (text windows of --tokens, every
token a target). Both full fine-tuning (DPO's reference then a frozen copy of the weights) and LoRA (the reference
is the same weights with the adapters off). With --device=cuda: bfloat16 autocast, and the peak is the GPU memory
torch allocated (train.py's last line).

    python benchmarks/bench_dpo.py [--steps=3] [--batch_size=2] [--tokens=256] [--lora_rank=8] [--device=cuda]
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_lora import SHAPE, measured  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402


@dataclass
class Options:
    steps: int = option(3, "optimizer steps per run")
    batch_size: int = option(2, "DPO's pairs per step; SFT's step takes twice as many sequences")
    tokens: int = option(256, "tokens per sequence (prompt + answer), and the block size")
    lora_rank: int = option(8, "the adapters' rank")
    corpus: str = option(str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "the text the pairs come from")
    device: str = option("cpu", "cpu (float32, peak RSS) or cuda (bfloat16, peak GPU memory)")
    json: str = option("", "also write the results here")


def write_pairs(corpus: str, path: Path, tokens: int, n: int = 64) -> None:
    """n preference records of the corpus's bytes: a prompt of tokens/2 bytes, two different answers of tokens/2."""
    text = Path(corpus).read_bytes().decode("ascii", "replace")
    half = tokens // 2
    with open(path, "w") as f:
        for i in range(n):
            start = i * 3 * half
            prompt, chosen, rejected = (text[start + k * half : start + (k + 1) * half] for k in range(3))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    import torch
    import transformers

    from gptlite.data.prepare import prepare
    from gptlite.data.prepare.preference import prepare_preference

    with tempfile.TemporaryDirectory(prefix="gptlite_bench_dpo_") as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(tmp / "base")
        write_pairs(args.corpus, tmp / "pairs.jsonl", args.tokens)
        prepare_preference([str(tmp / "pairs.jsonl")], "byte", tmp / "pairs", block_size=args.tokens, log=print)
        prepare([args.corpus], "byte", tmp / "text", log=lambda *a: None)
        cuda = args.device.startswith("cuda")
        common = [
            sys.executable,
            "train.py",
            f"--init_from={tmp / 'base'}",
            f"--block_size={args.tokens}",
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
        runs = {
            "SFT": [f"--data_dir={tmp / 'text'}", f"--batch_size={2 * args.batch_size}"],
            "DPO": [f"--data_dir={tmp / 'pairs'}", f"--batch_size={args.batch_size}"],
        }
        print(
            f"SmolLM2-360M shape, {'bfloat16' if cuda else 'float32'} on {args.device}, {2 * args.batch_size} "
            f"sequences of {args.tokens} tokens per step ({args.batch_size} DPO pairs), {args.steps} steps; peak "
            + ("GPU memory allocated" if cuda else "RSS of the whole command")
        )
        print(f"{'training':26} {'SFT MB':>8} {'DPO MB':>8} {'DPO/SFT':>8} {'SFT s/step':>11} {'DPO s/step':>11}")
        rows = []
        for name, extra in (
            ("full (DPO: a frozen copy)", []),
            ("LoRA (DPO: adapters off)", [f"--lora_rank={args.lora_rank}"]),
        ):
            peaks = {}
            steps = {}
            for kind, data in runs.items():
                rss, out = measured([*common, *data, *extra])
                peaks[kind] = float(re.findall(r"peak memory ([\d,]+) MiB", out)[-1].replace(",", "")) if cuda else rss
                steps[kind] = [float(s) / 1000 for s in re.findall(r"\| +([\d.]+) ms/step", out)]
            # the first step warms up allocations; the later ones are the step's time
            step_s = {k: min(v[1:] or v) for k, v in steps.items()}
            print(
                f"{name:26} {peaks['SFT']:8.0f} {peaks['DPO']:8.0f} {peaks['DPO'] / peaks['SFT']:7.2f}x "
                f"{step_s['SFT']:11.2f} {step_s['DPO']:11.2f}",
                flush=True,
            )
            rows.append(
                {
                    "training": name,
                    "sft_mb": peaks["SFT"],
                    "dpo_mb": peaks["DPO"],
                    "sft_s_per_step": step_s["SFT"],
                    "dpo_s_per_step": step_s["DPO"],
                }
            )
    if args.json:
        write_json(Path(args.json), {"device": args.device, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_dpo.py", lambda: run(parse(Options, argv, "bench_dpo.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
