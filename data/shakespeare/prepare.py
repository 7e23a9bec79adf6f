"""Tiny Shakespeare (1.1 MB of plays): download it, or use a local copy, and tokenize it.

    python data/shakespeare/prepare.py                       # char-level -> data/shakespeare_char
    python data/shakespeare/prepare.py --tokenizer=gpt2      # GPT-2 BPE  -> data/shakespeare_gpt2
    python data/shakespeare/prepare.py --input=tinyshakespeare.txt --tokenizer=path/to/gpt2.tiktoken

The split is the standard one: the first 90% of the text trains, the last 10% validates.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.data.download import download  # noqa: E402
from gptlite.data.prepare import prepare  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


@dataclass
class ShakespeareOptions:
    input: str = option("", "a local copy of tinyshakespeare.txt (skips the download)")
    tokenizer: str = option("char", "char, byte, gpt2 or a .tiktoken ranks file")
    out_dir: str = option("", "default: data/shakespeare_<tokenizer>")


def run(args: ShakespeareOptions) -> int:
    name = "gpt2" if args.tokenizer.endswith(".tiktoken") else args.tokenizer
    out_dir = Path(args.out_dir or ROOT / "data" / f"shakespeare_{name}")
    if args.input:
        source = Path(args.input)
    else:
        try:
            source = download(URL, ROOT / "data" / "shakespeare" / "input.txt")
        except ConnectionError as e:
            raise ConnectionError(f"{e} with --input=PATH") from None
    prepare([str(source)], args.tokenizer, out_dir, val_fraction=0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "shakespeare/prepare.py",
        lambda: run(parse(ShakespeareOptions, argv, "data/shakespeare/prepare.py", __doc__)),
        "run it again to continue where it stopped",
    )


if __name__ == "__main__":
    sys.exit(main())
