"""The server's prefix cache: time to first token of each turn of a chat under a long system prompt, with the cache
(`--prefix_cache_mb`) and without it (`--prefix_cache_mb=0`).

    python benchmarks/bench_prefix_cache.py                        # 1,500-token system prompt, 5 turns, 3 rounds
    python benchmarks/bench_prefix_cache.py --system_tokens=800 --turns=3 --rounds=2 --json=prefix.json

The model is GPT-2-124M's shape with random weights and GPT-2's tokenizer (bench_serve.py's run folder) with a
context of 2,048 (GPT-2's 1,024 does not hold the chat), served by `python -m gptlite.serve` in a process of its
own. GPT-2's tokenizer has no chat template, so the script renders each conversation as one prompt and sends it
to /v1/completions, as a chat template would render it for /v1/chat/completions. Each round holds one chat on each
server, the two servers in turn (never both at once): a system prompt of
`system_tokens` tokens, then `turns` user messages, each sent (streamed, greedy, `max_tokens` new tokens) with
every earlier turn and its reply, as a chat client sends them. A turn's time to first token is from sending its
request to its first text. The system prompt is the same in every round and the user messages differ, so a round's
later turns find in the cache what its own earlier turns left there. Prints each turn's min / median over the
rounds for both servers, and their ratio. This is a script that prints a table, not a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench_serve import GPT2_SHAPE, WORDS, start_server, stop_server  # noqa: E402

from gptlite import GPT  # noqa: E402
from gptlite.checkpoint import save_checkpoint  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import build_config, config_to_dict, option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402
from gptlite.tokenizer import get_tokenizer  # noqa: E402

CONTEXT = 2048
MODES = {"cached": 256, "uncached": 0}  # --prefix_cache_mb of each server


@dataclass
class BenchOptions:
    system_tokens: int = option(1500, "tokens of the system prompt")
    turns: int = option(5, "user turns in each chat")
    max_tokens: int = option(32, "tokens of each reply")
    rounds: int = option(3, "chats on each server (interleaved)")
    tokenizer: str = option("", "GPT-2's .tiktoken ranks file (default: ../shared/tokenizers/gpt2.tiktoken)")
    port: int = option(8766, "the servers' port")
    json: str = option("", "also write the results here")


def make_run(folder: Path, tokenizer: str) -> None:
    torch.manual_seed(0)
    cfg = build_config({**GPT2_SHAPE, "block_size": CONTEXT})
    save_checkpoint(folder / "ckpt.pt", {"config": config_to_dict(cfg), "model": GPT(cfg.model).state_dict()})
    get_tokenizer(tokenizer).save(folder / "tokenizer.json")


def system_prompt(tokens: int, tokenizer: str) -> str:
    """Words until the text is `tokens` tokens long in GPT-2's tokenizer."""
    encode = get_tokenizer(tokenizer).encode
    words = []
    while len(encode(" ".join(words))) < tokens:
        words.append(WORDS[(len(words) * 5) % len(WORDS)])
    return " ".join(words)


def user_message(round_: int, turn: int) -> str:
    """A question that no other round asks."""
    return f"Question {round_}.{turn}: " + " ".join(WORDS[(round_ * 11 + turn * 7 + j) % len(WORDS)] for j in range(12))


def render(messages: list[dict]) -> str:
    """A conversation as one prompt, each turn on lines of its own, ending where the assistant's reply begins (a
    chat template's job, done here because GPT-2's tokenizer has none)."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


def ask(url: str, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """The reply to a chat, streamed, and the seconds to its first text."""
    body = {"model": "bench", "prompt": render(messages), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            delta = choices[0]["text"] if choices else ""
            if delta and first is None:
                first = time.perf_counter() - start
            text += delta
    return text, first if first is not None else float("nan")


def chat(url: str, system: str, round_: int, options: BenchOptions) -> list[float]:
    """Each turn's time to first token in one chat."""
    messages = [{"role": "system", "content": system}]
    times = []
    for turn in range(options.turns):
        messages.append({"role": "user", "content": user_message(round_, turn)})
        reply, first = ask(url, messages, options.max_tokens)
        messages.append({"role": "assistant", "content": reply})
        times.append(first)
    return times


def mm(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f}"


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        options = parse(BenchOptions, sys.argv[1:] if argv is None else argv, "bench_prefix_cache.py", __doc__)
        print(machine_line(), flush=True)
        ranks = options.tokenizer or str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken")
        times = measure(options, ranks)
        print(table(options, times))
        if options.json:
            write_json(Path(options.json), {"first_token_s": times})
        return 0

    return run_command("bench_prefix_cache.py", body, "nothing was measured")


def measure(options: BenchOptions, ranks: str) -> dict[str, list[list[float]]]:
    """{mode: each turn's times to first token, one per round}, the two servers in turn, round after round."""
    system = system_prompt(options.system_tokens, ranks)
    url = f"http://127.0.0.1:{options.port}"
    times = {mode: [[] for _ in range(options.turns)] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        make_run(run, ranks)
        for r in range(options.rounds):
            for mode, megabytes in MODES.items():
                cmd = [
                    sys.executable,
                    "-m",
                    "gptlite.serve",
                    f"--model={run}",
                    "--model_name=bench",
                    f"--port={options.port}",
                    f"--prefix_cache_mb={megabytes}",
                    "--log_level=warning",
                ]
                server = start_server(cmd, options.port, Path(tmp) / f"{mode}.log")
                try:
                    ask(url, [{"role": "user", "content": "warm up"}], 4)
                    for turn, seconds in enumerate(chat(url, system, r, options)):
                        times[mode][turn].append(seconds)
                        print(f"round {r + 1} {mode:8s} turn {turn + 1}: first token {seconds:.3f} s", flush=True)
                finally:
                    stop_server(server)
    return times


def table(options: BenchOptions, times: dict[str, list[list[float]]]) -> str:
    lines = [
        f"\nsystem prompt of {options.system_tokens} tokens, replies of {options.max_tokens}; min / median (s)",
        "| turn | first token, cached (s) | first token, uncached (s) | uncached / cached |",
        "|---|---|---|---|",
    ]
    for turn in range(options.turns):
        cached, uncached = times["cached"][turn], times["uncached"][turn]
        ratio = statistics.median(uncached) / statistics.median(cached)
        lines.append(f"| {turn + 1} | {mm(cached)} | {mm(uncached)} | {ratio:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
