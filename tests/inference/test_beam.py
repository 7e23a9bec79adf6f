"""Beam search against transformers' generate(num_beams=N, do_sample=False): the same tokens for ragged prompts,
with and without an end token met early, every early_stopping mode; argument errors; sample.py --num_beams."""

import subprocess
import sys

import pytest
import torch
import transformers

import sample
from gptlite import GPT
from gptlite.inference.beam import beam_search
from gptlite.inference.sampling import GenerationOptions
from gptlite.tokenizer import CharTokenizer
from tests.conftest import ROOT, tiny_model

transformers.logging.set_verbosity_error()
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]  # ragged: the second is left-padded for transformers
NEW = 12
PAD = 1  # transformers fills finished rows with its pad id (0 would be replaced by the end token)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers GPT-2 with random weights, the same weights through GPT.from_pretrained)."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=97, n_positions=64, bos_token_id=None, eos_token_id=None
        )
    )
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("gpt2")
    hf.eval().save_pretrained(directory)
    return hf, GPT.from_pretrained(str(directory))


def hf_beams(hf, eos, **kw) -> list[list[int]]:
    """transformers' continuations of PROMPTS, without their padding."""
    width = max(map(len, PROMPTS))
    idx = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(
        idx, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=eos, **kw
    )[:, width:].tolist()
    rows = []
    for row in out:  # a row that ended holds its end token, then padding
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
        assert all(t == PAD for t in row[len(rows[-1]) :])
    return rows


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("with_end", [False, True], ids=["no-end-token", "end-token-met-early"])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)])
def test_the_same_tokens_as_transformers(models, num_beams, with_end, length_penalty, early_stopping):
    hf, model = models
    end = model.generate(PROMPTS, 4, temperature=0)[0][len(PROMPTS[0]) + 2] if with_end else None  # 3rd greedy token
    kw = dict(
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=num_beams,
    )
    expected = hf_beams(hf, end, **kw)
    ours = model.generate(PROMPTS, NEW, stop_tokens=[end] if with_end else [], **kw)
    assert [row[len(PROMPTS[i // num_beams]) :] for i, row in enumerate(ours)] == expected
    if with_end and length_penalty <= 1.0:  # (a larger penalty favours the long hypotheses that did not end)
        assert any(len(row) < NEW for row in expected)  # some hypothesis did end early
    best = model.generate(
        PROMPTS,
        NEW,
        temperature=0,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        stop_tokens=[end] if with_end else [],
    )
    assert best == [ours[0], ours[num_beams]]  # num_return_sequences=1: the best of each prompt


def test_tensor_prompts_padded_rows_and_one_beam_is_greedy(models):
    _, model = models
    idx = torch.tensor([PROMPTS[0], [20, 21, 22, 23, 24, 25]])
    greedy = model.generate(idx, NEW, temperature=0)
    assert torch.equal(model.generate(idx, NEW, num_beams=1), greedy)
    assert torch.equal(model.generate(idx, NEW, temperature=0, num_beams=1), greedy)
    beams = model.generate(idx, NEW, num_beams=3, num_return_sequences=2)
    lists = model.generate(idx.tolist(), NEW, num_beams=3, num_return_sequences=2)
    assert beams.shape == (4, 6 + NEW) and [[t for t in row if t != -1] for row in beams.tolist()] == lists
    end = lists[0][8]  # the first hypothesis' third token, made an end token: rows end at different lengths
    ended = model.generate(idx, NEW, num_beams=3, num_return_sequences=2, stop_tokens=[end])
    assert (ended == -1).any() and ended.shape[1] <= 6 + NEW


def test_beams_follow_their_parents_in_the_cache_and_compiled_steps_agree(models, monkeypatch):
    """The cache rows are reordered, never recomputed: each step feeds one token per beam. A compiled step
    (dynamo's capture, no code generation) gives the same beams."""
    _, model = models
    module = sys.modules["gptlite.inference.kvcache"]  # its start_decoding hands beam search the step
    decode_step = module.decode_step
    calls = []
    monkeypatch.setattr(module, "decode_step", lambda m, t, c: calls.append(t.shape) or m.step(t, c))
    plain = model.generate(PROMPTS, NEW, num_beams=4)
    # the 2 prompts prefilled once (6 tokens, left-padded), then 2 prompts x 4 beams, one token each
    assert calls == [(2, 6), *[(8, 1)] * (NEW - 1)]
    torch._dynamo.reset()
    monkeypatch.setattr(
        module, "_compiled", {"cpu": torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)}
    )
    assert model.generate(PROMPTS, NEW, num_beams=4, compile=True) == plain


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_beams": 0}, "num_beams=0 must be an integer >= 1"),
        ({"num_beams": 2, "temperature": 0.7}, r"temperature=0.7 must be 0 or 1 .* \(beam sampling is not supported\)"),
        ({"num_beams": 2, "top_k": 5}, r"top_k=5 must be None there \(beam sampling"),
        ({"num_beams": 2, "top_p": 0.9}, r"probabilities, so top_p=0.9 must be None there"),
        ({"num_beams": 2, "num_return_sequences": 2.0}, "num_return_sequences=2.0 must be an integer"),
        ({"num_beams": -1}, "num_beams=-1 must be an integer >= 1"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences=3 must be between 1 and num_beams=2"),
        ({"num_beams": 2, "seed": 1}, "seed cannot be used with num_beams"),
        ({"num_beams": 2, "repetition_penalty": 1.2}, "repetition_penalty cannot be used with num_beams"),
        ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping='sometimes' must be True, False or 'never'"),
    ],
)
def test_beam_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_model().generate(torch.tensor([[1, 2]]), 3, **kwargs)


def test_beams_that_part_late_or_not_at_all_are_said_to():
    """The README's --num_beams=4 --num_samples=2 on its char model printed two samples that looked the same: the
    best beams part little and late. Where they share more than half their text, a note says so and how to get
    continuations that differ; beams that part early get none."""
    assert sample.alike_beams_note(["the king is dead", "the king is here"]) == (
        "the 2 best beams share their first 12 characters: beam search returns the likeliest continuations, which "
        "part little and late; for continuations that differ, sample (--num_beams=1, the default)"
    )
    assert "the 2 best beams are the same text: " in sample.alike_beams_note(["the king", "the king"])
    assert sample.alike_beams_note(["the king is dead", "a queen lives on"]) is None
    assert sample.alike_beams_note(["the king is dead"]) is None


def test_beams_need_the_whole_context_within_block_size():
    with pytest.raises(ValueError, match=r"prompt plus max_new_tokens - 1 = 40 is more than block_size=32; shorten"):
        beam_search(tiny_model(), [[1] * 10], 31, GenerationOptions(num_beams=2))
    rope = tiny_model(pos_emb="rope")
    assert len(rope.generate([[1] * 10], 31, num_beams=2, extend_context=True)[0]) == 41


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_sample_py_prints_the_best_beams(tmp_path):
    model = tiny_model()
    from gptlite.checkpoint import save_checkpoint
    from gptlite.config import build_config, config_to_dict

    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": model.state_dict()})
    chars = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"
    tokenizer = CharTokenizer(chars)
    tokenizer.save(tmp_path / "tokenizer.json")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            f"--model={tmp_path}",
            "--start=ROMEO:",
            "--num_beams=4",
            "--num_samples=2",
            "--max_new_tokens=20",
            "--device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    expected = model.generate([tokenizer.encode("ROMEO:")], 20, num_beams=4, num_return_sequences=2)
    assert result.stdout == "".join(
        tokenizer.decode(row) + "\n" + ("-" * 40 + "\n" if i == 0 else "") for i, row in enumerate(expected)
    )
    texts = [tokenizer.decode(row)[len("ROMEO:") :] for row in expected]
    note = sample.alike_beams_note(texts)
    assert result.stderr == (f"sample.py: note: {note}\n" if note else "")
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            f"--out_dir={tmp_path}",
            "--num_beams=4",
            "--temperature=0.8",
            "--device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert refused.returncode == 2 and "temperature=0.8 must be 0 or 1" in refused.stderr
