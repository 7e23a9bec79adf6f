"""Prepare any corpus: text, JSONL or Parquet files, directories, globs, URLs, or a Hugging Face dataset ->
train/val token shards + tokenizer.json + manifest.json.

    python data/prepare.py --input PATH_OR_URL [more ...] --tokenizer SPEC --out_dir DIR [--val_fraction F]
    python data/prepare.py --input 'dump/*.jsonl' --text_field content --tokenizer gpt2 --out_dir DIR
    python data/prepare.py --hf_dataset HuggingFaceFW/fineweb-edu --hf_name sample-10BT --tokenizer gpt2 --out_dir DIR
    python data/prepare.py --verify --out_dir DIR          # check DIR's shards against its manifest

SPEC: byte | char | a tiktoken encoding name (gpt2, cl100k_base, o200k_base, ...) | path/to/ranks.tiktoken
Interrupted? Run the same command again: it continues where it stopped (--overwrite starts afresh).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gptlite.cli import run_command  # noqa: E402
from gptlite.prepare import SHARD_TOKENS, prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[], help="text/.jsonl/.parquet files, directories, globs or URLs")
    parser.add_argument("--tokenizer", default="gpt2", help="byte, char, a tiktoken name or a .tiktoken file")
    parser.add_argument("--out_dir", required=True, help="where the shards, tokenizer.json and manifest.json go")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="validation share: of the text's bytes (its end), or every 1/F-th record")
    parser.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument("--text_field", default="text", help="the field (column) of JSONL, Parquet and Hugging Face records that holds the text")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: one per core)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token type in the shards")
    parser.add_argument("--hf_dataset", help="a Hugging Face dataset to stream (needs pip install -e '.[data]')")
    parser.add_argument("--hf_name", help="its configuration, e.g. sample-10BT")
    parser.add_argument("--hf_split", default="train", help="its split to read (default: train)")
    parser.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir is complete or half done")
    parser.add_argument("--verify", action="store_true", help="only check out_dir's shards against its manifest.json")
    args = parser.parse_args(argv)
    if not args.input and not args.hf_dataset and not args.verify:
        parser.error("give --input files or --hf_dataset (or --verify)")

    def body() -> int:
        if args.verify:
            from gptlite.shards import verify_manifest

            manifest = verify_manifest(args.out_dir)
            print(f"{args.out_dir}: {len(manifest['shards'])} shards match manifest.json")
            return 0
        prepare(
            args.input, args.tokenizer, args.out_dir, args.val_fraction, args.shard_tokens, args.overwrite,
            text_field=args.text_field, workers=args.workers, dtype=args.dtype,
            hf_dataset=args.hf_dataset, hf_name=args.hf_name, hf_split=args.hf_split,
        )
        return 0

    return run_command("prepare.py", body, f"run the same command again to continue in {args.out_dir}")

if __name__ == "__main__":
    sys.exit(main())
