"""docs/pipeline.md's commands "at toy size, on a CPU", run as written, one after the other in one folder, each
stage on the last one's run folder, shrunk by the one rule the page states: every `--max_iters=N` is
`--max_iters=2`, `--vocab_size 8192` is `--vocab_size 512`, the inputs' corpus is the tests' copy of tiny Shakespeare
(data/pipeline/inputs.py --shakespeare=FILE: no download), and the server listens on a free port. The page's
first command, pip's install of the extras it uses, is not run (the tests' environment has them, and pip may be
offline): the test checks that it names an extra for each command that needs one. A command of the page that fails
as written fails here; tests/docs/test_pipeline_handoffs.py checks the hand-offs between the stages. The inputs'
own command is
checked here too: its files, their counts and formats, the same every time, a file already there kept."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from gptlite.config import tomllib
from tests.conftest import ROOT, shared_file
from tests.helpers.serving import free_port
from tests.test_readme import argv, bash_lines

PAGE = (ROOT / "docs" / "pipeline.md").read_text()
TOY = PAGE.split("## At toy size, on a CPU (minutes)")[1].split("\n## ")[0]
INSTALL = 'pip install -e ".[gguf,serve]"'
INPUTS = "python data/pipeline/inputs.py"


def shrunk(command: str) -> str:
    """The page's command at the test's size (see the module docstring)."""
    command = re.sub(r"--max_iters=\d+", "--max_iters=2", command)
    if command == INPUTS:
        command = f"{command} --shakespeare={shared_file('data/tinyshakespeare.txt')}"
    return command.replace("--vocab_size 8192", "--vocab_size 512")


def inputs_module():
    """data/pipeline/inputs.py as a module."""
    spec = importlib.util.spec_from_file_location("pipeline_inputs", ROOT / "data" / "pipeline" / "inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def test_the_pages_install_names_the_extra_of_each_command_that_needs_one():
    commands = bash_lines(TOY)
    assert commands[0] == INSTALL
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.search(r"\[(.*)\]", INSTALL)[1].split(",")
    assert set(named) <= set(extras), named
    needs = {"--format=gguf": "gguf", "python -m gptlite.serve": "serve"}  # the commands that import an extra
    for marker, extra in needs.items():
        assert any(marker in command for command in commands), marker
        assert extra in named, extra


@pytest.mark.slow  # starts a process for each command
def test_the_pipeline_pages_commands_run_as_written_at_toy_size(tmp_path):
    commands = bash_lines(TOY)
    assert len(commands) == 16 and commands[1] == INPUTS and commands[-1].startswith("python -m gptlite.serve")
    for command in commands[1:-1]:
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


@pytest.mark.slow  # starts a process
def test_the_inputs_are_the_pages_counts_and_formats_the_same_every_time(tmp_path):
    shakespeare = shared_file("data/tinyshakespeare.txt")
    command = [sys.executable, str(ROOT / "data" / "pipeline" / "inputs.py"), f"--shakespeare={shakespeare}"]
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
        subprocess.run(command, cwd=tmp_path / folder, check=True, capture_output=True)
    first = tmp_path / "first" / "data" / "pipeline"
    second = tmp_path / "second" / "data" / "pipeline"
    names = ["chats.jsonl", "corpus.txt", "pairs.jsonl", "test.jsonl", "train.jsonl"]
    assert sorted(p.name for p in first.iterdir()) == names
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in names)
    assert (first / "corpus.txt").read_text() == shakespeare.read_text()

    def question(messages: list[dict]) -> str:
        (message,) = messages
        assert message["role"] == "user"
        return message["content"]

    chats = read_jsonl(first / "chats.jsonl")
    pairs = read_jsonl(first / "pairs.jsonl")
    train = read_jsonl(first / "train.jsonl")
    test = read_jsonl(first / "test.jsonl")
    assert (len(chats), len(pairs), len(train), len(test)) == (400, 400, 400, 40)
    assert "400 records in each training file and 40 prompts in the test file" in " ".join(PAGE.split())
    for chat in chats:
        user, assistant = chat["messages"]
        assert assistant["role"] == "assistant" and assistant["content"] == str(eval_sum(question([user])))
    for pair in pairs:
        assert pair["chosen"] == str(eval_sum(pair["prompt"])) != pair["rejected"]
    for record in train + test:
        assert record["answer"] == str(eval_sum(question(record["prompt"])))
    held_out = {question(r["prompt"]) for r in test}
    seen = {question(r["prompt"]) for r in train} | {p["prompt"] for p in pairs}
    seen |= {c["messages"][0]["content"] for c in chats}
    assert len(held_out) == 40 and not held_out & seen


def eval_sum(question: str) -> int:
    """The sum a record asks for ("What is 7 plus 32?": 39)."""
    a, b = re.fullmatch(r"What is (\d+) plus (\d+)\?", question).groups()
    return int(a) + int(b)


def test_the_inputs_keep_a_file_already_there(tmp_path, capsys):
    inputs = inputs_module()
    out = tmp_path / "data" / "pipeline"
    out.mkdir(parents=True)
    (out / "chats.jsonl").write_text("mine\n")
    (out / "corpus.txt").write_text("my corpus")
    assert inputs.main([f"--out_dir={out}"]) == 0
    assert (out / "chats.jsonl").read_text() == "mine\n" and (out / "corpus.txt").read_text() == "my corpus"
    assert f"kept {out / 'chats.jsonl'}, already there" in capsys.readouterr().out
    assert len(read_jsonl(out / "pairs.jsonl")) == 400


def test_the_inputs_offline_with_no_copy_take_pythons_own_source_and_say_so(tmp_path, monkeypatch, capsys):
    inputs = inputs_module()
    monkeypatch.setattr(inputs, "URL", "http://127.0.0.1:9/input.txt")  # nothing listens: as offline
    monkeypatch.setattr(inputs, "DOWNLOADED", tmp_path / "no-download" / "input.txt")
    out = tmp_path / "data" / "pipeline"
    assert inputs.main([f"--out_dir={out}"]) == 0
    corpus = (out / "corpus.txt").read_text()
    assert len(corpus) == inputs.CORPUS_CHARS and '"""' in corpus  # Python source
    assert "Python's standard-library source" in capsys.readouterr().out
    assert not (tmp_path / "no-download").exists()


def test_the_inputs_name_a_missing_copy_of_shakespeare(tmp_path, capsys):
    inputs = inputs_module()
    missing = tmp_path / "tinyshakespeare.txt"
    assert inputs.main([f"--out_dir={tmp_path / 'out'}", f"--shakespeare={missing}"]) == 2
    line = capsys.readouterr().err.strip()
    assert f"--shakespeare={missing} does not exist" in line and len(line.splitlines()) == 1


def test_the_inputs_refuse_counts_they_cannot_write():
    inputs = inputs_module()
    with pytest.raises(ValueError, match=r"--records=0 and --test_records=40: each must be at least 1"):
        inputs.sums(0, 40)
    with pytest.raises(ValueError, match=r"test_records below 1600"):
        inputs.sums(10, 1600)
