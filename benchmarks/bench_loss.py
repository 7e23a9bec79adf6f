"""The chunked head + cross-entropy (gptlite.model.loss, train.py's default) against the whole-logits one
(--chunked_loss=false): peak RSS and time per step of train.py, each a whole command in a fresh process, for the
vocabularies of SmolLM2 (49,152), Llama 3 (128,256) and Qwen2 (151,936) on a small Llama-shaped body (random
weights from transformers: width 576, 4 layers, float32), batch 4 x block 512, on bytes of tiny Shakespeare. The
two runs of a vocabulary go in turn, `rounds` times; the table gives each one's lowest figures.

    python benchmarks/bench_loss.py [--steps=4] [--rounds=2] [--corpus=tinyshakespeare.txt]
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_lora import measured  # noqa: E402

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402

BODY = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
VOCABS = {"SmolLM2": 49152, "Llama 3": 128256, "Qwen2": 151936}


@dataclass
class Options:
    steps: int = option(4, "optimizer steps per run; the first (warm-up) is left out of the time")
    rounds: int = option(2, "runs of each kind, in turn")
    corpus: str = option(str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "the text to train on")


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    import torch
    import transformers

    from gptlite.data.prepare import prepare

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_loss_") as tmp:
        tmp = Path(tmp)
        prepare([args.corpus], "byte", tmp / "data", log=lambda *a: None)
        print(
            f"train.py, width 576 x 4 layers, float32, batch 4 x block 512, {args.steps} steps, "
            f"best of {args.rounds}; peak RSS of the whole command, time per step after the first"
        )
        print(
            f"{'vocabulary':20} {'whole MB':>9} {'chunked MB':>11} {'ratio':>6} {'whole ms':>9} {'chunked ms':>11} "
            f"{'ratio':>6}"
        )
        for name, vocab in VOCABS.items():
            torch.manual_seed(0)
            base = tmp / f"base_{vocab}"
            transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, **BODY)).save_pretrained(base)
            command = [
                sys.executable,
                "train.py",
                f"--init_from={base}",
                f"--data_dir={tmp / 'data'}",
                "--block_size=512",
                "--batch_size=4",
                f"--max_iters={args.steps}",
                f"--eval_interval={args.steps}",
                "--eval_iters=1",
                "--log_interval=1",
                "--warmup_iters=0",
                "--device=cpu",
                "--dtype=float32",
                f"--out_dir={tmp / 'out'}",
                "--overwrite",
            ]
            peaks, times = {False: [], True: []}, {False: [], True: []}
            for _ in range(args.rounds):
                for chunked in (False, True):
                    peak, out = measured([*command, f"--chunked_loss={str(chunked).lower()}"])
                    peaks[chunked].append(peak)
                    times[chunked].append(
                        statistics.median(float(ms) for ms in re.findall(r"\| +([\d.]+) ms/step", out)[1:])
                    )
            whole, chunked = (min(peaks[False]), min(times[False])), (min(peaks[True]), min(times[True]))
            print(
                f"{f'{name} ({vocab:,})':20} {whole[0]:9.0f} {chunked[0]:11.0f} {chunked[0] / whole[0]:5.2f}x "
                f"{whole[1]:9.0f} {chunked[1]:11.0f} {chunked[1] / whole[1]:5.2f}x",
                flush=True,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_loss.py", lambda: run(parse(Options, argv, "bench_loss.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
