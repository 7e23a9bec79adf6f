"""The README's commands, run as written on the model the README trains: the char model of
configs/shakespeare_char_cpu.toml in out/char (here trained for a few steps, in a folder of its own), with the
files the commands name (prompt.txt, notes.txt) beside it. A README example that fails on that model (beam search
asked for more tokens than its block holds) fails here."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, shared_file

README = (ROOT / "README.md").read_text()


def bash_lines(text: str) -> list[str]:
    """The commands of the README's ```bash blocks, continuation lines joined, comments cut."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command:
                lines.append(command)
    return lines


def on_the_char_model(command: str) -> bool:
    """A command of the README that reads out/char and returns (the server runs until stopped: its own tests)."""
    return "out/char " in command + " " and command.startswith(("python sample.py", "python -m gptlite.evaluate"))


def argv(command: str) -> list[str]:
    """The command's words with its optional parts ([--top_p=0.95]) taken, run by this Python."""
    words = shlex.split(command.replace("[", "").replace("]", ""))
    assert words[0] == "python"
    script = words[1] if words[1] == "-m" else str(ROOT / words[1])
    return [sys.executable, script, *words[2:]]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> Path:
    """A folder laid out as the README's commands expect: data/shakespeare_char, out/char, prompt.txt, notes.txt."""
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(ROOT / "configs")  # the commands run from the repository's root
    shakespeare = shared_file("data/tinyshakespeare.txt")
    prepare = [sys.executable, str(ROOT / "data/shakespeare/prepare.py"), f"--input={shakespeare}"]
    subprocess.run([*prepare, "--out_dir=data/shakespeare_char"], cwd=root, check=True, capture_output=True)
    train = next(c for c in bash_lines(README) if c.startswith("python train.py configs/shakespeare_char_cpu.toml"))
    assert train.endswith("--out_dir=out/char")
    done = subprocess.run(
        [*argv(train), "--max_iters=20", "--eval_interval=20", "--eval_iters=2"], cwd=root, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    (root / "prompt.txt").write_text("ROMEO:\nWhat light")
    (root / "notes.txt").write_text(shakespeare.read_text()[:5000])
    return root


def test_the_readme_names_its_commands_on_the_char_model():
    commands = [c for c in bash_lines(README) if on_the_char_model(c)]
    assert len(commands) >= 6, commands
    assert any("--num_beams" in c for c in commands) and any("--compile" in c for c in commands)


@pytest.mark.slow  # starts processes, and one of them compiles
@pytest.mark.parametrize("command", [c for c in bash_lines(README) if on_the_char_model(c)])
def test_each_readme_command_runs_as_written_on_the_readmes_char_model(command, readme_run):
    done = subprocess.run(argv(command), cwd=readme_run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    assert done.stdout.strip()


@pytest.mark.slow  # starts a process
def test_the_readmes_python_example_runs_on_the_readmes_char_model(readme_run):
    code = re.search(r"## Use the model from Python\n\n```python\n(.*?)```", README, re.S)[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=readme_run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ROMEO:")
