"""Prepare any text corpus: files, directories, globs or URLs -> train/val token shards + tokenizer.json.

    python data/prepare.py --input PATH_OR_URL [more ...] --tokenizer SPEC --out_dir DIR [--val_fraction F]

SPEC: byte | char | a tiktoken encoding name (gpt2, cl100k_base, o200k_base, ...) | path/to/ranks.tiktoken
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gptlite.prepare import prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text files, directories, globs or URLs")
    parser.add_argument("--tokenizer", default="gpt2", help="byte, char, a tiktoken name or a .tiktoken file")
    parser.add_argument("--out_dir", required=True, help="where the shards and tokenizer.json go")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="last fraction of the corpus kept for validation")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard file")
    parser.add_argument("--overwrite", action="store_true", help="prepare again even if out_dir is complete")
    args = parser.parse_args(argv)
    try:
        prepare(args.input, args.tokenizer, args.out_dir, args.val_fraction, args.shard_tokens, args.overwrite)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
