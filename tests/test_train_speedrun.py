"""The speedrun options against their definitions, each written out here rather than called from the code it checks:
ReLU-squared feed-forwards, value embeddings, U-net skips, logit soft-capping (GPT.head and the chunked loss),
zero-initialised output projections, Polar Express and NorMuon in Muon, the sequence-length warm-up, the moving
average of the weights; train.py with them end to end; the errors that name them; and the bigram hash embedding,
whose every cached or packed path (KV cache, beam search, the server's rows and prefix cache, packed spans) is
checked against full forwards of whole rows."""

import copy
import json
import math
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPT, GPTConfig
from gptlite.checkpoint import load_checkpoint
from gptlite.config import MODEL_SHAPE_KEYS, build_config, model_changes
from gptlite.data.prepare.preference import prepare_preference
from gptlite.data.shards import write_shard
from gptlite.evaluate.spans import Row as SpanRow
from gptlite.evaluate.spans import score_spans
from gptlite.hf import export_hf, family_of
from gptlite.hf.gguf import gguf_architecture
from gptlite.inference.generate import SLIDE_KEEP
from gptlite.inference.kvcache import new_cache, prefill
from gptlite.inference.sampling import GenerationOptions
from gptlite.model.loss import linear_cross_entropy
from gptlite.model.network import ReluSquaredMLP, previous_tokens
from gptlite.serve.engine import Engine, Job, Params, TokenLogprob
from gptlite.serve.prefix import BLOCK
from gptlite.tokenizer import CharTokenizer
from gptlite.train.optim import (
    NS_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    Muon,
    WeightAverage,
    newton_schulz,
    normalise_neurons,
    ns_schedule,
    orthogonalise,
    run_progress,
    seq_len_at,
)
from gptlite.train.run_config import resolve_config
from tests.conftest import ROOT, run_train, tiny_config
from tests.serve.test_engine_prefill import recording


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """This file's tests on one thread (small matrices: one is as fast, and leaves the machine's other cores alone),
    the thread count restored after them: what other files' tests measure does not depend on this one's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_importing_this_file_leaves_the_thread_count_alone():
    """pytest imports every file it collects before any test runs: what this one sets at import would hold for the
    other files' tests too."""
    code = "import torch; n = torch.get_num_threads(); import tests.test_train_speedrun; "
    code += "print(n, torch.get_num_threads())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    before, after = child.stdout.split()
    assert after == before


# The five (a, b, c) of modded-nanogpt's and nanochat's Polar Express (Amsel et al., 2025, computed for
# num_iters=5, safety_factor=2e-2, cushion=2), copied from their train_gpt.py; the input is divided by 1.02 ||X||_F.
PUBLISHED_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
KELLER_QUINTIC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's Muon: this quintic five times, on X / ||X||_F


# ---------------------------------------------------------------------------------------------
# references written out


def randomise(model: GPT, std: float = 0.3, seed: int = 0) -> GPT:
    """Every parameter drawn anew with a large std, so that each block, skip and mix changes the result visibly
    (at GPT-2's init of std 0.02 the blocks barely move the residual stream)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight (+ bias), over the last dimension (Ba et al., 2016)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + norm.eps) * norm.weight
    return y if norm.bias is None else y + norm.bias


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return x @ layer.weight.T if layer.bias is None else x @ layer.weight.T + layer.bias


def relu_squared(x: torch.Tensor, ffn: ReluSquaredMLP) -> torch.Tensor:
    """Primer's feed-forward (So et al., 2021): out_proj(relu(fc x)^2)."""
    return linear(torch.clamp(linear(x, ffn.fc), min=0) ** 2, ffn.out_proj)


def naive_attention(attn, x: torch.Tensor, ve: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), causal) v' out_proj^T with v' = value_mix[0] v + value_mix[1] ve, each of the KV
    value heads serving H / KV query heads; no positions inside (pos_emb=learned adds them before the blocks)."""
    B, T, _ = x.shape
    H, KV, D = attn.n_head, attn.n_kv_head, attn.head_dim
    w = attn.qkv.weight  # rows q (H*D), then k (KV*D), then v (KV*D)
    q = x @ w[: H * D].T
    k = x @ w[H * D : (H + KV) * D].T
    v = x @ w[(H + KV) * D :].T
    if ve is not None:
        v = attn.value_mix[0] * v + attn.value_mix[1] * ve
    q = q.view(B, T, H, D).transpose(1, 2)
    k, v = (t.view(B, T, KV, D).transpose(1, 2).repeat_interleave(H // KV, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v  # (B, H, T, D)
    return linear(y.transpose(1, 2).reshape(B, T, H * D), attn.out_proj)


def reference_hidden(model: GPT, idx: torch.Tensor, mirror: dict[int, int] | None = None) -> torch.Tensor:
    """The final-norm hidden states of a learned-positions, LayerNorm, relu2 model written out: block i gets, where
    `mirror` (receiver -> sender) names a sender j, skip_weights[j] times block j's output added to its input."""
    cfg = model.config
    x = model.tok_emb.weight[idx] + model.pos_emb.table.weight[: idx.size(1)]
    outputs = []
    for i, block in enumerate(model.blocks):
        if mirror and i in mirror:
            x = x + model.skip_weights[mirror[i]] * outputs[mirror[i]]
        ve = model.value_emb[i].weight[idx] if cfg.value_embeds else None
        x = x + naive_attention(block.attn, layer_norm(x, block.attn_norm), ve)
        x = x + relu_squared(layer_norm(x, block.ffn_norm), block.ffn)
        outputs.append(x)
    return layer_norm(x, model.norm)


def softcapped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(logits / cap)


# ---------------------------------------------------------------------------------------------
# relu2


@pytest.mark.parametrize("bias", [False, True])
def test_relu2_is_out_proj_of_the_squared_relu_of_fc_four_times_wide(bias):
    model = randomise(GPT(tiny_config(ffn="relu2", bias=bias)))
    ffn = model.blocks[0].ffn
    assert isinstance(ffn, ReluSquaredMLP) and model.config.ffn_hidden == 4 * 32
    assert ffn.fc.weight.shape == (128, 32) and ffn.out_proj.weight.shape == (32, 128)
    x = torch.randn(2, 5, 32)
    want = relu_squared(x, ffn)
    torch.testing.assert_close(ffn(x), want, atol=1e-4, rtol=1e-5)
    assert (linear(x, ffn.fc) < 0).any()  # the ReLU cuts something off here
    assert GPT(tiny_config(ffn="relu2", ffn_hidden=48)).blocks[0].ffn.fc.weight.shape == (48, 32)


# ---------------------------------------------------------------------------------------------
# value embeddings


def test_value_embeds_add_one_embedding_per_layer_as_wide_as_the_values_and_a_mix_of_two():
    model = GPT(tiny_config(value_embeds=True, n_layer=3, n_kv_head=2))  # KV * D = 2 * 8
    plain = GPT(tiny_config(n_layer=3, n_kv_head=2))
    added = set(model.state_dict()) - set(plain.state_dict())
    assert added == {f"value_emb.{i}.weight" for i in range(3)} | {f"blocks.{i}.attn.value_mix" for i in range(3)}
    assert all(model.value_emb[i].weight.shape == (97, 16) for i in range(3))
    assert all(model.blocks[i].attn.value_mix.tolist() == [0.5, 0.5] for i in range(3))
    assert model.value_emb[0].weight is not model.value_emb[1].weight


def test_attention_with_value_embeds_equals_the_naive_math_on_the_mixed_values():
    model = randomise(GPT(tiny_config(value_embeds=True, n_kv_head=2)))
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.value_mix.copy_(torch.tensor([0.3, -1.7]))
    x = torch.randn(3, 11, 32)
    ve = torch.randn(3, 11, 16)
    got = attn(x, ve=ve)
    torch.testing.assert_close(got, naive_attention(attn, x, ve), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, naive_attention(attn, x), atol=1e-2)  # ve changes the output


def test_value_mix_1_0_is_the_model_without_value_embeds():
    torch.manual_seed(0)
    with_ve = GPT(tiny_config(value_embeds=True)).eval()
    without = GPT(tiny_config()).eval()
    without.load_state_dict({k: v for k, v in with_ve.state_dict().items() if k in without.state_dict()})
    idx = torch.randint(0, 97, (2, 20))
    assert not torch.allclose(with_ve(idx)[0], without(idx)[0], atol=1e-4)  # at (0.5, 0.5) they differ
    with torch.no_grad():
        for block in with_ve.blocks:
            block.attn.value_mix.copy_(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(with_ve(idx)[0], without(idx)[0], atol=0, rtol=0)


def test_each_layer_mixes_its_own_value_embedding_of_the_tokens():
    model = randomise(GPT(tiny_config(value_embeds=True, ffn="relu2", n_layer=3)))
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.attn.value_mix.copy_(torch.tensor([0.5 + 0.2 * i, 1.0 - 0.6 * i]))
    idx = torch.randint(0, 97, (2, 13))
    torch.testing.assert_close(model.hidden(idx), reference_hidden(model, idx), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# U-net skips

# receiver block -> the block whose output it gets (block n_layer-1-i of the first n_layer // 2), written out
MIRRORS = {2: {1: 0}, 4: {2: 1, 3: 0}, 5: {3: 1, 4: 0}}


@pytest.mark.parametrize("n_layer", list(MIRRORS))
def test_unet_skips_add_each_early_blocks_output_to_its_mirror_block(n_layer):
    model = randomise(GPT(tiny_config(unet_skips=True, ffn="relu2", n_layer=n_layer)))
    assert model.skip_weights.shape == (n_layer // 2,)
    assert GPT(tiny_config(unet_skips=True, n_layer=n_layer)).skip_weights.tolist() == [1.0] * (n_layer // 2)
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.7, -1.3][: n_layer // 2]))
    idx = torch.randint(0, 97, (2, 13))
    got = model.hidden(idx)
    torch.testing.assert_close(got, reference_hidden(model, idx, MIRRORS[n_layer]), atol=1e-4, rtol=1e-4)
    if n_layer >= 4:  # the reference tells the mirror order from its reverse
        swapped = {receiver: n_layer // 2 - 1 - sender for receiver, sender in MIRRORS[n_layer].items()}
        assert not torch.allclose(got, reference_hidden(model, idx, swapped), atol=1e-2)


def test_unet_skips_with_one_layer_are_refused_in_one_line():
    """One block has no mirror: the switch would do nothing, so it is refused rather than accepted without a word."""
    with pytest.raises(ValueError, match=r"unet_skips=true joins block i's output to block n_layer-1-i's input, and "
                       r"n_layer=1 has no such pair; use n_layer >= 2 or leave unet_skips out"):  # fmt: skip
        tiny_config(unet_skips=True, n_layer=1)


def test_unet_skips_weighted_zero_are_the_model_without_them():
    torch.manual_seed(0)
    skips = GPT(tiny_config(unet_skips=True, n_layer=4)).eval()
    plain = GPT(tiny_config(n_layer=4)).eval()
    assert set(skips.state_dict()) - set(plain.state_dict()) == {"skip_weights"}
    plain.load_state_dict({k: v for k, v in skips.state_dict().items() if k != "skip_weights"})
    idx = torch.randint(0, 97, (2, 20))
    assert not torch.allclose(skips(idx)[0], plain(idx)[0], atol=1e-4)
    with torch.no_grad():
        skips.skip_weights.zero_()
    torch.testing.assert_close(skips(idx)[0], plain(idx)[0], atol=0, rtol=0)


def test_every_option_together_equals_the_written_out_model_and_trains_with_checkpointing():
    config = tiny_config(value_embeds=True, unet_skips=True, ffn="relu2", logit_softcap=2.0, n_layer=4)
    model = randomise(GPT(config))
    idx = torch.randint(0, 97, (2, 13))
    targets = torch.randint(0, 97, (2, 13))
    want = softcapped(reference_hidden(model, idx, MIRRORS[4]) @ model.lm_head.weight.T, 2.0)
    torch.testing.assert_close(model(idx)[0], want, atol=1e-4, rtol=1e-4)
    # activation checkpointing passes the value embeddings and the skips through: the same gradients
    model.train()
    grads = []
    for checkpoint_blocks in (False, True):
        model.checkpoint_blocks = checkpoint_blocks
        model.zero_grad()
        model(idx, targets)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(grads[0][n].abs().sum() > 0 for n in ("skip_weights", "value_emb.3.weight", "blocks.0.attn.value_mix"))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-5)


def test_cached_greedy_decoding_with_every_option_equals_full_recompute():
    """The KV cache's one-token steps get their tokens' value embeddings and the skips as the whole window does."""
    config = tiny_config(value_embeds=True, unet_skips=True, ffn="relu2", logit_softcap=2.0, n_layer=4, n_kv_head=2)
    model = randomise(GPT(config), std=0.2)
    torch.manual_seed(1)
    idx = torch.randint(0, 97, (3, 5))
    out = idx
    for _ in range(20):  # within block_size=32: no sliding window
        out = torch.cat([out, model(out)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(idx, 20, temperature=0), out)


def test_value_embeddings_are_lookups_that_add_no_matmul_flops():
    plain = GPT(tiny_config())
    mixed = GPT(tiny_config(value_embeds=True))
    # 6N counts the parameters a token is multiplied with: each layer's value_mix (2), not the tables it looks up
    assert mixed.flops_per_token() == plain.flops_per_token() + 6 * 2 * mixed.config.n_layer


# ---------------------------------------------------------------------------------------------
# logit soft-capping


def test_the_head_caps_every_logit_with_tanh():
    model = randomise(GPT(tiny_config(logit_softcap=2.0)), std=1.0)
    h = torch.randn(3, 7, 32)
    raw = h @ model.lm_head.weight.T
    torch.testing.assert_close(model.head(h), softcapped(raw, 2.0))
    assert raw.abs().max() > 10  # logits well past the cap, squashed
    idx = torch.randint(0, 97, (2, 16))
    logits = model(idx)[0]
    torch.testing.assert_close(logits, softcapped(model.hidden(idx) @ model.lm_head.weight.T, 2.0))
    assert 1.9 < logits.abs().max() <= 2.0  # tanh rounds to 1 in float32 far past the cap: never beyond it
    # generation's head caps too: the last position's logits from the KV-cache step
    cache = new_cache(model, 2)
    torch.testing.assert_close(prefill(model, cache, idx.tolist()), logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_chunked_loss_with_a_softcap_equals_cross_entropy_of_the_capped_logits(reduction):
    torch.manual_seed(0)
    h = torch.randn(300, 24, requires_grad=True)
    w = torch.randn(500, 24, requires_grad=True)  # logits of std ~5: a cap of 3 bends most of them
    t = torch.randint(0, 500, (300,))
    t[::7] = -1
    t[128:192] = -1  # a whole chunk without targets
    weights = torch.rand(300) if reduction == "none" else torch.tensor(3.0)  # an incoming gradient to pass back
    want = F.cross_entropy(softcapped(h @ w.T, 3.0), t, ignore_index=-1, reduction=reduction)
    want_h, want_w = torch.autograd.grad((want * weights).sum(), (h, w))
    got = linear_cross_entropy(h, w, t, reduction, chunk=64, softcap=3.0)
    got_h, got_w = torch.autograd.grad((got * weights).sum(), (h, w))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-4)
    uncapped_h = torch.autograd.grad(F.cross_entropy(h @ w.T, t, ignore_index=-1, reduction="sum"), h)[0]
    assert not torch.allclose(got_h, uncapped_h, atol=1e-2)  # the cap's chain rule matters here
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(linear_cross_entropy(h, w, t, reduction, chunk=64, softcap=3.0), want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_models_chunked_training_loss_equals_its_capped_logits_loss(reduction):
    model = randomise(GPT(tiny_config(logit_softcap=1.5)), std=0.5)
    model.train()
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    targets[0, :5] = -1
    losses = []
    grads = []
    for return_logits in (True, False):
        model.zero_grad()
        loss = model(idx, targets, reduction=reduction, return_logits=return_logits)[1]
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    logits = softcapped(model.hidden(idx) @ model.lm_head.weight.T, 1.5)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
    torch.testing.assert_close(losses[0], want.view_as(losses[0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# zero-initialised output projections


def test_zero_init_out_starts_every_block_as_the_identity():
    torch.manual_seed(0)
    model = GPT(tiny_config(zero_init_out=True, n_layer=3)).eval()
    projections = [n for n, _ in model.named_parameters() if n.endswith("out_proj.weight")]
    assert len(projections) == 6  # attention's and the feed-forward's, in every block
    assert all(not p.any() for n, p in model.named_parameters() if n in projections)
    assert all(p.any() for n, p in model.named_parameters() if n not in projections and p.dim() == 2)
    assert all(p.any() for n, p in GPT(tiny_config(n_layer=3)).named_parameters() if n in projections)
    idx = torch.randint(0, 97, (2, 20))
    x = model.tok_emb.weight[idx] + model.pos_emb.table.weight[:20]
    want = layer_norm(x, model.norm) @ model.tok_emb.weight.T
    torch.testing.assert_close(model(idx)[0], want, atol=1e-6, rtol=1e-5)
    # and training starts: the zero projections get a gradient of their own
    model(idx, idx)[1].backward()
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in projections)


def test_zero_init_out_may_change_on_resume_and_the_architecture_options_may_not():
    assert "zero_init_out" not in MODEL_SHAPE_KEYS
    assert {"ffn", "value_embeds", "unet_skips", "logit_softcap"} <= set(MODEL_SHAPE_KEYS)
    changes = model_changes({"zero_init_out": "true", "value_embeds": "true", "logit_softcap": "15"}, {})
    assert changes == [("value_embeds", "true", False), ("logit_softcap", "15", 0.0)]


# ---------------------------------------------------------------------------------------------
# Polar Express


def scalar_newton_schulz(s: list[float], coefficients, safety: float) -> list[float]:
    """What the iteration does to each singular value: s / (safety ||s||_2), then x <- a x + b x^3 + c x^5 for each
    step's (a, b, c), in float64."""
    norm = math.sqrt(sum(v * v for v in s))
    x = [v / (safety * norm) for v in s]
    for a, b, c in coefficients:
        x = [a * v + b * v**3 + c * v**5 for v in x]
    return x


def test_the_coefficients_are_the_published_ones():
    assert POLAR_EXPRESS_COEFFICIENTS == PUBLISHED_POLAR_EXPRESS
    assert ns_schedule("polar_express") == (PUBLISHED_POLAR_EXPRESS, 1.02)
    assert NS_COEFFICIENTS == KELLER_QUINTIC
    assert ns_schedule("quintic") == ((KELLER_QUINTIC,) * 5, 1.0)
    assert ns_schedule("quintic", 3) == ((KELLER_QUINTIC,) * 3, 1.0)


@pytest.mark.parametrize("method", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(6, 6), (6, 9), (9, 6)], ids=["square", "wide", "tall"])
def test_on_a_diagonal_matrix_each_singular_value_follows_the_scalar_polynomials(method, shape):
    s = [1.0, 0.6, 0.25, 0.1, 0.02, 0.004]
    g = torch.zeros(shape)
    g[range(6), range(6)] = torch.tensor(s)
    if method == "polar_express":
        coefficients = PUBLISHED_POLAR_EXPRESS
        safety = 1.02
    else:
        coefficients = (KELLER_QUINTIC,) * 5
        safety = 1
    want = torch.zeros(shape, dtype=torch.float64)
    want[range(6), range(6)] = torch.tensor(scalar_newton_schulz(s, coefficients, safety), dtype=torch.float64)
    got = newton_schulz(g, torch.float32, method=method)
    assert got.shape == shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_polar_express_lands_closer_to_1_than_the_quintic_on_a_random_matrix():
    torch.manual_seed(0)
    g = torch.randn(64, 32)
    got = newton_schulz(g, torch.float32, method="polar_express")
    s = torch.linalg.svdvals(got)
    # X -> p(X X^T) X keeps the singular vectors: each singular value goes through the scalar polynomials alone
    want = scalar_newton_schulz(torch.linalg.svdvals(g.double()).tolist(), PUBLISHED_POLAR_EXPRESS, 1.02)
    torch.testing.assert_close(
        s.double(), torch.tensor(want, dtype=torch.float64).sort(descending=True)[0], atol=1e-4, rtol=1e-4
    )
    quintic = torch.linalg.svdvals(newton_schulz(g, torch.float32, method="quintic"))
    # the five quintics equioscillate between 0.859 and 1.141 on the interval the normalisation leaves; the fixed
    # quintic leaves the smallest singular values near 0.68
    assert (s - 1).abs().max() < 0.145 < 0.3 < (quintic - 1).abs().max()
    # tall and wide: the same iteration on the transpose
    torch.testing.assert_close(newton_schulz(g.T, torch.float32, method="polar_express"), got.T, atol=1e-6, rtol=1e-5)
    # a batch, and orthogonalise's logical matrices, as each matrix alone
    batch = torch.randn(3, 16, 24)
    together = newton_schulz(batch, torch.float32, method="polar_express")
    for one, alone in zip(together, batch, strict=True):
        torch.testing.assert_close(one, newton_schulz(alone, torch.float32, method="polar_express"))
    (fused,) = orthogonalise([batch.flatten(0, 1)], split=3, dtype=torch.float32, method="polar_express")
    torch.testing.assert_close(fused, together.flatten(0, 1))


# ---------------------------------------------------------------------------------------------
# NorMuon


def test_normalise_neurons_from_a_zero_buffer_gives_each_matrix_one_row_rms_and_keeps_its_norm():
    torch.manual_seed(0)
    split = (32, 16, 16)  # grouped-query attention's q, k, v: rows of their own counts
    update = torch.randn(64, 16) * torch.rand(64, 1) * 3  # rows of very different sizes
    rms = update.square().mean(1).sqrt()
    assert rms.max() > 5 * rms.min()
    buffer = torch.zeros(64, 1)
    out = normalise_neurons(update, buffer, 0.95, split)
    torch.testing.assert_close(buffer, 0.05 * update.square().mean(dim=1, keepdim=True))
    for o, u in zip(out.split(split), update.split(split), strict=True):
        torch.testing.assert_close(o.square().mean(1).sqrt(), (u.norm() / math.sqrt(u.numel())).expand(len(u)))
        torch.testing.assert_close(o.norm(), u.norm())
        torch.testing.assert_close(o / o.norm(dim=1, keepdim=True), u / u.norm(dim=1, keepdim=True))  # directions
    # a second step: the running mean square by lerp, each row divided by its root, each matrix's norm restored
    second = torch.randn(64, 16)
    want_buffer = 0.95 * buffer + 0.05 * second.square().mean(dim=1, keepdim=True)
    scaled = second / want_buffer.sqrt()
    want = torch.cat([m * (u.norm() / m.norm()) for m, u in zip(scaled.split(split), second.split(split), strict=True)])
    out = normalise_neurons(second, buffer, 0.95, split)
    torch.testing.assert_close(buffer, want_buffer)
    torch.testing.assert_close(out, want)
    bf16 = normalise_neurons(second.bfloat16(), torch.zeros(64, 1), 0.95, 4)
    assert bf16.dtype == torch.bfloat16


def muon_by_hand(weight, grad, buffer, moment, split, lr, momentum, weight_decay, beta2, method):
    """One step of Muon's docstring with NorMuon, written out: the momentum buffer and Nesterov's update, each
    logical matrix's Newton-Schulz, each row divided by the root of its running mean square and each matrix scaled
    back to its norm, then decoupled weight decay and lr * sqrt(max(1, rows / cols))."""
    buffer = momentum * buffer + (1 - momentum) * grad
    update = (1 - momentum) * grad + momentum * buffer
    ortho = torch.cat([newton_schulz(m, torch.float32, method=method) for m in update.chunk(split)])
    moment = beta2 * moment + (1 - beta2) * ortho.square().mean(dim=1, keepdim=True)
    scaled = ortho / moment.sqrt()
    scaled = torch.cat(
        [m * (o.norm() / m.norm()) for m, o in zip(scaled.chunk(split), ortho.chunk(split), strict=True)]
    )
    rows, cols = weight.size(0) // split, weight.size(1)
    weight = (1 - lr * weight_decay) * weight - lr * math.sqrt(max(1.0, rows / cols)) * scaled
    return weight, buffer, moment


def test_a_muon_step_with_polar_express_and_normuon_is_its_formula_and_its_state_resumes():
    torch.manual_seed(0)
    qkv = torch.nn.Parameter(torch.randn(48, 16))
    fc = torch.nn.Parameter(torch.randn(64, 16))
    hyper = dict(lr=0.05, momentum=0.9, weight_decay=0.1)
    options = dict(ns_dtype=torch.float32, ns_method="polar_express", normuon=True, normuon_beta2=0.9)
    opt = Muon([{"params": [qkv], "split": 3}, {"params": [fc]}], **hyper, **options)
    hand = {p: (p.detach().clone(), torch.zeros_like(p), torch.zeros(p.size(0), 1)) for p in (qkv, fc)}
    for _ in range(3):
        for p, split in ((qkv, 3), (fc, 1)):
            p.grad = torch.randn_like(p)
            hand[p] = muon_by_hand(
                *hand[p][:1], p.grad, *hand[p][1:], split, **hyper, beta2=0.9, method="polar_express"
            )
        opt.step()
        for p in (qkv, fc):
            torch.testing.assert_close(p.detach(), hand[p][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(opt.state[p]["neuron_second_moment"], hand[p][2])
    # the state round trip (a copy, as a checkpoint's): an optimizer loaded from it takes the same next step
    qkv2, fc2 = (torch.nn.Parameter(p.detach().clone()) for p in (qkv, fc))
    opt2 = Muon([{"params": [qkv2], "split": 3}, {"params": [fc2]}], **hyper, **options)
    state = copy.deepcopy(opt.state_dict())
    assert {"momentum_buffer", "neuron_second_moment"} == set(state["state"][0]) == set(state["state"][1])
    opt2.load_state_dict(state)
    for p, p2 in ((qkv, qkv2), (fc, fc2)):
        p.grad = torch.randn_like(p)
        p2.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(qkv, qkv2) and torch.equal(fc, fc2)
    plain = Muon([torch.nn.Parameter(torch.randn(16, 16))], ns_dtype=torch.float32)
    plain.param_groups[0]["params"][0].grad = torch.randn(16, 16)
    plain.step()
    assert "neuron_second_moment" not in next(iter(plain.state.values()))  # off by default


# ---------------------------------------------------------------------------------------------
# the sequence-length warm-up


def train_config(**values):
    return build_config({"data_dir": "x", **values})


def test_the_windows_double_over_equal_shares_of_the_warmup_then_are_block_size():
    cfg = train_config(block_size=64, seq_len_start=16, seq_len_warmup=0.5, max_iters=100)
    assert [seq_len_at(step, cfg) for step in range(120)] == [16] * 25 + [32] * 25 + [64] * 70
    assert run_progress(50, cfg) == 0.5 and run_progress(150, cfg) == 1.0
    timed = train_config(
        block_size=64, seq_len_start=8, seq_len_warmup=0.6, max_iters=100, lr_schedule="time", max_minutes=10
    )  # three doublings over the first 6 minutes: 8 until 2, 16 until 4, 32 until 6
    got = [seq_len_at(0, timed, minutes) for minutes in (0, 1.9, 2.1, 3.9, 4.1, 5.9, 6.1, 20)]
    assert got == [8, 8, 16, 16, 32, 32, 64, 64]
    assert seq_len_at(99, timed, 1.0) == 8  # the time budget decides, not the step
    assert all(seq_len_at(step, train_config(block_size=64, max_iters=100)) == 64 for step in range(100))
    assert seq_len_at(0, train_config(block_size=64, seq_len_start=64)) == 64


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(seq_len_start=24), r"seq_len_start=24 must be block_size=64 divided by a power of two \(e.g. 16\)"),
        (dict(seq_len_start=128), r"seq_len_start=128 must be block_size=64 divided by a power of two"),
        (dict(seq_len_start=-16), r"seq_len_start=-16 must be block_size=64 divided by a power of two"),
        (dict(seq_len_start=16, seq_len_warmup=0), r"seq_len_warmup=0.0 must be in \(0, 1\]: a share of the run"),
        (dict(seq_len_start=16, seq_len_warmup=1.5), r"seq_len_warmup=1.5 must be in \(0, 1\]"),
    ],
)
def test_a_seq_len_start_that_does_not_double_to_block_size_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        train_config(block_size=64, **values)


# ---------------------------------------------------------------------------------------------
# the moving average of the weights


@pytest.mark.parametrize("decay", [0.5, 0.99])
def test_the_weight_average_is_the_moving_average_with_tensorflows_warmup(decay):
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1))
    ema = WeightAverage(model, decay)
    assert ema.names == [n for n, _ in model.named_parameters()] and "lm_head.weight" not in ema.names  # tied: once
    want = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for k in range(20):  # decay 0.5 is reached at the 9th update; 0.99 never in 20
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        d = min(decay, (1 + k) / (10 + k))
        want = {n: d * want[n] + (1 - d) * p.detach().double() for n, p in model.named_parameters()}
    assert ema.updates == 20
    for name, average in zip(ema.names, ema.average, strict=True):
        torch.testing.assert_close(average.double(), want[name], atol=1e-5, rtol=1e-5)
    # a state dict round trip into another model's average, then copy_to_model
    state = {"updates": ema.updates, "average": {n: a.clone() for n, a in ema.state_dict()["average"].items()}}
    torch.manual_seed(1)
    other = GPT(tiny_config(n_layer=1))
    restored = WeightAverage(other, decay)
    restored.load_state_dict(state)
    assert restored.updates == 20
    restored.copy_to_model()
    for name, p in other.named_parameters():
        torch.testing.assert_close(p.detach().double(), want[name], atol=1e-5, rtol=1e-5)
    assert other.lm_head.weight is other.tok_emb.weight  # the head is still the embedding


def test_the_weight_average_leaves_frozen_parameters_out_and_copies_in_the_models_dtype():
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1)).bfloat16()
    model.pos_emb.table.weight.requires_grad_(False)
    frozen = model.pos_emb.table.weight.detach().clone()
    start = model.tok_emb.weight.detach().float()
    ema = WeightAverage(model, 0.9)
    assert "pos_emb.table.weight" not in ema.names and all(a.dtype == torch.float32 for a in ema.average)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()  # decay 1/10 at the first update
    average = ema.average[ema.names.index("tok_emb.weight")]
    torch.testing.assert_close(average, 0.1 * start + 0.9 * model.tok_emb.weight.float())  # (start + 1) in bfloat16
    ema.copy_to_model()
    assert torch.equal(model.pos_emb.table.weight, frozen + 1.0)  # left as it is
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert torch.equal(model.tok_emb.weight, average.bfloat16())


# ---------------------------------------------------------------------------------------------
# errors that name the option


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(logit_softcap=-1), r"logit_softcap=-1.0 must be a finite number >= 0 \(0 = no cap; modded-nanogpt: 15\)"),
        (dict(ema_decay=1.0), r"config: ema_decay=1.0 must be in \[0, 1\) \(0 = no average; e.g. 0.99\)$"),
        (dict(ema_decay=1.5, normuon_beta2=0.95), r"config: ema_decay=1.5 must be in \[0, 1\)"),  # names 1.5 alone
        (dict(normuon_beta2=-0.1), r"config: normuon_beta2=-0.1 must be in \[0, 1\) \(e.g. 0.95\);"),
        (dict(fsdp=True, normuon=True), r"normuon=true and ema_decay work on whole matrices, .* without fsdp=true"),
        (dict(fsdp=True, ema_decay=0.9), r"normuon=true and ema_decay work on whole matrices, .* without fsdp=true"),
        (dict(muon_ns="polar"), r"muon_ns='polar' must be one of quintic, polar_express"),
        (dict(ffn="relu"), r"ffn='relu' must be one of swiglu, gelu, relu2"),
        (dict(value_embeds="maybe"), r"value_embeds='maybe' is not a boolean; use true or false"),
    ],
)
def test_bad_speedrun_options_are_refused_with_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        train_config(**values)


@pytest.mark.parametrize("name", ["value_embeds", "unet_skips", "zero_init_out"])
def test_the_model_switches_are_true_or_false(name):
    with pytest.raises(ValueError, match=rf"{name}=1 must be true or false"):
        tiny_config(**{name: 1})


def test_export_refuses_the_speedrun_architecture_options_by_name(tmp_path):
    for option, shown in (("value_embeds", "value_embeds=True"), ("unet_skips", "unet_skips=True")):
        config = tiny_config(pos_emb="rope", norm="rmsnorm", **{option: True})  # Llama's switches otherwise
        with pytest.raises(ValueError, match=rf"a model with {shown} has no transformers architecture"):
            family_of(config)
        with pytest.raises(ValueError, match=rf"{shown}.*without the speedrun options"):
            gguf_architecture(config)
    both = tiny_config(unet_skips=True, logit_softcap=15.0)
    with pytest.raises(ValueError, match=r"a model with unet_skips=True, logit_softcap=15.0 has no transformers"):
        family_of(both)
    with pytest.raises(ValueError, match=r"value_embeds=True has no transformers architecture"):
        export_hf(GPT(tiny_config(ffn="gelu", value_embeds=True)), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    family_of(tiny_config(pos_emb="rope", norm="rmsnorm", zero_init_out=True))  # only how a model starts: exports


# ---------------------------------------------------------------------------------------------
# train.py end to end

VOCAB = 128  # the corpus is ASCII
TINY = dict(
    vocab_size=VOCAB,
    n_layer=1,
    n_head=2,
    n_embd=16,
    block_size=16,
    batch_size=4,
    learning_rate=3e-3,
    warmup_iters=2,
    eval_iters=2,
    log_interval=1,
    device="cpu",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """One train and one val shard of a few thousand bytes of toy sentences."""
    rng = random.Random(0)
    words = "the a cat dog sat on mat and ran to see it was big small red".split()
    text = " ".join(rng.choice(words) for _ in range(1500)).encode()
    root = tmp_path_factory.mktemp("data")
    write_shard(root / "train_000000.bin", list(text[:5000]), VOCAB)
    write_shard(root / "val_000000.bin", list(text[5000:6500]), VOCAB)
    return root


def config(data: Path, out: Path, **overrides) -> list[str]:
    """train.py's arguments for a run of the tiny model on `data` into `out`."""
    return [f"--{k}={v}" for k, v in {**TINY, "data_dir": data, "out_dir": out, **overrides}.items()]


def resume(out: Path, *args: str) -> list[str]:
    return [f"--out_dir={out}", "--resume", *args]


def initial_weights(args: list[str]) -> dict[str, torch.Tensor]:
    """The weights train.py starts from: the model built right after seeding with the run's seed."""
    cfg = resolve_config(args)
    torch.manual_seed(cfg.seed)
    return dict(GPT(cfg.model).named_parameters())


def test_an_ema_run_ends_as_the_moving_average_of_its_weights(data, tmp_path, capsys):
    args = config(data, tmp_path, ema_decay=0.9, max_iters=6, eval_interval=1, keep_last=10)
    run = run_train(*args)
    assert run.code == 0 and run.step == 6, run.err
    assert "step     6 | the weights are now their moving average (ema_decay=0.9)" in capsys.readouterr().out
    # every checkpoint before the last holds the trained weights and the average so far: the average is the
    # recursion over the initial weights and those of steps 1, 2, ... with decay min(0.9, (1 + k) / (10 + k))
    average = {n: p.detach().double() for n, p in initial_weights(args).items()}
    for step in range(1, 6):
        ckpt = load_checkpoint(tmp_path / f"ckpt_{step:06d}.pt")
        d = min(0.9, step / (9 + step))
        average = {n: d * a + (1 - d) * ckpt["model"][n].double() for n, a in average.items()}
        assert ckpt["ema"]["updates"] == step and set(ckpt["ema"]["average"]) == set(average)
        for name, a in average.items():
            torch.testing.assert_close(ckpt["ema"]["average"][name].double(), a, atol=1e-6, rtol=1e-5)
        assert any(not torch.equal(ckpt["model"][n], ckpt["ema"]["average"][n]) for n in average)
    final = load_checkpoint(tmp_path)
    assert final["step"] == 6 and final["ema"]["updates"] == 6
    for name, a in final["ema"]["average"].items():  # the saved model is the average (its head the embedding)
        assert torch.equal(final["model"][name], a)
    assert torch.equal(final["model"]["lm_head.weight"], final["ema"]["average"]["tok_emb.weight"])


def test_an_ema_run_resumes_its_average_exactly(data, tmp_path):
    kw = dict(ema_decay=0.8, eval_interval=3, lr_decay_iters=6)
    straight = run_train(*config(data, tmp_path / "straight", max_iters=6, **kw))
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    (tmp_path / "resumed" / "ckpt_000006.pt").unlink()  # as if the run had stopped after its step-3 checkpoint
    assert load_checkpoint(tmp_path / "resumed")["ema"]["updates"] == 3
    resumed = run_train(*resume(tmp_path / "resumed", "--max_iters=6"))
    assert resumed.code == 0 and resumed.history == straight.history[3:], resumed.err  # bit for bit
    a = load_checkpoint(tmp_path / "straight")
    b = load_checkpoint(tmp_path / "resumed")
    assert a["ema"]["updates"] == b["ema"]["updates"] == 6
    assert all(torch.equal(a["ema"]["average"][n], b["ema"]["average"][n]) for n in a["ema"]["average"])
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])


def test_an_ema_run_stopped_by_its_time_budget_resumes_as_an_uninterrupted_run(data, tmp_path):
    kw = dict(ema_decay=0.9, eval_interval=20, lr_decay_iters=6)
    straight = run_train(*config(data, tmp_path / "straight", max_iters=6, **kw))
    stopped = run_train(*config(data, tmp_path / "stopped", max_iters=6, max_minutes=1e-9, **kw))
    assert stopped.stopped == "max_minutes=1e-09" and stopped.step == 1
    resumed = run_train(*resume(tmp_path / "stopped", "--max_minutes=0"))
    assert resumed.step == 6
    assert stopped.history + resumed.history == straight.history  # as without ema_decay, bit for bit


def test_the_sequence_length_warmup_trains_on_shorter_windows_of_the_same_tokens(data, tmp_path, capsys, monkeypatch):
    seen = []
    forward = GPT.forward

    def recording(self, idx, targets=None, *args, **kwargs):
        if self.training:
            seen.append((idx.clone(), targets.clone()))
        return forward(self, idx, targets, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", recording)
    plain = run_train(*config(data, tmp_path / "plain", max_iters=1, eval_interval=1))
    assert plain.code == 0, plain.err
    (plain_x, plain_y), *_ = seen
    seen.clear()
    kw = dict(seq_len_start=4, seq_len_warmup=0.5, max_iters=8, eval_interval=3, lr_decay_iters=8, keep_last=5)
    run = run_train(*config(data, tmp_path / "warmup", **kw))
    assert run.code == 0, run.err
    # two doublings over the first half of 8 steps: 4 tokens at steps 0-1, 8 at 2-3, then block_size=16
    assert [tuple(x.shape) for x, _ in seen] == [(16, 4)] * 2 + [(8, 8)] * 2 + [(4, 16)] * 4
    lines = [line for line in capsys.readouterr().out.splitlines() if "training on windows" in line]
    assert lines == [f"step {step:5d} | training on windows of {n} tokens" for step, n in ((0, 4), (2, 8), (4, 16))]
    # the same tokens as the batch of block_size windows, cut into rows of 4
    x, y = seen[0]
    assert torch.equal(x.reshape(4, 16), plain_x) and torch.equal(y.reshape(4, 16), plain_y)
    # resumed from step 3, the run says its windows at its first step and trains on as before
    shutil.copytree(tmp_path / "warmup", tmp_path / "resumed")
    for step in (6, 8):
        (tmp_path / "resumed" / f"ckpt_{step:06d}.pt").unlink()
    resumed = run_train(*resume(tmp_path / "resumed"))
    assert resumed.history == run.history[3:]
    lines = [line for line in capsys.readouterr().out.splitlines() if "training on windows" in line]
    assert lines == ["step     3 | training on windows of 8 tokens", "step     4 | training on windows of 16 tokens"]


def test_every_speedrun_option_together_trains_and_resumes_exactly(data, tmp_path):
    kw = dict(
        n_layer=2,
        ffn="relu2",
        value_embeds=True,
        unet_skips=True,
        logit_softcap=5.0,
        zero_init_out=True,
        optimizer="muon",
        muon_ns="polar_express",
        normuon=True,
        seq_len_start=8,
        seq_len_warmup=0.5,
        eval_interval=3,
        lr_decay_iters=6,
    )
    straight = run_train(*config(data, tmp_path / "straight", max_iters=6, **kw))
    assert straight.code == 0, straight.err
    assert straight.history[-1][1] < straight.history[0][1] - 0.1  # it learns
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    (tmp_path / "resumed" / "ckpt_000006.pt").unlink()  # as if the run had stopped after its step-3 checkpoint
    # zero_init_out only says how a fresh model starts: --resume may change it
    resumed = run_train(*resume(tmp_path / "resumed", "--zero_init_out=false"))
    assert resumed.code == 0 and resumed.history == straight.history[3:], resumed.err  # bit for bit
    a = load_checkpoint(tmp_path / "straight")
    b = load_checkpoint(tmp_path / "resumed")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert "neuron_second_moment" in b["optimizer"]["state"]["blocks.0.attn.qkv.weight"]
    assert {k: a["config"][k] for k in kw} == kw and b["config"]["zero_init_out"] is False


def test_the_shipped_speedrun_recipe_trains_on_windows_growing_to_its_block_size(tmp_path):
    """configs/shakespeare_char_cpu_90s.toml as shipped (a step budget instead of its time budget): a bigram table of
    a row per character pair, and windows of 64, 128, 256, then 512 tokens over the first 60% of the run."""
    rng = random.Random(0)
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "train_000000.bin", [rng.randrange(65) for _ in range(8000)], 65)
    write_shard(tmp_path / "data" / "val_000000.bin", [rng.randrange(65) for _ in range(3200)], 65)
    recipe = Path(__file__).resolve().parent.parent / "configs" / "shakespeare_char_cpu_90s.toml"
    overrides = dict(vocab_size=65, max_minutes=0, lr_schedule="steps", max_iters=10, warmup_iters=2)
    run = run_train(recipe, data_dir=tmp_path / "data", out_dir=tmp_path / "out", **overrides)
    assert run.code == 0 and run.step == 10, run.err
    assert re.findall(r"\| training on windows of (\d+) tokens", run.out) == ["64", "128", "256", "512"]
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt["model"]["bigram_emb.weight"].shape == (65 * 65 + 1, 96)


def test_the_warmup_is_refused_for_preference_pairs(tmp_path):
    records = [{"prompt": f"{n}=", "chosen": f"{n}"[::-1], "rejected": f"{n + 1}"} for n in range(100, 140)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_preference([str(tmp_path / "pairs.jsonl")], "byte", tmp_path / "data", block_size=16, log=lambda *a: None)
    run = run_train(*config(tmp_path / "data", tmp_path / "out", vocab_size=512, max_iters=2, seq_len_start=4))
    assert run.code == 2
    assert run.error == (
        "seq_len_start=4 cuts text windows into shorter ones; preference pairs and RL prompts are whole sequences: "
        "leave seq_len_start out"
    )


# ---------------------------------------------------------------------------------------------
# the bigram hash embedding (bigram_vocab): every path that feeds tokens against a full forward of the whole row

BV = 11  # the bigram models' vocabulary: every pair has a row of its own at bigram_vocab = BV * BV + 1
PAIRS = BV * BV + 1


def bigram_config(bigram_vocab: int = PAIRS, **overrides) -> GPTConfig:
    kw = dict(vocab_size=BV, n_layer=2, n_head=2, n_embd=16, block_size=64, pos_emb="rope", bigram_vocab=bigram_vocab)
    kw.update(overrides)
    return GPTConfig(**kw)


def bigram_model(bigram_vocab: int = PAIRS, seed: int = 0, **overrides) -> GPT:
    """A random bigram model whose pair table (std 1.0) outweighs the rest of the embedding, so that pairing a token
    with another predecessor changes what it predicts."""
    model = randomise(GPT(bigram_config(bigram_vocab, **overrides)), std=0.3, seed=seed)
    with torch.no_grad():
        model.bigram_emb.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed + 1))
    return model


def pair_rows(rows: list[list[int]], vocab: int, table: int) -> list[list[int]]:
    """Each token's row of the pair table, from the definition: the last row for a row's first token, else the
    pair's index (previous * vocab + token) modulo table - 1."""
    return [
        [table - 1 if t == 0 else (row[t - 1] * vocab + row[t]) % (table - 1) for t in range(len(row))] for row in rows
    ]


def greedy_window(model: GPT, prompt: list[int], n: int, logprobs: list[float] | None = None) -> list[int]:
    """Greedy decoding by a full forward of the window at every step, no cache; the window keeps its newest
    SLIDE_KEEP part when it would pass block_size (gptlite.inference.generate's policy). Each new token's
    log-probability is appended to `logprobs` when given."""
    block = model.config.block_size
    keep = int(block * SLIDE_KEEP)
    out = list(prompt)
    start = max(0, len(out) - block)
    with torch.no_grad():
        for _ in range(n):
            if len(out) - start > block:
                start = len(out) - keep
            logits = model(torch.tensor([out[start:]]))[0][0, -1]
            out.append(int(logits.argmax()))
            if logprobs is not None:
                logprobs.append(F.log_softmax(logits.double(), dim=-1)[out[-1]].item())
    return out


def random_rows(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(BV) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("table", [PAIRS, 7])
def test_bigram_ids_are_the_pair_index_modulo_the_table_and_the_last_row_for_a_first_token(table):
    model = GPT(bigram_config(table))
    assert model.bigram_emb.weight.shape == (table, 16)
    prev = torch.tensor([[p for p in range(-1, BV) for _ in range(BV)]])  # every pair, and every first token
    idx = torch.tensor([[c for _ in range(-1, BV) for c in range(BV)]])
    want = [
        table - 1 if p < 0 else (p * BV + c) % (table - 1)
        for p, c in zip(prev[0].tolist(), idx[0].tolist(), strict=True)
    ]
    assert model.bigram_ids(idx, prev).tolist() == [want]
    if table == PAIRS:  # a row of its own for every pair: the pair's index itself, the first tokens' row after them
        assert want == [BV * BV] * BV + list(range(BV * BV))
    # a forward without a cache pairs each token with the one before it in its own row
    rows = torch.tensor([[3, 3, 0, 10, 7], [10, 0, 1, 2, 3]])
    assert previous_tokens(rows).tolist() == [[-1, 3, 3, 0, 10], [-1, 10, 0, 1, 2]]
    assert model.bigram_ids(rows, previous_tokens(rows)).tolist() == pair_rows(rows.tolist(), BV, table)


@pytest.mark.parametrize("table", [PAIRS, 7])
def test_bigram_hidden_states_equal_the_written_out_model_and_train_the_pairs_rows(table):
    """tok_emb + bigram_emb[the pairs' rows] + the learned positions, then the blocks and the final norm written
    out (reference_hidden's); the loss reaches exactly the pair rows the batch uses."""
    model = bigram_model(table, pos_emb="learned", ffn="relu2")
    rows = random_rows([13, 13], seed=1)
    idx = torch.tensor(rows)
    x = model.tok_emb.weight[idx] + model.bigram_emb.weight[torch.tensor(pair_rows(rows, BV, table))]
    x = x + model.pos_emb.table.weight[: idx.size(1)]
    for block in model.blocks:
        x = x + naive_attention(block.attn, layer_norm(x, block.attn_norm))
        x = x + relu_squared(layer_norm(x, block.ffn_norm), block.ffn)
    want = layer_norm(x, model.norm)
    torch.testing.assert_close(model.hidden(idx), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model(idx)[0], want @ model.lm_head.weight.T, atol=1e-4, rtol=1e-4)
    model.train()
    targets = torch.tensor(random_rows([13, 13], seed=2))
    for return_logits in (True, False):  # the plain loss and the chunked one
        model.zero_grad()
        model(idx, targets, return_logits=return_logits)[1].backward()
        used = sorted({r for row in pair_rows(rows, BV, table) for r in row})
        touched = model.bigram_emb.weight.grad.abs().sum(1).nonzero().flatten().tolist()
        assert touched == used


def test_bigram_logits_are_causal_and_the_next_position_sees_a_token_through_its_pair_alone():
    t = 6
    idx = torch.tensor(random_rows([16], seed=3))
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % BV
    full = bigram_model()
    with torch.no_grad():
        a = full(idx)[0][0]
        b = full(changed)[0][0]
    torch.testing.assert_close(a[:t], b[:t], atol=1e-6, rtol=0)  # nothing before t sees token t
    assert ((a[t:] - b[t:]).abs().amax(-1) > 1e-3).all()
    # blocks that start as the identity (zero output projections): the logits at t + 1 see token t only through
    # the pair (t, t + 1), so they change with it, and stop changing without the pair table
    plain = GPT(bigram_config(zero_init_out=True)).eval()
    assert all(p.abs().sum() == 0 for n, p in plain.named_parameters() if n.endswith("out_proj.weight"))
    with torch.no_grad():
        plain.bigram_emb.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(4))
        moved = (plain(idx)[0][0] - plain(changed)[0][0]).abs().amax(-1) > 1e-4
        assert moved.nonzero().flatten().tolist() == [t, t + 1]
        plain.bigram_emb.weight.zero_()
        moved = (plain(idx)[0][0] - plain(changed)[0][0]).abs().amax(-1) > 1e-4
        assert moved.nonzero().flatten().tolist() == [t]


@pytest.mark.parametrize("table", [PAIRS, 7])
def test_bigram_cached_greedy_decoding_equals_full_recompute(table):
    model = bigram_model(table)
    idx = torch.tensor(random_rows([5, 5, 5], seed=5))
    out = model.generate(idx, 40, temperature=0)
    assert out.tolist() == [greedy_window(model, row, 40) for row in idx.tolist()]
    assert len({tuple(row) for row in out[:, 5:].tolist()}) == 3  # the rows differ: each follows its own pairs


def test_bigram_kv_cache_logits_equal_full_forwards_step_by_step():
    """Left-padded prompts of 1, 4 and 9 tokens prefilled, then given tokens fed one at a time, then a chunk of three
    at once (a conversation's next turn): every row's logits are its full forward's last ones, where the first real
    token follows the padding and pairs with nothing, and a chunk's first token with the cache's last."""
    model = bigram_model()
    rows = random_rows([1, 4, 9], seed=16)
    fed = random_rows([9, 9, 9], seed=17)
    cache = new_cache(model, 3, 20)
    with torch.no_grad():
        logits = prefill(model, cache, rows)
        for i, width in enumerate([1] * 6 + [3]):
            want = torch.stack([model(torch.tensor([row]))[0][0, -1] for row in rows])
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
            step = [f[i : i + width] for f in fed] if width == 1 else [f[6:] for f in fed]
            rows = [row + new for row, new in zip(rows, step, strict=True)]
            cache.prepare(width)
            logits = model.step(torch.tensor(step), cache)
        want = torch.stack([model(torch.tensor([row]))[0][0, -1] for row in rows])
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_bigram_ragged_prompts_through_sliding_windows_decode_as_each_alone():
    """Left-padded prompts of different lengths, with windows of 16 that slide at different steps: each window's
    first token is paired with nothing again, as in a full forward of the window."""
    model = bigram_model(block_size=16)
    prompts = random_rows([1, 4, 9, 16, 20], seed=6)
    with pytest.warns(UserWarning, match="the context reached block_size=16"):
        out = model.generate(prompts, 30, temperature=0)
    assert out == [greedy_window(model, p, 30) for p in prompts]


def test_bigram_samples_of_one_prompt_share_its_prefill_and_decode_greedily_alike():
    model = bigram_model()
    prompts = random_rows([3, 8], seed=7)
    out = model.generate(prompts, 25, temperature=0, num_samples=3)
    assert out == [greedy_window(model, p, 25) for p in prompts for _ in range(3)]


def test_bigram_extend_context_equals_a_twin_with_a_longer_block_size():
    """Rotary positions past block_size=16: a twin with block_size=128 and the same weights (the rotation has none)
    recomputes every step in full."""
    model = bigram_model(block_size=16)
    twin = GPT(bigram_config(block_size=128)).eval()
    twin.load_state_dict(model.state_dict())
    prompts = random_rows([5, 5], seed=8)
    out = model.generate(torch.tensor(prompts), 50, temperature=0, extend_context=True)
    assert out.tolist() == [greedy_window(twin, p, 50) for p in prompts]
    with pytest.warns(UserWarning, match="the context reached block_size=16"):
        slid = model.generate(torch.tensor(prompts), 50, temperature=0)
    assert out.tolist() != slid.tolist()  # the sliding window forgets


def beams_by_full_forward(model: GPT, prompt: list[int], new: int, num_beams: int) -> list[list[int]]:
    """Beam search without stop tokens, every beam's log-probabilities from a full forward: the num_beams best
    continuations by summed log-probability, best first (all of one length, so the length penalty orders nothing)."""
    beams = [(0.0, [])]
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([prompt + tokens for _, tokens in beams]))[0][:, -1]  # (beams, V)
            logprobs = F.log_softmax(logits.double(), dim=-1).tolist()
            candidates = [
                (s + lp[t], tokens + [t]) for (s, tokens), lp in zip(beams, logprobs, strict=True) for t in range(BV)
            ]
            beams = sorted(candidates, key=lambda c: -c[0])[:num_beams]
    return [tokens for _, tokens in beams]


def test_bigram_beam_search_reorders_the_beams_tokens_with_their_keys():
    model = bigram_model()
    prompts = random_rows([6, 2], seed=9)
    out = model.generate(prompts, 12, num_beams=3, num_return_sequences=3)
    want = [p + beam for p in prompts for beam in beams_by_full_forward(model, p, 12, 3)]
    assert out == want
    assert len({tuple(row) for row in out}) == 6


def engine_greedy(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy completions of requests submitted together, the engine's steps run here, one after another (no
    thread): every request queued before a step is admitted by it. Each request asks for its tokens'
    log-probabilities: its tokens and theirs are checked against greedy decoding by full forwards, which is
    sensitive where a token paired with a wrong predecessor would still be the greedy one."""
    got: list[list[TokenLogprob]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)

    def emitter(i: int):
        def emit(piece) -> None:
            got[i] += piece.logprobs
            if piece.finish_reason:
                reasons[i] = piece.error or piece.finish_reason

        return emit

    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.submit(
            Job(prompt, Params(max_tokens=n, options=GenerationOptions(temperature=0), logprobs=0), emitter(i))
        )
    for _ in range(200):
        if None not in reasons:
            break
        assert engine.turn()
    assert reasons == ["length"] * len(prompts) and engine.active == 0
    for prompt, n, entries in zip(prompts, max_tokens, got, strict=True):
        want: list[float] = []
        assert [e.token for e in entries] == greedy_window(engine.model, prompt, n, want)[len(prompt) :]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), torch.tensor(want), atol=1e-4, rtol=0)
    return [[e.token for e in entries] for entries in got]


def bigram_engine(**kw) -> tuple[Engine, list[tuple[int, int]]]:
    """An engine on a bigram model (a tokenizer of 11 characters, ids 0..10), and the (rows, tokens) of every step
    it runs."""
    engine = Engine(bigram_model(block_size=128), CharTokenizer("abcdefghijk"), **kw)
    return engine, recording(engine)


def test_bigram_engine_prefills_ragged_arrivals_together_and_moves_rows_with_their_tokens():
    """Prompts of 1 to 21 tokens prefilled together, right-padded; the shorter requests end first, and the last
    running row moves into each freed one, its tokens with its keys (the freed rows hold an earlier round's
    tokens there, which a row that moved without its own would pair its next token with). engine_greedy checks
    every completion against full forwards."""
    engine, shapes = bigram_engine(max_batch=5)
    engine_greedy(engine, random_rows([40] * 5, seed=10), [3] * 5)
    prompts = random_rows([1, 3, 7, 8, 21], seed=11)
    shapes.clear()
    engine_greedy(engine, prompts, [3, 14, 5, 14, 14])  # the 1- and 7-token prompts' rows free up first
    prefills = shapes[: shapes.index((5, 1))]  # the steps before the first decode of all five
    assert sum(rows for rows, _ in prefills) == 5 and (2, 8) in prefills  # 7 and 8 tokens, padded together


def test_bigram_engine_restores_prefix_blocks_with_their_tokens():
    """A prompt sharing 2 * BLOCK first tokens with an earlier one restores their blocks into a row whose slots a
    different prompt wrote last: the blocks' tokens, not the row's, pair with the one token prefilled after them."""
    engine, _ = bigram_engine(max_batch=2, prefix_cache_mb=1)
    shared, other = random_rows([2 * BLOCK, 2 * BLOCK + 6], seed=12)
    other[2 * BLOCK - 1] = (shared[2 * BLOCK - 1] + 1) % BV  # what the row holds before the restored blocks' end
    assert other[:BLOCK] != shared[:BLOCK]  # no block of its own to restore
    for prompt in (shared + [1, 2, 3, 4, 5], other, shared + [9]):  # one after another, in row 0
        engine_greedy(engine, [prompt], [10])
    assert engine.prefix.hits == 2 * BLOCK  # the third prompt's, which prefills one token, at slot 2 * BLOCK


def test_bigram_engine_copies_of_one_prompt_take_its_rows_tokens():
    """n completions of one prompt: one prefill, its row copied to the others, which decode what it does."""
    engine, shapes = bigram_engine(max_batch=4)
    prompt = random_rows([9], seed=13)[0] + [7]  # the copied row's last token pairs with the first one decoded
    out = engine_greedy(engine, [prompt] * 3 + [[4, 5]], [12] * 4)
    assert out[0] == out[1] == out[2] != out[3]
    assert sorted(shapes[:2]) == [(1, 2), (1, 10)] and shapes[2] == (4, 1)  # two prefills, then all four decode


@pytest.mark.parametrize("table", [PAIRS, 7])
def test_bigram_packed_spans_pair_each_token_with_its_own_rows_previous_one(table):
    """Rows sharing a prefix, packed into one sequence: each branch's first own token pairs with the shared prefix's
    last token, not with the branch packed before it; every row scores as alone and as its log-softmax by hand."""
    model = bigram_model(table)
    prefix = random_rows([10], seed=13)[0]
    tails = random_rows([4, 6, 1, 5], seed=14)
    rows = [SpanRow(prefix + tail, 3, len(prefix + tail)) for tail in tails]
    rows.append(SpanRow(prefix + tails[1][:3], 10, 13))  # a row that is the start of another
    rows.append(SpanRow(random_rows([65], seed=15)[0], 1, 65))  # block_size + 1 tokens, alone
    groups = [[0, 1, 2, 3, 4], [5]]
    packed = score_spans(model, rows, BV, groups=groups)
    alone = score_spans(model, rows, BV)
    want_loss = []
    want_greedy = []
    with torch.no_grad():
        for row in rows:
            logprobs = F.log_softmax(model(torch.tensor([row.tokens[:-1]]))[0][0].double(), dim=-1)
            span = range(row.start, row.end)
            want_loss.append(-sum(logprobs[q - 1, row.tokens[q]].item() for q in span))
            want_greedy.append(all(int(logprobs[q - 1].argmax()) == row.tokens[q] for q in span))
    for loss, count, greedy in (packed, alone):
        torch.testing.assert_close(
            torch.tensor(loss), torch.tensor(want_loss, dtype=torch.float32), atol=1e-4, rtol=1e-5
        )
        assert count == [row.end - row.start for row in rows] and greedy == want_greedy


def test_bigram_vocab_errors_export_and_flops(tmp_path):
    for bad in (1, -1, True):
        with pytest.raises(ValueError, match=rf"bigram_vocab={bad!r} must be 0 \(none\) or at least 2 rows"):
            bigram_config(bad)
    with pytest.raises(ValueError, match=r"bigram_vocab=1 must be 0 \(none\) or at least 2 rows"):
        train_config(bigram_vocab=1)
    config = tiny_config(pos_emb="rope", norm="rmsnorm", bigram_vocab=97 * 97 + 1)  # Llama's switches otherwise
    with pytest.raises(ValueError, match=r"a model with bigram_vocab=9410 has no transformers architecture"):
        family_of(config)
    with pytest.raises(ValueError, match=r"bigram_vocab=9410, .*without the speedrun options"):
        gguf_architecture(config)
    with pytest.raises(ValueError, match=r"bigram_vocab=9410 has no transformers architecture"):
        export_hf(GPT(config), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    family_of(tiny_config(pos_emb="rope", norm="rmsnorm"))  # the same model without the table exports
    # 6N leaves the table out, as it leaves out value embeddings and an untied token embedding: it is looked up,
    # never multiplied with
    for table in (PAIRS, 7):
        assert GPT(bigram_config(table)).flops_per_token() == GPT(bigram_config(0)).flops_per_token()
    untied = GPT(bigram_config(tie_embeddings=False, value_embeds=True)).flops_per_token()
    assert untied == GPT(bigram_config(0, tie_embeddings=False, value_embeds=True)).flops_per_token()
    assert GPT(bigram_config()).flops_per_token(100) == GPT(bigram_config(0)).flops_per_token(100)
