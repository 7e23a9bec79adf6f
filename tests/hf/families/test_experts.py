"""OLMoE, Qwen3-MoE and Granite 3 MoE in and out, against transformers itself: tiny models of four experts, two per
token, with random weights, saved with save_pretrained: logits within 2e-4, 30 greedy tokens on gptlite's cache equal
to generate's, the export loaded back as the same class with the same logits, the load-balancing loss equal to
transformers' aux_loss, train.py --init_from at learning rate 0, LoRA on the attention, the GGUF architecture; what
gptlite does not do for experts (dense layers among them, clipped q/k/v, quantization, LoRA on the experts) refused in
one line."""

import json

import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.checkpoint import load_checkpoint
from gptlite.data.prepare import prepare
from gptlite.hf import export_hf
from gptlite.hf.gguf import gguf_architecture
from gptlite.train.lora import LoRALinear, add_lora
from tests.conftest import run_train, shared_file
from tests.test_hf import randomized

transformers.logging.set_verbosity_error()
V = 97
COMMON = dict(
    hidden_size=64,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
EXPERTS = dict(num_experts_per_tok=2)
FAMILIES = {  # name -> (transformers class, its config)
    "olmoe": (  # the router's softmax as it is; q/k norm over all heads
        transformers.OlmoeForCausalLM,
        transformers.OlmoeConfig(**COMMON, **EXPERTS, num_experts=4, router_aux_loss_coef=0.02),
    ),
    "qwen3_moe": (  # the top k divided by their sum; q/k norm per head, a head width of its own
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **COMMON, **EXPERTS, num_experts=4, moe_intermediate_size=24, head_dim=24, norm_topk_prob=True
        ),
    ),
    "granitemoe": (  # a softmax over the top k logits; Granite's multipliers; tied
        transformers.GraniteMoeForCausalLM,
        transformers.GraniteMoeConfig(
            **COMMON,
            **EXPERTS,
            num_local_experts=4,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
            tie_word_embeddings=True,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    cls, config = FAMILIES[request.param]
    model = randomized(cls(config))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """Tiny Shakespeare in chars: 65 ids, all below the tiny models' vocabulary of 97."""
    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:20_000])
    out = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], "char", out, log=lambda *a: None)
    return out


def ids(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1))


def test_logits_greedy_tokens_and_the_export_equal_transformers(saved, tmp_path):
    name, hf, directory = saved
    ours = GPT.from_pretrained(str(directory))
    assert ours.config.n_experts == 4 and ours.config.experts_per_token == 2
    with torch.no_grad():
        expected = hf(ids()).logits
        torch.testing.assert_close(ours(ids())[0], expected, atol=2e-4, rtol=0)
        prompt = ids(1, 8)
        greedy = hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(prompt, 30, temperature=0), greedy)
    export_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, expected, atol=2e-4, rtol=0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["router_aux_loss_coef"] == hf.config.router_aux_loss_coef


def test_the_load_balancing_loss_equals_transformers_aux_loss(saved):
    """The same router logits in both (the same weights, a training forward): transformers' aux_loss, which its
    loss adds times router_aux_loss_coef, and gptlite's."""
    name, hf, directory = saved
    ours = GPT.from_pretrained(str(directory)).train()
    assert ours.config.router_aux_loss_coef == hf.config.router_aux_loss_coef
    with torch.no_grad():
        expected = hf(ids(), output_router_logits=True).aux_loss
    ours(ids(), ids())
    torch.testing.assert_close(ours.router_aux_loss(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_train_init_from_with_learning_rate_0_changes_no_weight(name, char_data, tmp_path):
    """The load-balancing loss is added and logged, and at learning rate 0 no weight changes."""
    cls, config = FAMILIES[name]
    randomized(cls(config)).save_pretrained(tmp_path / "hf")
    run = run_train(
        f"--init_from={tmp_path / 'hf'}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path / 'run'}",
        "--learning_rate=0",
        "--max_iters=2",
        "--eval_interval=2",
        "--log_interval=1",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=32",
        "--device=cpu",
    )
    assert run.code == 0, run.err
    assert "router aux" in run.out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["router_aux_loss"] > 0 for row in rows if "loss" in row)
    saved_weights = load_checkpoint(tmp_path / "run")["model"]
    for key, tensor in GPT.from_pretrained(str(tmp_path / "hf"), block_size=32).state_dict().items():
        assert torch.equal(saved_weights[key], tensor), key  # bit for bit


def test_lora_adapts_the_attention_and_refuses_the_experts(saved):
    name, hf, directory = saved
    model = GPT.from_pretrained(str(directory))
    with pytest.raises(ValueError, match=r"lora_targets: ffn.fc, ffn.out_proj name this model's experts, n_experts=4 "):
        add_lora(model, 4)  # the default targets: the feed-forward's too
    with torch.no_grad():
        before = model(ids())[0]
    add_lora(model, 4, targets=("attn.qkv", "attn.out_proj"))
    assert isinstance(model.blocks[0].attn.qkv, LoRALinear)
    with torch.no_grad():
        torch.testing.assert_close(model(ids())[0], before, atol=0, rtol=0)  # B starts at zero
    model.train()
    _, loss = model(ids(), ids())
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


def test_quantize_refuses_experts_in_one_line(saved):
    name, hf, directory = saved
    model = GPT.from_pretrained(str(directory))
    for mode in ("int8", "int4"):
        with pytest.raises(ValueError, match=rf"quantize='{mode}' quantizes linear layers, .* leave --quantize out"):
            model.quantize(mode)


def test_each_family_exports_to_its_llama_cpp_architecture(saved):
    """The architecture llama.cpp reads experts as (tests/hf/test_gguf.py compares llama.cpp's logits), except for
    OLMoE with grouped-query attention, which llama.cpp's olmoe does not have, refused in one line."""
    name, hf, directory = saved
    model = GPT.from_pretrained(str(directory))
    if name == "olmoe":  # the tiny model has 2 key/value heads for 4 query heads
        with pytest.raises(ValueError, match=r"llama.cpp's olmoe has as many key/value heads as query heads"):
            gguf_architecture(model.config, model.source_architecture)
        return
    family, arch = gguf_architecture(model.config, model.source_architecture)
    assert family.architecture == type(hf).__name__ and arch == name.replace("_", "")


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"dense feed-forwards in layers 1 among the experts' \(mlp_only_lay"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"dense feed-forwards in layers 0 .*decoder_sparse_step=2\)"),
        ("olmoe", {"clip_qkv": 8.0}, r"q, k and v clipped to \+-8.0 \(clip_qkv\), which gptlite does not do"),
        ("olmoe", {"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be an integer >= 1"),
    ],
)
def test_what_gptlite_cannot_hold_of_the_experts_is_refused(name, edit, message, tmp_path):
    cls, config = FAMILIES[name]
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), **edit}))
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(tmp_path))


def test_a_fine_tuning_run_may_turn_the_load_balancing_loss_off(char_data, tmp_path):
    """router_aux_loss_coef shapes no weight: --init_from takes the run's own, and 0 adds nothing."""
    cls, config = FAMILIES["olmoe"]
    randomized(cls(config)).save_pretrained(tmp_path / "hf")
    run = run_train(
        f"--init_from={tmp_path / 'hf'}",
        f"--data_dir={char_data}",
        f"--out_dir={tmp_path / 'run'}",
        "--router_aux_loss_coef=0",
        "--max_iters=1",
        "--eval_interval=1",
        "--log_interval=1",
        "--eval_iters=1",
        "--batch_size=2",
        "--block_size=32",
        "--device=cpu",
    )
    assert run.code == 0, run.err
    assert "router aux" not in run.out
    assert load_checkpoint(tmp_path / "run")["config"]["router_aux_loss_coef"] == 0
