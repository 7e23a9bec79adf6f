"""Download ready-made GPT-2 token shards of FineWeb (llm.c's format, 100M tokens each), the files that
modded-nanogpt trains on, so training can start without tokenizing. Needs pip install -e '.[data]'.

    python data/fineweb/download.py                            # val + 8 train shards -> data/fineweb10B
    python data/fineweb/download.py --train_shards 103         # all of FineWeb 10B (~20 GB)
    python data/fineweb/download.py --dataset finewebedu10B    # FineWeb-Edu 10B (up to 99 train shards)

Run it again after an interruption: finished files are kept. Then train with --data_dir=data/fineweb10B.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite.cli import run_command  # noqa: E402
from gptlite.prepare import TOKEN_SHARDS, download_token_shards  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fineweb10B", choices=list(TOKEN_SHARDS))
    parser.add_argument("--train_shards", type=int, default=8, help="train shards of 100M tokens (modded-nanogpt's speedrun uses 8)")
    parser.add_argument("--out_dir", help="default: data/<dataset>")
    parser.add_argument("--tokenizer", default="gpt2", help="written as tokenizer.json: gpt2, or a local gpt2.tiktoken offline")
    parser.add_argument("--revision", help="a commit of the Hugging Face repository, to pin the data")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir or ROOT / "data" / args.dataset)

    def body() -> int:
        download_token_shards(args.dataset, out_dir, args.train_shards, args.tokenizer, args.revision)
        return 0

    return run_command("fineweb/download.py", body, f"finished files are kept: run it again to continue in {out_dir}")

if __name__ == "__main__":
    sys.exit(main())
