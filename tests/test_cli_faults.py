"""Nothing lost, round two: the Hugging Face export and import, evaluate, beams, Muon's settings and plot under
faults and bad input. Every case ends in one line (or a clear exception) with the user's files as they were."""

import errno
import json
import math
import os
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers

from gptlite import GPT, plot
from gptlite.checkpoint import save_checkpoint
from gptlite.config import build_config, config_to_dict
from gptlite.evaluate import command as evaluate_command
from gptlite.hf import export_hf
from gptlite.inference.generate import generate_tokens
from gptlite.tokenizer import CharTokenizer
from tests.conftest import ROOT, run_train, tiny_model

transformers.logging.set_verbosity_error()
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"  # 97 characters
LLAMA = dict(pos_emb="rope", norm="rmsnorm", vocab_size=97, block_size=32)


def run(*args: str, script: str = "sample.py") -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-m", script] if not script.endswith(".py") else [str(ROOT / script)]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def run_here(main, capsys, *args: str) -> subprocess.CompletedProcess:
    """A command's main(argv) in this process, its result shaped as `run`'s: the same code path, without a
    Python start (and torch's import) per case."""
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


def one_line(result: subprocess.CompletedProcess, prog: str) -> str:
    """The one error line of a command that failed as a user's error should."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (
        result.stderr
    )
    return lines[0]


def folder(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------------------------------------
# The export: all or nothing, exactly a fresh export's files, the earlier folder kept whole


def test_a_failed_export_over_an_earlier_one_leaves_it_whole(tmp_path, monkeypatch):
    target = tmp_path / "hf"
    export_hf(tiny_model(seed=1, **LLAMA), target)
    before = folder(target)
    real = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):
        real(dict(list(tensors.items())[:2]), path, metadata=metadata)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match=r"could not write export folder .*hf: no space left on device; free space"):
        export_hf(tiny_model(seed=2, **LLAMA), target, overwrite=True)
    assert folder(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp folder left
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        export_hf(tiny_model(seed=2, **LLAMA), target, overwrite=True)
    assert folder(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_an_export_over_a_folder_holds_exactly_the_new_files_and_keeps_the_old_beside_it(tmp_path):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "vocab.json").write_text("{}")
    (target / "generation_config.json").write_text('{"eos_token_id": 5}')
    with pytest.raises(FileExistsError, match=r"already holds generation_config.json, vocab.json; .* overwrite"):
        export_hf(tiny_model(**LLAMA), target)
    logged = []
    written = export_hf(tiny_model(**LLAMA), target, overwrite=True, log=logged.append)
    assert (
        sorted(p.name for p in target.iterdir())
        == sorted(p.name for p in written)
        == ["config.json", "model.safetensors"]
    )
    (previous,) = [p for p in tmp_path.iterdir() if p.name.startswith("hf-previous-")]
    assert sorted(p.name for p in previous.iterdir()) == ["generation_config.json", "vocab.json"]
    assert logged == [f"moved the earlier contents of {target} to {previous}"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target)
    assert isinstance(hf, transformers.LlamaForCausalLM)


def test_export_to_a_file_or_an_unwritable_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"export folder .*file is a file, not a folder; choose another path"):
        export_hf(tiny_model(**LLAMA), tmp_path / "file")
    real_mkdir = type(tmp_path).mkdir

    def read_only(self, *args, **kwargs):
        if self.name.startswith(".out.tmp"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "mkdir", read_only)
    with pytest.raises(OSError, match=r"could not write export folder .*out: read-only file system; use a writable"):
        export_hf(tiny_model(**LLAMA), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_int8_model_is_not_exported(tmp_path):
    with pytest.raises(ValueError, match="a quantized model cannot be exported"):
        export_hf(tiny_model(**LLAMA).quantize("int8"), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_export_command_never_writes_over_its_run(tmp_path):
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, **LLAMA})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model(**LLAMA).state_dict()})
    line = one_line(run("export", f"--model={tmp_path}", f"--out={tmp_path}", script="gptlite.hf"), "gptlite.hf")
    assert "holds the run" in line and (tmp_path / "ckpt.pt").is_file()


# ---------------------------------------------------------------------------------------------
# Import: damaged and mismatched checkpoints are one line naming the file


@pytest.fixture
def hf_dir(tmp_path):
    directory = tmp_path / "hf"
    export_hf(tiny_model(**LLAMA), directory)
    return directory


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:300]),
            r"model\.safetensors cannot be read .*cut short or not a weights file",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b""), r"model\.safetensors cannot be read"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), r"config\.json holds a JSON list, not an object"),
        (lambda d: (d / "config.json").write_text("{nope"), r"config\.json is not valid JSON"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**json.loads((d / "config.json").read_text()), "intermediate_size": 96})
            ),
            r"tensor blocks\.0\.ffn\.fc\.weight has shape \(\d+, 32\) but the config describes \(192, 32\)",
        ),
    ],
)
def test_damaged_checkpoints_are_one_line_naming_the_file(hf_dir, damage, message):
    damage(hf_dir)
    with pytest.raises((ValueError, OSError), match=message):
        GPT.from_pretrained(str(hf_dir))


def test_non_finite_weights_are_refused_on_load(hf_dir):
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    name = sorted(weights)[3]
    weights[name][0] = float("nan")
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor {name} holds NaN or infinite values"):
        GPT.from_pretrained(str(hf_dir))


def test_sharded_and_torch_files_that_are_damaged_are_named(hf_dir):
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    index = hf_dir / "model.safetensors.index.json"
    index.write_text("not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        GPT.from_pretrained(str(hf_dir))
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index\.json has no weight_map"):
        GPT.from_pretrained(str(hf_dir))
    index.write_text(json.dumps({"weight_map": {k: "model-00001-of-00002.safetensors" for k in weights}}))
    with pytest.raises(FileNotFoundError, match=r"names shard model-00001-of-00002\.safetensors, which is not in"):
        GPT.from_pretrained(str(hf_dir))
    index.unlink()
    torch.save([1, 2, 3], hf_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin does not hold a state dict"):
        GPT.from_pretrained(str(hf_dir))
    torch.save(weights, hf_dir / "pytorch_model.bin")
    (hf_dir / "pytorch_model.bin").write_bytes((hf_dir / "pytorch_model.bin").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be read .*cut short") as e:
        GPT.from_pretrained(str(hf_dir))
    assert "Errno" not in str(e.value)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    from gptlite.data.prepare import prepare

    corpus = tmp_path_factory.mktemp("corpus") / "text.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 400)
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


def test_overwrite_moves_nothing_aside_when_the_pretrained_weights_fail(char_data, hf_dir, tmp_path):
    run_dir = tmp_path / "run"
    common = [
        f"--data_dir={char_data}",
        f"--out_dir={run_dir}",
        "--max_iters=1",
        "--eval_interval=1",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=16",
        "--device=cpu",
    ]
    run_train(*common, "--n_layer=1", "--n_head=2", "--n_embd=16")
    before = sorted(p.name for p in run_dir.iterdir())
    (hf_dir / "model.safetensors").write_bytes(b"\0" * 100)
    assert re.search(
        r"model\.safetensors cannot be read", run_train(*common, f"--init_from={hf_dir}", "--overwrite").error
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing moved into previous-TIME/


def test_data_beyond_a_pretrained_vocabulary_says_to_use_its_tokenizer(tmp_path):
    from gptlite.data.prepare import prepare

    corpus = tmp_path / "bytes.txt"
    corpus.write_text("".join(chr(c) for c in range(32, 127)) * 60)
    data = tmp_path / "data"
    prepare([str(corpus)], "byte", data, log=lambda *a: None)  # ids up to 126
    small = tmp_path / "hf"
    export_hf(tiny_model(**{**LLAMA, "vocab_size": 100}), small)
    error = run_train(
        f"--data_dir={data}",
        f"--out_dir={tmp_path / 'run'}",
        f"--init_from={small}",
        "--device=cpu",
        "--block_size=16",
        "--batch_size=2",
    ).error
    assert re.search(
        r"holds token id 12\d but the model's vocab_size is 100; prepare the data with .*hf's tokenizer", error
    )
    assert "--vocab_size" not in error


# ---------------------------------------------------------------------------------------------
# Sampling: ids the tokenizer cannot decode, bad beam counts


@pytest.mark.filterwarnings("ignore:the context reached block_size")
def test_ids_past_the_tokenizers_vocabulary_are_never_sampled(tmp_path, capsys):
    model = tiny_model(vocab_size=128)
    steps = list(generate_tokens(model, [[1, 2]], 60, temperature=5.0, seed=0))
    assert max(max(t.tolist()) for t in steps) >= 62  # without a limit, such ids come up
    steps = list(generate_tokens(model, [[1, 2]], 60, temperature=5.0, seed=0, vocab_limit=62))
    assert max(max(t.tolist()) for t in steps) < 62
    beams = model.generate([[1, 2]], 6, num_beams=3, num_return_sequences=3, vocab_limit=5)
    assert all(t < 5 for row in beams for t in row[2:])
    cfg = build_config({"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": model.state_dict()})
    chars = CHARS[:62]
    CharTokenizer(chars).save(tmp_path / "tokenizer.json")
    for extra in ([], ["--num_beams=3", "--num_samples=2"]):
        result = run(
            f"--out_dir={tmp_path}",
            "--start=AB",
            "--temperature=" + ("5" if not extra else "1"),
            "--max_new_tokens=" + ("60" if not extra else "20"),
            "--device=cpu",
            *extra,
        )
        assert result.returncode == 0, result.stderr
        assert set(result.stdout) <= set(chars) | {"-", "\n"}


@pytest.mark.parametrize("beams", ["0", "-1"])
def test_a_beam_count_below_1_is_refused(tmp_path, beams):
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model().state_dict()})
    CharTokenizer(CHARS).save(tmp_path / "tokenizer.json")
    line = one_line(run(f"--model={tmp_path}", f"--num_beams={beams}", "--device=cpu"), "sample.py")
    assert f"num_beams={beams} must be >= 1" in line


def test_a_run_never_goes_into_its_own_data_folder(char_data):
    before = sorted(p.name for p in char_data.iterdir())
    result = run(f"--data_dir={char_data}", f"--out_dir={char_data}", "--overwrite", script="train.py")
    assert "out_dir and data_dir are the same folder" in one_line(result, "train.py")
    assert sorted(p.name for p in char_data.iterdir()) == before


# ---------------------------------------------------------------------------------------------
# Muon's and every other float setting: finite, in range, checked at start-up


@pytest.mark.parametrize(
    "setting",
    [
        "--muon_lr=nan",
        "--muon_lr=inf",
        "--muon_weight_decay=nan",
        "--learning_rate=nan",
        "--beta2=1.5",
        "--grad_clip=-inf",
        "--max_minutes=nan",
    ],
)
def test_float_settings_must_be_finite_and_in_range(setting, char_data, tmp_path):
    result = run(f"--data_dir={char_data}", f"--out_dir={tmp_path}", "--optimizer=muon", setting, script="train.py")
    line = one_line(result, "train.py")
    assert setting.split("=")[0][2:] in line and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# plot: never over its own input; formats; rows it cannot draw


def test_plot_never_writes_over_the_metrics_it_reads(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in range(1, 6)))
    before = metrics.read_bytes()
    assert plot.main([str(tmp_path), f"--out={metrics}"]) == 2
    assert "is one of the metrics files plotted" in capsys.readouterr().err and metrics.read_bytes() == before
    assert plot.main([str(tmp_path), f"--out={tmp_path / 'loss.pdf'}"]) == 0
    assert (tmp_path / "loss.pdf").read_bytes()[:5] == b"%PDF-"
    assert plot.main([str(tmp_path), f"--out={tmp_path / 'loss.txt'}"]) == 2
    assert "names no format; use .png, .pdf or .svg" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rows,message",
    [
        (['{"step": "one", "loss": 2.0}'], r"row 1 is not a metrics row"),
        (["[1, 2]"], r"row 1 is not a metrics row"),
        (['{"loss": 2.0}'], r"row 1 is not a metrics row"),
        (['{"step": 1, "loss": NaN}', '{"step": 2, "val_loss": NaN}'], "has no finite loss values to plot"),
    ],
)
def test_plot_rows_it_cannot_draw_are_one_line(tmp_path, capsys, rows, message):
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert plot.main([str(tmp_path), f"--out={tmp_path / 'x.png'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------
# evaluate: texts too short to score, a --json folder that is not there


def test_evaluate_refuses_what_it_cannot_score_before_it_runs(tmp_path, capsys):
    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model().state_dict()})
    CharTokenizer(CHARS).save(tmp_path / "tokenizer.json")
    for content in ("", "a"):
        (tmp_path / "t.txt").write_text(content)
        line = one_line(
            run_here(evaluate_command.main, capsys, f"--model={tmp_path}", f"--text={tmp_path / 't.txt'}"),
            "gptlite.evaluate",
        )
        assert f"gives {len(content)} token(s); scoring needs at least 2" in line
    (tmp_path / "t.txt").write_text("To be, or not to be.\n")
    line = one_line(
        run_here(
            evaluate_command.main,
            capsys,
            f"--model={tmp_path}",
            f"--text={tmp_path / 't.txt'}",
            f"--json={tmp_path / 'no' / 'r.json'}",
        ),
        "gptlite.evaluate",
    )
    assert f"folder {tmp_path / 'no'} does not exist" in line
    line = one_line(
        run_here(
            evaluate_command.main, capsys, f"--model={tmp_path}", f"--text={tmp_path / 't.txt'}", "--json=/proc/r.json"
        ),
        "gptlite.evaluate",
    )  # a folder no file can be made in (root ignores permissions; /proc refuses anyway), found before scoring
    assert "--json=/proc/r.json: folder /proc cannot be written" in line
    assert math.isfinite(
        json.loads(
            run_here(
                evaluate_command.main,
                capsys,
                f"--model={tmp_path}",
                f"--text={tmp_path / 't.txt'}",
                f"--json={tmp_path / 'r.json'}",
            ).returncode
            == 0
            and (tmp_path / "r.json").read_text()
        )["val"]["loss"]
    )
    assert os.path.getsize(tmp_path / "r.json") > 0
    assert (
        run_here(
            evaluate_command.main,
            capsys,
            f"--model={tmp_path}",
            f"--text={tmp_path / 't.txt'}",
            f"--json={tmp_path / 'r.json'}",
        ).returncode
        == 0
    )  # an earlier result is replaced
    for given in ("ckpt.pt", "t.txt", "tokenizer.json"):  # inputs never are
        before = (tmp_path / given).read_bytes()
        line = one_line(
            run_here(
                evaluate_command.main,
                capsys,
                f"--model={tmp_path}",
                f"--text={tmp_path / 't.txt'}",
                f"--json={tmp_path / given}",
            ),
            "gptlite.evaluate",
        )
        assert "exists and is not an earlier result of this command" in line
        assert (tmp_path / given).read_bytes() == before


def test_prepare_never_takes_an_input_from_inside_its_out_dir(tmp_path):
    from gptlite.data.prepare import prepare

    out = tmp_path / "out"
    prepare([str(write_text(tmp_path / "a.txt"))], "byte", out, log=lambda *a: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shard = next(out.glob("train_*.bin"))
    with pytest.raises(ValueError, match=f"input {shard} lies inside --out_dir {out}"):
        prepare([str(shard)], "byte", out, overwrite=True, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing deleted before the refusal
    with pytest.raises(ValueError, match=f"--out_dir {tmp_path / 'shards'} lies inside the input folder {tmp_path}"):
        prepare([str(tmp_path)], "byte", tmp_path / "shards", log=lambda *a: None)


def test_a_full_disk_while_preparing_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    from gptlite.data.prepare import prepare
    from gptlite.data.shards import ShardWriter

    src, out = write_text(tmp_path / "a.txt"), tmp_path / "out"
    real = ShardWriter.write

    def full(self, tokens):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ShardWriter, "write", full)
    with pytest.raises(OSError, match=f"could not write the shards in {out} .*: no space left on device; free space"):
        prepare([str(src)], "byte", out, log=lambda *a: None)
    monkeypatch.setattr(ShardWriter, "write", real)
    assert prepare([str(src)], "byte", out, log=lambda *a: None)["train_tokens"] > 0


def test_an_os_error_no_command_described_is_put_in_words():
    from gptlite.cli import in_words

    assert in_words(OSError(errno.ENOSPC, "No space left on device")) == (
        "no space left on device; free space or use a folder on another disk"
    )
    assert in_words(OSError(errno.EACCES, "Permission denied", "/x/y")) == (
        "/x/y: permission denied; use a folder you can write to"
    )


def write_text(path):
    path.write_text("To be, or not to be, that is the question.\n" * 200)
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--chat", "--num_beams=2"],
            "--chat reads its prompts from stdin and samples one reply at a time; drop --num_beams",
        ),
        (["--chat", "--start=hi", "--num_samples=2"], "drop --start, --num_samples"),
        (["--system=Be brief."], "--system is the system prompt of a --chat conversation; add --chat"),
    ],
)
def test_sample_refuses_options_its_mode_would_ignore(tmp_path, capsys, args, message):
    import sample

    assert sample.main([f"--model={tmp_path}", "--device=cpu", *args]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("sample.py: error: ") and message in line and "\n" not in line


def test_a_prompt_file_that_is_not_text_is_named(tmp_path):
    import sample

    (tmp_path / "p.bin").write_bytes(b"ok\x88\x00")
    with pytest.raises(ValueError, match=f"prompt file {tmp_path / 'p.bin'} is not UTF-8 text"):
        sample.read_prompt(f"FILE:{tmp_path / 'p.bin'}")


def test_a_full_disk_under_safetensors_is_one_line_and_keeps_the_earlier_export(tmp_path):
    """A real full disk (a 64 KiB tmpfs, as root) under the export's safetensors writer: one line, the earlier
    export whole."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    from gptlite.hf import export_hf

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        (disk / "hf").mkdir()
        (disk / "hf" / "config.json").write_text("{}")
        with pytest.raises(OSError, match=r"could not write export folder .*hf: no space left on device; free space"):
            export_hf(tiny_model(**LLAMA), disk / "hf", overwrite=True)
        assert [p.name for p in disk.iterdir()] == ["hf"] and (disk / "hf" / "config.json").read_text() == "{}"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_tokenizer_write_that_fails_changes_nothing(tmp_path, monkeypatch):
    from pathlib import Path

    from gptlite.tokenizer.trainer import write_files

    (tmp_path / "tokenizer.json").write_text("old")
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == ".tokenizer.json.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=r"could not write the tokenizer files in .* \(nothing there changed\): no space"):
        write_files(tmp_path, {"tokenizer.json": "new", "tokenizer_config.json": "{}"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]
    assert (tmp_path / "tokenizer.json").read_text() == "old"


def test_serve_names_an_address_it_cannot_listen_on_before_loading(tmp_path, capsys):
    import socket

    from gptlite.serve.__main__ import main as serve_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_main([f"--model={tmp_path / 'no_run'}", f"--port={port}"]) == 2  # refused before the run is read
    assert capsys.readouterr().err.strip() == (
        f"gptlite.serve: error: cannot listen on 127.0.0.1:{port} (Address already "
        "in use); choose another --port or --host"
    )
