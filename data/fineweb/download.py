"""Download ready-made GPT-2 token shards of FineWeb (llm.c's format, 100M tokens each), the files that
modded-nanogpt trains on, so training can start without tokenizing. Needs pip install -e '.[data]'.

    python data/fineweb/download.py                            # val + 8 train shards -> data/fineweb10B
    python data/fineweb/download.py --train_shards 103         # all of FineWeb 10B (~20 GB)
    python data/fineweb/download.py --dataset finewebedu10B    # FineWeb-Edu 10B (up to 99 train shards)

Run it again after an interruption: finished files are kept. Then train with --data_dir=data/fineweb10B.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.data.download import TOKEN_SHARDS, download_token_shards  # noqa: E402


@dataclass
class DownloadOptions:
    dataset: str = option("fineweb10B", "the token-shard dataset", choices=tuple(TOKEN_SHARDS))
    train_shards: int = option(8, "train shards of 100M tokens (modded-nanogpt's speedrun uses 8)")
    out_dir: str = option("", "default: data/<dataset>")
    tokenizer: str = option("gpt2", "written as tokenizer.json: gpt2, or a local gpt2.tiktoken offline")
    revision: str | None = option(None, "a commit of the Hugging Face repository, to pin the data")


def run(args: DownloadOptions) -> int:
    out_dir = Path(args.out_dir or ROOT / "data" / args.dataset)
    download_token_shards(args.dataset, out_dir, args.train_shards, args.tokenizer, args.revision)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "fineweb/download.py",
        lambda: run(parse(DownloadOptions, argv, "data/fineweb/download.py", __doc__)),
        "finished files are kept: run it again to continue",
    )


if __name__ == "__main__":
    sys.exit(main())
