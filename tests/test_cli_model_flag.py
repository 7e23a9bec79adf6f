"""--model, the one flag for the model a command reads (sample.py, gptlite.evaluate, gptlite.serve, gptlite.hf
export), and --out, where hf export writes: each command reads a run folder (and a Hugging Face directory) through
it, and does what it did under the old spellings (--out_dir, --init_from, --hf_dir), which still work with one note on
stderr; two spellings that disagree, and a model name that names nothing, are one-line errors."""

import json
import re
import shutil
from dataclasses import dataclass
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import sample
from gptlite import GPT
from gptlite.checkpoint import load_model, save_checkpoint
from gptlite.cli import HelpRequested, model_to_read, parse, renamed_option
from gptlite.config import build_config, config_to_dict, option
from gptlite.evaluate import command as evaluate_command
from gptlite.hf.__main__ import ExportOptions
from gptlite.hf.__main__ import main as hf_main
from gptlite.inference.cpu import native
from gptlite.serve import __main__ as serve_command
from gptlite.serve import connection
from gptlite.tokenizer import CharTokenizer
from gptlite.tokenizer.trainer import train_bpe
from tests.conftest import shared_file, tiny_model

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"  # 97 characters
LLAMA = {"pos_emb": "rope", "norm": "rmsnorm"}  # a layout both Hugging Face folders and GGUF files hold
NOT_FOUND = (
    "is not a folder here, nor a name gptlite downloads: a model to read is a gptlite run folder, a Hugging Face"
)


def make_run(folder, tokenizer) -> GPT:
    """A run folder as train.py leaves one (a checkpoint and the tokenizer.json), of a tiny random model."""
    folder.mkdir(parents=True)
    shape = {"vocab_size": tokenizer.vocab_size, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}
    model = tiny_model(**{**shape, **LLAMA}).cpu()
    config = config_to_dict(build_config({**shape, **LLAMA}))
    save_checkpoint(folder / "ckpt.pt", {"config": config, "model": model.state_dict()})
    tokenizer.save(folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """(the run folder of a char model, the model)"""
    folder = tmp_path_factory.mktemp("runs") / "char"
    return folder, make_run(folder, CharTokenizer(CHARS))


def note(prog: str, old: str, new: str, value) -> str:
    """The line on stderr of a command given the old spelling --old=value of --new."""
    what = "where the export goes" if new == "out" else "the model to read"
    return f"{prog}: note: --{old} names {what}; it is spelled --{new}={value} now (--{old} still works)\n"


def one_error(err: str, prog: str) -> str:
    """The one line of a user's error, without the command's prefix."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0].removeprefix(f"{prog}: error: ")


# ---------------------------------------------------------------------------------------------
# The rule, once (gptlite.cli)


@dataclass
class Reader:
    model: str = option("", "the model")
    out_dir: str = option("", "old")
    init_from: str = option("", "old")


def test_the_model_is_given_once_under_any_spelling(capsys):
    assert model_to_read(parse(Reader, ["--model=runs/a"]), "prog") == "runs/a"
    assert capsys.readouterr().err == ""
    assert model_to_read(parse(Reader, ["--out_dir=runs/a"]), "prog") == "runs/a"
    assert capsys.readouterr().err == note("prog", "out_dir", "model", "runs/a")
    assert model_to_read(parse(Reader, ["--init_from", "gpt2"]), "prog") == "gpt2"
    assert capsys.readouterr().err == note("prog", "init_from", "model", "gpt2")
    assert model_to_read(parse(Reader, ["--model=runs/a", "--out_dir=runs/a"]), "prog") == "runs/a"  # the same one
    assert capsys.readouterr().err == note("prog", "out_dir", "model", "runs/a")
    assert model_to_read(parse(Reader, []), "prog", default="out") == "out"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--model=runs/a", "--out_dir=runs/b"],
            "--model=runs/a and --out_dir=runs/b each name the model to read, and they differ; give it once: "
            "--model=VALUE",
        ),
        (
            ["--out_dir=runs/a", "--init_from=gpt2"],
            "--out_dir=runs/a and --init_from=gpt2 each name the model to read, and they differ",
        ),
        ([], "give the model to read: --model=X, where X is a gptlite run folder, a Hugging Face directory or a hub"),
    ],
)
def test_two_models_or_none_are_refused(argv, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        model_to_read(parse(Reader, argv), "prog")
    assert capsys.readouterr().err == ""  # no note before the error


def test_under_torchrun_rank_0_alone_prints_the_note(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert renamed_option(parse(Reader, ["--out_dir=runs/a"]), "model", ("out_dir",), "prog", "it") == "runs/a"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "options,prog",
    [
        (sample.SampleOptions, "sample.py"),
        (evaluate_command.EvaluateOptions, "python -m gptlite.evaluate"),
        (serve_command.ServeOptions, "python -m gptlite.serve"),
        (ExportOptions, "python -m gptlite.hf"),
    ],
)
def test_help_lists_model(options, prog):
    with pytest.raises(HelpRequested) as e:
        parse(options, ["--help"], prog, "doc")
    lines = str(e.value).splitlines()
    assert any(line.startswith("  --model=''  the model to ") for line in lines), lines
    assert any(line.startswith("  --out_dir=''  the old spelling of --model=RUN (still works)") for line in lines)


# ---------------------------------------------------------------------------------------------
# A name that names nothing


def test_a_model_name_that_names_nothing_is_one_line_naming_it(tmp_path):
    typo = tmp_path / "out" / "typo"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(typo))} {NOT_FOUND}") as e:
        load_model(init_from=str(typo))
    assert "gpt2, gpt2-medium, gpt2-large, gpt2-xl" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'ckpt.pt'} is a file, not a folder: a model")):
        load_model(init_from=str(tmp_path / "ckpt.pt"))
    with pytest.raises(FileNotFoundError, match=re.escape("Qwen/Qwen3-0.6B is not a folder here, nor a name gptlite")):
        GPT.from_pretrained("Qwen/Qwen3-0.6B")  # a Hub repository gptlite does not download: said so, offline


@pytest.mark.parametrize(
    "main,prog,args",
    [
        (sample.main, "sample.py", ["--device=cpu"]),
        (evaluate_command.main, "gptlite.evaluate", ["--device=cpu"]),
        (serve_command.main, "gptlite.serve", ["--device=cpu", "--port=0"]),
        (hf_main, "gptlite.hf", ["export", "--out=exported"]),
    ],
)
def test_each_command_names_a_model_that_is_not_there(main, prog, args, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--model=out/typo"]) == 2
    assert one_error(capsys.readouterr().err, prog).startswith(f"out/typo {NOT_FOUND}")
    assert list(tmp_path.iterdir()) == []  # nothing written


# ---------------------------------------------------------------------------------------------
# Each command


def test_sample_reads_the_model_under_each_spelling(char_run, tmp_path, capsys, monkeypatch):
    run, _ = char_run
    argv = ["--device=cpu", "--start=ROMEO:", "--max_new_tokens=12", "--temperature=0"]
    native.load()  # in a fresh cache the first decode builds the CPU kernels, saying so on stderr: not read here
    capsys.readouterr()
    assert sample.main([f"--model={run}", *argv]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 12 + 1 and err == ""
    for old in ("out_dir", "init_from"):
        assert sample.main([f"--{old}={run}", *argv]) == 0
        assert capsys.readouterr() == (out, note("sample.py", old, "model", run))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(run, tmp_path / "out")
    assert sample.main(argv) == 0  # nanoGPT's default: the run in ./out, with no note
    assert capsys.readouterr() == (out, "")
    assert sample.main([f"--model={run}", "--out_dir=out", *argv]) == 2
    assert one_error(capsys.readouterr().err, "sample.py") == (
        f"--model={run} and --out_dir=out each name the model to read, and they differ; give it once: --model=VALUE"
    )


def test_evaluate_reads_the_model_under_each_spelling(char_run, tmp_path, capsys):
    run, _ = char_run
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4)
    scores = {}
    for flag in ("model", "out_dir", "init_from"):
        json_file = tmp_path / f"{flag}.json"
        assert evaluate_command.main([f"--{flag}={run}", f"--text={text}", "--device=cpu", f"--json={json_file}"]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("val: loss ")
        # stderr: the note, then the windows' progress bar
        expected = [] if flag == "model" else [note("gptlite.evaluate", flag, "model", run)]
        assert [line for line in err.splitlines(keepends=True) if ": note: " in line] == expected
        assert err.startswith("".join(expected) + "\rwindows:"), err
        scores[flag] = json.loads(json_file.read_text())
        assert scores[flag]["model"] == str(run)
    assert scores["model"]["val"]["loss"] == scores["out_dir"]["val"]["loss"] == scores["init_from"]["val"]["loss"]
    hf = tmp_path / "hf"
    assert hf_main(["export", f"--model={run}", f"--out={hf}"]) == 0  # a Hugging Face directory: no data of its own
    capsys.readouterr()
    assert evaluate_command.main([f"--model={hf}", "--task=val", "--device=cpu"]) == 2
    assert one_error(capsys.readouterr().err, "gptlite.evaluate") == (
        f"--task=val of {hf} (not a gptlite run folder: no training data of its own) needs --data_dir=DIR or "
        "--text=FILE"
    )
    assert evaluate_command.main([f"--model={hf}", f"--text={text}", "--device=cpu"]) == 0
    assert capsys.readouterr().out.startswith("val: loss ")


def test_serve_reads_the_model_under_each_spelling(char_run, capsys, monkeypatch):
    """The command up to the server's start: the app serves the run's weights under the run folder's name. uvicorn
    is neither run (its own tests serve) nor configured (its logging set-up would write to this test's captured
    stderr after the test)."""
    run, model = char_run
    served = []

    def record(server, engine) -> int:
        served.append((server.config.app.state.server.model_name, engine.model.state_dict()))
        engine.close()
        return 0

    monkeypatch.setattr(serve_command, "serve", record)
    monkeypatch.setattr(connection, "uvicorn_config", lambda app, *args, **options: SimpleNamespace(app=app))
    for flag in ("model", "out_dir", "init_from"):
        assert serve_command.main([f"--{flag}={run}", "--port=0", "--device=cpu", "--dtype=float32"]) == 0
        assert capsys.readouterr().err == ("" if flag == "model" else note("gptlite.serve", flag, "model", run))
        name, weights = served.pop()
        assert name == run.name
        for key, tensor in model.state_dict().items():
            torch.testing.assert_close(weights[key].cpu(), tensor, rtol=0, atol=0)
    assert serve_command.main([f"--model={run}", "--init_from=gpt2", "--port=0"]) == 2
    assert "each name the model to read, and they differ" in one_error(capsys.readouterr().err, "gptlite.serve")


def test_hf_export_reads_model_and_writes_out(char_run, tmp_path, capsys):
    run, model = char_run
    assert hf_main(["export", f"--model={run}", f"--out={tmp_path / 'hf'}"]) == 0
    assert capsys.readouterr().err == ""
    exported = GPT.from_pretrained(str(tmp_path / "hf"))
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[key], tensor, rtol=0, atol=0)
    files = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files.keys()
    for old, new in [(f"--out_dir={run}", f"--out={tmp_path / 'a'}"), (f"--model={run}", f"--hf_dir={tmp_path / 'b'}")]:
        assert hf_main(["export", old, new]) == 0
        flag, _, value = (old if old.startswith("--out_dir") else new)[2:].partition("=")
        renamed = {"out_dir": "model", "hf_dir": "out"}[flag]
        assert capsys.readouterr().err == note("gptlite.hf", flag, renamed, value)
        written = tmp_path / ("a" if flag == "out_dir" else "b")
        assert {p.name: p.read_bytes() for p in written.iterdir()} == files  # the same export


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model=RUN", "--out=x", "--hf_dir=y"],
            "--out=x and --hf_dir=y each name where the export goes, and they differ; give it once: --out=VALUE",
        ),
        (["--model=RUN"], "--out is required: --out=DIR"),
        (["--format=gguf", "--model=RUN"], "--out is required: --out=FILE.gguf"),
        (
            ["--format=gguf", "--model=RUN", "--hf_dir=x"],
            "--hf_dir is --format=hf's old spelling of --out; a GGUF file goes to --out=FILE.gguf",
        ),
        (
            ["--model=HF", "--out=x"],
            "HF is not a gptlite run folder (no ckpt_NNNNNN.pt or ckpt.pt in it): --format=hf exports a run's "
            "checkpoint; a Hugging Face directory or hub name is in that layout already (--format=gguf takes any)",
        ),
        (
            ["--out=x"],
            "give the model to read: --model=X, where X is a gptlite run folder, a Hugging Face directory or a hub "
            "name such as gpt2",
        ),
    ],
)
def test_hf_export_refuses_in_one_line(args, message, char_run, tmp_path, capsys, monkeypatch):
    run, _ = char_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "HF").mkdir()
    (tmp_path / "HF" / "config.json").write_text("{}")
    assert hf_main(["export", *(a.replace("RUN", str(run)) for a in args)]) == 2
    assert one_error(capsys.readouterr().err, "gptlite.hf") == message.replace("RUN", str(run))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HF"]  # nothing written


def test_hf_export_to_gguf_reads_a_run_or_a_directory(tmp_path, capsys):
    """--format=gguf --model=RUN --out=FILE.gguf holds the run's weights; the old --init_from=DIR still works."""
    bpe = train_bpe([shared_file("data/tinyshakespeare.txt").read_text()[:20_000]], vocab_size=320)
    run = tmp_path / "run"
    model = make_run(run, bpe)
    out = tmp_path / "gguf" / "run.gguf"
    assert hf_main(["export", "--format=gguf", f"--model={run}", f"--out={out}"]) == 0
    assert capsys.readouterr().err == ""
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    embedding = np.asarray(tensors["token_embd.weight"].data).reshape(model.tok_emb.weight.shape)
    np.testing.assert_array_equal(embedding, model.tok_emb.weight.detach().numpy())
    assert hf_main(["export", f"--model={run}", f"--out={tmp_path / 'hf'}"]) == 0
    again = tmp_path / "gguf" / "hf.gguf"
    assert hf_main(["export", "--format=gguf", f"--init_from={tmp_path / 'hf'}", f"--out={again}"]) == 0
    assert capsys.readouterr().err == note("gptlite.hf", "init_from", "model", tmp_path / "hf")
    tensors = {t.name: t for t in gguf.GGUFReader(again).tensors}
    np.testing.assert_array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(embedding.shape), embedding)


# ---------------------------------------------------------------------------------------------
# Opening the model: one function (gptlite.checkpoint.open_model) from one set of options (gptlite.cli.ModelOptions)


def test_sample_serve_and_evaluate_open_their_model_through_open_model(char_run, tmp_path, capsys, monkeypatch):
    """Each command hands its parsed options (a ModelOptions) to open_model, with what it does its own way: sample.py
    prints the warnings it held and notes a compile, the server serves uncompiled where torch.compile cannot work,
    evaluation opens on its rank's device."""
    from gptlite import checkpoint
    from gptlite.cli import ModelOptions

    run, _ = char_run
    real = checkpoint.open_model
    opened = []

    def recording(options, prog, *args, **kwargs):
        opened.append((type(options), options.model, prog, args, sorted(kwargs)))
        return real(options, prog, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open_model", recording)
    monkeypatch.setattr(sample, "open_model", recording)  # sample.py imports it at its top
    monkeypatch.setattr(serve_command, "serve", lambda server, engine: engine.close() or 0)
    monkeypatch.setattr(connection, "uvicorn_config", lambda app, *args, **options: SimpleNamespace(app=app))
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    assert sample.main([f"--model={run}", "--device=cpu", "--max_new_tokens=2", "--num_samples=1"]) == 0
    assert serve_command.main([f"--model={run}", "--port=0", "--device=cpu"]) == 0
    assert evaluate_command.main([f"--model={run}", f"--text={text}", "--device=cpu"]) == 0
    capsys.readouterr()
    assert opened == [
        (sample.SampleOptions, str(run), "sample.py", (), ["after_loading", "compiling"]),
        (serve_command.ServeOptions, str(run), "gptlite.serve", (), ["uncompiled"]),
        (evaluate_command.EvaluateOptions, str(run), "gptlite.evaluate", (0,), []),
    ]
    assert all(issubclass(options, ModelOptions) for options, *_ in opened)


@pytest.mark.filterwarnings("ignore:.*int8 decodes this model slower")  # a tiny model: where the CPU's cache is known
def test_open_model_moves_quantizes_and_says_so_in_order(char_run, capsys, monkeypatch):
    """The device and precision chosen and written back into the options, the checkpoint's weights moved there, the
    quantization, then the command's own step (after_loading), the kernels, and the compile note last."""
    from gptlite import gpt
    from gptlite.checkpoint import open_model
    from gptlite.cli import ModelOptions
    from gptlite.inference.cpu import native
    from gptlite.inference.quantize import quantized_as

    run, model = char_run
    steps = []
    monkeypatch.setattr(native, "load_for_command", lambda prog: steps.append(f"kernels for {prog}"))
    options = ModelOptions(model=str(run), device="cpu")
    opened, tokenizer = open_model(options, "sample.py", after_loading=lambda: steps.append("loaded"))
    assert (options.device, options.dtype) == ("cpu", "float32")  # "auto" resolved, written back
    assert not opened.training and tokenizer.vocab_size == len(CHARS)
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(opened.state_dict()[key].float().cpu(), tensor, rtol=0, atol=0)
    assert steps == ["loaded", "kernels for sample.py"]
    steps.clear()

    def quantize(model, mode, group_size):
        steps.append(f"{mode} on {model.tok_emb.weight.device}")
        return real_quantize(model, mode, group_size)

    real_quantize = gpt.quantize
    monkeypatch.setattr(gpt, "quantize", quantize)
    options = ModelOptions(model=str(run), device="cpu", quantize="int8", compile=True)
    quantized, _ = open_model(
        options, "sample.py", after_loading=lambda: steps.append("loaded"), compiling="the first tokens wait"
    )
    assert quantized_as(quantized) == "int8" and options.compile
    assert steps == ["int8 on cpu", "loaded", "kernels for sample.py"]
    assert capsys.readouterr().err == "sample.py: note: --compile: the first tokens wait\n"


def test_evaluate_has_no_compile_flag_and_each_command_keeps_its_words():
    """The options are declared once (ModelOptions); a command rewords a flag's help, or drops a flag it has no use
    for, without a second default or choice list."""
    from gptlite.cli import ModelOptions

    with pytest.raises(ValueError, match="unknown option '--compile'"):
        parse(evaluate_command.EvaluateOptions, ["--model=run", "--compile"])
    assert evaluate_command.EvaluateOptions(model="run").compile is False
    for options in (sample.SampleOptions, serve_command.ServeOptions, evaluate_command.EvaluateOptions):
        with pytest.raises(HelpRequested) as e:
            parse(options, ["--help"], "prog", "doc")
        lines = str(e.value).splitlines()
        assert any(line.startswith("  --quantize=''  int8 or int4: ") for line in lines)
        assert any(line.endswith("(one of '', int8, int4)") for line in lines)
        assert parse(options, ["--model=run"]).dtype == ModelOptions.dtype == "auto"
