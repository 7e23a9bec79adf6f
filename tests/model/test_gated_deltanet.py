"""The gated delta rule against transformers' reference PyTorch paths (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule), its chunked form against its recurrence, forward and backward."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from gptlite.model.gated_deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule

B = 2  # rows
HK = 2  # query/key heads
HV = 4  # value heads
DK = 8  # a query/key head's width
DV = 16  # a value head's width


def inputs(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k (B, T, Hk, dk), v (B, T, Hv, dv), log decays g <= 0 and beta in (0, 1) (B, T, Hv), and a state
    (B, Hv, dk, dv) to start from; each key head serves two value heads."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(B, T, HK, DK, generator=gen),
        k=torch.randn(B, T, HK, DK, generator=gen),
        v=torch.randn(B, T, HV, DV, generator=gen),
        g=-2 * torch.rand(B, T, HV, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
        state=torch.randn(B, HV, DK, DV, generator=gen),
    )


def transformers_rule(fn, x: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return fn(
        x["q"],
        x["k"],
        x["v"],
        g=x["g"],
        beta=x["beta"],
        initial_state=x["state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_the_chunked_rule_equals_transformers(chunk_size):
    """70 tokens: a second, partial chunk of 64; or four and a part of 16."""
    x = inputs(70)
    out, state = chunked_gated_delta_rule(**x, chunk_size=chunk_size)
    expected_out, expected_state = transformers_rule(torch_chunk_gated_delta_rule, x, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=0)


def test_the_recurrent_rule_equals_transformers():
    x = inputs(9)
    out, state = recurrent_gated_delta_rule(**x)
    expected_out, expected_state = transformers_rule(torch_recurrent_gated_delta_rule, x)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("start", ["zeros", "a state"])
def test_the_chunked_rule_equals_the_recurrence_token_by_token(start):
    """The prompt's chunked pass, then decoding's steps one token at a time from its state, equal the recurrence
    over the whole sequence."""
    x = inputs(70, seed=1)
    if start == "zeros":
        x["state"] = None
    expected_out, expected_state = recurrent_gated_delta_rule(**x)
    prompt = {name: t[:, :50] for name, t in x.items() if name != "state"}
    out, state = chunked_gated_delta_rule(**prompt, state=x["state"], chunk_size=16)
    outs = [out]
    for t in range(50, 70):
        step = {name: x[name][:, t : t + 1] for name in ("q", "k", "v", "g", "beta")}
        out, state = recurrent_gated_delta_rule(**step, state=state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), expected_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=0)


def test_the_chunked_rules_gradients_equal_the_recurrences():
    """Training runs through the chunked form: its gradients are the recurrence's."""
    grads = []
    for rule in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        x = {name: t.clone().requires_grad_() for name, t in inputs(20, seed=2).items()}
        kw = {"chunk_size": 8} if rule is chunked_gated_delta_rule else {}
        out, state = rule(**x, **kw)
        (out.square().sum() + state.sum()).backward()
        grads.append([x[name].grad for name in ("q", "k", "v", "g", "beta", "state")])
    for chunked, recurrent in zip(*grads, strict=True):
        torch.testing.assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4)


def test_the_rule_keeps_its_inputs_dtype():
    x = {name: t.to(torch.bfloat16) for name, t in inputs(5).items()}
    for rule in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        out, state = rule(**x)
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
