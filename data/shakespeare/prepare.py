"""Tiny Shakespeare (1.1 MB of plays): download it, or use a local copy, and tokenize it.

    python data/shakespeare/prepare.py                       # char-level -> data/shakespeare_char
    python data/shakespeare/prepare.py --tokenizer=gpt2      # GPT-2 BPE  -> data/shakespeare_gpt2
    python data/shakespeare/prepare.py --input=tinyshakespeare.txt --tokenizer=path/to/gpt2.tiktoken

The split is the standard one: the first 90% of the text trains, the last 10% validates.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite.cli import run_command  # noqa: E402
from gptlite.prepare import download, prepare  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="a local copy of tinyshakespeare.txt (skips the download)")
    parser.add_argument("--tokenizer", default="char", help="char, byte, gpt2 or a .tiktoken ranks file")
    parser.add_argument("--out_dir", help="default: data/shakespeare_<tokenizer>")
    args = parser.parse_args(argv)
    name = "gpt2" if args.tokenizer.endswith(".tiktoken") else args.tokenizer
    out_dir = Path(args.out_dir or ROOT / "data" / f"shakespeare_{name}")

    def body() -> int:
        source = Path(args.input) if args.input else download(URL, ROOT / "data" / "shakespeare" / "input.txt")
        prepare([str(source)], args.tokenizer, out_dir, val_fraction=0.1)
        return 0

    return run_command("shakespeare/prepare.py", body, f"run it again to continue in {out_dir}")

if __name__ == "__main__":
    sys.exit(main())
