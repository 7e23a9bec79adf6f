"""Today's open models in and out, against transformers itself: Llama with grouped-query attention, an untied Llama
(TinyLlama's kind), Llama 3's RoPE scaling, Qwen2, Qwen3 and Mistral, built with random weights (every parameter,
norms and biases too), saved with save_pretrained: equal logits, equal greedy tokens, export back into the same
class; sharded and torch files; the checkpoint's dtype kept; the directory's tokenizer used."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.checkpoint import load_checkpoint
from gptlite.data.prepare import prepare
from gptlite.hf import export_hf
from gptlite.inference.generate import generate
from tests.conftest import DEVICE, ROOT, run_train, shared_file
from tests.test_hf import randomized

transformers.logging.set_verbosity_error()
V, T = 97, 64
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=V,
    max_position_embeddings=T,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
GRANITE4 = dict(  # GraniteMoeHybridConfig's: attention layers only, no experts, a shared MLP of its own width
    **COMMON,
    num_key_value_heads=2,
    shared_intermediate_size=80,
    layer_types=["attention", "attention"],
    num_local_experts=0,
    num_experts_per_tok=0,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.5,
)
OLMO3_YARN = {  # the long-context OLMo 3's kind: YaRN in the global layers alone, past an original context of 16
    "full_attention": {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.2,
        "beta_fast": 8.0,
    },
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
# Ministral 3's RoPE: YaRN and q's factor 1 + 0.5 log(1 + floor(position / 16)), past an original context of 16
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
GRANITE4_H = dict(  # Granite 4-H's kind: Mamba-2 layers among attention, chunks of 16 (the prompts are longer)
    **{**GRANITE4, "num_hidden_layers": 3, "layer_types": ["attention", "mamba", "mamba"]},
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_chunk_size=16,
    mamba_d_conv=4,
)
FAMILIES = {  # name -> (transformers class, its config)
    "llama-gqa": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=500.0, tie_word_embeddings=True),
    ),
    "llama-untied": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=False),
    ),
    "llama3-scaled": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3, tie_word_embeddings=True),
    ),
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config(
            **COMMON, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False, use_sliding_window=False
        ),
    ),
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, use_sliding_window=False
        ),
    ),
    "mistral": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    ),
    "granite": (
        transformers.GraniteForCausalLM,
        transformers.GraniteConfig(
            **COMMON,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
        ),
    ),
    "smollm3": (
        transformers.SmolLM3ForCausalLM,
        transformers.SmolLM3Config(
            **COMMON, num_key_value_heads=2, no_rope_layers=[0, 1], tie_word_embeddings=True, use_sliding_window=False
        ),
    ),
    "phi3": (
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None),
    ),
    "phi4-mini": (  # a quarter of each head unrotated, LongRoPE: the 40 + 40 tokens within its original context of 64
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config(
            **{**COMMON, "max_position_embeddings": 128},
            num_key_value_heads=2,
            tie_word_embeddings=True,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                "long_factor": [2.0, 3.0, 4.0, 6.0, 10.0, 16.0],
            },
        ),
    ),
    "olmo2": (
        transformers.Olmo2ForCausalLM,
        transformers.Olmo2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "nanochat": (
        transformers.NanoChatForCausalLM,
        transformers.NanoChatConfig(
            **COMMON, num_key_value_heads=2, final_logit_softcapping=3.0, tie_word_embeddings=False
        ),
    ),
    "granite4": (  # Granite 4.0 350M/1B's kind: every layer attention, the shared MLP alone, RoPE
        transformers.GraniteMoeHybridForCausalLM,
        transformers.GraniteMoeHybridConfig(**GRANITE4, position_embedding_type="rope", tie_word_embeddings=True),
    ),
    "granite4-nope": (  # no positions at all: transformers' default position_embedding_type
        transformers.GraniteMoeHybridForCausalLM,
        transformers.GraniteMoeHybridConfig(**GRANITE4, position_embedding_type=None, tie_word_embeddings=False),
    ),
    "granite4-h": (  # no positions, as Granite 4-H
        transformers.GraniteMoeHybridForCausalLM,
        transformers.GraniteMoeHybridConfig(**GRANITE4_H, position_embedding_type=None, tie_word_embeddings=False),
    ),
    "gemma3": (  # a window of 8: the 40 tokens of the logits and the 8 + 32 of the greedy test go well past it
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig(
            **{k: v for k, v in COMMON.items() if k != "rms_norm_eps"},
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    "olmo3": (  # a window of 8, three local layers to one global (transformers' default layer_types)
        transformers.Olmo3ForCausalLM,
        transformers.Olmo3Config(
            **{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False
        ),
    ),
    "olmo3-yarn": (
        transformers.Olmo3ForCausalLM,
        transformers.Olmo3Config(
            **COMMON,
            num_key_value_heads=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=OLMO3_YARN,
            tie_word_embeddings=True,
        ),
    ),
    "ministral3": (
        transformers.Ministral3ForCausalLM,
        transformers.Ministral3Config(
            **COMMON, num_key_value_heads=2, head_dim=16, rope_parameters=MINISTRAL3_ROPE, tie_word_embeddings=False
        ),
    ),
    "lfm2": (  # a conv layer (LFM2's gated short convolution, its state on the cache), then attention
        transformers.Lfm2ForCausalLM,
        transformers.Lfm2Config(
            **{k: v for k, v in COMMON.items() if k != "rms_norm_eps"},
            norm_eps=1e-5,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=True,
        ),
    ),
}
# issue 73's: train.py --init_from with learning rate 0 too
NEW_FAMILIES = [
    "granite",
    "smollm3",
    "phi3",
    "phi4-mini",
    "olmo2",
    "nanochat",
    "gemma3",
    "granite4",
    "olmo3",
    "ministral3",
    "granite4-h",
    "lfm2",
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    cls, config = FAMILIES[request.param]
    model = randomized(cls(config))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


def ids(batch: int = 2, length: int = 40, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.device
def test_logits_greedy_tokens_and_the_export_equal_transformers(saved, tmp_path):
    """40 tokens: past llama3's original context of 16, where its scaling acts; 32 greedy tokens on gptlite's KV
    cache. Both models on the test device."""
    name, hf, directory = saved
    hf = hf.to(DEVICE)
    ours = GPT.from_pretrained(str(directory)).to(DEVICE)
    with torch.no_grad():
        expected = hf(ids(device=DEVICE)).logits
        torch.testing.assert_close(ours(ids(device=DEVICE))[0], expected, atol=1e-4, rtol=0)
        prompt = ids(1, 8, DEVICE)
        greedy = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(prompt, 32, temperature=0), greedy)
    export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().to(DEVICE)
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(ids(device=DEVICE)).logits, expected, atol=1e-4, rtol=0)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]
        == hf.config.tie_word_embeddings
    )


def test_the_kv_cache_holds_only_the_key_value_heads(saved):
    name, hf, directory = saved
    from gptlite.inference.kvcache import new_cache

    model = GPT.from_pretrained(str(directory))
    cache = new_cache(model, 3, 16)
    first = min(model.config.attention_layer_ids)  # (LFM2's first layer is a convolution, with no keys)
    assert cache.k[first].shape == (3, hf.config.num_key_value_heads, 16, model.config.head_width)


def test_sharded_torch_and_bfloat16_checkpoints(tmp_path):
    cls, config = FAMILIES["llama-gqa"]
    hf = randomized(cls(config))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with torch.no_grad():
        expected = hf(ids()).logits
        for folder in ("sharded", "bin"):
            torch.testing.assert_close(
                GPT.from_pretrained(str(tmp_path / folder))(ids())[0], expected, atol=1e-4, rtol=0
            )
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    kept = GPT.from_pretrained(str(tmp_path / "bf16"))
    assert all(p.dtype == torch.bfloat16 for p in kept.parameters())
    assert all(
        p.dtype == torch.float32 for p in GPT.from_pretrained(str(tmp_path / "bf16"), torch.float32).parameters()
    )


def test_a_sliding_window_bounds_the_context(tmp_path):
    config = transformers.MistralConfig(
        **{**COMMON, "max_position_embeddings": 256}, num_key_value_heads=2, sliding_window=48
    )
    randomized(transformers.MistralForCausalLM(config)).save_pretrained(tmp_path)
    assert GPT.from_pretrained(str(tmp_path)).config.block_size == 48
    with pytest.raises(
        ValueError,
        match=r"its sliding window 48 is shorter than block_size=64; gptlite attends to the "
        r"whole context: use block_size <= 48",
    ):
        GPT.from_pretrained(str(tmp_path), block_size=64)


def test_init_from_a_model_directory_needs_no_tokenizer_flag(tmp_path):
    """The directory's tokenizer.json becomes the model's tokenizer, with its end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    cls, config = FAMILIES["qwen2"]
    randomized(cls(config)).save_pretrained(tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["To be or not to be, that is the question."] * 50,
        trainers.BpeTrainer(
            vocab_size=V,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:90],
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            f"--init_from={tmp_path}",
            "--start=To be",
            "--num_samples=1",
            "--max_new_tokens=10",
            "--device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0 and result.stdout.startswith("To be"), result.stderr


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """Tiny Shakespeare in chars: 65 ids, all below the tiny models' vocabulary of 97."""
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:20_000])
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_train_init_from_with_learning_rate_0_changes_no_weight(name, char_data, tmp_path):
    cls, config = FAMILIES[name]
    randomized(cls(config)).save_pretrained(tmp_path / "hf")
    run_train(
        f"--init_from={tmp_path / 'hf'}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path / 'run'}",
        "--learning_rate=0",
        "--max_iters=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=32",
        "--device=cpu",
    )
    saved_weights = load_checkpoint(tmp_path / "run")["model"]
    for key, tensor in GPT.from_pretrained(str(tmp_path / "hf"), block_size=32).state_dict().items():
        assert torch.equal(saved_weights[key], tensor), key  # bit for bit


def test_a_negative_attention_scale_is_refused():
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=r"attn_scale=-0.5 must be a number >= 0 \(0 = 1 / sqrt\(head width\)\)"):
        GPTConfig(attn_scale=-0.5)


def test_gguf_export_refuses_the_families_it_does_not_write():
    from gptlite import GPTConfig
    from gptlite.hf.gguf import gguf_architecture

    nanochat = dict(qk_norm=True, norm_weight=False, embed_norm=True, rope_reverse=True, tie_embeddings=False)
    config = GPTConfig(pos_emb="rope", norm="rmsnorm", ffn="relu2", **nanochat)
    with pytest.raises(ValueError, match=r"GGUF export of a NanoChatForCausalLM is not implemented .*convert_hf"):
        gguf_architecture(config)
    ministral3 = GPTConfig(pos_emb="rope", norm="rmsnorm", ffn="swiglu", query_scale_beta=0.1)
    with pytest.raises(ValueError, match=r"GGUF export of a Ministral3ForCausalLM is not implemented .*convert_hf"):
        gguf_architecture(ministral3)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(nope_layers="1,x"), r"nope_layers='1,x' must be comma-separated layer indices, e.g. '3,7'"),
        (dict(nope_layers="0,5", n_layer=2), r"nope_layers='0,5' names layer 5; the layers are 0..n_layer-1"),
        (dict(nope_layers="0", pos_emb="learned"), r"nope_layers='0' needs pos_emb='rope'"),
    ],
)
def test_bad_nope_layers_are_refused(values, message):
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            transformers.Qwen2Config(
                **COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
            ),
            r"gptlite cannot hold this Qwen2ForCausalLM: RoPE on part of each head \(partial_rotary_factor=0.5; "
            r"Phi-3's alone has it here\)",
        ),
        (
            transformers.Qwen2Config(**COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            r"gptlite cannot hold this Qwen2ForCausalLM: RoPE scaling of type 'yarn' \(gptlite has llama3's, and "
            r"Phi-3's longrope\)",
        ),
        (
            transformers.Gemma3TextConfig(**COMMON, attn_logit_softcapping=50.0),
            r"gptlite cannot hold this Gemma3ForCausalLM: soft-capped attention scores \(attn_logit_softcapping=50.0\)",
        ),
        (
            transformers.GraniteMoeHybridConfig(**{**GRANITE4, "num_local_experts": 4, "num_experts_per_tok": 2}),
            r"gptlite cannot hold this GraniteMoeHybridForCausalLM: a mixture of experts \(num_local_experts=4\), "
            r"which gptlite does not have$",
        ),
        (
            # transformers' default layer_types: every layer Mamba-2 ("linear_attention", its newer name), which loads
            transformers.GraniteMoeHybridConfig(**{**GRANITE4, "layer_types": None, "num_local_experts": 4}),
            r"gptlite cannot hold this GraniteMoeHybridForCausalLM: a mixture of experts \(num_local_experts=4\), "
            r"which gptlite does not have$",
        ),
        (
            transformers.Gemma3Config(text_config=dict(COMMON)),
            r"model_type='gemma3' is Gemma 3's vision tower with its text model \(Gemma3ForConditionalGeneration\), "
            r"which gptlite does not have; gptlite loads .*Gemma3ForCausalLM \(gemma3_text\)",
        ),
    ],
)
def test_what_the_switches_cannot_hold_is_refused_before_any_weight_is_read(config, message, tmp_path):
    """config.json alone: the refusal comes from it, before a weight file is looked for."""
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(tmp_path))


def test_a_whole_qk_norm_needs_qk_norm():
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=r"qk_norm_scope='all' says how qk_norm normalises q and k; it needs qk_norm"):
        GPTConfig(qk_norm_scope="all")


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(norm_weight=False), r"norm_weight=false makes the RMSNorms parameter-free; norm='layernorm' is no"),
        (dict(rope_reverse=True), r"rope_reverse=true says which way RoPE rotates; pos_emb='learned' is no RoPE"),
    ],
)
def test_nanochat_switches_need_their_layout(values, message):
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


@pytest.mark.device
@pytest.mark.parametrize("name", ["gemma3", "olmo3-yarn", "ministral3"])
def test_gemma3_ragged_prompts_decode_past_the_window_as_each_alone(name, tmp_path):
    """Left-padded rows in one batch: each local layer's window counts from the row's own first token, and so do
    YaRN's angles and Ministral 3's factor on q (past its original context of 16)."""
    cls, config = FAMILIES[name]
    hf = randomized(cls(config)).to(DEVICE)
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(str(tmp_path)).to(DEVICE)
    prompts = [ids(1, 13)[0].tolist(), ids(1, 3)[0].tolist()]
    together = ours.generate(prompts, 30, temperature=0)
    for prompt, row in zip(prompts, together, strict=True):
        with torch.no_grad():
            alone = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=30, do_sample=False)
        assert list(row) == alone[0].tolist()


@pytest.mark.parametrize("name", ["gemma3", "olmo3-yarn", "ministral3"])
def test_gemma3_on_the_servers_row_cache_decodes_past_the_window_as_generate(name, tmp_path):
    """The server's continuous batching: rows join and leave one cache; each row's window (and position) is its
    own."""
    from gptlite.inference.sampling import GenerationOptions
    from gptlite.serve.engine import Engine, Params
    from gptlite.tokenizer import CharTokenizer
    from tests.helpers.serving import CHARS
    from tests.serve.test_engine import PROMPTS, Collect, greedy

    cls, config = FAMILIES[name]
    randomized(cls(config)).save_pretrained(tmp_path)
    model, tokenizer = GPT.from_pretrained(str(tmp_path)), CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=3).start()
    try:
        texts = Collect(
            engine, tokenizer, PROMPTS, Params(max_tokens=20, options=GenerationOptions(temperature=0))
        ).wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 20) for p in PROMPTS]


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(sliding_window=8), r"sliding_window=8 and window_layers='' go together"),
        (dict(sliding_window=-1), r"sliding_window=-1 must be an integer >= 0 \(0 = none\)"),
        (dict(window_layers="0,9", sliding_window=8, n_layer=2), r"window_layers='0,9' names layer 9"),
        (dict(rope_local_theta=1e4), r"rope_local_theta=10000.0 is the RoPE base of window_layers; it needs them"),
    ],
)
def test_bad_sliding_windows_are_refused(values, message):
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


def test_longrope_stays_within_its_original_context(tmp_path):
    """Past it transformers switches to the long factors, which gptlite does not have: refused, naming the limit."""
    cls, config = FAMILIES["phi4-mini"]
    randomized(cls(config)).save_pretrained(tmp_path)
    assert GPT.from_pretrained(str(tmp_path)).config.block_size == 64
    with pytest.raises(ValueError, match=r"block_size=65 is past longrope's original context 64, .*"):
        GPT.from_pretrained(str(tmp_path), block_size=65)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(pos_emb="rope", rope_dims=3), r"rope_dims=3 must be an even integer >= 0 \(0 = the whole head\)"),
        (dict(pos_emb="rope", rope_dims=128, n_embd=64, n_head=2), r"rope_dims=128 is more than the head width 32"),
        (
            dict(pos_emb="rope", rope_scaling="longrope", rope_short_factor="1,2", n_embd=64, n_head=4),
            r"longrope needs one rope_short_factor per rotated pair, 8; got 2",
        ),
        (
            dict(pos_emb="rope", rope_scaling="longrope", rope_short_factor="1,x"),
            r"longrope needs rope_short_factor \(and rope_long_factor\) as comma-separated numbers",
        ),
        (
            dict(pos_emb="rope", rope_scaling="yarn", rope_beta_fast=1.0, rope_beta_slow=2.0),
            r"yarn scaling needs rope_factor >= 1 and rope_beta_fast > rope_beta_slow, got 8.0, 1.0, 2.0",
        ),
        (dict(pos_emb="rope", query_scale_beta=-0.1), r"query_scale_beta=-0.1 must be a number >= 0 \(0 = none\)"),
        (
            dict(pos_emb="rope", query_scale_beta=0.1, rope_dims=4),
            r"query_scale_beta=0.1 scales q by its RoPE position; it needs pos_emb='rope' rotating the whole head",
        ),
    ],
)
def test_bad_partial_rotary_and_longrope_are_refused(values, message):
    from gptlite import GPTConfig

    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


def test_gemmas_norm_equals_transformers_in_bfloat16():
    """1 + weight and the product in float32, cast once, as Gemma3RMSNorm computes them: in bfloat16, 1 + weight
    would keep only 8 bits of the weight."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from gptlite import GPTConfig
    from gptlite.model.network import RMSNorm

    theirs = Gemma3RMSNorm(64, eps=1e-6)
    ours = RMSNorm(GPTConfig(n_embd=64, n_head=4, norm="rmsnorm", norm_eps=1e-6, norm_unit_offset=True))
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.3)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@pytest.fixture(scope="module")
def gemma3_modes(tmp_path_factory):
    """A tiny Gemma 3 directory as a user downloads one (tests/helpers/gemma3.py: Gemma's chat template, <eos> and
    <end_of_turn>) and, prepared with its own tokenizer, what each mode of fine-tuning reads: conversations
    (chat/, its targets the `model` turns), preference pairs in messages (pairs/) and RL prompts (prompts.jsonl)."""
    from gptlite.data.prepare.preference import prepare_preference
    from tests.helpers.gemma3 import gemma3_dir

    root = tmp_path_factory.mktemp("gemma3_modes")
    gemma3_dir(root / "hf")
    lines = [line for line in shared_file("data/tinyshakespeare.txt").read_text().splitlines()[:2000] if line][:400]
    chats = [
        {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
        for a, b in zip(lines[::2], lines[1::2], strict=True)
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    prepare([str(root / "chats.jsonl")], str(root / "hf"), root / "chat", chat=True, block_size=32, log=print)
    pairs = [
        {"prompt": [{"role": "user", "content": a}], "chosen": b, "rejected": c}
        for a, b, c in zip(lines[::3], lines[1::3], lines[2::3], strict=False)
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prepare_preference([str(root / "pairs.jsonl")], str(root / "hf"), root / "pairs", block_size=32, log=print)
    prompts = [{"prompt": [{"role": "user", "content": "Say ay."}], "answer": "ay"}] * 16
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


@pytest.mark.parametrize("folder", ["chat", "pairs"])
def test_gemma3_data_trains_on_its_model_turns(gemma3_modes, folder):
    """--chat's targets and --preference's answers, rendered with Gemma's own template: each `model` turn's content
    and its <end_of_turn>, nothing of the user's turns, of the markers that open a turn or of the newline after."""
    from gptlite.data.shards import ANSWER, TARGET, read_roles, read_shard, roles_path
    from gptlite.tokenizer import load_tokenizer
    from tests.helpers.gemma3 import END_OF_TURN

    tokenizer = load_tokenizer(gemma3_modes / "hf")
    shard = sorted((gemma3_modes / folder).glob("train_*.bin"))[0]
    tokens = read_shard(shard)
    roles = read_roles(roles_path(shard), len(tokens))
    runs = []  # the target tokens, a list per turn (a pair's two answers lie side by side, each first one ANSWER)
    for token, role, before in zip(tokens.tolist(), roles.tolist(), [0, *roles.tolist()[:-1]], strict=True):
        if role & TARGET and (role & ANSWER or not before & TARGET):
            runs.append([])
        if role & TARGET:
            runs[-1].append(token)
    lines = {line.strip() for line in shared_file("data/tinyshakespeare.txt").read_text().splitlines()}
    whole = [tokenizer.decode(run) for run in runs if run[-1] == END_OF_TURN]
    assert whole and all(t.removesuffix("<end_of_turn>") in lines for t in whole)
    cut = [tokenizer.decode(run) for run in runs if run[-1] != END_OF_TURN]  # answers cut to block_size
    assert all(any(line.startswith(t) for line in lines) for t in cut)


GEMMA3_MODES = {  # mode -> (data folder, options)
    "chat": ("chat", []),
    "lora": ("chat", ["--lora_rank=4", "--lora_alpha=8"]),
    "dpo": ("pairs", []),
    "rl": ("chat", ["--rl", "--reward=exact", "--rl_samples=4", "--rl_max_new_tokens=4"]),
}


@pytest.mark.parametrize("mode", list(GEMMA3_MODES))
def test_gemma3_fine_tunes_in_every_mode_and_resumes(gemma3_modes, mode, tmp_path):
    """train.py --init_from=<a Gemma 3 directory> on conversations with its template (whole and LoRA), on
    preference pairs (DPO) and on rewards (RL): finite losses, weights (or adapters) that move, and a run stopped at
    step 2 and resumed gives the straight run's next steps."""
    folder, options = GEMMA3_MODES[mode]
    args = [
        f"--init_from={gemma3_modes / 'hf'}",
        f"--data_dir={gemma3_modes / folder}",
        *options,
        *([f"--rl_prompts={gemma3_modes / 'prompts.jsonl'}"] if mode == "rl" else []),
        "--block_size=32",
        "--batch_size=4",
        "--learning_rate=1e-2",
        "--warmup_iters=0",
        "--lr_decay_iters=4",  # the straight run's schedule for the stopped one too
        "--eval_iters=1",
        "--log_interval=1",
        "--device=cpu",
    ]
    straight = run_train(*args, f"--out_dir={tmp_path / 'a'}", "--max_iters=4", "--eval_interval=2")
    assert straight.code == 0, straight.err
    losses = [loss for _, loss in straight.history]
    assert len(losses) == 4 and all(map(math.isfinite, losses)) and straight.skipped_steps == 0
    trained = load_checkpoint(tmp_path / "a")["model"]
    start = GPT.from_pretrained(str(gemma3_modes / "hf"), block_size=32).state_dict()
    if mode == "lora":
        assert trained and all(k.endswith(("lora_A", "lora_B")) for k in trained)
        assert any(t.abs().sum() > 0 for k, t in trained.items() if k.endswith("lora_B"))  # B starts at zero
    else:
        assert any(not torch.equal(trained[k], t) for k, t in start.items())
    first = run_train(*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=2", "--eval_interval=2")
    assert first.code == 0, first.err
    resumed = run_train(f"--out_dir={tmp_path / 'b'}", "--resume", "--max_iters=4")
    assert resumed.code == 0, resumed.err
    assert resumed.history == straight.history[2:]


# ---------------------------------------------------------------------------------------------
# Every config.json layout transformers reads maps to the same model (issue 84): the older keys (rope_scaling,
# rope_theta at the top level, Gemma 3's sliding_window_pattern and rope_local_base_freq) and keys left out (their
# defaults, each family's own). Each layout is written over a saved model's config.json, and the logits of
# transformers reading that file are the reference.


def rewritten(directory, tmp_path, edit):
    """A copy of a saved model's directory whose config.json `edit` (a function of the dict) rewrites."""
    import shutil

    out = tmp_path / "layout"
    shutil.copytree(directory, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit(config)))
    return out


def assert_same_logits(directory) -> transformers.PreTrainedModel:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = GPT.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids())[0], hf(ids()).logits, atol=1e-4, rtol=0)
    return hf


def older_rope_keys(config: dict) -> dict:
    """rope_parameters as transformers 4 wrote it: rope_theta and partial_rotary_factor at the top level, the
    scaling (if any) under rope_scaling; Gemma 3's base per layer kind as rope_theta (global layers) and
    rope_local_base_freq (sliding ones)."""
    rope = dict(config.pop("rope_parameters"))
    if "full_attention" in rope:  # a table per layer kind: Gemma 3
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = dict(rope["full_attention"])
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return config


def defaults_left_out(config: dict) -> dict:
    """The keys whose absence transformers fills with the family's default, and which leave the weights' shapes."""
    keys = ["rms_norm_eps", "rope_theta", "final_logit_softcapping", "sliding_window", "layer_types"]
    if config["model_type"] in ("granitemoehybrid", "lfm2"):
        keys.remove("layer_types")  # its default makes every layer Mamba-2 (LFM2's: attention): another model
    for key in keys:
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") == "default" or "full_attention" in rope:
        config.pop("rope_parameters", None)
    else:
        rope.pop("rope_theta", None)
    return config


@pytest.mark.parametrize("layout", [older_rope_keys, defaults_left_out], ids=["older_rope_keys", "defaults_left_out"])
def test_every_config_layout_transformers_reads_is_the_same_model(saved, layout, tmp_path):
    _, _, directory = saved
    assert_same_logits(rewritten(directory, tmp_path, layout))


def phi3_original_in_the_table(config: dict) -> dict:
    """original_max_position_embeddings in rope_parameters alone: Phi-3's config class has a top-level one always
    (4096 by default), which transformers takes over the table's."""
    config["rope_parameters"]["original_max_position_embeddings"] = config.pop("original_max_position_embeddings")
    return config


def phi3_su(config: dict) -> dict:
    """Phi-3's first configs named LongRoPE "su"."""
    config["rope_scaling"] = {**older_rope_keys(config)["rope_scaling"], "rope_type": "su"}
    return config


@pytest.mark.parametrize("layout", [phi3_original_in_the_table, phi3_su])
def test_phi3s_config_layouts_are_the_same_model(layout, tmp_path):
    cls, config = FAMILIES["phi4-mini"]
    randomized(cls(config)).save_pretrained(tmp_path / "saved")
    assert_same_logits(rewritten(tmp_path / "saved", tmp_path, layout))


def gemma3_released_1b(config: dict) -> dict:
    """google/gemma-3-1b's config.json layout: sliding_window_pattern, rope_theta and rope_local_base_freq, no
    layer_types, no rope_parameters (theirs are 1e6 and 1e4; others here, to tell them from the defaults)."""
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    return {
        **config,
        "sliding_window_pattern": 2,
        "rope_theta": 5e5,
        "rope_local_base_freq": 100.0,
        "rope_scaling": None,
    }


def without(*keys: str):
    def edit(config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in keys}

    return edit


@pytest.mark.parametrize(
    "layout, kinds",
    [
        (gemma3_released_1b, ["sliding_attention", "full_attention"]),
        (without("layer_types"), ["sliding_attention", "sliding_attention"]),  # every 6th layer global
        (without("rope_parameters"), ["sliding_attention", "full_attention"]),  # RoPE bases 1e6 and 1e4
        (lambda c: {**without("layer_types")(c), "sliding_window_pattern": 1}, ["full_attention"] * 2),
        (lambda c: {**c, "layer_types": ["attention", "sliding_attention"]}, ["full_attention", "sliding_attention"]),
    ],
    ids=["released_1b", "no_layer_types", "no_rope_parameters", "pattern_1", "legacy_attention"],
)
def test_gemma3s_config_layouts_are_the_same_model(layout, kinds, tmp_path):
    """Issue 84: Gemma 3 1B's released layout loaded with every layer global and one RoPE base (logits off by 5.3);
    float32, 40 tokens past the window of 8."""
    cls, config = FAMILIES["gemma3"]
    model = randomized(cls(config))
    model.save_pretrained(tmp_path / "saved")
    hf = assert_same_logits(rewritten(tmp_path / "saved", tmp_path, layout))
    assert hf.config.layer_types == kinds  # transformers read the layout as meant


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar=0 must be a finite number > 0"),
        ({"query_pre_attn_scalar": -4}, r"query_pre_attn_scalar=-4 must be a finite number > 0"),
        ({"query_pre_attn_scalar": "abc"}, r'query_pre_attn_scalar="abc" must be a finite number > 0'),
        ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be an integer >= 1"),
        ({"hidden_size": 64.5}, r"hidden_size=64.5 must be an integer >= 1"),
        ({"rms_norm_eps": None}, r"rms_norm_eps=null must be a finite number > 0"),
        ({"sliding_window": 0}, r"sliding_window=0 must be an integer >= 1"),
        ({"tie_word_embeddings": "yes"}, r'tie_word_embeddings="yes" must be true or false'),
        ({"layer_types": ["sliding_attention"]},
         r"layer_types=\[\"sliding_attention\"\] must be a list of num_hidden_layers=2 kinds, each sliding_attention "
         r"or full_attention"),
        ({"layer_types": ["sliding_attention", "local"]}, r"layer_types=.* must be a list of num_hidden_layers=2"),
        ({"layer_types": None, "sliding_window_pattern": 0}, r"sliding_window_pattern=0 must be an integer >= 1"),
        ({"rope_parameters": {"full_attention": {"rope_theta": -1.0}}},
         r"rope_parameters\.full_attention\.rope_theta=-1\.0 must be a finite number > 0"),
        ({"rope_parameters": None, "rope_local_base_freq": "1e4"}, r'rope_local_base_freq="1e4" must be a finite'),
        ({"rope_parameters": [1]}, r"rope_parameters=\[1\] must be a table \(a JSON object\) or null"),
    ],
)  # fmt: skip
def test_config_json_numbers_are_checked_where_read_naming_the_file_and_key(edit, message, tmp_path):
    """Issue 84: query_pre_attn_scalar=0 was a ZeroDivisionError traceback, -4 a complex attention scale, "abc" a
    float() error naming neither the file nor the key."""
    _, config = FAMILIES["gemma3"]
    config.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, **edit}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: {message}"):
        GPT.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("llama3-scaled", {"rope_parameters": {**LLAMA3, "factor": 0}}, r"rope_parameters\.factor=0 must be a finite"),
        ("llama-gqa", {"rope_scaling": {**LLAMA3, "low_freq_factor": "1"}}, r"rope_scaling\.low_freq_factor=\"1\""),
        ("llama-gqa", {"rope_theta": -1, "rope_parameters": None}, r"rope_theta=-1 must be a finite number > 0"),
        ("granite", {"logits_scaling": 0}, r"logits_scaling=0 must be a finite number > 0"),
        ("qwen2", {"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be a finite number > 0, at most 1"),
        ("smollm3", {"no_rope_layers": [1]}, r"no_rope_layers=\[1\] must be a list of num_hidden_layers=2 0s and 1s"),
        ("nanochat", {"num_key_value_heads": -2}, r"num_key_value_heads=-2 must be an integer >= 1 or null"),
        ("llama-gqa", {"num_attention_heads": 3}, r"invalid GPTConfig: n_head=3 is not a multiple of n_kv_head=2"),
    ],
)  # fmt: skip
def test_other_families_numbers_are_checked_too(name, edit, message, tmp_path):
    _, config = FAMILIES[name]
    config.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, **edit}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: {message}"):
        GPT.from_pretrained(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Ministral 3's vision-language checkpoints (issue 86): the text model of a Mistral3ForConditionalGeneration


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_mistral3_vision_checkpoint_loads_its_text_model(tie, tmp_path, capsys):
    """transformers' AutoModelForCausalLM has no class for a Mistral3Config: the reference is the whole
    vision-language model's logits on text. The vision weights are left out, said in one line; the model exports as
    its text model's class (Ministral3ForCausalLM) with the same logits, tied as the top level's
    tie_word_embeddings says."""
    _, text = FAMILIES["ministral3"]
    vision = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision, image_token_index=V - 1, tie_word_embeddings=tie
    )
    hf = randomized(transformers.Mistral3ForConditionalGeneration(config)).eval()
    hf.save_pretrained(tmp_path / "vl")
    ours = GPT.from_pretrained(str(tmp_path / "vl"))
    note = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"note: .*vl is a Mistral3ForConditionalGeneration: its text model is read, and its \d+ weights under "
        r"vision_tower\., multi_modal_projector\. \(the vision tower and projector\) left out",
        note,
    ), note
    assert ours.config.tie_embeddings is tie
    text_ids = ids() % (V - 1)  # no image token
    with torch.no_grad():
        expected = hf(input_ids=text_ids).logits
        torch.testing.assert_close(ours(text_ids)[0], expected, atol=2e-4, rtol=0)
        prompt = text_ids[:1, :8]
        greedy = hf.generate(input_ids=prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(prompt, 32, temperature=0), greedy)
    export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Ministral3ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(back(text_ids).logits, expected, atol=2e-4, rtol=0)


def test_a_mistral3_with_another_text_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral3", "text_config": {"model_type": "qwen2"}, "tie_word_embeddings": True})
    )
    with pytest.raises(
        ValueError, match=r'config.json: text_config.model_type="qwen2" must be one of ministral3, mistral; correct'
    ):
        GPT.from_pretrained(str(tmp_path))


@pytest.fixture(scope="module")
def granite4_h(tmp_path_factory):
    """A tiny random Granite 4-H saved by transformers, and the model itself."""
    cls, config = FAMILIES["granite4-h"]
    hf = randomized(cls(config))
    directory = tmp_path_factory.mktemp("granite4-h")
    hf.save_pretrained(directory)
    return hf, directory


def test_granite4_h_rows_of_a_left_padded_batch_decode_what_they_decode_alone(granite4_h):
    """Prompts of 20 and 3 tokens in one batch (the short one left-padded past a chunk of 16): each row's 30 greedy
    tokens are its own alone, and transformers' generate."""
    hf, directory = granite4_h
    ours = GPT.from_pretrained(str(directory))
    prompts = [ids(1, 20)[0].tolist(), ids(1, 3)[0].tolist()]
    batch = generate(ours, prompts, 30, temperature=0)
    with torch.no_grad():
        for prompt, row in zip(prompts, batch, strict=True):
            assert row == generate(ours, [prompt], 30, temperature=0)[0]
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
            assert row == want[0].tolist()


def test_granite4_h_served_concurrent_completions_equal_transformers_greedy_continuations(granite4_h):
    """The server (continuous batching, each row its own Mamba-2 state) with requests of different lengths at once:
    each completion is transformers' greedy continuation of the same ids."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.helpers.serving import MODEL, Served

    hf, directory = granite4_h
    served = Served(max_batch=3, model=GPT.from_pretrained(str(directory)))
    prompts = ["ROMEO:", "a", "The quick brown fox", "To be or not to be", "xy"]
    lengths = [12, 30, 5, 20, 9]

    def complete(prompt: str, n: int) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        response = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
        return response.json()["choices"][0]["text"]

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts, lengths))
    finally:
        served.close()
    for prompt, n, text in zip(prompts, lengths, texts, strict=True):
        prompt_ids = served.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert text == served.tokenizer.decode(out[0, len(prompt_ids) :].tolist()), prompt


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("time_step_limit", "fast", r"time_step_limit=\"fast\" must be \[min, max\], two numbers"),
        ("mamba_d_head", 7, r"mamba_d_head=7 must be mamba_expand \* hidden_size / mamba_n_heads = 16"),
        (
            "layer_types",
            ["attention", "mamba"],
            r"layer_types=.* must be a list of num_hidden_layers=3 kinds, each attention or mamba",
        ),
    ],
)
def test_a_granite4_h_config_with_bad_mamba_values_is_named(key, value, message, tmp_path):
    """config.json's Mamba-2 keys, each checked where it is read: the file, the key, what it must be."""
    transformers.GraniteMoeHybridConfig(**GRANITE4_H).save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    values[key] = value
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=rf"config.json: {message}; correct it there"):
        GPT.from_pretrained(str(tmp_path))


def test_granite4_h_lora_on_the_mamba_projections_trains_them_and_merges(granite4_h):
    """LoRA on mamba.in_proj and mamba.out_proj: only the adapters train (through the chunked scan), decoding runs
    through them, and merging them back gives the adapted model's logits and greedy tokens."""
    from gptlite.train.lora import LoRALinear, add_lora, merge_lora

    _, directory = granite4_h
    pretrained = GPT.from_pretrained(str(directory))
    model = add_lora(GPT.from_pretrained(str(directory)), 4, targets=("mamba.in_proj", "mamba.out_proj"))
    adapted_layers = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert adapted_layers == [f"blocks.{i}.mamba.{p}" for i in (1, 2) for p in ("in_proj", "out_proj")]
    tokens = ids(2, 40)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    before = dict(pretrained.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    prompt = tokens[0, :20].tolist()
    with torch.no_grad():
        adapted = model(tokens)[0]
        assert not torch.allclose(adapted, pretrained(tokens)[0])
        greedy = model.generate([prompt], 8, temperature=0)
        merged = merge_lora(model)
        torch.testing.assert_close(merged(tokens)[0], adapted, atol=1e-4, rtol=1e-4)
        assert merged.generate([prompt], 8, temperature=0) == greedy
