"""The inputs of docs/pipeline.md's toy run, written into data/pipeline/: a corpus to pretrain on (corpus.txt, tiny
Shakespeare) and sums in the formats the page's commands read, the same records every time (a seeded generator):

    chats.jsonl   conversations for SFT (data/prepare.py --chat): {"messages": [user's sum, assistant's answer]}
    pairs.jsonl   preference pairs for DPO (data/prepare.py --preference): {"prompt", "chosen", "rejected"}
    train.jsonl   prompts for RL (train.py --rl_prompts): {"prompt": [the user's message], "answer"}
    test.jsonl    prompts for evaluate --task=rl, sums that none of the other files holds

    python data/pipeline/inputs.py                                   # downloads tiny Shakespeare (1.1 MB) once
    python data/pipeline/inputs.py --shakespeare=tinyshakespeare.txt   # offline: a copy you have

Offline with no copy, corpus.txt is Python's own standard-library source (as scripts/quickstart.sh does), and the
command says so. A file already there is kept, never overwritten (delete it to write it afresh).
"""

import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.data.download import download  # noqa: E402
from gptlite.files import make_dir, write_text  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DOWNLOADED = ROOT / "data" / "shakespeare" / "input.txt"  # where data/shakespeare/prepare.py keeps its download
CORPUS_CHARS = 1_100_000  # the standard-library corpus is cut to tiny Shakespeare's size
LARGEST = 40  # the sums' terms run from 1 to LARGEST


@dataclass
class InputsOptions:
    shakespeare: str = option("", "a local copy of tinyshakespeare.txt (skips the download)")
    out_dir: str = option("data/pipeline", "where the five files go")
    records: int = option(400, "records in chats.jsonl, pairs.jsonl and train.jsonl each")
    test_records: int = option(40, "prompts in test.jsonl")


def corpus(shakespeare: str) -> tuple[str, str]:
    """The pretraining text and where it came from: tiny Shakespeare (the copy given, or downloaded), else Python's
    standard-library source."""
    if shakespeare:
        path = Path(shakespeare)
        if not path.is_file():
            raise FileNotFoundError(f"--shakespeare={shakespeare} does not exist; name a copy of tinyshakespeare.txt")
        return path.read_text(encoding="utf-8"), f"tiny Shakespeare from {path}"
    try:
        return download(URL, DOWNLOADED).read_text(encoding="utf-8"), "tiny Shakespeare"
    except ConnectionError:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = ""
        for path in sorted(stdlib.glob("*.py")):
            text += path.read_text(encoding="utf-8", errors="replace")
            if len(text) >= CORPUS_CHARS:
                break
        source = (
            f"Python's standard-library source ({stdlib}/*.py), since tiny Shakespeare could not be downloaded "
            "(--shakespeare=FILE names a copy you have)"
        )
        return text[:CORPUS_CHARS], source


def sums(records: int, test_records: int) -> dict[str, list[dict]]:
    """The four JSONL files' records: each a sum "What is A plus B?" of two terms in 1..LARGEST, answered by its
    digits; test.jsonl's sums are held out from the other three files."""
    every = [(a, b) for a in range(1, LARGEST + 1) for b in range(1, LARGEST + 1)]
    if records < 1 or test_records < 1 or test_records >= len(every):
        raise ValueError(
            f"--records={records} and --test_records={test_records}: each must be at least 1, and test_records "
            f"below {len(every)} (the sums there are)"
        )
    rng = random.Random(0)
    rng.shuffle(every)
    held_out = every[:test_records]
    seen = every[test_records:]

    def question(a: int, b: int) -> str:
        return f"What is {a} plus {b}?"

    chats = []
    pairs = []
    train = []
    for _ in range(records):
        a, b = rng.choice(seen)
        user, answer = question(a, b), str(a + b)
        chats.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
        a, b = rng.choice(seen)
        wrong = str(a + b + rng.choice((-2, -1, 1, 2)))  # a near miss: the pair differs in the answer alone
        pairs.append({"prompt": question(a, b), "chosen": str(a + b), "rejected": wrong})
        a, b = rng.choice(seen)
        train.append({"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)})
    test = [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)} for a, b in held_out]
    return {"chats.jsonl": chats, "pairs.jsonl": pairs, "train.jsonl": train, "test.jsonl": test}


def run(args: InputsOptions) -> int:
    out_dir = make_dir(args.out_dir)
    records = sums(args.records, args.test_records)  # checks the counts before anything is written
    for name in ("corpus.txt", *records):
        path = out_dir / name
        if path.exists():
            print(f"kept {path}, already there (delete it to write it afresh)")
        elif name == "corpus.txt":
            text, source = corpus(args.shakespeare)
            write_text(path, text)
            print(f"wrote {path}: {source}, {len(text):,} characters")
        else:
            write_text(path, "".join(json.dumps(record) + "\n" for record in records[name]))
            print(f"wrote {path}: {len(records[name])} records")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "pipeline/inputs.py",
        lambda: run(parse(InputsOptions, argv, "data/pipeline/inputs.py", __doc__)),
        "run it again: it keeps the files already written",
    )


if __name__ == "__main__":
    sys.exit(main())
