"""Generate text from a trained checkpoint or pretrained weights, streaming tokens to stdout as they are produced.

    python sample.py --out_dir=OUT [--start=TEXT | --start=FILE:prompt.txt] [--num_samples=3]
    python sample.py --init_from=gpt2 [--tokenizer=gpt2.tiktoken] [--start=TEXT] ...   # no training needed
    python sample.py --out_dir=OUT --num_beams=4 [--num_samples=2] [--length_penalty=1.0]  # beam search
                     [--max_new_tokens=500] [--temperature=0.8] [--top_k=200] [--top_p=None]
                     [--repetition_penalty=1.0] [--frequency_penalty=0.0] [--stop=STRING ...]
                     [--stop_at_eot=true] [--batch_size=8] [--seed=1337] [--device=auto] [--dtype=auto]
                     [--compile=false] [--quantize=int8] [--extend_context=false]

Samples are generated `batch_size` at a time and share the prompt's prefill. The first sample of each
batch is printed token by token as it is generated; the others are printed when their batch is done.
With --num_beams the `num_samples` best beams are printed when the search ends (see gptlite.beam).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from gptlite.checkpoint import load_model
from gptlite.cli import run_command
from gptlite.generate import generate, generate_text
from gptlite.model import GPT
from gptlite.tokenizer import Tokenizer

SEPARATOR = "-" * 40 + "\n"
UNSET = object()  # a flag the command line did not give


def optional(cast):
    """argparse type accepting 'None' for no limit."""
    return lambda s: None if s.lower() == "none" else cast(s)


def boolean(s: str) -> bool:
    """argparse type for true/false flags (`--compile` alone also means true)."""
    if s.lower() in ("true", "1", "yes", "on"):
        return True
    if s.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{s!r} is not a boolean; use true or false")


def unescape(s: str) -> str:
    r"""Backslash escapes as in Python strings, so `--stop='\n\n'` stops at a blank line."""
    return s.encode("latin-1", "backslashreplace").decode("unicode_escape")


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} does not exist")
        return path.read_text(encoding="utf-8")
    return start


def resolve(args: argparse.Namespace) -> None:
    """Fill in device and dtype `auto`, and check the values argparse cannot."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={args.device} but CUDA is not available; use --device=cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    if args.num_samples < 1 or args.batch_size < 1:
        raise ValueError(f"num_samples={args.num_samples} and batch_size={args.batch_size} must be >= 1")
    beams = args.num_beams > 1  # beam search scores the model's own probabilities: no temperature, no top-k
    if beams and args.num_samples > args.num_beams:
        raise ValueError(f"num_samples={args.num_samples} must be <= num_beams={args.num_beams}: the best beams are printed")
    if args.temperature is UNSET:
        args.temperature = 1.0 if beams else 0.8
    if args.top_k is UNSET:
        args.top_k = None if beams else 200


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings while text streams (e.g. the context window sliding): the text so far goes out first, then the
    warning on its own line of stderr, without Python's source-path prefix, so stdout holds only the text."""
    sys.stdout.flush()
    sys.stderr.write(f"\nsample.py: note: {message}\n")
    sys.stderr.flush()


def print_samples(model: GPT, tokenizer: Tokenizer, prompt: str, args: argparse.Namespace) -> None:
    """Sample `num_samples` continuations, `batch_size` at a time, the first of each batch streamed."""
    options = {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
        "stop": args.stop, "stop_at_eot": args.stop_at_eot, "extend_context": args.extend_context,
        "compile": args.compile, "generator": torch.Generator(device=args.device).manual_seed(args.seed),
    }
    for first in range(0, args.num_samples, args.batch_size):
        n = min(args.batch_size, args.num_samples - first)
        texts = [""] * n
        stream = generate_text(model, tokenizer, prompt, args.max_new_tokens, num_samples=n, **options)
        sys.stdout.write((SEPARATOR if first else "") + prompt)
        for pieces in stream:
            sys.stdout.write(pieces[0])
            sys.stdout.flush()
            texts = [t + p for t, p in zip(texts, pieces)]
        sys.stdout.write("\n" + "".join(SEPARATOR + prompt + text + "\n" for text in texts[1:]))


def print_beams(model: GPT, tokenizer: Tokenizer, prompt: str, args: argparse.Namespace) -> None:
    """The `num_samples` best continuations by beam search, best first, cut at the end-of-text token (if
    stop_at_eot) and before the first stop string."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
    stops = [tokenizer.eot_id] if args.stop_at_eot and tokenizer.eot_id is not None else []
    penalties = {"repetition_penalty": (args.repetition_penalty, 1.0), "frequency_penalty": (args.frequency_penalty, 0.0)}
    refused = {k: value for k, (value, off) in penalties.items() if value != off}  # generate says why
    rows = generate(model, [ids], args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    num_beams=args.num_beams, num_return_sequences=args.num_samples, length_penalty=args.length_penalty,
                    early_stopping=args.early_stopping, stop_tokens=stops, extend_context=args.extend_context,
                    compile=args.compile, **refused)
    texts = []
    for row in rows:
        new = row[len(ids) :]
        text = tokenizer.decode(new[:-1] if new and new[-1] in stops else new)
        cuts = [i for i in (text.find(s) for s in args.stop if s) if i >= 0]
        texts.append(text[: min(cuts)] if cuts else text)
    sys.stdout.write(SEPARATOR.join(prompt + text + "\n" for text in texts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the training run's directory (holds ckpt.pt)")
    parser.add_argument("--init_from", default="", help="sample from pretrained weights instead: gpt2, gpt2-medium, "
                        "gpt2-large, gpt2-xl or a Hugging Face directory (GPT-2 or Llama)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer.json, .tiktoken ranks file or tiktoken name "
                        "(default: the run's tokenizer.json; GPT-2's BPE with --init_from)")
    parser.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=UNSET, help="0 = greedy (default 0.8; 1 with --num_beams)")
    parser.add_argument("--top_k", type=optional(int), default=UNSET,
                        help="keep the k most likely tokens (None = all; default 200, None with --num_beams)")
    parser.add_argument("--top_p", type=optional(float), default=None, help="nucleus sampling threshold (None = off)")
    parser.add_argument("--repetition_penalty", type=float, default=1.0, help="CTRL's penalty on seen tokens (1 = off)")
    parser.add_argument("--frequency_penalty", type=float, default=0.0, help="subtracted per earlier occurrence (0 = off)")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams (1 = sample)")
    parser.add_argument("--length_penalty", type=float, default=1.0,
                        help="beam search: a hypothesis scores its log-probability / length ** length_penalty")
    parser.add_argument("--early_stopping", type=lambda s: s if s == "never" else boolean(s), default=False,
                        help="beam search: true, false (transformers' heuristic) or never")
    parser.add_argument("--stop", action="append", default=[], type=unescape,
                        help="stop a sample before this text (repeatable; backslash escapes such as \\n work)")
    parser.add_argument("--stop_at_eot", type=boolean, nargs="?", const=True, default=True,
                        help="stop a sample at the end-of-text token, if the tokenizer has one")
    parser.add_argument("--batch_size", type=int, default=8, help="samples generated together")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights' precision; auto = bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--compile", type=boolean, nargs="?", const=True, default=False,
                        help="torch.compile the decode step (CUDA graphs on CUDA, frozen weights on the CPU); "
                             "the first call compiles")
    parser.add_argument("--quantize", default="", choices=["", "int8"],
                        help="int8: weight-only int8 weights (a quarter of float32's bytes; fastest with --compile)")
    parser.add_argument("--extend_context", type=boolean, nargs="?", const=True, default=False,
                        help="sinusoidal or rope positions: run past block_size instead of sliding the window")
    args = parser.parse_args(argv)

    def body() -> int:
        warnings.showwarning = show_warning
        resolve(args)
        model, tokenizer = load_model(args.out_dir, args.init_from, args.tokenizer)
        model = model.to(args.device, getattr(torch, args.dtype)).eval()
        if args.quantize:
            model.quantize(args.quantize)
        prompt = read_prompt(args.start)
        (print_beams if args.num_beams > 1 else print_samples)(model, tokenizer, prompt, args)
        return 0

    return run_command("sample.py", body, "nothing to save")

if __name__ == "__main__":
    sys.exit(main())
