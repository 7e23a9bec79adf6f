"""The mixture of experts against its references: the grouped computation equals every expert computed for every
token and weighted by the router's choice (the naive math), forward and backward; the load-balancing loss equals
transformers' load_balancing_loss_func; the switches' rules."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

from gptlite import GPTConfig
from gptlite.model.network import MixtureOfExperts, Transformer, load_balancing_loss

MOE = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32, pos_emb="rope", norm="rmsnorm", ffn_hidden=24)


def naive_experts(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, each output times its weight where the router chose it, else 0."""
    probs = torch.softmax(moe.router(x).float(), dim=-1)  # (B, T, E)
    top, chosen = probs.topk(moe.top_k, dim=-1)  # (B, T, K)
    if moe.renorm:
        top = top / top.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(-1, chosen, top)  # (B, T, E), 0 where not chosen
    out = torch.zeros_like(x)
    for e in range(moe.n_experts):
        gate, value = F.linear(x, moe.fc.weight[e]).chunk(2, dim=-1)
        out = out + weights[..., e : e + 1] * F.linear(F.silu(gate) * value, moe.out_proj.weight[e])
    return out


@pytest.mark.parametrize("renorm", [False, True])
def test_grouped_experts_equal_every_expert_on_every_token(renorm):
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(**MOE, n_experts=5, experts_per_token=2, experts_renorm=renorm))
    x = torch.randn(3, 11, 32, requires_grad=True)
    got = moe(x)
    expected = naive_experts(moe, x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    grads = torch.autograd.grad(got.square().sum(), [x, moe.router.weight, moe.fc.weight, moe.out_proj.weight])
    naive = torch.autograd.grad(expected.square().sum(), [x, moe.router.weight, moe.fc.weight, moe.out_proj.weight])
    for a, b in zip(grads, naive, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_experts_train_under_autocast():
    """Under bfloat16 autocast the experts' outputs are bfloat16 and the residual stream float32: they add up."""
    torch.manual_seed(0)
    model = Transformer(GPTConfig(**MOE, n_experts=4, experts_per_token=2))
    idx = torch.randint(0, 50, (2, 16))
    _, expected = model(idx, idx)
    with torch.autocast("cpu", torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=2e-2, rtol=0)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_an_expert_no_token_chose_is_skipped():
    """One token, one choice: the other experts get no rows, and their weights no gradient."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(**MOE, n_experts=4, experts_per_token=1))
    x = torch.randn(1, 1, 32)
    torch.testing.assert_close(moe(x), naive_experts(moe, x), atol=1e-6, rtol=0)
    moe(x).sum().backward()
    used = moe.fc.weight.grad.flatten(1).abs().sum(1) > 0  # (E,)
    assert used.sum() == 1


def test_the_load_balancing_loss_equals_transformers():
    torch.manual_seed(0)
    logits = [torch.randn(40, 6) for _ in range(3)]  # three layers' (tokens, experts)
    expected = load_balancing_loss_func(tuple(logits), 6, 2)
    torch.testing.assert_close(load_balancing_loss(logits, 2), expected, atol=1e-6, rtol=0)


def test_the_model_keeps_router_logits_in_training_forwards_only():
    torch.manual_seed(0)
    model = Transformer(GPTConfig(**MOE, n_experts=4, experts_per_token=2))
    idx = torch.randint(0, 50, (2, 16))
    model.eval()
    model(idx)
    assert model.router_aux_loss() is None
    model.train()
    model(idx, idx)
    loss = model.router_aux_loss()
    assert loss is not None and loss.requires_grad
    assert model.router_aux_loss() is None  # let go once taken


def test_flops_count_the_experts_a_token_goes_through():
    dense = Transformer(GPTConfig(**MOE))
    moe = Transformer(GPTConfig(**MOE, n_experts=4, experts_per_token=1))
    router = 2 * 4 * 32  # two layers' routers, 4 x 32
    assert moe.flops_per_token() - dense.flops_per_token() == 6 * router


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(n_experts=4, experts_per_token=5), r"experts_per_token=5 must be in 1..n_experts=4"),
        (dict(n_experts=4), r"experts_per_token=0 must be in 1..n_experts=4"),
        (dict(experts_per_token=2), r"experts_per_token=2 says how a mixture of experts routes tokens; it needs n_exp"),
        (dict(router_aux_loss_coef=0.01), r"router_aux_loss_coef=0.01 says how .* it needs n_experts > 0"),
        (dict(n_experts=-1), r"n_experts=-1 must be an integer >= 0"),
        (dict(n_experts=4, experts_per_token=2, router_aux_loss_coef=-1.0), r"router_aux_loss_coef=-1.0 must be a fin"),
        (dict(n_experts=4, experts_per_token=2, ffn="gelu"), r"n_experts=4 makes SwiGLU experts; ffn='gelu' is no"),
        (dict(n_experts=4, experts_per_token=2, bias=True), r"n_experts=4 makes experts without biases; bias=true"),
    ],
)
def test_bad_expert_switches_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**MOE, **values})
