"""Hugging Face interop against transformers itself: GPT-2 and Llama checkpoints in (logits, greedy tokens, the
Hub's key layout), gptlite models out, GPT-2's tokenizer files, train.py and sample.py --init_from, refusals."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gptlite import GPT, GPTConfig
from gptlite.checkpoint import load_checkpoint
from gptlite.cli import parse
from gptlite.config import read_toml
from gptlite.data.prepare import prepare
from gptlite.hf import GPT2_NAMES, export_hf, family_of
from gptlite.hf.tokenizer_files import bpe_merges, hf_tokenizer_files
from gptlite.tokenizer import ByteTokenizer, CharTokenizer, TiktokenTokenizer, get_tokenizer, load_tokenizer
from gptlite.tokenizer.tiktoken_bpe import tiktoken_encoding
from gptlite.train.run_config import resolve_config
from tests.conftest import ROOT, run_train, shared_file, tiny_model

transformers.logging.set_verbosity_error()
V, T = 97, 64  # vocabulary and positions of the tiny models
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"  # a char tokenizer with V ids


def randomized(model):
    """Every parameter random, norm weights and biases too, so that no mapping error hides behind ones and zeros."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def hf_gpt2(**kw):
    return randomized(
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=2, n_head=4, n_embd=32, vocab_size=V, n_positions=T, bos_token_id=None, eos_token_id=None, **kw
            )
        )
    )


def hf_llama(**kw):
    config = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=V,
        max_position_embeddings=T,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    return randomized(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **kw})))


def save(model, tmp_path_factory, name: str):
    """(transformers model, the directory save_pretrained wrote it to)."""
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def gpt2_saved(tmp_path_factory):
    return save(hf_gpt2(), tmp_path_factory, "gpt2")


@pytest.fixture(scope="module")
def llama_saved(tmp_path_factory):
    return save(hf_llama(), tmp_path_factory, "llama")


@pytest.fixture(params=["gpt2", "llama"])
def saved(request):
    return request.getfixturevalue(f"{request.param}_saved")


def ids(batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1))


def test_import_gives_the_logits_and_greedy_tokens_of_transformers(saved):
    hf, directory = saved
    model = GPT.from_pretrained(str(directory))
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-4, rtol=0)
        expected = hf.generate(idx, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(idx, 20, temperature=0), expected)
    assert not model.training and model.lm_head.weight is model.tok_emb.weight


def test_the_hubs_gpt2_layout_loads_too(gpt2_saved, tmp_path):
    """The Hub's gpt2 files name the weights without `transformer.`, keep no lm_head and carry attention-mask
    buffers; pytorch_model.bin instead of safetensors."""
    hf, directory = gpt2_saved
    weights = {k.removeprefix("transformer."): v for k, v in load_file(directory / "model.safetensors").items()}
    weights |= {f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, T, T)) for i in range(2)}
    weights |= {f"h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)}
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    torch.save(weights, tmp_path / "pytorch_model.bin")
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(str(tmp_path))(idx)[0], hf(idx).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "switches",
    [dict(ffn="gelu", bias=True), dict(ffn="gelu"), dict(pos_emb="rope", norm="rmsnorm", rope_theta=500.0)],
    ids=["gpt2", "gpt2-without-biases", "llama"],
)
def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(tmp_path, switches):
    model = randomized(GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=32, **switches)))
    written = export_hf(model, tmp_path)
    assert sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if "rope" in switches.values() else "GPT2LMHeadModel")
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-4, rtol=0)
    back = GPT.from_pretrained(str(tmp_path))
    for name, tensor in model.state_dict().items():  # a model without biases comes back with zero biases
        assert torch.equal(back.state_dict()[name], tensor), name
    # the directory is not overwritten unless asked
    with pytest.raises(
        FileExistsError, match=r"already holds model\.safetensors, config\.json; export to a new directory"
    ):
        export_hf(model, tmp_path)
    export_hf(model, tmp_path, overwrite=True)


def trained_with(config: GPTConfig, flags: str) -> GPTConfig:
    """`config` with train.py's `flags` (as a shell hands them over) set."""
    given = parse(GPTConfig, shlex.split(flags))
    return dataclasses.replace(config, **{name: getattr(given, name) for name in given.given})


def test_other_models_are_refused_naming_the_flags_that_make_one_that_exports(tmp_path):
    """The quick start's switches (learned positions, LayerNorm, SwiGLU) and others: one short line naming the
    train.py flags of GPT-2's and of Llama's layout, each of which makes a model that exports."""
    quick_start = read_toml(ROOT / "configs" / "shakespeare_char_cpu.toml")
    shape = dict(vocab_size=V, block_size=T, n_layer=1, n_head=4, n_embd=32)
    for switches in (
        {k: v for k, v in quick_start.items() if k in ("pos_emb", "norm", "ffn", "bias")},
        dict(pos_emb="sinusoidal", ffn="gelu"),
        dict(pos_emb="rope", norm="rmsnorm", bias=True),
        dict(pos_emb="rope", norm="rmsnorm", qkv_bias=True, qk_norm=True),
        dict(pos_emb="learned", n_kv_head=2, embed_scale=2.0),
    ):
        config = GPTConfig(**shape, **switches)
        with pytest.raises(ValueError, match=r"has no transformers architecture; a model trained with --") as e:
            export_hf(GPT(config), tmp_path)
        message = str(e.value)
        assert "\n" not in message and len(message) < 300, message
        suggested = re.findall(r"((?:--\S+ ?)+) \((\w+)\)", message.split("; ")[1])
        assert {family for _, family in suggested} >= {"GPT2LMHeadModel"}, message
        for flags, family in suggested:
            assert family_of(trained_with(config, flags)).architecture == family, flags
    assert not any(tmp_path.iterdir())  # nothing was written
    config = GPTConfig(**shape, pos_emb="learned")
    with pytest.raises(ValueError) as e:
        export_hf(GPT(config), tmp_path)
    assert str(e.value) == (
        "a model with pos_emb='learned', norm='layernorm', ffn='swiglu' has no transformers architecture; a model "
        "trained with --ffn=gelu (GPT2LMHeadModel) or --pos_emb=rope --norm=rmsnorm (LlamaForCausalLM) exports"
    )


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: hf_llama(attention_bias=True), r"biases on the attention's projections, its output's too"),
        (lambda: hf_llama(mlp_bias=True), r"biases in the feed-forward \(mlp_bias=true\)"),
        (
            lambda: hf_llama(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 500.0,
                    "original_max_position_embeddings": 32,
                }
            ),
            r"RoPE scaling of type 'yarn'",
        ),
        (lambda: hf_gpt2(activation_function="relu"), r"activation_function='relu'"),
        (
            lambda: randomized(
                transformers.GemmaForCausalLM(
                    transformers.GemmaConfig(
                        hidden_size=32,
                        intermediate_size=48,
                        num_hidden_layers=1,
                        num_attention_heads=4,
                        num_key_value_heads=1,
                        head_dim=8,
                        vocab_size=V,
                    )
                )
            ),
            r"model_type='gemma' is Gemma's scaled embeddings and GeGLU feed-forward, which "
            r"gptlite does not have; gptlite loads GPT2LMHeadModel \(gpt2\), LlamaForCausalLM",
        ),
    ],
)
def test_checkpoints_gptlite_cannot_hold_are_refused_in_one_line(tmp_path, make, message):
    make().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(tmp_path))


def without_a_tensor(state: dict, config: dict) -> None:
    del state["model.layers.1.mlp.up_proj.weight"]


def untied_in_the_config(state: dict, config: dict) -> None:
    config["tie_word_embeddings"] = False  # the file holds no lm_head.weight: it was saved tied


def with_an_extra_tensor(state: dict, config: dict) -> None:
    state["model.layers.0.extra.weight"] = torch.zeros(3)


def with_a_head_of_its_own(state: dict, config: dict) -> None:
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0  # though the config ties them


@pytest.mark.parametrize(
    "edit, message",
    [
        (without_a_tensor, r"the checkpoint has no model.layers.1.mlp.up_proj.weight, which a LlamaForCausalLM of 2"),
        (untied_in_the_config, r"the checkpoint has no lm_head.weight, which a LlamaForCausalLM of 2 layers needs"),
        (with_an_extra_tensor, r"the checkpoint has weights a LlamaForCausalLM of gptlite's kind does not: model."),
        (with_a_head_of_its_own, r"the checkpoint's lm_head.weight differs from its token embedding though its"),
    ],
)
def test_weights_that_do_not_match_the_config_are_refused_naming_the_folder_and_the_fix(tmp_path, edit, message):
    hf_llama().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    edit(state, config)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: {message}.*(: download|: set) ") as e:
        GPT.from_pretrained(str(tmp_path))
    assert "download" in str(e.value)


def test_a_smaller_block_size_crops_the_learned_positions(saved):
    hf, directory = saved
    model = GPT.from_pretrained(str(directory), block_size=16, dropout=0.1)
    assert model.config.block_size == 16 and model.config.dropout == 0.1
    idx = ids(length=16)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx)[0], hf(idx).logits, atol=1e-4, rtol=0)
    if isinstance(hf, transformers.GPT2LMHeadModel):
        with pytest.raises(ValueError, match=rf"block_size=128 is more than the {T} positions .* learned"):
            GPT.from_pretrained(str(directory), block_size=128)
    with pytest.raises(ValueError, match="the pretrained model fixes n_layer; only block_size"):
        GPT.from_pretrained(str(directory), n_layer=3)


def test_missing_checkpoints_and_offline_downloads_fail_in_one_line(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"nowhere is not a folder here, nor a name gptlite downloads: .* gpt2, gpt2-medium"
    ):
        GPT.from_pretrained(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"config\.json does not exist"):
        GPT.from_pretrained(str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--model=gpt2", "--device=cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"hf download {GPT2_NAMES['gpt2']} config.json model.safetensors" in result.stderr
    assert "pass that directory instead of 'gpt2'" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# GPT-2's tokenizer


def test_gpt2_tokenizer_files_give_transformers_the_same_ids(tmp_path):
    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    for name, text in hf_tokenizer_files(tokenizer, 1024).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [
        "Hello world",
        "  spaces, tabs\tand\n\nnew lines ",
        "naïve café 日本語 🙂",
        "It's they're we've I'd 3.14",
        shared_file("data/tinyshakespeare.txt").read_text()[:5000],
    ]
    for text in texts:
        assert hf(text)["input_ids"] == tokenizer.encode(text), text[:40]
    assert hf.eos_token_id == tokenizer.eot_id == 50256 and hf.decode(tokenizer.encode(texts[2])) == texts[2]
    other = TiktokenTokenizer(  # GPT-2's ranks split by another pattern: transformers' GPT-2 tokenizer cannot
        tiktoken_encoding("other", r"\S+|\s+", tokenizer.enc._mergeable_ranks, {"<|endoftext|>": 50256})
    )
    with pytest.raises(
        ValueError, match="reproduces byte-pair encodings with GPT-2's split pattern only; this tokenizer is tiktoken "
        "with another pattern"
    ):  # fmt: skip
        hf_tokenizer_files(other, 64)


def test_bpe_merges_are_recovered_from_ranks():
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"abc": 257, b"cab": 258, b"abab": 259}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"c", b"ab"), (b"ab", b"ab")]
    with pytest.raises(ValueError, match=r"token 3 \(b'abc'\) is no merge of two tokens"):
        bpe_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


# ---------------------------------------------------------------------------------------------
# train.py, sample.py and the command line


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """Tiny Shakespeare in chars: 65 ids, all below the tiny models' vocabulary of 97."""
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:60_000])
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


def test_train_from_pretrained_weights_with_learning_rate_0_changes_nothing(saved, char_data, tmp_path):
    hf, directory = saved
    args = [
        f"--init_from={directory}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path}",
        "--learning_rate=0",
        "--max_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=32",
        "--device=cpu",
    ]
    cfg = resolve_config(args)
    assert (cfg.model.vocab_size, cfg.model.block_size, cfg.model.n_layer) == (V, 32, 2)
    summary = run_train(*args)
    assert summary["step"] == 3
    saved_weights = load_checkpoint(tmp_path)["model"]
    for name, tensor in GPT.from_pretrained(str(directory), block_size=32).state_dict().items():
        assert torch.equal(saved_weights[name], tensor), name  # bit for bit
    # the shape is the pretrained model's; a resumed run continues from the checkpoint
    with pytest.raises(ValueError, match=r"--init_from=.* fixes the model's shape; drop n_layer=3 \(the model has 2\)"):
        resolve_config([*args, "--n_layer=3"])
    resumed = run_train(f"--out_dir={tmp_path}", "--resume", "--max_iters=4")
    assert resumed["step"] == 4


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_sample_from_pretrained_weights_prints_text(saved, tmp_path):
    _, directory = saved
    CharTokenizer(CHARS).save(tmp_path / "tokenizer.json")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            f"--init_from={directory}",
            f"--tokenizer={tmp_path / 'tokenizer.json'}",
            "--start=ROMEO:",
            "--num_samples=1",
            "--max_new_tokens=30",
            "--device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) > 30
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), f"--init_from={directory}", "--device=cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "is not GPT-2 (97 ids), so its tokenizer is unknown" in result.stderr


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_export_command_writes_a_run_for_transformers(char_data, tmp_path):
    run = tmp_path / "run"
    run_train(
        f"--data_dir={char_data}",
        f"--out_dir={run}",
        "--ffn=gelu",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=16",
        "--max_iters=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--device=cpu",
    )
    command = [sys.executable, "-m", "gptlite.hf", "export", f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "no tokenizer files are written" not in result.stdout and "GPT2LMHeadModel" in result.stdout
    # the files the README's export section lists, no more
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    chars = load_tokenizer(run)  # the run's char tokenizer, written for transformers: the same ids both ways
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(text)["input_ids"] == chars.encode(text) == load_tokenizer(tmp_path / "hf").encode(text)
    assert theirs.decode(chars.encode(text)) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model = GPT.from_pretrained(str(tmp_path / "hf"))
    idx = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_inner"] == 64
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (
        again.returncode == 2 and "already holds model.safetensors" in again.stderr and "Traceback" not in again.stderr
    )
    default = tmp_path / "default"  # the quick start's model, smaller: no transformers class
    run_train(
        str(ROOT / "configs" / "shakespeare_char_cpu.toml"),
        f"--data_dir={char_data}",
        f"--out_dir={default}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=16",
        "--max_iters=1",
        "--eval_interval=1",
        "--eval_iters=1",
        "--device=cpu",
    )
    refused = subprocess.run(
        [*command[:4], f"--out_dir={default}", f"--hf_dir={tmp_path / 'hf2'}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        "gptlite.hf: error: a model with pos_emb='learned', norm='layernorm', ffn='swiglu' has no transformers "
        "architecture; a model trained with --ffn=gelu (GPT2LMHeadModel) or --pos_emb=rope --norm=rmsnorm "
        "(LlamaForCausalLM) exports"
    )
    assert not (tmp_path / "hf2").exists()


def test_byte_and_char_tokenizers_are_written_for_transformers_with_their_ids(tmp_path):
    """A byte or char model's export carries a tokenizer.json that transformers and gptlite read with the model's
    ids: every byte, unseen characters refused alike, the chat markers gptlite added, the chat template."""
    texts = ["héllo wörld 日本 🙂\n\t", bytes(range(256)).decode("latin-1"), "<|im_start|>user\nhi<|im_end|>"]
    chars = CharTokenizer(set(texts[0] + texts[2]) - set("<|>_"))
    byte = ByteTokenizer()
    for tokenizer in (byte, chars):
        tokenizer.use_default_template()  # as data/prepare.py --chat does: ChatML's markers past the vocabulary
        folder = tmp_path / tokenizer.kind
        folder.mkdir()
        for name, content in hf_tokenizer_files(tokenizer, 64).items():
            (folder / name).write_text(content)
        theirs, again = transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
        for text in texts[:2] if tokenizer is byte else [texts[0]]:
            assert theirs(text)["input_ids"] == tokenizer.encode(text) == again.encode(text), text
            assert theirs.decode(tokenizer.encode(text)) == text
        marked, _ = tokenizer.encode_special(texts[2])  # the markers as the special tokens they are
        assert theirs(texts[2])["input_ids"] == marked and tokenizer.special_id("<|im_end|>") in marked
        assert again.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_weights_of_a_dtype_a_model_cannot_hold_are_refused(char_data, tmp_path, dtype):
    """Issue 84: an int32 embedding was cast to float and trained on (its values 99.9% zeros); sample, evaluate and
    serve met a load_state_dict traceback. Refused in one line naming the file, the tensor and the dtype."""
    import safetensors.torch

    directory = tmp_path / "hf"
    hf_llama().save_pretrained(directory)
    weights = safetensors.torch.load_file(directory / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].to(dtype)
    safetensors.torch.save_file(weights, directory / "model.safetensors")
    dtype_name = str(dtype).removeprefix("torch.")
    message = (
        f"{directory / 'model.safetensors'}: tensor model.embed_tokens.weight is {dtype_name}, and a model's weights "
        "are floating point (float32, bfloat16, float16); the file is damaged or not a model's weights: download or "
        "save it again"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GPT.from_pretrained(str(directory))
    run = run_train(f"--init_from={directory}", f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}",
                    "--max_iters=1", "--block_size=32", "--batch_size=2", "--device=cpu")  # fmt: skip
    assert run.code == 2 and run.error == message and not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_gptlite_checkpoint_with_integer_weights_is_refused(tmp_path):
    from gptlite.checkpoint import model_from_checkpoint

    model = tiny_model()
    state = {k: v.to(torch.int32) if k == "tok_emb.weight" else v for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tensor tok_emb\.weight is int32, and the model holds floating-point"):
        model_from_checkpoint({"config": {**vars(model.config)}, "model": state})
