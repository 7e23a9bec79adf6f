"""Prepare any corpus: text, JSONL or Parquet files, directories, globs, URLs, or a Hugging Face dataset ->
train/val token shards + tokenizer.json + manifest.json.

    python data/prepare.py --input PATH_OR_URL [more ...] --tokenizer SPEC --out_dir DIR [--val_fraction F]
    python data/prepare.py --input 'dump/*.jsonl' --text_field content --tokenizer gpt2 --out_dir DIR
    python data/prepare.py --hf_dataset HuggingFaceFW/fineweb-edu --hf_name sample-10BT --tokenizer gpt2 --out_dir DIR
    python data/prepare.py --input chats.jsonl --chat --tokenizer DIR --out_dir DIR2 # conversations {"messages": [...]}
    python data/prepare.py --input pairs.jsonl --preference --tokenizer DIR --block_size 1024 --out_dir DIR3
        # preference pairs {"prompt": ..., "chosen": ..., "rejected": ...} for DPO (train.py trains on them with DPO)
    python data/prepare.py --verify --out_dir DIR          # check DIR's shards against its manifest

SPEC: byte | char | a tiktoken encoding name (gpt2, cl100k_base, o200k_base, ...) | path/to/ranks.tiktoken
Interrupted? Run the same command again: it continues where it stopped (--overwrite starts afresh).
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.data.prepare import SHARD_TOKENS, prepare  # noqa: E402
from gptlite.data.prepare.preference import prepare_preference  # noqa: E402


@dataclass
class PrepareOptions:
    input: list[str] = option(default_factory=list, help="text/.jsonl/.parquet files, directories, globs or URLs")
    tokenizer: str = option("gpt2", "byte, char, a tiktoken name or a .tiktoken file")
    out_dir: str = option("", "where the shards, tokenizer.json and manifest.json go (required)")
    val_fraction: float = option(0.1, "validation share: of the text's bytes (its end), or every 1/F-th record")
    shard_tokens: int = option(SHARD_TOKENS, "tokens per shard file")
    text_field: str = option(
        "text", "the field (column) of JSONL, Parquet and Hugging Face records that holds the text"
    )
    workers: int | None = option(None, "tokenizing processes (default: one per core)")
    dtype: str = option("auto", "token type in the shards", choices=("auto", "uint16", "uint32"))
    hf_dataset: str | None = option(None, "a Hugging Face dataset to stream (needs pip install -e '.[data]')")
    hf_name: str | None = option(None, "its configuration, e.g. sample-10BT")
    hf_split: str = option("train", "its split to read")
    chat: bool = option(
        False,
        "records hold conversations (--messages_field): render them with the tokenizer's chat "
        "template and train on the assistant's turns only",
    )
    messages_field: str = option(
        "messages", "--chat: the field of a record that holds its list of {role, content} messages"
    )
    preference: bool = option(
        False,
        "records hold a prompt and a chosen and a rejected answer (text or messages, TRL's fields) for DPO; "
        "a record without them is an error, a pair with identical answers or a prompt that fills block_size is "
        "dropped and counted, an answer too long for block_size is cut (see gptlite/data/prepare/preference.py)",
    )
    prompt_field: str = option("prompt", "--preference: the field that holds the prompt (text or messages)")
    chosen_field: str = option("chosen", "--preference: the field that holds the chosen answer")
    rejected_field: str = option("rejected", "--preference: the field that holds the rejected answer")
    block_size: int = option(
        0,
        "--chat: a conversation longer than block_size + 1 tokens is cut or dropped; --preference: the training "
        "window, which answers are cut to (0: no limit)",
    )
    too_long: str = option(
        "drop", "--chat: what happens to a conversation longer than block_size", choices=("drop", "cut")
    )
    overwrite: bool = option(False, "start afresh even if out_dir is complete or half done")
    verify: bool = option(False, "only check out_dir's shards against its manifest.json")


def run(args: PrepareOptions) -> int:
    if not args.out_dir:
        raise ValueError("--out_dir is required: the folder the shards go to")
    if not args.input and not args.hf_dataset and not args.verify:
        raise ValueError("give --input files or --hf_dataset (or --verify)")
    if args.verify:
        from gptlite.data.shards import verify_manifest

        manifest = verify_manifest(args.out_dir)
        print(f"{args.out_dir}: {len(manifest['shards'])} shards match manifest.json")
        return 0
    if args.preference:
        if args.chat or args.hf_dataset:
            raise ValueError("--preference reads local JSONL or Parquet files: leave out --chat and --hf_dataset")
        prepare_preference(
            args.input,
            args.tokenizer,
            args.out_dir,
            args.val_fraction,
            args.shard_tokens,
            args.overwrite,
            fields=(args.prompt_field, args.chosen_field, args.rejected_field),
            block_size=args.block_size,
            dtype=args.dtype,
        )
        return 0
    prepare(
        args.input,
        args.tokenizer,
        args.out_dir,
        args.val_fraction,
        args.shard_tokens,
        args.overwrite,
        text_field=args.text_field,
        workers=args.workers,
        dtype=args.dtype,
        hf_dataset=args.hf_dataset,
        hf_name=args.hf_name,
        hf_split=args.hf_split,
        chat=args.chat,
        messages_field=args.messages_field,
        block_size=args.block_size,
        too_long=args.too_long,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parsed: list[PrepareOptions] = []

    def body() -> int:
        parsed.append(parse(PrepareOptions, argv, "data/prepare.py", __doc__))
        return run(parsed[0])

    return run_command(
        "prepare.py",
        body,
        lambda: "run the same command again to continue in " + (parsed[0].out_dir if parsed else "its out_dir"),
    )


if __name__ == "__main__":
    sys.exit(main())
