"""Bits per byte against its definition, HellaSwag against a plain reference scorer, bad HellaSwag files, the
evaluation command, and val bpb in train.py's log."""

import json
import math
import re
import string
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPT, GPTConfig, evaluate
from gptlite.data.prepare import prepare
from gptlite.evaluate import byte_lengths, ending_losses, evaluate_windows, hellaswag, read_hellaswag
from gptlite.evaluate import command as evaluate_command
from gptlite.tokenizer import CharTokenizer, get_tokenizer
from tests.conftest import ROOT, run_train, shared_file

TEXT = "Hello, naïve café 日本語 🙂 world.\n" * 3  # multi-byte characters: bytes != characters != tokens


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    return get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))


def tiny_gpt(vocab_size: int, block_size: int = 16, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=16)).eval()


def test_bpb_of_ascii_characters_is_the_loss_in_bits():
    text = shared_file("data/tinyshakespeare.txt").read_text()[:3000]
    assert text.isascii()
    tokenizer = CharTokenizer(sorted(set(text)))
    model = tiny_gpt(tokenizer.vocab_size)
    loss, bpb, n = evaluate_windows(
        model, [torch.tensor(tokenizer.encode(text))], 4, byte_lengths(tokenizer, tokenizer.vocab_size)
    )
    assert n == len(text) - 1 and bpb == pytest.approx(loss / math.log(2), rel=1e-6)


def test_bpb_of_gpt2_tokens_agrees_with_their_decoded_bytes(gpt2_tokenizer):
    """Reference: window by window, the cross-entropy of every target but end-of-text (which stands for no
    text) over ln 2 and the UTF-8 bytes of those targets decoded."""
    tok, eot = gpt2_tokenizer, gpt2_tokenizer.eot_id
    ids = tok.encode(TEXT) + [eot] + tok.encode(TEXT[::-1])
    model = tiny_gpt(tok.vocab_size + 7)  # a padded vocabulary: the extra ids are no text
    lengths = byte_lengths(tok, model.config.vocab_size)
    assert lengths[eot] == 0 and (lengths[tok.vocab_size :] == 0).all() and lengths[tok.encode(" world")[0]] == 6
    loss, bpb, n = evaluate_windows(model, [torch.tensor(ids)], 3, lengths)
    nats, targets, kept = 0.0, [], []
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 16):
            window = torch.tensor(ids[start : start + 17])
            ce = F.cross_entropy(model(window[None, :-1])[0][0], window[1:], reduction="none")
            for t, c in zip(window[1:].tolist(), ce.tolist(), strict=True):
                targets.append(c)
                if t != eot:
                    nats += c
                    kept.append(t)
    assert n == len(targets) == len(ids) - 1 and loss == pytest.approx(sum(targets) / len(targets), rel=1e-5)
    assert bpb == pytest.approx(nats / (math.log(2) * len(tok.token_bytes(kept))), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# HellaSwag

EXAMPLES = [
    {
        "ctx": "A man is sitting on a roof. He",
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "label": 3,
    },
    {
        "ctx": "The chef cracks two eggs into the bowl and",
        "endings": ["whisks them.", "sings", "the bowl flies to the moon and back again.", "puts on a coat."],
        "label": 0,
    },
    {
        "ctx": "Kids play football. A boy",
        "endings": ["kicks the ball into the goal", "eats", "reads a long book about trains", "sleeps"],
        "label": 0,
    },
    {
        "ctx": "She opens her laptop, types a password,",
        "endings": ["and logs in.", "then the laptop", "and", "naïve café 日本語"],
        "label": 1,
    },
    {
        "ctx": "Rain falls on the city while",
        "endings": ["people open umbrellas", "x", "the sun", "cars drive slowly through puddles"],
        "label": 2,
    },
]


def write_jsonl(path, rows) -> None:
    path.write_text(
        "".join(json.dumps({**r, "ind": i, "split": "val"}) + "\n" for i, r in enumerate(rows)), encoding="utf-8"
    )


def reference_ending_losses(model, tokenizer, example):
    """One ending at a time, no padding: the context's tokens then those of ' ' + ending, the ending's loss."""
    totals, means = [], []
    with torch.no_grad():
        for ending in example["endings"]:
            ctx, end = tokenizer.encode(example["ctx"]), tokenizer.encode(" " + ending)
            tokens = torch.tensor(ctx + end)
            ce = F.cross_entropy(model(tokens[None, :-1])[0][0], tokens[1:], reduction="none")[len(ctx) - 1 :]
            totals.append(ce.sum().item())
            means.append(ce.mean().item())
    return totals, means


def test_hellaswag_equals_a_plain_reference_scorer(gpt2_tokenizer, tmp_path):
    model = tiny_gpt(gpt2_tokenizer.vocab_size, block_size=64, seed=3)
    total, mean = ending_losses(model, gpt2_tokenizer, EXAMPLES)  # all five at once, padded to the longest
    correct = correct_norm = 0
    for i, example in enumerate(EXAMPLES):
        ref_total, ref_mean = reference_ending_losses(model, gpt2_tokenizer, example)
        torch.testing.assert_close(total[i], torch.tensor(ref_total), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(mean[i], torch.tensor(ref_mean), atol=1e-4, rtol=1e-5)
        correct += min(range(4), key=ref_total.__getitem__) == example["label"]
        correct_norm += min(range(4), key=ref_mean.__getitem__) == example["label"]
    assert not torch.equal(total.argmin(1), mean.argmin(1))  # the two scores disagree somewhere: both are tested
    path = tmp_path / "hellaswag_val.jsonl"
    write_jsonl(path, EXAMPLES)
    for batch_size in (1, 2, 8):
        scores = hellaswag(model, gpt2_tokenizer, path, batch_size=batch_size, progress=False)
        assert scores == {"acc": correct / 5, "acc_norm": correct_norm / 5, "n": 5}
    assert hellaswag(model, gpt2_tokenizer, path, limit=2, progress=False)["n"] == 2


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", r"line 2 is not JSON \(Expecting value\)"),
        ('{"ctx": "a", "label": 0}', r"line 2 has no field 'endings'; a HellaSwag row holds ctx, endings and label"),
        ('{"ctx": "a", "endings": ["x", "y"], "label": 0}', r"line 2: endings must be a list of 4 strings"),
        (
            '{"ctx": "a", "endings": ["w", "x", "y", "z"], "label": 7}',
            r"line 2: label must be one of 0, 1, 2, 3 \(got 7\)",
        ),
        (
            '{"ctx": null, "endings": ["w", "x", "y", "z"], "label": 2}',
            r"line 2: ctx must be a non-empty string .*got None",
        ),
        ('{"ctx": "", "endings": ["w", "x", "y", "z"], "label": 2}', r"line 2: ctx must be a non-empty string"),
        ('{"ctx": "a", "endings": ["w", "x", "y", "z"], "label": true}', r"line 2: label must be one of 0, 1, 2, 3"),
    ],
)
def test_a_bad_hellaswag_row_is_named(tmp_path, line, message):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + " " + message):
        read_hellaswag(path)


def test_a_hellaswag_row_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_bytes(json.dumps(EXAMPLES[0]).encode() + b"\n" + b'{"ctx": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" line 2 is not UTF-8 text"):
        read_hellaswag(path)


def test_missing_and_empty_hellaswag_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"HellaSwag file .*nope\.jsonl does not exist; download https://"):
        read_hellaswag(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no HellaSwag examples"):
        read_hellaswag(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------------------------------------
# train.py and the command


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:50_000] + string.printable)  # all of ASCII
    data = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", data, log=lambda *a: None)
    out = tmp_path_factory.mktemp("run")
    summary = run_train(
        f"--data_dir={data}",
        f"--out_dir={out}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=32",
        "--max_iters=4",
        "--eval_interval=4",
        "--eval_iters=0",
        "--device=cpu",
    )
    return data, out, summary


def test_train_logs_val_bpb_next_to_val_loss(char_run):
    _, out, summary = char_run
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line][-1]
    assert row["val_loss"] == summary["val_history"][-1][1]
    assert row["val_bpb"] == pytest.approx(row["val_loss"] / math.log(2), rel=1e-6)  # ASCII characters: 1 byte each


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_evaluate_command(char_run, tmp_path, gpt2_tokenizer, capsys):
    data, out, summary = char_run
    hellaswag_file = tmp_path / "hs.jsonl"
    write_jsonl(hellaswag_file, [e for e in EXAMPLES if (e["ctx"] + "".join(e["endings"])).isascii()])  # char model
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlite.evaluate",
            f"--out_dir={out}",
            "--task=val,hellaswag",
            f"--hellaswag_file={hellaswag_file}",
            f"--json={tmp_path / 'r.json'}",
            "--device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("val: loss ") and f"of {data} val split" in lines[0]
    assert lines[1].startswith("hellaswag: acc ") and "| 4 examples |" in lines[1]
    results = json.loads((tmp_path / "r.json").read_text())
    # train.py's every window of the val split, but for the last, shorter one
    assert results["val"]["loss"] == pytest.approx(summary["val_history"][-1][1], abs=0.02)
    assert 0 <= results["hellaswag"]["acc"] <= 1 and results["hellaswag"]["n"] == 4
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 5)
    result = subprocess.run(
        [sys.executable, "-m", "gptlite.evaluate", f"--out_dir={out}", f"--text={text}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0 and f"tokens of {text}" in result.stdout, result.stderr
    for args, message in [
        ([], "give the model to read: --model=X, where X is a gptlite run folder, a Hugging Face directory or a hub"),
        ([f"--model={out}", "--task=mmlu"], "--task: unknown 'mmlu'"),
        (
            [f"--model={out}", "--task=hellaswag", f"--hellaswag_file={tmp_path / 'x.jsonl'}"],
            "does not exist; download",
        ),
    ]:
        code = evaluate_command.main(args)  # in this process: the same one-line errors, without a Python start each
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_offline_hellaswag_download_fails_first_and_names_the_option(char_run, tmp_path, monkeypatch, capsys):
    """--task=val,hellaswag without network: the download fails before val is scored, in one line that says to pass
    --hellaswag_file; no results file and no empty folder are left."""
    _, out, _ = char_run
    monkeypatch.chdir(tmp_path)  # the default file, data/hellaswag/hellaswag_val.jsonl, is relative to here
    # nothing listens
    monkeypatch.setattr(evaluate.hellaswag_task, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")
    code = evaluate_command.main([f"--model={out}", "--task=val,hellaswag", f"--json={tmp_path / 'r.json'}"])
    captured = capsys.readouterr()
    assert code == 2 and "val:" not in captured.out
    error = captured.err.strip()
    assert re.fullmatch(r"gptlite\.evaluate: error: could not download http://127\.0\.0\.1:9/hellaswag_val\.jsonl "
                        r"\(.*\); download it elsewhere and pass the local file instead with --hellaswag_file=PATH",
                        error), error  # fmt: skip
    assert not (tmp_path / "data").exists() and not (tmp_path / "r.json").exists()


def test_a_text_folder_and_a_run_without_data_are_named(char_run, tmp_path, capsys):
    """--text=FOLDER was said not to exist; a checkpoint whose config names no data_dir (made by hand) gave 'data
    does not exist; ... --out_dir=)' with the empty path. Each is one line naming what to give."""
    from gptlite.checkpoint import load_checkpoint, save_checkpoint

    _, out, _ = char_run
    assert evaluate_command.main([f"--model={out}", f"--text={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--text={tmp_path} is a folder; give a text file (or --data_dir=DIR for prepared shards)" in err, err
    ckpt = load_checkpoint(out)
    ckpt["config"]["data_dir"] = ""
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run / "ckpt.pt", ckpt)
    assert evaluate_command.main([f"--model={run}", "--task=val", f"--tokenizer={out / 'tokenizer.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--task=val: the run {run} names no data_dir in its checkpoint's" in err
