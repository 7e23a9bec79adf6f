"""Qwen3.5 in and out against transformers itself: tiny random models saved by transformers (Qwen3_5ForCausalLM, and
a Qwen3_5ForConditionalGeneration whose text tower AutoModelForCausalLM takes), every parameter random: logits past a
chunk of the Gated DeltaNet layers, export back into the text class, a training step's loss and gradients through
the chunked rule, LoRA on the layers' projections, train.py --init_from at learning rate 0."""

import json

import pytest
import torch
import transformers

from gptlite import GPT, GPTConfig
from gptlite.checkpoint import load_checkpoint
from gptlite.data.prepare import prepare
from gptlite.hf import export_hf
from gptlite.train.lora import add_lora, merge_lora
from tests.conftest import run_train, shared_file
from tests.test_hf import randomized

transformers.logging.set_verbosity_error()
V = 97
TEXT = dict(  # four layers: three Gated DeltaNet (two key heads serving four value heads), then full attention
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=V,
    max_position_embeddings=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
LORA_TARGETS = "attn.in_proj,attn.qkv,attn.out_proj,ffn.fc,ffn.out_proj"


def text_model(**changes) -> transformers.Qwen3_5ForCausalLM:
    return randomized(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**TEXT, **changes})))


@pytest.fixture(scope="module", params=["untied", "tied"])
def saved(request, tmp_path_factory):
    hf = text_model(tie_word_embeddings=request.param == "tied")
    directory = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    hf.save_pretrained(directory)
    return hf, directory


def ids(batch: int = 2, length: int = 70) -> torch.Tensor:
    """70 tokens: past the chunked rule's first chunk of 64."""
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1))


def test_logits_and_the_export_equal_transformers(saved, tmp_path):
    hf, directory = saved
    ours = GPT.from_pretrained(str(directory))
    assert ours.config.layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert ours.config.rope_dims == 8  # a quarter of each head of 32
    with torch.no_grad():
        expected = hf(ids()).logits
        torch.testing.assert_close(ours(ids())[0], expected, atol=2e-4, rtol=0)
    export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Qwen3_5ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, expected, atol=2e-4, rtol=0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["layer_types"] == hf.config.layer_types
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings


def test_a_vision_language_checkpoint_loads_its_text_tower(tmp_path):
    """Qwen3.5 is released as Qwen3_5ForConditionalGeneration: the text model's logits are AutoModelForCausalLM's,
    the vision tower is left out with one warning line, and the model exports as the text class."""
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    randomized(transformers.Qwen3_5ForConditionalGeneration(config)).save_pretrained(tmp_path / "vl")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vl").eval()
    with pytest.warns(UserWarning, match=r"the text model is loaded and \d+ weights of the vision tower"):
        ours = GPT.from_pretrained(str(tmp_path / "vl"))
    with torch.no_grad():
        expected = hf(ids()).logits
        torch.testing.assert_close(ours(ids())[0], expected, atol=2e-4, rtol=0)
    export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Qwen3_5ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, expected, atol=2e-4, rtol=0)


def test_multi_token_prediction_weights_are_left_out_in_one_line(tmp_path):
    """Qwen3.5's checkpoints carry a draft head for speculative decoding (mtp.*) that transformers leaves out too."""
    from safetensors.torch import load_file, save_file

    hf = text_model()
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 weights of multi-token prediction \(mtp\.\*\) are left out"):
        ours = GPT.from_pretrained(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids(1, 20))[0], hf(ids(1, 20)).logits, atol=2e-4, rtol=0)


def test_a_config_without_layer_types_has_every_fourth_layer_full_attention(tmp_path):
    hf = text_model(num_hidden_layers=8)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = GPT.from_pretrained(str(tmp_path))
    assert ours.config.layer_kinds == tuple(hf.config.layer_types)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids(1, 20))[0], hf(ids(1, 20)).logits, atol=2e-4, rtol=0)


def test_a_training_step_has_transformers_loss_and_gradients(saved):
    """Training runs through the chunked rule: the loss of 70 tokens and the gradients of the Gated DeltaNet's and
    the gated attention's weights equal transformers' forward and backward."""
    hf, directory = saved
    ours = GPT.from_pretrained(str(directory)).train()
    hf = hf.train()
    x = ids()
    targets = torch.roll(x, -1, dims=1)
    _, loss = ours(x, targets)
    loss.backward()
    expected = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), targets.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    layers = hf.model.layers
    pairs = [
        (ours.blocks[0].attn.A_log, layers[0].linear_attn.A_log),
        (ours.blocks[1].attn.conv.weight, layers[1].linear_attn.conv1d.weight),
        (ours.blocks[2].attn.out_proj.weight, layers[2].linear_attn.out_proj.weight),
        (ours.blocks[2].attn.norm.weight, layers[2].linear_attn.norm.weight),
        (ours.blocks[3].attn.out_proj.weight, layers[3].self_attn.o_proj.weight),
    ]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-3)
    z_rows = ours.blocks[0].attn.sizes[0]  # in_proj: q, k, v, then z
    torch.testing.assert_close(
        ours.blocks[0].attn.in_proj.weight.grad[z_rows : z_rows + 32],
        layers[0].linear_attn.in_proj_z.weight.grad,
        atol=1e-4,
        rtol=1e-3,
    )
    hf.zero_grad()


def test_lora_adapts_the_gated_deltanet_and_gated_attention_projections(saved):
    """Adapters on every projection of both kinds of layer: gradients reach them, and merging them into the weights
    gives the adapted model's logits."""
    _, directory = saved
    model = add_lora(GPT.from_pretrained(str(directory)), rank=4, targets=tuple(LORA_TARGETS.split(",")))
    adapted = [name for name, p in model.named_parameters() if p.requires_grad]
    assert "blocks.0.attn.in_proj.lora_A" in adapted and "blocks.3.attn.qkv.lora_A" in adapted
    _, loss = model(ids(), torch.roll(ids(), -1, dims=1))
    loss.backward()
    assert model.blocks[0].attn.in_proj.lora_B.grad.abs().sum() > 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
        expected = model(ids())[0]
        torch.testing.assert_close(merge_lora(model)(ids())[0], expected, atol=1e-3, rtol=1e-4)  # rounding


def test_peft_loads_the_adapters_with_equal_logits(saved, tmp_path):
    """Gated DeltaNet's fused in_proj's adapter becomes one per transformers projection (in_proj_qkv, _z, _b, _a),
    the gated attention's qkv one per q_proj (query and gate rows), k_proj, v_proj: PEFT's model on transformers'
    has the gptlite model's logits."""
    import peft

    from gptlite.hf.adapter import export_adapter

    _, directory = saved
    model = add_lora(GPT.from_pretrained(str(directory)), rank=4, targets=tuple(LORA_TARGETS.split(",")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        expected = model(ids())[0]
    export_adapter(model, tmp_path / "adapter", base=str(directory))
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)  # a copy: PEFT changes the model it wraps
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids()).logits, expected, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """Tiny Shakespeare in chars: 65 ids, all below the tiny models' vocabulary of 97."""
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:20_000])
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


def test_train_init_from_with_learning_rate_0_changes_no_weight(saved, char_data, tmp_path):
    _, directory = saved
    run_train(
        f"--init_from={directory}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path / 'run'}",
        "--learning_rate=0",
        "--max_iters=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=70",
        "--device=cpu",
    )
    saved_weights = load_checkpoint(tmp_path / "run")["model"]
    for key, tensor in GPT.from_pretrained(str(directory), block_size=70).state_dict().items():
        assert torch.equal(saved_weights[key], tensor), key  # bit for bit


def test_train_init_from_with_lora_on_every_projection(saved, char_data, tmp_path):
    _, directory = saved
    run = run_train(
        f"--init_from={directory}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path / 'run'}",
        "--lora_rank=4",
        f"--lora_targets={LORA_TARGETS}",
        "--max_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=70",
        "--device=cpu",
    )
    assert run.code == 0
    adapters = load_checkpoint(tmp_path / "run")["model"]
    assert any(name.startswith("blocks.0.attn.in_proj.lora_") for name in adapters)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(layer_types="full_attention,lstm"), r"layer_types names 'lstm'; the kinds are full_attention"),
        (
            dict(layer_types="linear_attention", n_layer=1, linear_k_heads=3, linear_v_heads=4),
            r"linear_v_heads=4 is not a multiple of linear_k_heads=3",
        ),
    ],
)
def test_bad_layer_types_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


def test_gguf_export_is_refused_in_one_line(saved):
    from gptlite.hf.gguf import gguf_architecture

    _, directory = saved
    model = GPT.from_pretrained(str(directory))
    with pytest.raises(ValueError, match=r"GGUF export of a Qwen3_5ForCausalLM is not implemented"):
        gguf_architecture(model.config, model.source_architecture)


def test_muon_orthogonalises_each_matrix_of_the_fused_projections(saved):
    """Gated DeltaNet's in_proj stacks q, k, v, z, b and a; the gated attention's qkv its query-and-gate rows, k
    and v: Muon takes each as a matrix of its own."""
    from gptlite.train.optim import block_matrices

    _, directory = saved
    model = GPT.from_pretrained(str(directory))
    splits = block_matrices(model)
    assert splits[model.blocks[0].attn.in_proj.weight] == (32, 32, 32, 32, 4, 4)
    assert splits[model.blocks[3].attn.qkv.weight] == (256, 64, 64)


def test_greedy_tokens_on_the_cache_equal_transformers_generate(saved):
    """A prompt of 70 tokens (past a chunk) prefilled through the chunked rule, then 30 steps of the recurrence with
    the convolution's last inputs carried: transformers' greedy tokens."""
    hf, directory = saved
    ours = GPT.from_pretrained(str(directory))
    prompt = ids(1, 70)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 30, temperature=0), expected)


def test_left_padded_rows_decode_as_each_alone(saved):
    """Left padding enters neither the convolution nor the recurrent state: each row of one batch decodes what
    transformers decodes for its prompt alone."""
    hf, directory = saved
    ours = GPT.from_pretrained(str(directory))
    prompts = [ids(1, 13)[0].tolist(), ids(1, 3)[0].tolist(), ids(1, 7)[0].tolist()]
    together = ours.generate(prompts, 20, temperature=0)
    for prompt, row in zip(prompts, together, strict=True):
        with torch.no_grad():
            alone = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert list(row) == alone[0].tolist()


def test_the_servers_concurrent_completions_equal_transformers(tmp_path):
    """The server's continuous batching: rows of different lengths join and leave one cache, each with its own
    recurrent and convolution state; each completion is transformers' greedy continuation of its ids. (One model:
    the head's tie changes nothing the server does.)"""
    from gptlite.inference.sampling import GenerationOptions
    from gptlite.serve.engine import Engine, Params
    from gptlite.tokenizer import CharTokenizer
    from tests.helpers.serving import CHARS
    from tests.serve.test_engine import PROMPTS, Collect

    hf = text_model()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path))
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=3).start()
    try:
        texts = Collect(
            engine, tokenizer, PROMPTS, Params(max_tokens=20, options=GenerationOptions(temperature=0))
        ).wait()
    finally:
        engine.close()
    for prompt, text in zip(PROMPTS, texts, strict=True):
        prompt_ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = hf.generate(prompt_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert text == tokenizer.decode(expected[0, prompt_ids.size(1) :].tolist())
