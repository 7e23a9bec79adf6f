"""docs/pipeline.md's commands "at toy size, on a CPU", run as written, one after the other in one folder, each
stage on the last one's run folder, shrunk by the one rule the page states: every `--max_iters=N` is
`--max_iters=2`, `--vocab_size 8192` is `--vocab_size 512`, the files the commands read hold 100 KB of tiny
Shakespeare (corpus.txt) and a few dozen records (chats.jsonl, pairs.jsonl, train.jsonl, test.jsonl), and the
server listens on a free port. A command of the page that fails as written (RL's options against its block_size)
fails here; tests/test_pipeline.py checks the hand-offs between the stages."""

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import ROOT, shared_file
from tests.serving import free_port
from tests.test_pipeline import sums, write_jsonl
from tests.test_readme import argv, bash_lines

PAGE = (ROOT / "docs" / "pipeline.md").read_text()
TOY = PAGE.split("## At toy size, on a CPU (minutes)")[1].split("\n## ")[0]


def shrunk(command: str) -> str:
    """The page's command at the test's size (see the module docstring)."""
    command = re.sub(r"--max_iters=\d+", "--max_iters=2", command)
    return command.replace("--vocab_size 8192", "--vocab_size 512")


def write_records(root) -> None:
    """The files the page's commands read, in the formats its "Records" paragraph gives."""
    (root / "corpus.txt").write_text(shared_file("data/tinyshakespeare.txt").read_text()[:100_000])
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in sums(60, 0)
    ]
    write_jsonl(root / "chats.jsonl", chats)
    write_jsonl(root / "pairs.jsonl", [{"prompt": q, "chosen": a, "rejected": f"{a}0"} for q, a in sums(60, 1)])
    prompts = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in sums(32, 2)]
    write_jsonl(root / "train.jsonl", prompts[:20])
    write_jsonl(root / "test.jsonl", prompts[20:])


def serve(command: str, root) -> str:
    """Start the page's server command on a free port, ask it one chat question as a client would, stop it with
    SIGTERM; its reply."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([*argv(command), f"--port={port}"], cwd=root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "rl", "messages": [{"role": "user", "content": "What is 3 plus 4?"}], "max_tokens": 8}
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    reply = json.loads(response.read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            log, _ = process.communicate(timeout=30)
        finally:
            process.kill()
    assert "Traceback" not in log, log
    return reply["choices"][0]["message"]["content"]


@pytest.mark.slow  # starts a process for each command
def test_the_pipeline_pages_commands_run_as_written_at_toy_size(tmp_path):
    commands = bash_lines(TOY)
    assert len(commands) == 14 and commands[-1].startswith("python -m gptlite.serve")
    write_records(tmp_path)
    for command in commands[:-1]:
        stdin = "What is 1 plus 2?\n" if "--chat" in command and command.startswith("python sample.py") else None
        done = subprocess.run(argv(shrunk(command)), cwd=tmp_path, input=stdin, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"{command}\n{done.stderr}"
    for run in ("pre", "sft", "dpo", "rl"):
        assert (tmp_path / "out" / run / "ckpt.pt").is_file(), run
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [
        "rl-f16.Modelfile", "rl-f16.gguf", "rl-q8_0.Modelfile", "rl-q8_0.gguf"
    ]  # fmt: skip
    assert isinstance(serve(commands[-1], tmp_path), str)
