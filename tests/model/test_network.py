"""The architecture against its references: naive attention math, the position, norm and feed-forward
formulas (sinusoidal, RoPE, RMSNorm, SwiGLU, tanh GELU), causality for every variant, weight tying, biases,
input validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPT, GPTConfig
from gptlite.model.network import (
    Block,
    ConvBlock,
    GeluMLP,
    RMSNorm,
    RotaryPositions,
    ShortConv,
    SwiGLUGate,
    layer_states,
    masked_attention,
    rotate_half,
    sinusoidal_table,
)
from tests.conftest import DEVICE, VARIANTS, randint, tensor, tiny_config, tiny_model

pytestmark = pytest.mark.device


def naive_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention written out (Vaswani et al. eq. 1), using the module's weights."""
    B, T, C = x.shape
    H = attn.n_head
    D = C // H
    q, k, v = (x @ attn.qkv.weight.T).split(C, dim=2)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
    scores = scores.masked_fill(~mask, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, C) @ attn.out_proj.weight.T


def test_sdpa_attention_equals_naive_math():
    model = tiny_model()
    attn = model.blocks[0].attn
    x = torch.randn(3, 17, 32, device=DEVICE)
    torch.testing.assert_close(attn(x), naive_attention(attn, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_math_for_compiled_cpu_steps_equals_sdpa(monkeypatch, dtype):
    """Inside a compiled CPU step masked_attention writes the math out instead of calling SDPA; both
    must agree, padding mask included."""
    q, k, v = (torch.randn(2, 4, 3, 8, dtype=dtype) for _ in range(3))
    mask = torch.rand(2, 1, 3, 3) > 0.4
    mask[..., 0] = True  # every query sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(masked_attention(q, k, v, mask), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(
        masked_attention(q, k, v, None), F.scaled_dot_product_attention(q, k, v), atol=tol, rtol=tol
    )


def test_causality(variant):
    """Changing tokens after position t never changes logits at or before t."""
    model = tiny_model(**variant)
    idx = randint(97, (2, 20))
    t = 9
    changed = idx.clone()
    changed[:, t + 1 :] = randint(97, (2, 20 - t - 1))
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_sinusoidal_table_matches_formula():
    table = sinusoidal_table(50, 16)
    for p in (0, 1, 7, 49):
        for i in range(8):
            angle = p / 10000 ** (2 * i / 16)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_position_types():
    learned = tiny_model(pos_emb="learned")
    sinus = tiny_model(pos_emb="sinusoidal")
    assert any("pos_emb" in n for n, _ in learned.named_parameters())
    assert [n for n, _ in sinus.named_parameters() if "pos_emb" in n] == ["pos_emb.gain"]  # the table is a buffer
    assert "pos_emb.table" in dict(sinus.named_buffers())
    assert learned.num_params() - sinus.num_params() == 32 * 32 - 32  # the table, less the gain per channel
    # positions matter: the same tokens in another order give different logits
    idx = tensor([[5, 5, 5, 5]])
    logits, _ = sinus(idx)
    assert not torch.allclose(logits[0, 0], logits[0, 3])


def rope_by_complex_numbers(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoFormer eq. 34 in the rotate_half layout: coordinates (i, i + D/2) form the complex number
    x_i + j x_(i+D/2), which is multiplied by exp(j pos theta^(-2i/D))."""
    D = x.size(-1)
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double())
    angle = pos.double()[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (T, D/2)
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).float()


def test_rope_matches_its_formula_and_depends_only_on_the_offset():
    config = tiny_config(pos_emb="rope", rope_theta=500.0)
    rope = RotaryPositions(config)
    D = config.n_embd // config.n_head
    q, k = torch.randn(2, 1, 4, 7, D, dtype=torch.float32).unbind(0)  # (B=1, H=4, T=7, D) each
    pos = torch.arange(3, 10)
    rq, rk = rope.rotate(q, k, rope.rotation(pos))
    torch.testing.assert_close(rq, rope_by_complex_numbers(q, pos, 500.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk, rope_by_complex_numbers(k, pos, 500.0), atol=1e-5, rtol=1e-5)
    # the same vectors placed at positions shifted by s give the same scores: q_m . k_n depends on m - n only
    for shift in (1, 20, 300):
        sq, sk = rope.rotate(q, k, rope.rotation(pos + shift))
        torch.testing.assert_close(sq @ sk.transpose(-2, -1), rq @ rk.transpose(-2, -1), atol=1e-4, rtol=1e-4)
    # per-row positions (B, T) rotate each row by its own positions
    rows = torch.stack([pos, pos + 5])  # (2, T)
    q2 = q.expand(2, -1, -1, -1)
    rq2, _ = rope.rotate(q2, q2, rope.rotation(rows))
    torch.testing.assert_close(rq2[1], rope_by_complex_numbers(q[0], pos + 5, 500.0), atol=1e-5, rtol=1e-5)
    assert torch.equal(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0]))


def test_rmsnorm_matches_its_formula():
    for bias in (False, True):
        norm = RMSNorm(tiny_config(norm_eps=1e-6, bias=bias))
        with torch.no_grad():
            norm.weight.normal_()
            if bias:
                norm.bias.normal_()
        x = torch.randn(3, 5, 32) * 4
        expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight + (norm.bias if bias else 0)
        torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)
    assert norm.bfloat16()(x.bfloat16()).dtype == torch.bfloat16  # normalised in float32, returned in bf16


def test_gelu_mlp_matches_gpt2s_formula():
    mlp = GeluMLP(tiny_config(ffn="gelu", bias=True))
    assert mlp.fc.out_features == 4 * 32  # GPT-2's width
    with torch.no_grad():
        mlp.fc.bias.normal_()
    x = torch.randn(2, 5, 32) * 3
    h = x @ mlp.fc.weight.T + mlp.fc.bias
    gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))  # GPT-2's gelu
    torch.testing.assert_close(mlp(x), gelu @ mlp.out_proj.weight.T + mlp.out_proj.bias, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_bias_applies_to_every_linear_and_norm_of_every_variant(bias):
    for overrides in (v for v in VARIANTS.values() if not (v.get("qkv_bias") or v.get("qk_norm"))):  # see below
        model = GPT(tiny_config(**{**overrides, "bias": bias}))
        layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm, RMSNorm))]
        assert len(layers) == 2 * 6 + 2  # per block: 2 norms, qkv, 2 out_proj, fc; the final norm; the head
        for m in layers:
            has_bias = getattr(m, "bias", None) is not None
            assert has_bias == (bias and m is not model.lm_head), (overrides, m)  # the tied head never has one


def test_qkv_bias_and_qk_norm_add_their_own_parameters_only():
    """Qwen2's biases sit on q, k and v alone; Qwen3's norms are one RMSNorm of head width each for q and k."""
    model = GPT(tiny_config(**VARIANTS["qwen2"]))
    assert [n for n, p in model.named_parameters() if n.endswith("bias")] == [
        f"blocks.{i}.attn.qkv.bias" for i in (0, 1)
    ]
    model = GPT(tiny_config(**VARIANTS["qwen3"]))
    norms = {n: p.shape for n, p in model.named_parameters() if "qk_norm" in n}
    assert norms == {f"blocks.{i}.attn.qk_norm.{w}_norm.weight": (16,) for i in (0, 1) for w in "qk"}


def test_every_variant_compiles_as_one_graph(variant):
    """No graph breaks in training's forward (dynamo's capture, without code generation)."""
    torch._dynamo.reset()  # each variant is new code to dynamo: start below its recompile limit (8 per function)
    model = tiny_model(**variant)
    idx = randint(97, (2, 9))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(idx, idx)[1], model(idx, idx)[1])


@pytest.mark.parametrize("name", ["rope", "gpt2"])
def test_flops_per_token_of_variants(name):
    """6N + 12LCT, N without a learned position table (RoPE has none; GPT-2's MLP is two 4C-wide matrices)."""
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, **VARIANTS[name]))
    C, V = 768, 50304
    ffn = 2 * C * 4 * C + 4 * C + C if name == "gpt2" else 3 * C * model.config.ffn_hidden
    norms = 2 * C * (2 if name == "gpt2" else 1)  # LayerNorm weight (and bias)
    attn = 4 * C * C + (4 * C if name == "gpt2" else 0)
    n = V * C + 12 * (attn + ffn + norms) + norms // 2
    assert model.num_params(exclude_positions=True) == n
    assert model.flops_per_token() == 6 * n + 12 * 12 * C * 1024


def test_gpt2_variant_has_gpt2s_parameter_count():
    """GPT-2 small in HF transformers has 124,439,808 parameters (vocab 50,257, tied head)."""
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, ffn="gelu", bias=True)
    assert GPT(cfg).num_params() == 124_439_808


def test_swiglu_matches_formula():
    model = tiny_model()
    ffn = model.blocks[0].ffn
    F_ = model.config.ffn_hidden
    W1, W3 = ffn.fc.weight[:F_], ffn.fc.weight[F_:]
    x = torch.randn(2, 5, 32, device=DEVICE)
    expected = (F.silu(x @ W1.T) * (x @ W3.T)) @ ffn.out_proj.weight.T
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


def test_head_is_tied_to_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    with torch.no_grad():
        model.tok_emb.weight[3, 0] = 123.0
    assert model.lm_head.weight[3, 0].item() == 123.0


def test_tying_survives_state_dict_round_trip(tmp_path):
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    fresh = GPT(tiny_config()).to(DEVICE)
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert fresh.lm_head.weight is fresh.tok_emb.weight
    torch.testing.assert_close(fresh.lm_head.weight, model.tok_emb.weight)


def test_forward_shapes_and_loss():
    model = tiny_model()
    idx = randint(97, (3, 11))
    logits, loss = model(idx)
    assert logits.shape == (3, 11, 97) and loss is None
    logits2, loss = model(idx, idx)
    assert logits2.shape == (3, 11, 97)
    expected = F.cross_entropy(logits2.reshape(-1, 97), idx.reshape(-1))
    torch.testing.assert_close(loss, expected)
    # ignore_index=-1: masked targets do not count
    targets = idx.clone()
    targets[:, 5:] = -1
    _, masked = model(idx, targets)
    torch.testing.assert_close(masked, F.cross_entropy(logits2[:, :5].reshape(-1, 97), idx[:, :5].reshape(-1)))
    # an untrained model predicts roughly uniformly
    assert abs(loss.item() - math.log(97)) < 0.5


def test_too_long_and_out_of_vocab_inputs_raise():
    model = tiny_model()
    with pytest.raises(ValueError, match="length 33 is longer than block_size=32"):
        model(tensor([[0] * 33]))
    with pytest.raises(ValueError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        model(tensor([[1, 97]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(tensor([[-1, 2]]))


@pytest.mark.parametrize(
    "idx,targets,error,message",
    [
        ("list", None, TypeError, r"idx must be a tensor of token ids of shape \(B, T\), got list"),
        ("1-D", None, ValueError, r"idx must have shape \(B, T\), got \(3,\); a single sequence is idx\[None\]"),
        ("float", None, TypeError, "idx must hold integer token ids, got dtype torch.float32; use idx.long()"),
        ("ok", "other shape", ValueError, r"targets must have the shape of idx, \(1, 3\), got \(1, 2\)"),
        ("ok", "float", TypeError, "targets must be a tensor of integer token ids"),
    ],
)
def test_bad_inputs_and_targets_are_named(idx, targets, error, message):
    model = tiny_model()
    idx = {
        "list": [[1, 2, 3]],
        "1-D": tensor([1, 2, 3]),
        "float": tensor([[1.0, 2.0, 3.0]]),
        "ok": tensor([[1, 2, 3]]),
    }[idx]
    targets = {"other shape": tensor([[1, 2]]), "float": tensor([[1.0, 2.0, 3.0]])}.get(targets, targets)
    with pytest.raises(error, match=message):
        model(idx, targets)


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=256))
    std = model.blocks[0].attn.out_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_param_count_and_flops():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model = GPT(cfg)
    # embedding + positions + 12 * (attention 4C^2 + SwiGLU 3*C*F + 2 norms) + final norm
    C, F_ = 768, cfg.ffn_hidden
    expected = 50304 * C + 1024 * C + 12 * (4 * C * C + 3 * C * F_ + 2 * C) + C
    assert model.num_params() == expected
    assert 120e6 < model.num_params() < 130e6
    assert model.flops_per_token() == 6 * (expected - 1024 * C) + 12 * 12 * 768 * 1024


def test_swiglu_gate_matches_the_chunked_math_and_its_gradient():
    """SwiGLUGate's one-buffer backward against autograd through chunk, silu and mul, and gradcheck."""
    h = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 5, 6, dtype=torch.float64)
    gate, value = h.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(F.silu(gate) * value, h, grad)
    out = SwiGLUGate.apply(h)
    (got,) = torch.autograd.grad(out, h, grad)
    torch.testing.assert_close(out, F.silu(gate) * value)
    torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(SwiGLUGate.apply, (h,))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpointing_gives_the_gradients_of_a_plain_backward(variant, dropout):
    """checkpoint_blocks recomputes each block in backward (with the same dropout masks): loss and every gradient
    equal those of the backward that kept the activations."""
    idx = randint(97, (2, 24))
    grads = []
    for recompute in (False, True):
        model = tiny_model(dropout=dropout, **variant).train()
        model.checkpoint_blocks = recompute
        torch.manual_seed(1)
        loss = model(idx, idx)[1]
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_keeps_only_the_blocks_inputs():
    """Saved for backward with recomputation: far fewer tensors than without (each block's input, not its insides)."""
    counts = []
    for recompute in (False, True):
        model = tiny_model(n_layer=4).train()
        model.checkpoint_blocks = recompute
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t):
            model(randint(97, (2, 24)), randint(97, (2, 24)))[1].backward()
        counts.append(sum(saved))
    assert counts[1] < counts[0] / 2, counts


def test_weights_of_another_shape_are_refused_naming_the_tensor_and_the_fix():
    model = tiny_model()
    state = dict(model.state_dict())
    state["tok_emb.weight"] = state["tok_emb.weight"][:-1]
    message = r"^saved: tensor tok_emb.weight has shape \(\d+, \d+\) but the config describes .*: put back the config"
    with pytest.raises(ValueError, match=message + r" saved with these weights, or download or save the model again$"):
        model.check_state(state, "saved")


CONV = dict(n_layer=3, layer_types="conv,full_attention,conv", pos_emb="rope", norm="rmsnorm")  # LFM2's layout


def test_short_conv_is_its_formula_and_causal():
    """LFM2's gated short convolution: y_t = out_proj(c_t * sum_j w_j * (b * x)_{t-K+1+j}), the inputs before the
    first token zero; changing a later token leaves earlier outputs alone."""
    torch.manual_seed(0)
    conv = ShortConv(tiny_config(conv_kernel=3, conv_bias=True)).to(DEVICE)
    x = torch.randn(2, 7, 32, device=DEVICE)
    b, c, h = conv.in_proj(x).chunk(3, dim=-1)  # (B, T, C) each
    bx = F.pad(b * h, (0, 0, 2, 0))  # (B, 2 + T, C): two zero inputs before the first token
    weight = conv.conv.weight[:, 0]  # (C, K)
    mixed = [sum(weight[:, j] * bx[:, t + j] for j in range(3)) + conv.conv.bias for t in range(7)]  # T x (B, C)
    want = conv.out_proj(c * torch.stack(mixed, dim=1))  # (B, T, C)
    torch.testing.assert_close(conv(x), want, atol=1e-5, rtol=1e-5)
    changed = x.clone()
    changed[:, 4:] = torch.randn(2, 3, 32, device=DEVICE)
    torch.testing.assert_close(conv(changed)[:, :4], want[:, :4])


def test_layer_types_build_each_layers_block_and_keep_conv_state_only_there():
    model = tiny_model(**CONV)
    assert [type(block) for block in model.blocks] == [ConvBlock, Block, ConvBlock]
    assert [sorted(specs) for specs in layer_states(model.config)] == [["conv"], [], ["conv"]]
    assert layer_states(model.config)[0]["conv"].shape == (32, 2)  # (C, conv_kernel - 1)
    assert model.config.attention_layer_ids == {1}
