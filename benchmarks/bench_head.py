"""The output head and its cross-entropy alone: gptlite.model.loss.linear_cross_entropy (train.py's loss, in chunks)
against the whole computation as PyTorch's users write it, F.cross_entropy(F.linear(h, weight), targets), in
float32 on 3,072 tokens (the budget recipes' 6 x 512), for training (forward and backward) and for evaluation (no
gradients), at two vocabularies (8,192 ids, a small BPE; GPT-2's 50,257) and the widths of small CPU models, and
at Llama 3's 128,256 ids and SmolLM2-135M's width, 576 (the chunks are sized by both: gptlite.model.loss.chunk_tokens).
The two take turns, `rounds` times after a warm-up each; each cell is the median time and its spread (max - min), and
the ratio is whole / chunked: above 1 the chunked loss is faster.

    python benchmarks/bench_head.py [--rounds=7] [--tokens=3072]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402

CASES = [(vocab, width) for vocab in (8192, 50257) for width in (24, 72, 192)] + [(128256, 576)]  # (ids, width)


@dataclass
class Options:
    rounds: int = option(7, "timed runs of each, in turn, after one warm-up each")
    tokens: int = option(3072, "tokens (rows of hidden states) per call")


def whole(h, weight, targets):
    import torch.nn.functional as F

    return F.cross_entropy(F.linear(h, weight), targets)


def chunked(h, weight, targets):
    from gptlite.model.loss import linear_cross_entropy

    return linear_cross_entropy(h, weight, targets)


def timed(loss_fn, h, weight, targets, train: bool) -> float:
    """Seconds for one call: the loss and, for training, its backward into h and weight."""
    import torch

    start = time.perf_counter()
    if train:
        loss_fn(h, weight, targets).backward()
    else:
        with torch.no_grad():
            loss_fn(h, weight, targets)
    return time.perf_counter() - start


def cell(times: list[float]) -> str:
    return f"{1000 * statistics.median(times):7.0f} ms ±{1000 * (max(times) - min(times)) / 2:4.0f}"


def run(args: Options) -> int:
    import torch

    print(machine_line(), flush=True)
    print(f"float32, {args.tokens:,} tokens a call, median of {args.rounds} (± half the spread)")
    print(f"{'':8} {'vocab':>7} {'width':>5} {'whole':>16} {'chunked':>16} {'ratio':>6}")
    for train in (True, False):
        for vocab, width in CASES:
            torch.manual_seed(0)
            h = torch.randn(args.tokens, width, requires_grad=train)
            weight = (0.02 * torch.randn(vocab, width)).requires_grad_(train)
            targets = torch.randint(0, vocab, (args.tokens,))
            times = {whole: [], chunked: []}
            for loss_fn in times:
                timed(loss_fn, h, weight, targets, train)  # warm-up: the allocator's first blocks
            for _ in range(args.rounds):
                for loss_fn in times:
                    times[loss_fn].append(timed(loss_fn, h, weight, targets, train))
                    h.grad = weight.grad = None
            ratio = statistics.median(times[whole]) / statistics.median(times[chunked])
            kind = "train" if train else "evaluate"
            print(
                f"{kind:8} {vocab:7,} {width:5} {cell(times[whole]):>16} {cell(times[chunked]):>16} {ratio:5.2f}x",
                flush=True,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_head.py", lambda: run(parse(Options, argv, "bench_head.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
