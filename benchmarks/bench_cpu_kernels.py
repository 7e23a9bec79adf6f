"""Each CPU decode kernel alone, on GPT-2 124M's matrices: the seconds one call takes, as gptlite measures them to
choose (`gptlite.inference.cpu.decode.measure` for the float32 kernels, `Int8Linear.measure` for the int8 ways: copies
of a random weight spanning more memory than the caches, called in turn, the fastest of 5 rounds), at one row (decoding
one sequence) and at eight (a batch), with the time of a whole token's matrices (12 blocks and the head) and the
rate each streams the weight's bytes at; and the int8 head as `quantize("int8")` makes it, a scale per 32 weights
(`Int8GroupLinear.measure`). The kernels gptlite.inference.cpu.native could not build here are left out.

    python benchmarks/bench_cpu_kernels.py [--rows=1,8]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402

# GPT-2 124M's matrices (N, K) and how many of each a token reads: q/k/v, attention out, MLP in, MLP out, the head
SHAPES = {"q/k/v": (2304, 768), "out": (768, 768), "fc": (3072, 768), "proj": (768, 3072), "head": (50304, 768)}
PER_TOKEN = {"q/k/v": 12, "out": 12, "fc": 12, "proj": 12, "head": 1}


@dataclass
class Options:
    rows: str = option("1,8", "row counts to measure, comma-separated")


def table(rows: int, kind: str, times: dict[str, dict[str, float]], bytes_per_weight: int) -> str:
    """A markdown table: a line per kernel, a column per matrix, the whole token's matrices, and GB/s."""
    kernels = list(next(iter(times.values())))
    lines = [
        f"| {kind}, {rows} row{'s' if rows > 1 else ''} | " + " | ".join(SHAPES) + " | per token | GB/s |",
        "|---|" + "---:|" * (len(SHAPES) + 2),
    ]
    weights = sum(PER_TOKEN[name] * N * K for name, (N, K) in SHAPES.items())
    for kernel in kernels:
        token = sum(PER_TOKEN[name] * times[name][kernel] for name in SHAPES)
        cells = [f"{times[name][kernel] * 1e6:,.0f} us" for name in SHAPES]
        rate = weights * bytes_per_weight / token / 1e9
        lines.append(f"| {kernel} | " + " | ".join(cells) + f" | {token * 1e3:.1f} ms | {rate:.1f} |")
    return "\n".join(lines)


def run(args: Options) -> int:
    import torch

    from gptlite.inference.cpu.decode import measure
    from gptlite.inference.quantize import Int8GroupLinear, Int8Linear

    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        floats = {name: measure(shape, rows) for name, shape in SHAPES.items()}
        print(table(rows, "float32", floats, 4), flush=True)
        int8 = {name: Int8Linear.measure(shape, rows) for name, shape in SHAPES.items()}
        print(table(rows, "int8", int8, 1), flush=True)
        grouped = Int8GroupLinear.measure(SHAPES["head"], rows)  # what quantize("int8") makes of the head
        ways = ", ".join(f"{way} {seconds * 1e6:,.0f} us" for way, seconds in grouped.items())
        print(f"int8 head with a scale per 32 weights (the vocabulary table), {rows} rows: {ways}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "bench_cpu_kernels", lambda: run(parse(Options, argv, "benchmarks/bench_cpu_kernels.py", __doc__))
    )


if __name__ == "__main__":
    sys.exit(main())
