"""Generate text from a trained checkpoint, streaming tokens to stdout as they are produced.

    python sample.py --out_dir=OUT [--start=TEXT | --start=FILE:prompt.txt] [--num_samples=3]
                     [--max_new_tokens=500] [--temperature=0.8] [--top_k=200] [--top_p=None] [--seed=1337]
                     [--device=auto] [--dtype=auto]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gptlite.checkpoint import load_checkpoint, model_from_checkpoint
from gptlite.generate import generate_tokens
from gptlite.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

TOKENIZER_FILE = "tokenizer.json"


def optional(cast):
    """argparse type accepting 'None' for no limit."""
    return lambda s: None if s.lower() == "none" else cast(s)


def find_tokenizer(out_dir: Path, ckpt: dict) -> Tokenizer:
    """The tokenizer.json train.py copied into out_dir, else the one beside the training shards."""
    for path in (out_dir / TOKENIZER_FILE, Path(ckpt["config"].get("data_dir", "")) / TOKENIZER_FILE):
        if path.is_file():
            return load_tokenizer(path)
    raise FileNotFoundError(f"no {TOKENIZER_FILE} in {out_dir} or the training data_dir; copy the data's {TOKENIZER_FILE} into {out_dir}")


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} does not exist")
        return path.read_text(encoding="utf-8")
    return start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the training run's directory (holds ckpt.pt)")
    parser.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=optional(int), default=200, help="keep the k most likely tokens (None = all)")
    parser.add_argument("--top_p", type=optional(float), default=None, help="nucleus sampling threshold (None = off)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights' precision; auto = bfloat16 on CUDA, float32 elsewhere")
    args = parser.parse_args(argv)
    try:
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={args.device} but CUDA is not available; use --device=cpu")
        if args.dtype == "auto":
            args.dtype = "bfloat16" if args.device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
        if args.num_samples < 1 or args.max_new_tokens < 0:
            raise ValueError(f"num_samples={args.num_samples} must be >= 1 and max_new_tokens={args.max_new_tokens} >= 0")
        out_dir = Path(args.out_dir)
        ckpt = load_checkpoint(out_dir, map_location="cpu")
        tokenizer = find_tokenizer(out_dir, ckpt)
        model = model_from_checkpoint(ckpt).to(args.device, getattr(torch, args.dtype)).eval()
        del ckpt
        prompt = tokenizer.encode(read_prompt(args.start))
        if not prompt:
            prompt = [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
        idx = torch.tensor([prompt], dtype=torch.long, device=args.device)
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        for k in range(args.num_samples):
            stream = StreamDecoder(tokenizer)
            sys.stdout.write(tokenizer.decode(prompt))
            for token in generate_tokens(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p, generator):
                sys.stdout.write(stream.feed(token.tolist()))
                sys.stdout.flush()
            sys.stdout.write(stream.flush() + "\n" + ("-" * 40 + "\n" if k < args.num_samples - 1 else ""))
    except (ValueError, FileNotFoundError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
