"""Mamba-2's scan and mixer (gptlite.model.mamba2): the chunked scan and the recurrent step against the naive
recurrence and against transformers' torch path (GraniteMoeHybrid's), prompts longer than a chunk; the mixer against
transformers' GraniteMoeHybridMambaLayer, decoding through its state, padding kept out of it."""

import torch
import torch.nn.functional as F
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as reference

from gptlite.model.mamba2 import Mamba2, ssd_chunked, ssd_step
from tests.conftest import tiny_config

HEADS = 4
GROUPS = 2


def naive_scan(x, dt, A, B, C, state):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, one token and one head at a time, in float64."""
    batch, T, H, P = x.shape
    per_group = H // B.size(2)
    h = state.double().clone()
    ys = torch.zeros(batch, T, H, P, dtype=torch.float64)
    for t in range(T):
        for head in range(H):
            g = head // per_group
            decay = torch.exp(dt[:, t, head].double() * A[head].double())[:, None, None]  # (B, 1, 1)
            inflow = (dt[:, t, head, None].double() * x[:, t, head].double())[:, :, None] * B[:, t, g, None].double()
            h[:, head] = decay * h[:, head] + inflow  # (B, P, N)
            ys[:, t, head] = torch.einsum("bpn,bn->bp", h[:, head], C[:, t, g].double())
    return ys, h


def scan_inputs(T: int, seed: int = 0):
    """x (2, T, H, P), dt (2, T, H) > 0, A (H,) < 0, B and C (2, T, G, N), a starting state (2, H, P, N)."""
    torch.manual_seed(seed)
    x = torch.randn(2, T, HEADS, 3)
    dt = F.softplus(torch.randn(2, T, HEADS))
    A = -torch.rand(HEADS) - 0.1
    B = torch.randn(2, T, GROUPS, 5)
    C = torch.randn(2, T, GROUPS, 5)
    state = torch.randn(2, HEADS, 3, 5)
    return x, dt, A, B, C, state


def test_the_chunked_scan_and_the_step_are_the_naive_recurrence():
    """Over 11 tokens in chunks of 4 (the last one partial), from a state: the chunked scan's outputs and final state,
    and the step's taken one token at a time, are the recurrence's."""
    x, dt, A, B, C, state = scan_inputs(11)
    want_y, want_state = naive_scan(x, dt, A, B, C, state)
    y, final = ssd_chunked(x, dt, A, B, C, chunk_size=4, state=state)
    torch.testing.assert_close(y.double(), want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), want_state, atol=1e-4, rtol=1e-4)
    h = state
    steps = []
    for t in range(11):
        y_t, h = ssd_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, dim=1).double(), want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double(), want_state, atol=1e-4, rtol=1e-4)


def test_a_chunk_size_changes_nothing_and_a_zero_step_leaves_the_state_alone():
    x, dt, A, B, C, state = scan_inputs(9, seed=1)
    y4, final4 = ssd_chunked(x, dt, A, B, C, chunk_size=4, state=state)
    y16, final16 = ssd_chunked(x, dt, A, B, C, chunk_size=16, state=state)
    torch.testing.assert_close(y4, y16, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final4, final16, atol=1e-5, rtol=1e-5)
    padded = torch.cat([dt[:, :5], torch.zeros(2, 4, HEADS)], dim=1)  # the last 4 tokens padding: dt 0
    _, through_padding = ssd_chunked(x, padded, A, B, C, chunk_size=4, state=state)
    _, first_five = ssd_chunked(x[:, :5], dt[:, :5], A, B[:, :5], C[:, :5], chunk_size=4, state=state)
    torch.testing.assert_close(through_padding, first_five, atol=1e-5, rtol=1e-5)


def test_the_scans_are_transformers_torch_path():
    """transformers' mamba2_chunk_scan and mamba2_selective_state_update (what GraniteMoeHybrid runs without
    kernels), given the raw time steps with dt_bias, softplus and the D skip."""
    x, raw_dt, A, B, C, state = scan_inputs(10, seed=2)
    dt_bias = torch.randn(HEADS)
    D = torch.randn(HEADS)
    dt = F.softplus(raw_dt + dt_bias)
    want_y, want_state = reference.mamba2_chunk_scan(
        x, raw_dt, A, B, C, 4, D=D, dt_bias=dt_bias, initial_states=state, dt_softplus=True, return_final_states=True
    )
    y, final = ssd_chunked(x, dt, A, B, C, chunk_size=4, state=state)
    torch.testing.assert_close(y + D[:, None] * x, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_state, atol=1e-4, rtol=1e-4)
    P = x.size(-1)
    N = B.size(-1)
    theirs = state.clone()
    want_step = reference.mamba2_selective_state_update(
        theirs,
        x[:, 0],
        raw_dt[:, 0, :, None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B[:, 0],
        C[:, 0],
        D[:, None].expand(-1, P),
        dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True,
    )
    y_step, h = ssd_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    torch.testing.assert_close(y_step + D[:, None] * x[:, 0], want_step, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, theirs, atol=1e-5, rtol=1e-5)


MAMBA = dict(mamba_heads=HEADS, mamba_head_dim=16, mamba_state=8, mamba_groups=GROUPS, mamba_chunk_size=4)


def reference_mixer(mixer: Mamba2) -> torch.nn.Module:
    """transformers' GraniteMoeHybridMambaLayer with the weights of `mixer`."""
    config = GraniteMoeHybridConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        layer_types=["mamba"],
        mamba_n_heads=HEADS,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=GROUPS,
        mamba_expand=2,
        mamba_chunk_size=4,
        mamba_d_conv=4,
        rms_norm_eps=1e-5,
    )
    layer = reference.GraniteMoeHybridMambaLayer(config, 0)
    with torch.no_grad():
        layer.in_proj.weight.copy_(mixer.in_proj.weight)
        layer.conv1d.weight.copy_(mixer.conv.weight)
        layer.conv1d.bias.copy_(mixer.conv.bias)
        layer.dt_bias.copy_(mixer.dt_bias)
        layer.A_log.copy_(mixer.A_log)
        layer.D.copy_(mixer.D)
        layer.norm.weight.copy_(mixer.norm.weight)
        layer.out_proj.weight.copy_(mixer.out_proj.weight)
    return layer.eval()


def random_mixer() -> Mamba2:
    torch.manual_seed(0)
    mixer = Mamba2(tiny_config(**MAMBA))
    with torch.no_grad():
        mixer.dt_bias.normal_()
        mixer.D.normal_()
        mixer.A_log.uniform_(-1, 1)
        mixer.norm.weight.normal_(1, 0.2)
    return mixer.eval()


def test_the_mixer_is_transformers_mamba_layer_over_a_prompt_longer_than_a_chunk():
    mixer = random_mixer()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), reference_mixer(mixer)(x), atol=2e-5, rtol=2e-5)


class StateCache:
    """The part of AttentionCache a mamba layer reads: each row's state and which tokens are real."""

    def __init__(self, rows: int, real: torch.Tensor | None = None):
        specs = Mamba2.state_spec(tiny_config(**MAMBA))
        self.state = {name: torch.zeros(rows, *spec.shape) for name, spec in specs.items()}
        self.real = real

    def read_state(self, layer: int) -> dict[str, torch.Tensor]:
        return self.state

    def write_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        self.state = state


def test_decoding_through_the_state_gives_the_whole_forward_and_padding_never_enters_it():
    """A prompt of 6 through the chunked scan, then 5 tokens one at a time (the step), equal the forward over all 11;
    a left-padded row and a right-padded row (the server's) leave the state their real tokens alone leave."""
    mixer = random_mixer()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        whole = mixer(x)
        cache = StateCache(2)
        parts = [mixer(x[:, :6], cache)]
        for t in range(6, 11):
            parts.append(mixer(x[:, t : t + 1], cache))
        torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)

        alone = StateCache(1)
        mixer(x[:1, :5], alone)
        padded = torch.cat([torch.randn(1, 3, 32), x[:1, :5], torch.randn(1, 3, 32)], dim=1)  # 3 pads each side
        real = torch.tensor([[False] * 3 + [True] * 5 + [False] * 3])
        cache = StateCache(1, real)
        out = mixer(padded, cache)
        torch.testing.assert_close(out[:, 3:8], whole[:1, :5], atol=1e-5, rtol=1e-5)
        for name in ("conv", "ssm"):
            torch.testing.assert_close(cache.state[name], alone.state[name], atol=1e-5, rtol=1e-5)


def test_the_chunked_scans_gradients_are_the_recurrences():
    """Training runs through the chunked scan: its gradients (past a chunk, from a state) are those of the step taken
    token by token, and finite where the decay's masked entries are exp(-inf)."""
    inputs = [t.requires_grad_() for t in scan_inputs(9, seed=3)]
    x, dt, A, B, C, state = inputs
    y, final = ssd_chunked(x, dt, A, B, C, chunk_size=4, state=state)
    weights = torch.randn_like(y)
    chunked = torch.autograd.grad((y * weights).sum() + final.sum(), inputs)
    h = state
    steps = []
    for t in range(9):
        y_t, h = ssd_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        steps.append(y_t)
    recurrent = torch.autograd.grad((torch.stack(steps, dim=1) * weights).sum() + h.sum(), inputs)
    for got, want in zip(chunked, recurrent, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
