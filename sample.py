"""Generate text from a trained checkpoint or pretrained weights, streaming tokens to stdout as they are produced.

    python sample.py --model=RUN [--start=TEXT | --start=FILE:prompt.txt] [--num_samples=3]
    python sample.py --model=gpt2 [--tokenizer=gpt2.tiktoken] [--start=TEXT] ...   # no training needed
    python sample.py --model=RUN --num_beams=4 [--num_samples=2] [--length_penalty=1.0]  # beam search
    python sample.py --model=RUN --chat [--system=TEXT]     # a conversation: a user turn per line of stdin
                     [--max_new_tokens=500] [--temperature=0.8] [--top_k=200] [--top_p=None]
                     [--repetition_penalty=1.0] [--frequency_penalty=0.0] [--stop=STRING ...]
                     [--stop_at_eot=true] [--batch_size=8] [--seed=1337] [--device=auto] [--dtype=auto]
                     [--compile=false] [--quantize=int8|int4] [--extend_context=false]

--model names a training run's folder (default: out, train.py's), a Hugging Face directory (GPT-2, Llama, Mistral,
Qwen2, Qwen3) or a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl); --out_dir and --init_from, its old
spellings, still work.

Samples are generated `batch_size` at a time and share the prompt's prefill. The first sample of each
batch is printed token by token as it is generated; the others are printed when their batch is done.
With --num_beams the `num_samples` best beams are printed when the search ends (see gptlite.inference.beam), and a note
where they share most of their text.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gptlite.checkpoint import open_model
from gptlite.cli import MODEL_KINDS, ModelOptions, model_to_read, parse, reworded, run_command
from gptlite.config import TrainConfig, option, parse_bool
from gptlite.device import pick_device, pick_dtype
from gptlite.gpt import GPT
from gptlite.inference.conversation import Conversation
from gptlite.inference.generate import generate_text_with, generate_with
from gptlite.inference.sampling import GenerationOptions, Sampling
from gptlite.tokenizer import Tokenizer

SEPARATOR = "-" * 40 + "\n"
DEFAULT_MODEL = TrainConfig.out_dir  # train.py's run folder, as in nanoGPT: `python sample.py` reads what it wrote


@dataclass
class SampleOptions(ModelOptions):
    model: str = reworded(
        ModelOptions,
        "model",
        f"the model to sample from: {MODEL_KINDS} (default: {DEFAULT_MODEL}, where train.py writes its run)",
    )
    compile: bool = reworded(
        ModelOptions,
        "compile",
        "torch.compile the decode step (CUDA graphs on CUDA, frozen weights on the CPU); the first call compiles",
    )
    quantize: str = reworded(
        ModelOptions,
        "quantize",
        "int8 or int4: weight-only quantized weights (a quarter or an eighth of float32's bytes; int4 on the CPU)",
    )
    start: str = option("\n", "prompt text, or FILE:path to read it from a file")
    num_samples: int = option(3, "samples to print (1 by default with --temperature=0: greedy text is always the same)")
    max_new_tokens: int = option(500, "tokens to generate per sample")
    temperature: float | None = option(None, "0 = greedy (default 0.8; 1 with --num_beams)")
    top_k: int | None = option(200, "keep the k most likely tokens (None = all; None by default with --num_beams)")
    top_p: float | None = option(None, "nucleus sampling threshold (None = off)")
    repetition_penalty: float = option(1.0, "CTRL's penalty on seen tokens (1 = off)")
    frequency_penalty: float = option(0.0, "subtracted per earlier occurrence (0 = off)")
    num_beams: int = option(1, "beam search with this many beams (1 = sample)")
    length_penalty: float = option(
        1.0, "beam search: a hypothesis scores its log-probability / length ** length_penalty"
    )
    early_stopping: str = option("false", "beam search: true, false (transformers' heuristic) or never")
    stop: list[str] = option(
        default_factory=list, help="stop a sample before this text (repeatable; backslash escapes such as \\n work)"
    )
    stop_at_eot: bool = option(True, "stop a sample at the end-of-text token, if the tokenizer has one")
    batch_size: int = option(8, "samples generated together")
    seed: int = option(1337, "the sampling seed")
    extend_context: bool = option(
        False, "sinusoidal or rope positions: run past block_size instead of sliding the window"
    )
    chat: bool = option(
        False,
        "hold a conversation: each line on stdin is a user turn, the reply streams to stdout; "
        "it ends at the end of input or Ctrl-C",
    )
    system: str = option("", "--chat: the system prompt")


def unescape(s: str) -> str:
    r"""Backslash escapes as in Python strings, so `--stop='\n\n'` stops at a blank line."""
    return s.encode("latin-1", "backslashreplace").decode("unicode_escape")


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} does not exist")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}); give a text file") from None
    return start


def resolve(args: SampleOptions) -> None:
    """Fill in device and dtype `auto` and the defaults that depend on --num_beams, and check the values the
    parser cannot."""
    args.device = pick_device(args.device)
    args.dtype = pick_dtype(args.dtype, args.device)
    if args.num_samples < 1 or args.batch_size < 1:
        raise ValueError(f"num_samples={args.num_samples} and batch_size={args.batch_size} must be >= 1")
    if args.num_beams < 1:
        raise ValueError(f"num_beams={args.num_beams} must be >= 1 (1 samples, more search that many beams)")
    given = getattr(args, "given", ())
    unused = [f"--{k}" for k in ("num_beams", "start", "stop", "num_samples", "batch_size") if k in given]
    if args.chat and unused:
        raise ValueError(
            f"--chat reads its prompts from stdin and samples one reply at a time; drop {', '.join(unused)}"
        )
    if args.system and not args.chat:
        raise ValueError("--system is the system prompt of a --chat conversation; add --chat, or put it in --start")
    if args.early_stopping.lower() == "never":
        args.early_stopping = "never"
    else:
        try:
            args.early_stopping = parse_bool("early_stopping", args.early_stopping)
        except ValueError:
            raise ValueError(f"early_stopping={args.early_stopping!r} must be true, false or never") from None
    args.stop = [unescape(s) for s in args.stop]
    beams = args.num_beams > 1  # beam search scores the model's own probabilities: no temperature, no top-k
    if beams and args.num_samples > args.num_beams:
        raise ValueError(
            f"num_samples={args.num_samples} must be <= num_beams={args.num_beams}: the best beams are printed"
        )
    if args.temperature is None:
        args.temperature = 1.0 if beams else 0.8
    if beams and "top_k" not in given:
        args.top_k = None
    if args.temperature == 0 and not beams and "num_samples" not in given:
        args.num_samples = 1  # greedy decoding writes the same text every time: one copy says it all


class Notes:
    """Warnings raised while text streams (e.g. the context window sliding), held until the text is out and then
    printed on stderr, a line each without Python's source-path prefix: after the text, never inside it, also
    where stdout and stderr share a terminal. `hold` is a warnings.showwarning."""

    def __init__(self):
        self.held: list[str] = []

    def hold(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.held.append(str(message))

    def print(self) -> None:
        sys.stdout.flush()
        for message in self.held:
            sys.stderr.write(f"sample.py: note: {message}\n")
        sys.stderr.flush()
        self.held = []


def generation_options(args: SampleOptions, tokenizer: Tokenizer) -> GenerationOptions:
    """The options of generation that sampling and beam search both read from the command's (each refuses those it
    does not take: beam search says why penalties cannot be used with it)."""
    return GenerationOptions(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        extend_context=args.extend_context,
        compile=args.compile,
        vocab_limit=tokenizer.vocab_size,
    )


def print_samples(model: GPT, tokenizer: Tokenizer, prompt: str, args: SampleOptions, notes: Notes) -> None:
    """Sample `num_samples` continuations, `batch_size` at a time, the first of each batch streamed."""
    options = generation_options(args, tokenizer)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    for first in range(0, args.num_samples, args.batch_size):
        n = min(args.batch_size, args.num_samples - first)
        texts = [""] * n
        stream = generate_text_with(
            model,
            tokenizer,
            prompt,
            args.max_new_tokens,
            replace(options, num_samples=n),
            stop=args.stop,
            stop_at_eot=args.stop_at_eot,
            generator=generator,
        )
        sys.stdout.write((SEPARATOR if first else "") + prompt)
        for pieces in stream:
            sys.stdout.write(pieces[0])
            sys.stdout.flush()
            texts = [t + p for t, p in zip(texts, pieces, strict=True)]
        sys.stdout.write("\n" + "".join(SEPARATOR + prompt + text + "\n" for text in texts[1:]))
        notes.print()


def print_beams(model: GPT, tokenizer: Tokenizer, prompt: str, args: SampleOptions, notes: Notes) -> None:
    """The `num_samples` best continuations by beam search, best first, cut at the end-of-text token (if
    stop_at_eot) and before the first stop string."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
    stops = [tokenizer.eot_id] if args.stop_at_eot and tokenizer.eot_id is not None else []
    options = replace(
        generation_options(args, tokenizer),
        num_beams=args.num_beams,
        num_return_sequences=args.num_samples,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
        stop_tokens=stops,
    )
    rows = generate_with(model, [ids], args.max_new_tokens, options)
    texts = []
    for row in rows:
        new = row[len(ids) :]
        text = tokenizer.decode(new[:-1] if new and new[-1] in stops else new)
        cuts = [i for i in (text.find(s) for s in args.stop if s) if i >= 0]
        texts.append(text[: min(cuts)] if cuts else text)
    sys.stdout.write(SEPARATOR.join(prompt + text + "\n" for text in texts))
    note = alike_beams_note(texts)
    if note:
        notes.held.append(note)
    notes.print()


def alike_beams_note(texts: list[str]) -> str | None:
    """A note where the best beams' texts share more than half of the shortest (or are one text, from different
    tokens): beam search returns the likeliest continuations, which tend to part only near their end, and the user
    who asked for several may have wanted different ones."""
    if len(texts) < 2:
        return None
    shared = len(os.path.commonprefix(texts))
    if shared * 2 <= min(map(len, texts)):
        return None
    alike = "are the same text" if len(set(texts)) == 1 else f"share their first {shared:,} characters"
    return (
        f"the {len(texts)} best beams {alike}: beam search returns the likeliest continuations, which part little "
        "and late; for continuations that differ, sample (--num_beams=1, the default)"
    )


def chat(model: GPT, tokenizer: Tokenizer, args: SampleOptions, notes: Notes) -> int:
    """The conversation loop of --chat: a user turn per line of stdin, the reply streamed (see
    gptlite.inference.conversation)."""
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    conversation = Conversation(model, tokenizer, sampling, args.max_new_tokens, args.system, generator)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        for piece in conversation.reply(line.rstrip("\n")):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        notes.print()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = parse(SampleOptions, argv, "sample.py", __doc__)
        notes = Notes()
        warnings.showwarning = notes.hold
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch's own, inside compile
        args.model = model_to_read(args, "sample.py", default=DEFAULT_MODEL)
        resolve(args)
        model, tokenizer = open_model(
            args,
            "sample.py",
            after_loading=notes.print,  # what loading warned about comes before any text
            compiling="the first tokens wait while the decode step compiles (a minute or more on a CPU)",
        )
        if args.chat:
            return chat(model, tokenizer, args, notes)
        prompt = read_prompt(args.start)
        (print_beams if args.num_beams > 1 else print_samples)(model, tokenizer, prompt, args, notes)
        return 0

    return run_command("sample.py", body, "nothing to save")


if __name__ == "__main__":
    sys.exit(main())
