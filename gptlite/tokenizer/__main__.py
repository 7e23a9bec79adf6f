"""python -m gptlite.tokenizer train: a byte-level BPE trained on your corpus (see gptlite.tokenizer.trainer).

    python -m gptlite.tokenizer train --input FILES... --vocab_size N --out_dir DIR [--text_field text]
                                      [--max_chars N] [--overwrite]

--input takes what data/prepare.py takes (text files, folders, globs, URLs, JSONL and Parquet with --text_field),
read as a stream. DIR gets tokenizer.json and tokenizer_config.json (transformers' AutoTokenizer loads DIR), then:
    python data/prepare.py --input ... --tokenizer DIR --out_dir data/mine
An existing DIR/tokenizer.json is replaced only with --overwrite; an interrupted run writes nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gptlite.cli import parse, run_command
from gptlite.config import option
from gptlite.data.prepare.sources import START, check_sources, input_bytes, iter_pieces, piece_texts, resolve_sources
from gptlite.files import make_dir
from gptlite.tokenizer.trainer import check_vocab_size, chunks, hf_files, train_bpe, write_files


@dataclass(kw_only=True)
class TrainOptions:
    command: list[str] = option(default_factory=list, help="train", positional=True)
    input: list[str] = option(default_factory=list, help="text/.jsonl/.parquet files, directories, globs or URLs")
    vocab_size: int = option(help="ids in all: the 256 bytes, the special tokens and the merges (e.g. 8192)")
    out_dir: str = option(help="where tokenizer.json and tokenizer_config.json go")
    text_field: str = option("text", "the field (column) of JSONL and Parquet records that holds the text")
    max_chars: int | None = option(None, "read at most this many characters of the corpus")
    overwrite: bool = option(False, "replace an existing OUT_DIR/tokenizer.json")


def train(options: TrainOptions) -> int:
    if options.command != ["train"]:
        raise ValueError(
            f"unknown command {' '.join(options.command) or '(none)'}; use: python -m gptlite.tokenizer "
            "train --input FILES... --vocab_size N --out_dir DIR"
        )
    check_vocab_size(options.vocab_size)
    if not options.input:
        raise ValueError("no --input: give the text, JSONL or Parquet files, folders or globs to train on")
    if options.max_chars is not None and options.max_chars < 1:
        raise ValueError(f"max_chars={options.max_chars} must be >= 1")
    out = Path(options.out_dir)
    sources = resolve_sources(options.input, out / "downloads", None, None, "train")
    written = {(out / name).resolve() for name in ("tokenizer.json", "tokenizer_config.json")}
    for source in sources:
        if Path(source["path"]) in written:
            raise ValueError(
                f"input {source['path']} is a file this command writes; train on the corpus, or choose "
                "another --out_dir"
            )
    check_sources(sources, options.text_field)
    total = input_bytes(sources, options.text_field)
    if not total:
        raise ValueError(f"the inputs ({', '.join(options.input)}) are empty; there is no text to train on")
    if (out / "tokenizer.json").exists() and not options.overwrite:
        raise FileExistsError(
            f"{out / 'tokenizer.json'} exists; choose another --out_dir or pass --overwrite to replace it"
        )
    start = time.perf_counter()
    texts = corpus(sources, options.text_field, total)
    tokenizer = train_bpe(chunks(texts, options.max_chars), options.vocab_size)
    make_dir(out, "out_dir")
    write_files(out, hf_files(tokenizer))
    print(
        f"trained a byte-level BPE of {tokenizer.vocab_size:,} ids on {total / 1e6:.1f} MB in "
        f"{time.perf_counter() - start:.1f} s: wrote {out / 'tokenizer.json'} and tokenizer_config.json"
    )
    return 0


def corpus(sources: list[dict], text_field: str, total: int) -> Iterator[str]:
    """Every document's text, read piece by piece (bounded memory), with a progress bar over the input's bytes."""
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="reading", dynamic_ncols=True, file=sys.stderr) as bar:
        for piece in iter_pieces(sources, START, 0.5, text_field):  # (val_fraction only moves text blocks' ends)
            for text, _ in piece_texts(piece.kind, piece.data, piece.origin, text_field):
                yield text
            bar.update(piece.n_bytes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "gptlite.tokenizer",
        lambda: train(parse(TrainOptions, argv, "python -m gptlite.tokenizer", __doc__)),
        "nothing was written",
    )


if __name__ == "__main__":
    sys.exit(main())
