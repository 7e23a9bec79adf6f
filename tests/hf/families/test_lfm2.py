"""LFM2 (Lfm2ForCausalLM) against transformers itself, on a tiny random model saved by transformers, its conv layers
first, between and last: what needs a conv layer's decode state (gptlite.model.attention_cache) beyond the families'
common tests (tests/hf/test_families.py: logits, greedy tokens on the cache, export, train.py --init_from): left-padded
batches, beam search and sampling, the server's rows, LoRA on the convolution's projections."""

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.train.lora import LoRALinear, add_lora, merge_lora
from tests.helpers.serving import CHARS, MODEL, Served
from tests.test_hf import randomized

transformers.logging.set_verbosity_error()
V = len(CHARS)  # the serving helpers' character tokenizer is the vocabulary
CONFIG = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,  # adjusted as transformers does: 2/3 of it, times 1.5, up to a multiple of 32: 96
    block_ffn_dim_multiplier=1.5,
    block_multiple_of=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    layer_types=["conv", "full_attention", "conv", "conv"],
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
PAD = 0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model with random weights, gptlite's GPT.from_pretrained of its directory)."""
    hf = randomized(transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**CONFIG)))
    directory = tmp_path_factory.mktemp("lfm2")
    hf.save_pretrained(directory)
    return hf, GPT.from_pretrained(str(directory))


def hf_greedy(hf, prompt: list[int], n: int, **kw) -> list[list[int]]:
    """transformers' continuations of one prompt (new tokens only)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kw)
    return [row[len(prompt) :] for row in out.tolist()]


def test_the_feed_forward_width_is_transformers_adjusted_one(saved):
    hf, model = saved
    assert model.config.ffn_hidden == hf.model.layers[0].feed_forward.w1.out_features == 96
    assert model.config.layer_types == "conv,full_attention,conv,conv" and model.config.conv_kernel == 3


def test_logits_and_30_greedy_tokens_on_the_cache_equal_transformers(saved):
    hf, model = saved
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))  # far longer than the conv
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, atol=2e-4, rtol=0)
    prompt = ids[0, :8].tolist()
    assert model.generate([prompt], 30, temperature=0)[0][8:] == hf_greedy(hf, prompt, 30)[0]


def test_left_padded_prompts_each_decode_what_they_decode_alone(saved):
    """Two prompts of 3 and 11 tokens in one batch: the shorter's 8 pads enter neither attention nor a conv state."""
    hf, model = saved
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    together = model.generate(prompts, 16, temperature=0)
    assert together == [model.generate([p], 16, temperature=0)[0] for p in prompts]
    continuations = [row[len(p) :] for row, p in zip(together, prompts, strict=True)]
    assert continuations == [hf_greedy(hf, p, 16)[0] for p in prompts]


def test_beam_search_equals_transformers_and_sampling_repeats_with_its_seed(saved):
    """Beams reorder and copy the conv states with their keys and values."""
    hf, model = saved
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    beams = model.generate([prompt], 12, num_beams=3, num_return_sequences=3)
    assert [row[len(prompt) :] for row in beams] == hf_greedy(hf, prompt, 12, num_beams=3, num_return_sequences=3)
    sampled = model.generate([prompt, prompt[:5]], 12, temperature=1.0, seed=7, num_samples=2)
    assert sampled == model.generate([prompt, prompt[:5]], 12, temperature=1.0, seed=7, num_samples=2)
    assert len(sampled) == 4 and all(0 <= t < V for row in sampled for t in row)


def test_the_server_completes_concurrent_requests_with_transformers_greedy_text(saved):
    """Requests of different prompt and completion lengths at once: rows join, leave and move, prefills are padded;
    each completion is transformers' greedy continuation of its prompt."""
    hf, model = saved
    served = Served(max_batch=3, model=model)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    jobs = [("ROMEO:", 12), ("a", 5), ("The quick brown", 9), ("JULIET: O", 3), ("To be or not to be", 7)]

    def run(job: tuple[str, int]) -> str:
        prompt, n = job
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text

    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(run, jobs))
    finally:
        served.close()
    tokenizer = served.tokenizer
    assert texts == [tokenizer.decode(hf_greedy(hf, tokenizer.encode(p), n)[0]) for p, n in jobs]


def test_lora_on_the_convolutions_projections_trains_them_and_merges(saved):
    """LoRA on conv.in_proj and conv.out_proj: only the adapters train, decoding runs through them, and merging
    them back gives the adapted model's logits and greedy tokens."""
    _, pretrained = saved
    model = add_lora(copy.deepcopy(pretrained), 4, targets=("conv.in_proj", "conv.out_proj"))
    adapted_layers = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert adapted_layers == [f"blocks.{i}.conv.{p}" for i in (0, 2, 3) for p in ("in_proj", "out_proj")]
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    before = dict(pretrained.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    prompt = ids[0, :6].tolist()
    with torch.no_grad():
        adapted = model(ids)[0]
        assert not torch.allclose(adapted, pretrained(ids)[0])
        greedy = model.generate([prompt], 8, temperature=0)
        merged = merge_lora(model)
        torch.testing.assert_close(merged(ids)[0], adapted, atol=1e-4, rtol=1e-4)
        assert merged.generate([prompt], 8, temperature=0) == greedy


def test_liquid_ais_own_key_names_are_read_as_transformers_reads_them(saved, tmp_path):
    """block_ff_dim and tie_embedding (LiquidAI's config.json names) over intermediate_size and tie_word_embeddings;
    full_attn_idxs where layer_types is left out."""
    hf, _ = saved
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["block_ff_dim"] = config.pop("intermediate_size")
    config["intermediate_size"] = 1  # what block_ff_dim replaces
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    config["tie_word_embeddings"] = False
    config["full_attn_idxs"] = [i for i, kind in enumerate(config.pop("layer_types")) if kind == "full_attention"]
    path.write_text(json.dumps(config))
    ids = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(str(tmp_path))(ids)[0], hf(ids).logits, atol=2e-4, rtol=0)


def test_a_layer_kind_gptlite_lacks_is_refused_naming_the_file(tmp_path):
    config = transformers.Lfm2Config(**{**CONFIG, "layer_types": ["conv", "linear_attention", "conv", "conv"]})
    randomized(transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**CONFIG))).save_pretrained(tmp_path)
    config.save_pretrained(tmp_path)  # the same weights, a config.json naming a kind gptlite does not have
    message = r"config.json: layer_types=.*\"linear_attention\".* must be a list of num_hidden_layers=4 kinds"
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(tmp_path))
