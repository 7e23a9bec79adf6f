"""sample.py on a tiny random checkpoint: streaming, samples, stop strings, errors."""

import contextlib
import io
import re

import pytest
import torch

import sample
from gptlite.checkpoint import save_checkpoint
from gptlite.cli import parse
from gptlite.config import build_config, config_to_dict
from gptlite.tokenizer import CharTokenizer
from tests.conftest import DEVICE, VARIANTS, tiny_model

pytestmark = pytest.mark.device

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"  # 97 characters, the tiny model's vocabulary
SEPARATOR = "-" * 40 + "\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(out / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model().state_dict()})
    CharTokenizer(CHARS).save(out / "tokenizer.json")
    return out


def run(run_dir, capsys, *args) -> tuple[int, str, str]:
    code = sample.main([f"--model={run_dir}", f"--device={DEVICE}", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_samples_print_with_their_prompt(run_dir, capsys):
    args = ("--start=ROMEO:", "--num_samples=5", "--batch_size=2", "--max_new_tokens=20")
    code, out, _ = run(run_dir, capsys, *args)
    assert code == 0
    samples = out.split(SEPARATOR)
    assert len(samples) == 5 and all(s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 20 + 1 for s in samples)
    assert run(run_dir, capsys, *args)[1] == out  # the same seed gives the same samples
    _, greedy, _ = run(run_dir, capsys, "--start=ROMEO:", "--num_samples=3", "--max_new_tokens=20", "--temperature=0")
    assert len(set(greedy.split(SEPARATOR))) == 1  # greedy samples agree


@pytest.mark.filterwarnings("ignore:the context reached block_size")
@pytest.mark.parametrize("name", ["rope", "gpt2", "llama"])
def test_every_variant_samples_what_its_model_generates(tmp_path, capsys, name):
    """sample.py rebuilds the architecture from the checkpoint's config: greedy text equals model.generate's,
    past block_size too (rope could also run there with --extend_context)."""
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, **VARIANTS[name]})
    model = tiny_model(**VARIANTS[name])
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": model.state_dict()})
    tokenizer = CharTokenizer(CHARS)
    tokenizer.save(tmp_path / "tokenizer.json")
    code, out, _ = run(
        tmp_path,
        capsys,
        "--start=ROMEO:",
        "--num_samples=1",
        "--max_new_tokens=40",
        "--temperature=0",
        "--dtype=float32",
    )
    expected = model.generate(torch.tensor([tokenizer.encode("ROMEO:")], device=DEVICE), 40, temperature=0)
    assert code == 0 and out == tokenizer.decode(expected[0].tolist()) + "\n"


def test_first_sample_streams_token_by_token(run_dir, monkeypatch):
    writes = []

    class Recorder:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Recorder())
    assert (
        sample.main(
            [f"--out_dir={run_dir}", f"--device={DEVICE}", "--start=A", "--num_samples=1", "--max_new_tokens=15"]
        )
        == 0
    )
    assert writes[0] == "A" and all(len(w) == 1 for w in writes[1:16])  # one character per step, as it came


def test_stop_strings_cut_each_sample(run_dir, capsys):
    args = ("--start=Hi", "--num_samples=2", "--max_new_tokens=30", "--temperature=0")
    text = run(run_dir, capsys, *args)[1].split(SEPARATOR)[0][2:-1]
    stop = text[8:10]
    _, out, _ = run(run_dir, capsys, *args, f"--stop={stop}", "--stop=\\n\\n")
    assert out.split(SEPARATOR) == ["Hi" + text[: text.index(stop)] + "\n"] * 2
    assert sample.unescape("\\n\\t\u00e9\u65e5") == "\n\t\u00e9\u65e5"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch_size=0"], "num_samples=3 and batch_size=0 must be >= 1"),
        (["--max_new_tokens=-2"], "max_new_tokens=-2 must be an integer >= 0"),
        (["--top_p=2"], r"top_p=2.0 must be in \(0, 1\]"),
        (["--extend_context"], "extend_context=True needs pos_emb='sinusoidal'"),
        (["--start=\u65e5"], "'\u65e5' is not in this char tokenizer's vocabulary"),
        (["--start=FILE:/nonexistent/prompt.txt"], "prompt file /nonexistent/prompt.txt does not exist"),
    ],
)
def test_errors_are_one_line_on_stderr(run_dir, capsys, args, message):
    code, out, err = run(run_dir, capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("sample.py: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_argument_errors(monkeypatch):
    with pytest.raises(ValueError, match="num_samples=0 and batch_size=8 must be >= 1"):
        sample.resolve(sample.SampleOptions(device="cpu", dtype="auto", num_samples=0, batch_size=8))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cuda but CUDA is not available here; use --device=cpu"):
        sample.resolve(sample.SampleOptions(device="cuda", dtype="auto", num_samples=1, batch_size=8))
    with pytest.raises(ValueError, match="'maybe' is not a boolean; use true or false"):
        parse(sample.SampleOptions, ["--compile=maybe"])


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_sampling_in_one_line(run_dir, signum):
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            str(sample.__file__),
            f"--out_dir={run_dir}",
            "--device=cpu",
            "--max_new_tokens=1000000",
            "--num_samples=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout.read(5)  # it is generating
    time.sleep(0.2)
    proc.send_signal(getattr(signal, signum))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, signum)
    assert stderr.strip().splitlines()[-1] == f"sample.py: interrupted ({signum}); nothing to save"


def test_a_sliding_window_note_goes_to_stderr_after_the_text(run_dir, capsys, monkeypatch):
    import warnings

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # sample.main replaces it
    code, out, err = run(run_dir, capsys, "--start=A", "--num_samples=1", "--max_new_tokens=80", "--temperature=0")
    assert code == 0
    assert "context reached block_size" not in out
    note = [line for line in err.splitlines() if "block_size" in line]
    assert note == [
        "sample.py: note: the context reached block_size=32: a full window keeps its newest 24 tokens, "
        "which are prefilled again at positions 0.. (see gptlite.inference.generate)"
    ]
    # on its own line after the text, never inside it, also where stdout and stderr share a terminal
    shared = io.StringIO()
    with contextlib.redirect_stdout(shared), contextlib.redirect_stderr(shared):
        assert sample.main([f"--model={run_dir}", "--start=A", "--num_samples=1", "--max_new_tokens=80",
                            "--temperature=0", "--device=cpu"]) == 0  # fmt: skip
    assert shared.getvalue() == out + note[0] + "\n"


def test_greedy_decoding_prints_one_sample_unless_asked_for_more(run_dir, capsys):
    code, out, _ = run(run_dir, capsys, "--start=A", "--max_new_tokens=8", "--temperature=0")
    assert code == 0 and SEPARATOR not in out and out.startswith("A")
    code, out, _ = run(run_dir, capsys, "--start=A", "--max_new_tokens=8", "--temperature=0", "--num_samples=2")
    assert code == 0 and out.count(SEPARATOR) == 1  # asked for: two (identical) samples
