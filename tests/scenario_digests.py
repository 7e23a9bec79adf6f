"""Digests of what train.py writes in the scenarios a refactor must leave as they were: text, resume, the weight
average (EMA, also resumed past the end where it saved its trained weights), chat, LoRA, DPO, RL, refusals and
FSDP on two processes. Run it before and after a change; every line must stay the same.

    python -m tests.scenario_digests [--fsdp=false]

Each scenario runs train.py on a tiny model in a folder of its own (paths relative to it), and prints the sha256
of its log (the command's output, without the times and rates that differ from run to run), of its metrics.jsonl
(without its time fields) and of every checkpoint's contents (each tensor's dtype, shape and bytes, and every other
value, by name; the run's command line and git commit left out, and the fingerprint of its data, whose manifest
records when it was prepared).
"""

import contextlib
import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # one thread, in this process and the torchrun ones: sums round alike

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--vocab_size=128",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=8",
    "--learning_rate=3e-3",
    "--min_lr=3e-4",
    "--warmup_iters=3",
    "--eval_iters=2",
    "--log_interval=1",
    "--device=cpu",
    "--keep_last=10",
]
TIMES = re.compile(r" \| +[\d.]+ ms/step \| +\d+ tok/s \| mfu \S+| \| peak memory .*$", re.M)
LIBRARY_NAME = re.compile(r"matvec-[0-9a-f]+\.so")
STILL_COMPILING = re.compile(r"^gptlite: still compiling the CPU decode kernels \(\d+ s\)\n", re.M)
TIME_FIELDS = ("ms_per_step", "tokens_per_s", "mfu")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def train(*args: str) -> str:
    """`python train.py ARGS` in this process (tests/conftest.py's run_train); its output, then its errors."""
    from tests.conftest import run_train

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run = run_train(*args)
    return run.out + run.err + f"exit {run.code}\n"


def flat(value, name: str = ""):
    """(name, value) for every leaf of a checkpoint's nested dicts, lists and tuples."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from flat(value[key], f"{name}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flat(item, f"{name}/{i}")
    else:
        yield name, value


def checkpoint_digest(path: Path, other_processes: bool) -> str:
    """The digest of a checkpoint's contents. `other_processes`: it was written by processes of their own (torchrun),
    whose python and numpy generators were seeded from the OS as each started (train.py does not seed them), so
    their states are left out."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    digest = hashlib.sha256()
    for name, value in flat(ckpt):
        if name in ("/meta/command", "/meta/git_commit", "/data/data"):  # the last: prepare's manifest has its time
            continue
        if other_processes and re.fullmatch(r"/rng/\d+/(python|numpy)/.*", name):
            continue
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype} {tuple(value.shape)}".encode())
            digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def digests(name: str, log: str, run: Path, other_processes: bool) -> list[str]:
    # the tests' private cache (tests/conftest.py) is a new temporary folder each run: its name is left out, and so
    # are the progress lines of the kernels' first build, whose count follows how long the compiler took, and the
    # built library's name, a hash of the kernels' source (a change to matvec.cpp renames it, not what a run does)
    log = log.replace(os.environ["GPTLITE_TEST_CACHE"], "GPTLITE_TEST_CACHE")
    log = STILL_COMPILING.sub("", log)
    log = LIBRARY_NAME.sub("matvec-HASH.so", log)
    lines = [f"{name} log {sha(TIMES.sub('', log).encode())}"]
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        rows = [{k: v for k, v in row.items() if k not in TIME_FIELDS} for row in rows]
        lines.append(f"{name} metrics {sha(json.dumps(rows).encode())}")
    for path in sorted(run.glob("ckpt_*.pt")):
        lines.append(f"{name} {path.name} {checkpoint_digest(path, other_processes)}")
    return lines


def text_data(folder: Path) -> Path:
    from tests.test_train import write_corpus

    return write_corpus(folder / "data")


def scenarios(fsdp: bool):
    """(name, the runs: each a list of train.py's arguments, the run folder)"""
    from gptlite.data.prepare import prepare
    from gptlite.data.prepare.preference import prepare_preference
    from gptlite.hf import export_hf
    from tests.test_hf import CHARS, hf_llama
    from tests.tokenizer.test_chat import write_chats
    from tests.train.test_preference import digits_pairs
    from tests.train.test_preference import write_jsonl as write_pairs
    from tests.train.test_rl import digit_prompts, teach_format
    from tests.train.test_rl import write_jsonl as write_prompts

    text_data(Path.cwd())
    text = ["--data_dir=data", *TINY]
    yield "text", [[*text, "--out_dir=text", "--max_iters=6", "--eval_interval=3", "--dropout=0.1"]]
    yield (
        "resume",
        [
            [*text, "--out_dir=resume", "--max_iters=3", "--eval_interval=3", "--dropout=0.1", "--lr_decay_iters=6"],
            ["--out_dir=resume", "--resume", "--max_iters=6"],
        ],
    )
    yield (
        "ema",
        [
            [*text, "--out_dir=ema", "--max_iters=4", "--eval_interval=2", "--ema_decay=0.9", "--lr_decay_iters=6"],
            ["--out_dir=ema", "--resume", "--max_iters=6"],  # from the trained weights saved beside the average
        ],
    )

    write_chats(Path("chats.jsonl"), 40)
    prepare(["chats.jsonl"], "byte", Path("chat_data"), chat=True, block_size=64, log=lambda *a: None)
    chat = ["--data_dir=chat_data", *TINY, "--vocab_size=258", "--block_size=64", "--batch_size=4"]
    yield "chat", [[*chat, "--out_dir=chat", "--max_iters=4", "--eval_interval=2"]]

    hf_llama().save_pretrained("llama")
    Path("chars.txt").write_text(CHARS * 300)
    prepare(["chars.txt"], "char", Path("char_data"), log=lambda *a: None)
    lora = [
        "--init_from=llama",
        "--data_dir=char_data",
        "--lora_rank=4",
        "--lora_alpha=8",
        "--block_size=32",
        "--batch_size=4",
        "--learning_rate=1e-2",
        "--warmup_iters=2",
        "--eval_iters=2",
        "--log_interval=1",
        "--device=cpu",
        "--lr_decay_iters=6",
    ]
    yield (
        "lora",
        [
            [*lora, "--out_dir=lora", "--max_iters=4", "--eval_interval=2"],
            ["--out_dir=lora", "--resume", "--max_iters=6"],
        ],
    )

    write_pairs(Path("pairs.jsonl"), digits_pairs(100))
    prepare_preference(["pairs.jsonl"], "byte", Path("pair_data"), block_size=32, log=lambda *a: None)
    hf_llama(vocab_size=256).save_pretrained("llama256")
    dpo = [
        "--init_from=llama256",
        "--data_dir=pair_data",
        "--block_size=32",
        "--batch_size=4",
        "--learning_rate=1e-2",
        "--warmup_iters=2",
        "--eval_iters=2",
        "--log_interval=1",
        "--lr_decay_iters=6",
        "--device=cpu",
    ]
    yield (
        "dpo",
        [
            [*dpo, "--out_dir=dpo", "--max_iters=3", "--eval_interval=3"],
            ["--out_dir=dpo", "--resume", "--max_iters=6"],
        ],
    )
    yield "dpo_lora", [[*dpo, "--out_dir=dpo_lora", "--max_iters=3", "--eval_interval=3", "--lora_rank=4"]]

    export_hf(teach_format(20), Path("sft"))
    corpus = "".join(f"{r['prompt']}{r['answer']}\n" for r in digit_prompts(100, seed=3))
    Path("digits.txt").write_text(corpus)
    prepare(["digits.txt"], "char", Path("digit_data"), log=lambda *a: None)
    write_prompts(Path("prompts.jsonl"), digit_prompts(200, seed=1))
    rl = [
        "--init_from=sft",
        "--data_dir=digit_data",
        "--rl=true",
        "--rl_prompts=prompts.jsonl",
        "--reward=exact",
        "--rl_samples=4",
        "--rl_max_new_tokens=4",
        "--batch_size=4",
        "--block_size=16",
        "--learning_rate=1e-3",
        "--warmup_iters=0",
        "--eval_iters=1",
        "--log_interval=1",
        "--device=cpu",
    ]
    yield (
        "rl",
        [
            [*rl, "--out_dir=rl", "--max_iters=2", "--eval_interval=2"],
            [*rl, "--out_dir=rl", "--max_iters=4", "--eval_interval=2", "--resume"],
        ],
    )
    yield "grpo_lora", [[*rl, "--out_dir=grpo_lora", "--max_iters=2", "--rl_loss=grpo", "--lora_rank=4"]]

    yield (
        "refusals",
        [
            ["--out_dir=text", "--resume", "--data_dir=chat_data"],  # another kind of data
            [*text, "--out_dir=text"],  # a fresh run into a finished run's folder
            ["--out_dir=lora", "--resume", "--lora_rank=8"],  # other adapters
            [*text, "--out_dir=refused", "--ema_decay=1.5"],
        ],
    )
    if fsdp:
        yield "fsdp", [[*text, "--out_dir=fsdp", "--max_iters=4", "--eval_interval=2", "--batch_size=4", "--fsdp=true"]]


def torchrun(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")]
        + list(args),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return result.stdout + f"exit {result.returncode}\n"


@dataclass
class Options:
    fsdp: bool = option(True, "run the two-process FSDP scenario too")


def main() -> int:
    return run_command(
        "scenario_digests", lambda: print_digests(parse(Options, sys.argv[1:], "tests/scenario_digests.py", __doc__))
    )


def print_digests(options: Options) -> int:
    torch.set_num_threads(1)
    random.seed(0)  # the generators a checkpoint saves that train.py does not seed: the same in every process
    np.random.seed(0)
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        for name, runs in scenarios(options.fsdp):
            log = "".join((torchrun if name == "fsdp" else train)(*args) for args in runs)
            run = Path(next((a.split("=", 1)[1] for a in runs[0] if a.startswith("--out_dir=")), name))
            for line in digests(name, log, run, other_processes=name == "fsdp"):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
