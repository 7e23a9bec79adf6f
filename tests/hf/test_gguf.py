"""GGUF export against llama.cpp itself (llama-cpp-python): tokens, logits and greedy continuations, the chat
template, the refusals, and a file that is whole or absent."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from tokenizers import pre_tokenizers

from gptlite import GPT, GPTConfig
from gptlite.cli import parse
from gptlite.config import read_toml
from gptlite.device import cpu_summary
from gptlite.files import write_folder
from gptlite.hf import export_hf
from gptlite.hf.__main__ import main as hf_main
from gptlite.hf.families.llama import llama_rows
from gptlite.hf.gguf import LLAMA3_PATTERN, QWEN2_PATTERN, export_gguf, gguf_tensors, role_wrappers
from gptlite.tokenizer import CharTokenizer, HFTokenizer, tokenizer_from_spec
from gptlite.tokenizer.chat import render
from gptlite.tokenizer.trainer import train_bpe
from tests.conftest import ROOT, run_train, shared_file
from tests.helpers.llama_cpp_reference import llama_cpp

TEXTS = [
    "Hello world",
    "héllo wörld — 日本語のテキスト 🙂🙃 naïve café",
    "  spaces\tand\ttabs  \n\n\n  trailing   ",
    "it's we'll they've 123 4567 89012 3.14159 !!?? x",
    "def f(x):\n    return x ** 2  # squares\n\r\n\tindented\r\n",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "",
]
SHAPE = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)
ARCHITECTURES = {  # llama.cpp's name -> gptlite's switches
    "gpt2": dict(pos_emb="learned", norm="layernorm", ffn="gelu", bias=True, tie_embeddings=True),
    "gpt2_untied_no_bias": dict(pos_emb="learned", norm="layernorm", ffn="gelu", bias=False, tie_embeddings=False),
    "llama": dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", n_kv_head=2, tie_embeddings=False),
    "qwen2": dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", n_kv_head=2, qkv_bias=True, rope_theta=1e6),
    "qwen3": dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", n_kv_head=2, qk_norm=True, head_dim=24),
    "llama_rope_scaled": dict(
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_factor=4.0,
        rope_original_context=16,
    ),
    "granite": dict(
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        n_kv_head=2,
        embed_scale=3.0,
        residual_scale=0.5,
        attn_scale=0.2,
        logits_scaling=2.5,
    ),
    "smollm3": dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", n_kv_head=2, n_layer=4, nope_layers="3"),
    "gemma3": dict(  # a window of 8 positions in layer 0: the prompt and 32 greedy tokens go well past it
        pos_emb="rope",
        norm="rmsnorm",
        ffn="geglu",
        norm_position="both",
        norm_unit_offset=True,
        qk_norm=True,
        embed_scale=8.0,
        n_kv_head=2,
        rope_theta=1e6,
        sliding_window=8,
        window_layers="0",
        rope_local_theta=1e4,
        logit_softcap=5.0,
    ),
    "olmo2": dict(
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        n_kv_head=2,
        norm_position="post",
        qk_norm=True,
        qk_norm_scope="all",
    ),
    "lfm2": dict(  # a conv layer, then attention: the conv's state carries every greedy token's last inputs
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        n_kv_head=2,
        qk_norm=True,
        rope_theta=1e6,
        layer_types="conv,full_attention",
    ),
    "olmoe": dict(  # llama.cpp's olmoe has no grouped-query attention
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        ffn_hidden=32,
        qk_norm=True,
        qk_norm_scope="all",
        n_experts=4,
        experts_per_token=2,
    ),
    "qwen3moe": dict(
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        ffn_hidden=32,
        n_kv_head=2,
        qk_norm=True,
        head_dim=24,
        n_experts=4,
        experts_per_token=2,
        experts_renorm=True,
    ),
    "granitemoe": dict(
        pos_emb="rope",
        norm="rmsnorm",
        ffn="swiglu",
        ffn_hidden=32,
        n_kv_head=2,
        embed_scale=3.0,
        residual_scale=0.5,
        attn_scale=0.2,
        logits_scaling=2.5,
        n_experts=4,
        experts_per_token=2,
        experts_renorm=True,
    ),
}


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    return tokenizer_from_spec(str(shared_file("tokenizers/gpt2.tiktoken")))


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained as `python -m gptlite.tokenizer train` trains one (GPT-4's split pattern)."""
    text = shared_file("data/tinyshakespeare.txt").read_text()[:200_000]
    return train_bpe([text, *TEXTS], vocab_size=600)


def random_model(seed: int, vocab_size: int, **switches) -> GPT:
    """Random weights that make decisive logits: embeddings and head at 1, the blocks' matrices at 0.5/sqrt(their
    inputs) (larger ones make a chaotic network that multiplies any rounding), norms' gains and all biases random
    too (zeros and ones would hide a gain or bias put in the wrong place)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, **{**SHAPE, **switches}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("tok_emb.weight", "lm_head.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.5 / math.sqrt(p.shape[-1]))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)
    return model.eval()


def greedy(model: GPT, ids: list[int], n: int) -> list[int]:
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits[:, -1:].argmax(-1)], dim=1)
    return idx[0].tolist()


def relative_error(model: GPT, path, ids: list[int]) -> tuple[float, np.ndarray, np.ndarray]:
    """The largest absolute difference of the logits over their standard deviation, and both sets of logits:
    gptlite's model against llama.cpp reading its GGUF file."""
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0].double().numpy()
    theirs = llama_cpp(path, evaluate=[ids]).logits[0]
    return float(np.abs(ours - theirs).max() / ours.std()), ours, theirs


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_llama_cpp_tokenizes_and_computes_as_gptlite(arch, gpt2_tokenizer, bpe, tmp_path):
    tokenizer = gpt2_tokenizer if arch.startswith("gpt2") else bpe
    vocab_size = 50304 if arch.startswith("gpt2") else 640  # padded past the tokenizer: unused ids
    model = random_model(1, vocab_size, **ARCHITECTURES[arch])
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer)
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch.split("_")[0]
    reference = llama_cpp(path, tokenize=TEXTS, detokenize=[tokenizer.encode(text) for text in TEXTS])
    for text, tokens, back in zip(TEXTS, reference.tokens, reference.texts, strict=True):
        assert tokens == tokenizer.encode(text), text
        assert back == text
    prompt = tokenizer.encode(TEXTS[5])
    ids = greedy(model, prompt, 32)
    error, ours, theirs = relative_error(model, path, ids)
    assert error < 1e-2, error  # llama.cpp keeps its KV cache in f16
    assert (theirs[len(prompt) - 1 : -1].argmax(-1) == ours[len(prompt) - 1 : -1].argmax(-1)).all()
    assert ids[len(prompt) :] == [int(t) for t in theirs[len(prompt) - 1 : -1].argmax(-1)]


@pytest.mark.parametrize("nope_layers", ["", "0,1"], ids=["rope", "no_positions"])
def test_granite4_goes_to_llama_cpp_as_its_converter_writes_it(nope_layers, bpe, tmp_path):
    """A model loaded as GraniteMoeHybridForCausalLM (Granite 4, attention only) is llama.cpp's granite, as
    convert_hf_to_gguf.py writes such a model; without positions, RoPE is switched off there
    (rope.scaling.finetuned=false). The bound is tighter than the other architectures': llama.cpp rotating q and k
    in the model without positions would stay within theirs."""
    model = random_model(1, 640, **ARCHITECTURES["granite"], nope_layers=nope_layers)
    if nope_layers:  # Granite's multipliers and SmolLM3's NoPE layers: no family's alone, unless named
        with pytest.raises(ValueError, match="llama.cpp has no architecture for a model with"):
            export_gguf(model, tmp_path / "unnamed.gguf", bpe)
    path = export_gguf(model, tmp_path / "m.gguf", bpe, architecture="GraniteMoeHybridForCausalLM")
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "granite"
    assert ("granite.rope.scaling.finetuned" in fields) == bool(nope_layers)
    prompt = bpe.encode(TEXTS[5])
    ids = greedy(model, prompt, 32)
    error, ours, theirs = relative_error(model, path, ids)
    assert error < 1e-3, error
    assert ids[len(prompt) :] == [int(t) for t in theirs[len(prompt) - 1 : -1].argmax(-1)]


GRANITE4_H = dict(  # Granite 4-H's layout: Mamba-2 layers among attention, no positions, chunks shorter than the text
    n_layer=3,
    layer_types="mamba,full_attention,mamba",
    nope_layers="0,1,2",
    mamba_heads=8,
    mamba_head_dim=16,
    mamba_state=16,
    mamba_groups=2,
    mamba_chunk_size=16,
)


def test_granite4_h_goes_to_llama_cpp_as_granitehybrid(bpe, tmp_path):
    """A model with Mamba-2 layers is llama.cpp's granitehybrid, as convert_hf_to_gguf.py writes Granite 4-H (no key
    or value heads in a Mamba-2 layer, its ssm keys and tensors); llama.cpp reads it with gptlite's logits over a
    prompt and greedy tokens longer than a chunk, and chooses the same tokens."""
    model = random_model(1, 640, **{**ARCHITECTURES["granite"], **GRANITE4_H})
    path = export_gguf(model, tmp_path / "m.gguf", bpe, architecture="GraniteMoeHybridForCausalLM")
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "granitehybrid"
    assert fields["granitehybrid.attention.head_count_kv"].contents() == [0, 2, 0]
    assert fields["granitehybrid.ssm.inner_size"].contents() == 128
    prompt = bpe.encode(TEXTS[5])
    ids = greedy(model, prompt, 32)
    error, ours, theirs = relative_error(model, path, ids)
    assert error < 1e-3, error
    assert ids[len(prompt) :] == [int(t) for t in theirs[len(prompt) - 1 : -1].argmax(-1)]
    half = export_gguf(model, tmp_path / "f16.gguf", bpe, "f16", architecture="GraniteMoeHybridForCausalLM")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(half).tensors}
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ssm_in.weight"] == gguf.GGMLQuantizationType.F16
    error, _, _ = relative_error(model, half, ids)
    assert error < 1e-2, error


def test_granite4_h_with_what_llama_cpp_lacks_is_refused_in_one_line(bpe, tmp_path):
    model = random_model(1, 640, **{**ARCHITECTURES["granite"], **GRANITE4_H}, mamba_dt_max=0.5)
    with pytest.raises(ValueError, match=r"llama.cpp's granitehybrid has no Mamba-2 layers with time steps clamped"):
        export_gguf(model, tmp_path / "m.gguf", bpe, architecture="GraniteMoeHybridForCausalLM")
    assert not (tmp_path / "m.gguf").exists()


def byte_level_bpe(pre_tokenizer) -> HFTokenizer:
    """A byte-level BPE with `pre_tokenizer`, trained on tiny Shakespeare as a model directory's tokenizer.json
    would be laid out (an end-of-text special token first)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, trainers

    rust = RustTokenizer(models.BPE(ignore_merges=True))
    rust.pre_tokenizer = pre_tokenizer
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator([shared_file("data/tinyshakespeare.txt").read_text()[:100_000], *TEXTS], trainer)
    return HFTokenizer(json.loads(rust.to_str()), eos="<|endoftext|>")


PRE_TOKENIZERS = {  # llama.cpp's name -> how a tokenizer.json splits text that way
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "qwen2": lambda: split_then_bytes(QWEN2_PATTERN),
    "llama-bpe": lambda: split_then_bytes(LLAMA3_PATTERN),
}


def split_then_bytes(pattern: str):
    from tokenizers import Regex

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@pytest.mark.parametrize("pre", list(PRE_TOKENIZERS))
def test_each_pre_tokenizer_splits_in_llama_cpp_as_in_gptlite(pre, tmp_path):
    tokenizer = byte_level_bpe(PRE_TOKENIZERS[pre]())
    model = random_model(7, 512, **ARCHITECTURES["qwen2"])
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer)
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == pre
    for text, tokens in zip(TEXTS, llama_cpp(path, tokenize=TEXTS).tokens, strict=True):
        assert tokens == tokenizer.encode(text), text


def test_a_pretrained_directory_exports_from_the_command_line(bpe, tmp_path, capsys):
    """--init_from: a Hugging Face directory (here one gptlite wrote, with its tokenizer) to a GGUF file."""
    model = random_model(8, 640, **ARCHITECTURES["qwen2"])
    plain = copy.copy(bpe)
    plain.chat_template = None  # a base model's tokenizer without one
    export_hf(model, tmp_path / "hf", plain)
    out = tmp_path / "qwen2.gguf"
    assert hf_main(["export", "--format=gguf", f"--init_from={tmp_path / 'hf'}", f"--out={out}", "--type=f16"]) == 0
    error, _, _ = relative_error(model, out, bpe.encode(TEXTS[5]))
    assert error < BOUNDS["f16"]
    assert not list(tmp_path.glob("*Modelfile"))  # no chat template, no Modelfile
    capsys.readouterr()
    assert hf_main(["export", "--format=gguf", f"--model={tmp_path / 'hf'}"]) == 2
    assert capsys.readouterr().err == "gptlite.hf: error: --out is required: --out=FILE.gguf\n"


def test_a_q8_0_export_on_a_cpu_with_amx_says_how_to_run_it_in_llama_cpp(bpe, tmp_path, capsys, monkeypatch):
    import gptlite.hf.__main__ as command

    export_hf(random_model(8, 640, **ARCHITECTURES["qwen2"]), tmp_path / "hf", bpe)
    for extensions, said in ((["AVX2"], False), (["AVX2", "AVX-512", "AVX512-BF16", "AMX"], True)):
        monkeypatch.setattr(command, "cpu_extensions", lambda extensions=extensions: extensions)
        out = tmp_path / f"{len(extensions)}.gguf"
        assert (
            hf_main(["export", "--format=gguf", f"--init_from={tmp_path / 'hf'}", f"--out={out}", "--type=q8_0"]) == 0
        )
        printed = capsys.readouterr().out
        assert ("llama.cpp with --no-repack (or LLAMA_ARG_REPACK=0), or export --type=f16" in printed) == said


@pytest.mark.parametrize(
    "arch, n_embd, kind",
    [("llama", 48, "q4_0"), ("llama", 48, "q8_0"), ("llama", 64, "q4_0"), ("gpt2", 64, "f16")],
)
def test_the_export_line_says_the_types_the_file_holds(arch, n_embd, kind, bpe, tmp_path, capsys):
    """A matrix whose input width is not whole blocks of 32 goes in f16 in a q4_0 or q8_0 file, and GPT-2's learned
    positions in f32: the line says how many matrices of each type the file holds, which and why."""
    export_hf(random_model(8, 640, **ARCHITECTURES[arch], n_embd=n_embd), tmp_path / "hf", bpe)
    out = tmp_path / "m.gguf"
    assert hf_main(["export", "--format=gguf", f"--model={tmp_path / 'hf'}", f"--out={out}", f"--type={kind}"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    held: dict[str, list[str]] = {}
    for t in gguf.GGUFReader(out).tensors:
        if len(t.shape) == 2:
            held.setdefault(t.tensor_type.name.lower(), []).append(t.name.removesuffix(".weight"))
    said = dict(re.findall(r"(\w+) for (\d+) matri", line))
    assert said == {t: str(len(names)) for t, names in held.items()}, line
    for t, names in held.items():
        if t != kind:
            roles = {name.split(".")[-1] for name in names}
            part = line.split(f"{t} for ")[1]
            assert all(role in part for role in roles), line
            why = "learned positions" if t == "f32" else "whose input width is not a multiple of 32"
            assert why in part, line
    assert (len(held) > 1) == (n_embd % 32 != 0 or arch == "gpt2"), line


# the largest difference over the logits' standard deviation at each type, with room over the most measured on
# these models (docs/hf.md: f16 0.0025, bf16 0.019, q8_0 0.064: llama.cpp also rounds the activations to 8 bits
# for q8_0's products, and the output head's logits carry it whole)
BOUNDS = {"f16": 1e-2, "bf16": 3e-2, "q8_0": 7e-2}


@pytest.mark.parametrize("kind", list(BOUNDS))
def test_half_and_q8_0_files_stay_within_their_bounds(kind, bpe, tmp_path):
    model = random_model(2, 640, **ARCHITECTURES["llama"])
    path = export_gguf(model, tmp_path / f"m-{kind}.gguf", bpe, kind)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == kind.upper() and types["blk.0.attn_norm.weight"] == "F32"
    error, _, _ = relative_error(model, path, bpe.encode(TEXTS[5]))
    assert error < BOUNDS[kind], error


def test_llama_rows_interleave_what_gptlite_rotates_in_halves():
    """A head of width 4 holds rows (a0, a1, b0, b1), rotated as pairs (a0, b0), (a1, b1); llama.cpp's llama
    rotates neighbours: (a0, b0, a1, b1)."""
    w = torch.arange(8.0).reshape(8, 1)  # two heads
    assert llama_rows(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_the_chat_template_goes_in_and_renders_as_gptlites(bpe, tmp_path):
    tokenizer = train_bpe([shared_file("data/tinyshakespeare.txt").read_text()[:50_000]], vocab_size=400)
    tokenizer.use_default_template()  # ChatML, its markers added past the vocabulary
    model = random_model(3, tokenizer.vocab_size, **ARCHITECTURES["qwen3"])
    path = export_gguf(model, tmp_path / "chat.gguf", tokenizer)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And?"},
    ]
    formatter = Jinja2ChatFormatter(tokenizer.chat_template, eos_token="<|im_end|>", bos_token="")
    rendered = formatter(messages=messages).prompt
    assert rendered == render(tokenizer.chat_template, messages, True, tokenizer.special_texts())
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reference = llama_cpp(path, tokenize=[rendered], special=True)
    assert reference.metadata["tokenizer.chat_template"] == tokenizer.chat_template
    assert reference.tokens == [ids]
    assert role_wrappers(tokenizer.chat_template, tokenizer) is not None


LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
    "\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SMOLLM2_TEMPLATE = (  # ChatML with a system message of its own when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NUMBERED_TEMPLATE = "{% for m in messages %}{{ loop.index }}. {{ m['content'] }}\n{% endfor %}"


class Specials:
    """What a chat template may name, as a tokenizer gives it."""

    def __init__(self, bos: str):
        self.bos = bos

    def special_texts(self) -> dict:
        return {"bos_token": self.bos, "eos_token": None}


@pytest.mark.parametrize(
    "template, expected",
    [
        (LLAMA3_TEMPLATE, '<|begin_of_text|>{{ range .Messages }}{{ if eq .Role "system" }}<|start_header_id|>'),
        (SMOLLM2_TEMPLATE, '{{ if ne (index .Messages 0).Role "system" }}<|im_start|>system\nYou are a helpful'),
        (NUMBERED_TEMPLATE, None),
    ],
)
def test_ollamas_go_template_writes_what_the_jinja_one_does(template, expected):
    wrappers = role_wrappers(template, Specials("<|begin_of_text|>"))
    if expected is None:
        assert wrappers is None
        return
    assert wrappers.go_template().startswith(expected)
    for messages in (
        [{"role": "user", "content": "a"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "b"}],
    ):
        assert wrappers.render(messages) == render(
            template, messages, True, Specials("<|begin_of_text|>").special_texts()
        )


def test_a_run_trained_with_its_own_bpe_exports_with_an_ollama_modelfile(tmp_path, capsys):
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "gguf" / "model.gguf"
    text = shared_file("data/tinyshakespeare.txt").read_text()[:100_000]
    tokenizer = make_data(data, text)
    done = run_train(
        f"--data_dir={data}",
        f"--out_dir={run}",
        "--pos_emb=rope",
        "--norm=rmsnorm",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=4",
        "--max_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--device=cpu",
    )
    assert done.code == 0, done.err
    assert hf_main(["export", "--format=gguf", f"--model={run}", f"--out={out}", "--type=q8_0"]) == 0
    assert out.is_file() and "wrote" in capsys.readouterr().out
    assert llama_cpp(out, tokenize=[TEXTS[1]]).tokens == [tokenizer.encode(TEXTS[1])]
    modelfile = (out.parent / "model.Modelfile").read_text()
    assert "FROM ./model.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "{{ range .Messages }}" in modelfile
    # again: the file exists, so nothing is written without --overwrite
    before = out.read_bytes()
    capsys.readouterr()  # llama.cpp's own log lines
    assert hf_main(["export", "--format=gguf", f"--model={run}", f"--out={out}"]) == 2  # a user's error
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and "--overwrite" in err[0]
    assert out.read_bytes() == before
    # another type beside it: its own file and Modelfile, the first pair untouched
    f16 = out.with_name("model-f16.gguf")
    assert hf_main(["export", "--format=gguf", f"--model={run}", f"--out={f16}", "--type=f16"]) == 0
    assert "FROM ./model-f16.gguf" in (out.parent / "model-f16.Modelfile").read_text()
    assert (out.parent / "model.Modelfile").read_text() == modelfile and out.read_bytes() == before
    assert llama_cpp(f16, tokenize=[TEXTS[1]]).tokens == [tokenizer.encode(TEXTS[1])]


def make_data(folder, text: str):
    """A data folder as data/prepare.py writes one: train and val shards and a BPE trained on the text, with ChatML's
    markers (so the run has a chat template); returns the tokenizer."""
    from gptlite.data.shards import write_shard

    tokenizer = train_bpe([text, *TEXTS], vocab_size=600)
    tokenizer.use_default_template()
    folder.mkdir()
    ids = np.array(tokenizer.encode(text), dtype=np.uint16)
    cut = int(0.9 * len(ids))
    write_shard(folder / "train_000000.bin", ids[:cut], tokenizer.vocab_size)
    write_shard(folder / "val_000000.bin", ids[cut:], tokenizer.vocab_size)
    tokenizer.save(folder / "tokenizer.json")
    return tokenizer


@pytest.mark.parametrize(
    "switches, message",
    [
        (dict(pos_emb="sinusoidal", ffn="swiglu"), "pos_emb='sinusoidal'"),
        (dict(pos_emb="learned", ffn="swiglu", norm="layernorm"), "llama.cpp has no architecture"),
        (dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", qkv_bias=True, qk_norm=True), "qk_norm=True"),
        (
            dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", nope_layers="0"),
            r"llama.cpp's smollm3 has no positions in every fourth layer \(none here\), and this model in layers 0; "
            r"GGUF export needs nope_layers=''",
        ),
        (
            {**ARCHITECTURES["gemma3"], "attn_scale": 0.1},
            r"llama.cpp's gemma3 scales attention by 1 / sqrt\(head width\) = 0.25, and this model by attn_scale=0.1 "
            r"\(query_pre_attn_scalar other than head_dim\); GGUF export needs them equal",
        ),
        (  # YaRN in a family whose GGUF gptlite writes without it
            {**ARCHITECTURES["olmo2"], "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_context": 16},
            r"gptlite writes llama.cpp's olmo2 without YaRN's RoPE scaling, and this model has rope_scaling='yarn'; "
            r"export it with python -m gptlite.hf export",
        ),
        (  # OLMo 3: its local layers
            {**ARCHITECTURES["olmo2"], "sliding_window": 8, "window_layers": "0", "rope_local_theta": 1e4},
            r"llama.cpp's olmo2 attends to the whole context in every layer, and this model's layers 0 to a sliding "
            r"window of 8; GGUF export needs an OLMo 3 without sliding-window layers",
        ),
        (
            {**ARCHITECTURES["lfm2"], "conv_bias": True},
            r"llama.cpp's lfm2 has no biases in its conv layers, and this model has \(conv_bias=true\); GGUF export "
            r"needs conv_bias=false",
        ),
        (
            {**ARCHITECTURES["olmoe"], "n_kv_head": 2},
            r"llama.cpp's olmoe has as many key/value heads as query heads, and this model 2 of 4; GGUF export needs "
            r"n_kv_head=4",
        ),
        (
            {**ARCHITECTURES["qwen3moe"], "experts_renorm": False},
            r"llama.cpp's qwen3moe divides the chosen experts' weights by their sum, and this model has "
            r"experts_renorm=False; GGUF export needs experts_renorm=True",
        ),
    ],
)
def test_a_model_llama_cpp_cannot_run_is_refused_in_one_line(switches, message, bpe, tmp_path):
    model = GPT(GPTConfig(vocab_size=640, **SHAPE, **switches))
    with pytest.raises(ValueError, match=message) as e:
        export_gguf(model, tmp_path / "m.gguf", bpe)
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


def test_the_quick_starts_model_is_refused_naming_the_flags_that_make_one_llama_cpp_runs(bpe, tmp_path):
    quick_start = read_toml(ROOT / "configs" / "shakespeare_char_cpu.toml")
    switches = {k: v for k, v in quick_start.items() if k in ("pos_emb", "norm", "ffn", "bias")}
    config = GPTConfig(vocab_size=640, **SHAPE, **switches)
    with pytest.raises(ValueError) as e:
        export_gguf(GPT(config), tmp_path / "m.gguf", bpe)
    assert str(e.value) == (
        "llama.cpp has no architecture for a model with pos_emb='learned', norm='layernorm', ffn='swiglu'; a model "
        "trained with --ffn=gelu (llama.cpp's gpt2) or --pos_emb=rope --norm=rmsnorm (llama.cpp's llama) exports"
    )
    for flags, arch in (("--ffn=gelu", "gpt2"), ("--pos_emb=rope --norm=rmsnorm", "llama")):
        given = parse(GPTConfig, flags.split())
        trained = dataclasses.replace(config, **{name: getattr(given, name) for name in given.given})
        path = export_gguf(GPT(trained), tmp_path / f"{arch}.gguf", bpe)
        assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    assert not list(tmp_path.glob(".*"))


def test_char_and_byte_tokenizers_are_refused_in_one_line(tmp_path):
    tokenizer = CharTokenizer(sorted(set("hello world")))
    model = GPT(GPTConfig(vocab_size=16, **SHAPE, **ARCHITECTURES["llama"]))
    with pytest.raises(ValueError, match="char-level tokenizer has no form llama.cpp runs") as e:
        export_gguf(model, tmp_path / "m.gguf", tokenizer)
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


def test_an_interrupted_export_leaves_no_partial_file_and_the_earlier_one_whole(bpe, tmp_path, monkeypatch):
    model = random_model(4, 640, **ARCHITECTURES["llama"])
    out = export_gguf(model, tmp_path / "m.gguf", bpe)
    before = out.read_bytes()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(random_model(5, 640, **ARCHITECTURES["llama"]), out, bpe, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"] and out.read_bytes() == before
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_gguf(model, out, bpe)


def test_lfm2s_convolution_kernels_stay_f32_in_a_quantized_file(bpe, tmp_path):
    """llama.cpp's convolution takes its kernels in f32, as its converter writes them; the projections quantize."""
    model = random_model(2, 640, **ARCHITECTURES["lfm2"])
    path = export_gguf(model, tmp_path / "m.gguf", bpe, "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.shortconv.conv.weight"] == "F32" and types["blk.0.shortconv.in_proj.weight"] == "Q8_0"
    error, _, _ = relative_error(model, path, bpe.encode(TEXTS[5]))
    assert error < BOUNDS["q8_0"], error


def test_every_weight_goes_in_once(bpe):
    for switches in ARCHITECTURES.values():
        model = random_model(6, 640, **switches)
        names = [name for name, _ in gguf_tensors_of(model)]
        assert len(names) == len(set(names))
        weights = sum(t.numel() for _, t in gguf_tensors_of(model) if not _.startswith("rope_freqs"))
        assert weights == sum(p.numel() for p in model.parameters()) + missing_biases(model) + tied_again(model)


def gguf_tensors_of(model: GPT):
    from gptlite.hf import family_of

    return list(gguf_tensors(family_of(model.config), model.state_dict(), model.config))


def tied_again(model: GPT) -> int:
    """llama.cpp's olmo2 and olmoe read an output matrix always: a tied model writes its embedding a second time
    there."""
    from gptlite.hf import family_of

    c = model.config
    always = getattr(family_of(c), "gguf_always_output", False)  # Llama's layout's attribute
    return c.vocab_size * c.n_embd if always and c.tie_embeddings else 0


def missing_biases(model: GPT) -> int:
    """GPT-2's layout has a bias wherever GPT-2 has one; a bias=False model writes zeros there."""
    c = model.config
    if c.pos_emb != "learned" or c.bias:
        return 0
    per_layer = 2 * c.n_embd + 3 * c.n_embd + c.n_embd + c.ffn_hidden + c.n_embd
    return c.n_layer * per_layer + c.n_embd


def test_a_crash_in_llama_cpp_fails_one_test_that_names_the_library_and_the_cpu(bpe, tmp_path):
    """The child dies of SIGSEGV once the model is loaded, as llama.cpp's AMX path does on some Intel CPUs: the
    check fails with the library, the signal and the CPU in its first line, and this process goes on."""
    path = export_gguf(random_model(9, 640, **ARCHITECTURES["llama"]), tmp_path / "m.gguf", bpe, "q8_0")
    with pytest.raises(pytest.fail.Exception) as e:
        llama_cpp(path, tokenize=[TEXTS[0]], crash=True)
    first = str(e.value).splitlines()[0]
    assert first.startswith("llama.cpp died of SIGSEGV in a child process reading m.gguf (llama-cpp-python ")
    assert cpu_summary() in first
    assert llama_cpp(path, tokenize=[TEXTS[0]]).tokens == [bpe.encode(TEXTS[0])]


def test_the_suite_runs_on_past_a_crash_in_llama_cpp(pytester):
    """In a pytest run of its own: a test whose llama.cpp child crashes fails, and the test after it passes."""
    pytester.makepyfile(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from gptlite import GPT, GPTConfig
        from gptlite.hf.gguf import export_gguf
        from gptlite.tokenizer.trainer import train_bpe
        from tests.helpers.llama_cpp_reference import llama_cpp

        def model_file(tmp_path):
            tokenizer = train_bpe(["a small corpus of words, words and more words"] * 20, vocab_size=300)
            config = GPTConfig(vocab_size=320, block_size=16, n_layer=1, n_head=2, n_embd=32, pos_emb="rope",
                               norm="rmsnorm")
            return export_gguf(GPT(config), tmp_path / "m.gguf", tokenizer), tokenizer

        def test_crashes(tmp_path):
            llama_cpp(model_file(tmp_path)[0], tokenize=["words"], crash=True)

        def test_after_it(tmp_path):
            path, tokenizer = model_file(tmp_path)
            assert llama_cpp(path, tokenize=["words"]).tokens == [tokenizer.encode("words")]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*llama.cpp died of SIGSEGV in a child process reading m.gguf*"])


def test_an_out_that_is_no_gguf_file_suggests_one_where_it_was_meant(tmp_path, capsys):
    """--out=DIR for a GGUF file suggests a file inside DIR, named for the model and the type; --out=X.bin suggests
    X.gguf in X.bin's own folder (not a bare name, which would land in the working directory)."""
    folder = tmp_path / "exports"
    folder.mkdir()
    for out, suggested in ((folder, folder / "gpt2-f16.gguf"), (folder / "m.bin", folder / "m.gguf")):
        capsys.readouterr()
        assert hf_main(["export", "--format=gguf", "--model=gpt2", f"--out={out}", "--type=f16"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(f"(e.g. --out={suggested})"), err
    assert not list(folder.iterdir())


def test_a_full_disk_under_the_gguf_writer_says_so_and_keeps_the_earlier_file(bpe, tmp_path, monkeypatch):
    """numpy's tofile on a full disk raises an OSError without an errno ("10240 requested and 8496 written"): it is
    said as the full disk it is, as the Hugging Face export says it, and the earlier file stays whole."""
    model = random_model(4, 640, **ARCHITECTURES["llama"])
    out = export_gguf(model, tmp_path / "m.gguf", bpe)
    before = out.read_bytes()

    def full_disk(self, *args, **kwargs):  # the header is written; the first tensor meets the full disk
        raise OSError("10240 requested and 8496 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match=r"^could not write .*m\.gguf \(nothing there changed\): no space left on device; "
                                      r"free space or use a folder on another disk$"):  # fmt: skip
        export_gguf(random_model(5, 640, **ARCHITECTURES["llama"]), out, bpe, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"] and out.read_bytes() == before


def dead_pid() -> int:
    """The pid of a process that ran and ended."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def export_command(model: os.PathLike, out: os.PathLike, *options: str, **run) -> subprocess.CompletedProcess:
    """python -m gptlite.hf export --format=gguf in a process of its own."""
    command = [sys.executable, "-m", "gptlite.hf", "export", "--format=gguf", f"--model={model}", f"--out={out}"]
    return subprocess.run([*command, *options], capture_output=True, text=True, timeout=300, cwd=ROOT, **run)


def test_a_killed_exports_temporary_file_is_removed_by_the_next_export(bpe, tmp_path):
    """The temporary file a killed export left (.m.gguf.tmp-PID of a process that no longer runs) goes when m.gguf is
    written again, said in one line; a running process's, another target's and a name not of that form stay."""
    export_hf(random_model(3, 640, **ARCHITECTURES["llama"]), tmp_path / "hf", bpe)
    folder = tmp_path / "out"
    folder.mkdir()
    dead = dead_pid()
    stale = folder / f".m.gguf.tmp-{dead}"
    stale.write_bytes(b"\0" * 2**20)
    kept = [folder / f".m.gguf.tmp-{os.getpid()}", folder / f".n.gguf.tmp-{dead}", folder / ".m.gguf.tmp-12x"]
    for path in kept:
        path.write_bytes(b"part")
    result = export_command(tmp_path / "hf", folder / "m.gguf")
    assert result.returncode == 0, result.stderr
    assert not stale.exists() and all(path.read_bytes() == b"part" for path in kept)
    said = [line for line in result.stderr.splitlines() if "removed" in line]
    assert said == [
        f"note: removed .m.gguf.tmp-{dead} (1.0 MiB) beside {folder / 'm.gguf'}: left by a write whose process "
        f"(pid {dead}) no longer runs (killed or crashed)"
    ]


def test_an_atomic_folder_write_removes_the_temporary_folder_of_a_killed_one(tmp_path):
    dead = dead_pid()
    stale = tmp_path / f".hf.tmp-{dead}"
    live = tmp_path / f".hf.tmp-{os.getppid()}"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"part")
    said = []
    write_folder(tmp_path / "hf", lambda folder: (folder / "config.json").write_text("{}"), log=said.append)
    assert not stale.exists() and (live / "model.safetensors").exists()
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["config.json"]
    assert len(said) == 1 and said[0].startswith(f"removed .hf.tmp-{dead} (0.0 MiB) beside {tmp_path / 'hf'}")


def test_an_export_past_the_file_size_limit_says_so_and_keeps_the_earlier_file(bpe, tmp_path):
    """Under ulimit -f (RLIMIT_FSIZE) a write past the limit fails with EFBIG (Python ignores SIGXFSZ, which would
    kill it): the command ends with one line naming the limit and how to raise it, not a full disk, and leaves no
    temporary file and the earlier file whole. (The limit is set by the shell, as a user sets it: a preexec_fn
    would run between fork and exec in a process with threads.)"""
    export_hf(random_model(3, 640, **ARCHITECTURES["llama"]), tmp_path / "hf", bpe)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"earlier")
    command = [sys.executable, "-m", "gptlite.hf", "export", "--format=gguf", f"--model={tmp_path / 'hf'}"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        ["bash", "-c", 'ulimit -f 64 && exec "$@"', "bash", *command, f"--out={out}", "--overwrite"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"gptlite.hf: error: could not write {out} (nothing there changed): the file reached this process's file "
        "size limit (ulimit -f: 65,536 bytes); raise it (ulimit -f unlimited) and run it again\n"
    )
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"] and out.read_bytes() == b"earlier"
