"""The one command-line parser: dataclass options, --key=value and --key value, lists, positionals, TOML, help,
did-you-mean; and that no other module imports a parser library."""

import ast
import errno
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from gptlite.cli import HelpRequested, config_help, help_text, parse, run_command
from gptlite.config import option
from tests.conftest import ROOT


@dataclass
class Options:
    runs: list[str] = option(default_factory=list, help="the runs", positional=True)
    out_dir: str = option("out", "where it goes")
    steps: int = option(10, "how many")
    rate: float | None = option(None, "how fast (none = auto)")
    flag: bool = option(False, "a switch")
    input: list[str] = option(default_factory=list, help="files")
    kind: str = option("a", "which", choices=("a", "b"))


def test_both_spellings_lists_and_positionals():
    o = parse(
        Options,
        [
            "r1",
            "--out_dir=x",
            "--steps",
            "3",
            "--rate",
            "-0.5",
            "--flag",
            "r2",
            "--input",
            "f1",
            "f2",
            "--input=f3",
            "--kind",
            "b",
        ],
    )
    assert (o.runs, o.out_dir, o.steps, o.rate, o.flag, o.input, o.kind) == (
        ["r1", "r2"],
        "x",
        3,
        -0.5,
        True,
        ["f1", "f2", "f3"],
        "b",
    )
    assert o.given == {"runs", "out_dir", "steps", "rate", "flag", "input", "kind"}
    o = parse(Options, ["--flag", "false", "--rate=none", "--out-dir", "y"])
    assert (o.flag, o.rate, o.out_dir, o.steps) == (False, None, "y", 10) and o.given == {"flag", "rate", "out_dir"}


def test_a_toml_file_sits_between_defaults_and_the_command_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('steps = 7\nout_dir = "from_toml"\n')
    o = parse(Options, [str(path), "--out_dir=cli"])
    assert (o.steps, o.out_dir) == (7, "cli")


def test_every_problem_is_reported_together_with_did_you_mean():
    with pytest.raises(ValueError) as e:
        parse(Options, ["--stpes=3", "--rate=fast", "--kind=c", "--flag=maybe"])
    message = str(e.value)
    assert "unknown option '--stpes'; did you mean '--steps'?" in message
    assert "rate='fast' is not a number" in message and "kind='c' must be one of a, b" in message
    assert "flag='maybe' is not a boolean; use true or false" in message
    with pytest.raises(ValueError, match="--steps needs a value: --steps=VALUE"):
        parse(Options, ["--steps"])


def test_help_lists_every_option_with_its_default_and_help():
    with pytest.raises(HelpRequested) as e:
        parse(Options, ["--help"], "prog", "The doc.")
    text = str(e.value)
    assert text.startswith("The doc.") and "--steps=10  how many" in text and "RUNS ..." in text
    assert "--kind='a'  which (one of a, b)" in text
    assert run_command("prog", lambda: parse(Options, ["-h"], "prog", "The doc.")) == 0


@dataclass
class Quantized:
    quantize: str = option("", "int8 or int4", choices=("", "int8", "int4"))


def test_an_empty_choice_is_shown_as_the_empty_text_it_is():
    """The empty choice (none) reads as '' in errors and in --help, not as nothing before a comma."""
    with pytest.raises(ValueError, match=r"^quantize='int2' must be one of '', int8, int4$"):
        parse(Quantized, ["--quantize=int2"])
    assert parse(Quantized, ["--quantize="]).quantize == ""
    assert "--quantize=''  int8 or int4 (one of '', int8, int4)" in help_text(Quantized, "prog", "The doc.")


def test_a_file_too_large_that_no_command_described_names_the_size_limit():
    from gptlite.cli import in_words

    assert in_words(OSError(errno.EFBIG, "File too large", "/x/y")) == (
        "/x/y: the file reached this process's file size limit (ulimit -f) or the largest its file system holds; "
        "raise the limit (ulimit -f unlimited) or use a folder on another file system"
    )


@dataclass
class Shape:
    depth: int = option(2, "how deep")


@dataclass
class Reader:
    model: str = option("", "the model to read")
    shape: Shape = field(default_factory=Shape)


def test_help_leaves_out_a_nested_config_by_its_type_not_its_name():
    """A field named model is an option like any other (the commands' --model); a nested dataclass (train.py's
    model: GPTConfig, whose fields train.py lists itself) is not one."""
    text = help_text(Reader, "prog", "The doc.")
    assert "  --model=''  the model to read" in text.splitlines() and "--shape" not in text
    train = config_help()
    assert "  --n_layer=12" in train and "--model=" not in train


def test_only_cli_imports_a_command_line_parser_library():
    out = subprocess.run(
        [sys.executable, "scripts/layout_report.py", "--no-tests"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert "files importing a command-line parser library: 0 (none)" in out.stdout, out.stdout
    assert "gptlite modules in import cycles: 0" in out.stdout, out.stdout
    tree = ast.parse((ROOT / "gptlite" / "cli.py").read_text())
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in ast.dump(n) for n in tree.body)


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.parametrize(
    "command,typo,meant",
    [
        (["sample.py"], "--out_dirr=x", "out_dir"),
        (["data/prepare.py"], "--out_dirr=x", "out_dir"),
        (["train.py"], "--out_dirr=x", "out_dir"),
        (["-m", "gptlite.evaluate"], "--out_dirr=x", "out_dir"),
        (["-m", "gptlite.plot"], "--outt=x.png", "out"),
        (["-m", "gptlite.hf"], "--hf_dirr=x", "hf_dir"),
        (["-m", "gptlite.serve"], "--portt=1", "port"),
        (["-m", "gptlite.tokenizer", "train"], "--vocab_sizee=1", "vocab_size"),
        (["-m", "gptlite.scaling"], "--data_dirr=x", "data_dir"),
        (["data/shakespeare/prepare.py"], "--out_dirr=x", "out_dir"),
    ],
)
def test_every_command_has_help_and_did_you_mean(command, typo, meant):
    path = [str(ROOT / command[0]), *command[1:]] if command[0].endswith(".py") else command
    out = subprocess.run([sys.executable, *path, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--" in out.stdout and "Traceback" not in out.stderr, out.stderr
    # `--help | head -1`: the reader goes away before the help is written; the command ends quietly, as SIGPIPE
    # ends a command (141), not in a BrokenPipeError's traceback
    reader_gone = subprocess.Popen([sys.executable, *path, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=ROOT, text=True)  # fmt: skip
    reader_gone.stdout.close()
    assert reader_gone.wait(timeout=120) == 141 and reader_gone.stderr.read() == ""
    out = subprocess.run([sys.executable, *path, typo], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and f"did you mean '{meant}'?" in out.stderr.replace("'--", "'"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_rank_other_than_0_waits_before_its_error_and_ends_quietly_on_sigterm(tmp_path):
    """Under torchrun rank 0 alone prints an error's line; another rank waits first, so that torchrun, which ends
    every rank once one has failed, cannot end rank 0 before it has printed. Ended by SIGTERM while it waits, the
    rank stops without a word (no traceback); left to wait out the grace, it prints its own line, naming itself."""
    import os
    import signal
    import time

    script = (
        "import sys, gptlite.cli as cli\n"
        "cli.RANK_GRACE_S = float(sys.argv[1])\n"
        "sys.exit(cli.run_command('demo', lambda: (_ for _ in ()).throw(ValueError('bad input'))))\n"
    )
    env = {**os.environ, "RANK": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, "0.2"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == "rank 1: demo: error: bad input"
    rank0 = subprocess.run(
        [sys.executable, "-c", script, "30"], env={**env, "RANK": "0"}, capture_output=True, text=True, timeout=60
    )
    assert rank0.returncode == 2 and rank0.stderr.strip() == "demo: error: bad input"  # at once: no wait on rank 0
    waiting = subprocess.Popen([sys.executable, "-c", script, "30"], env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(3)  # started, failed, waiting
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=20) == -signal.SIGTERM and waiting.stderr.read() == ""
    # a note is not an error: the command goes on after it, on every rank, with no wait (a 600-s grace would
    # overrun the timeout); and rank 1 does not print it
    note = "import gptlite.cli as cli\ncli.RANK_GRACE_S = 600.0\ncli.report('demo: note: spelled --new now')\n"
    noted = subprocess.run([sys.executable, "-c", note], env=env, capture_output=True, text=True, timeout=60)
    assert noted.returncode == 0 and noted.stderr == ""


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize(
    "extra,blocked,command",
    [
        ("serve", "fastapi", ["-m", "gptlite.serve", "--model=run"]),
        ("serve", "llguidance", ["-m", "gptlite.serve", "--model=run"]),
        ("data", "pyarrow", ["data/prepare.py", "--input=x.parquet", "--tokenizer=byte", "--out_dir=out"]),
        ("data", "datasets", ["data/prepare.py", "--hf_dataset=a/b", "--tokenizer=byte", "--out_dir=out"]),
        ("eval", "lm_eval", ["-m", "gptlite.evaluate", "--model=gpt2", "--task=lm_eval:arc_easy"]),
        ("gguf", "gguf", ["-m", "gptlite.hf", "export", "--format=gguf", "--model=gpt2", "--out=x.gguf"]),
        ("plot", "matplotlib", ["-m", "gptlite.plot", "run"]),
    ],
)
def test_a_missing_extra_is_one_line_naming_its_pip_install(extra, blocked, command, tmp_path):
    """Each command as a user runs it where the extra's package is not installed (its import fails, as Python's
    does when sys.modules holds None): one line naming the package and `pip install -e ".[EXTRA]"`, exit 2."""
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    if command[0].endswith(".py"):
        argv = [str(ROOT / command[0]), *command[1:]]
        run = f"runpy.run_path({argv[0]!r}, run_name='__main__')"
    else:  # -m MODULE
        argv = [command[1], *command[2:]]
        run = f"runpy.run_module({argv[0]!r}, run_name='__main__', alter_sys=True)"
    code = f"import runpy, sys\nsys.modules[{blocked!r}] = None\nsys.argv = {argv!r}\n{run}\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f'needs the {blocked} package: pip install -e ".[{extra}]"' in done.stderr
