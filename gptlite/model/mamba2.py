"""Mamba-2's mixer (Dao & Gu, 2024, "Transformers are SSMs": state space duality, SSD) and its two forms of one scan:
`ssd_chunked`, which prompts and training run (a chunk's tokens at once as masked matrix products, the state passed
between chunks), and `ssd_step`, the recurrence one decoded token at a time takes. Both compute

    h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t

per head, h (P, N); the recurrence is a named function of its own so that a kernel could take its place.

Shape legend: B batch, T tokens, H heads, P head width, G groups (of heads sharing B and C), N state size,
L chunk length, K the convolution's width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptlite.config import GPTConfig
from gptlite.model.attention_cache import AttentionCache, StateSpec


def per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C of G groups (..., G, N) -> (..., H, N): each group's for each of its heads."""
    return t.repeat_interleave(heads // t.size(-2), dim=-2)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a (..., L) -> (..., L, L): entry [i, j] = a[j+1] + ... + a[i] for j <= i (the log of the decay from token j to
    token i), -inf above the diagonal. Summed from a masked cumsum rather than a difference of cumsums, which is
    steadier in float32 (as the reference, mamba_ssm's ssd_minimal)."""
    L = a.size(-1)
    a = a[..., None].expand(*a.shape, L)  # (..., L, L): a[i] in row i of every column
    below = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a.masked_fill(~below, 0), dim=-2)  # (..., L, L)
    inside = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~inside, -torch.inf)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over a whole sequence, chunk by chunk: within a chunk as attention-like matrix products (the
    "diagonal blocks"), across chunks by passing each chunk's final state on (SSD's chunked algorithm).

    x (B, T, H, P), dt (B, T, H) the time steps (already biased, softplus'd and clamped), A (H,) negative, B and C
    (B, T, G, N), state (B, H, P, N) before the first token or None (zeros) -> y (B, T, H, P) and the state after the
    last token (B, H, P, N), both float32. A token with dt 0 neither decays the state nor enters it."""
    batch, T, H, P = x.shape
    pad = (chunk_size - T % chunk_size) % chunk_size  # zeros at the end: dt 0 leaves the state as it was
    x = F.pad(x.float() * dt.float()[..., None], (0, 0, 0, 0, 0, pad))  # (B, T', H, P): the input times its step
    a = F.pad(dt.float() * A.float(), (0, 0, 0, pad))  # (B, T', H): each token's log-decay
    B = F.pad(per_head(B.float(), H), (0, 0, 0, 0, 0, pad))  # (B, T', H, N)
    C = F.pad(per_head(C.float(), H), (0, 0, 0, 0, 0, pad))  # (B, T', H, N)
    chunks = x.size(1) // chunk_size
    x = x.view(batch, chunks, chunk_size, H, P)  # (B, c, L, H, P)
    B = B.view(batch, chunks, chunk_size, H, -1)  # (B, c, L, H, N)
    C = C.view(batch, chunks, chunk_size, H, -1)  # (B, c, L, H, N)
    a = a.view(batch, chunks, chunk_size, H).permute(0, 3, 1, 2)  # (B, H, c, L)
    a_cum = torch.cumsum(a, dim=-1)  # (B, H, c, L): log-decay from the chunk's start to each token

    # 1. within each chunk: y_i = sum over j <= i of (C_i . B_j) decay(j -> i) x_j
    decay = torch.exp(segment_sum(a))  # (B, H, c, L, L)
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay  # (B, H, c, L, L)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x)  # (B, c, L, H, P)

    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (B, H, c, L)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)  # (B, c, H, P, N)

    # 3. across chunks: the state at each chunk's start, from the state before the sequence and the chunks before
    if state is None:
        state = x.new_zeros(batch, H, P, B.size(-1))
    states = torch.cat([state.float()[:, None], states], dim=1)  # (B, c+1, H, P, N)
    chunk_decay = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # (B, H, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)  # (B, c+1, H, P, N)
    starts = states[:, :-1]  # (B, c, H, P, N): each chunk's starting state
    final = states[:, -1]  # (B, H, P, N)

    # 4. the starting state's part in each token's output, decayed to the token
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, starts, torch.exp(a_cum))  # (B, c, L, H, P)
    y = y.reshape(batch, chunks * chunk_size, H, P)[:, :T]  # (B, T, H, P)
    return y, final


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: state (B, H, P, N), x (B, H, P), dt (B, H) (biased, softplus'd, clamped), A (H,),
    B and C (B, G, N) -> y (B, H, P) and the new state (B, H, P, N), both float32."""
    H = x.size(1)
    dt = dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]  # (B, H, 1, 1)
    B = per_head(B.float(), H)  # (B, H, N)
    C = per_head(C.float(), H)  # (B, H, N)
    state = state.float() * decay + (dt[..., None] * x.float())[..., None] * B[:, :, None, :]  # (B, H, P, N)
    y = torch.einsum("bhpn,bhn->bhp", state, C)  # (B, H, P)
    return y, state


class GatedRMSNorm(nn.Module):
    """Mamba-2's norm of the scan's output: y * silu(gate), then an RMSNorm over each group's channels (n_groups of
    them, as mamba_ssm's RMSNormGated with norm_before_gate=False), times a learned weight."""

    def __init__(self, width: int, groups: int, eps: float):
        super().__init__()
        self.groups = groups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y, gate (B, T, H*P) -> (B, T, H*P) in y's dtype."""
        dtype = y.dtype
        y = y.float() * F.silu(gate.float())
        grouped = y.view(*y.shape[:-1], self.groups, -1)  # (B, T, G, H*P/G)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(y.shape).to(dtype)


class Mamba2(nn.Module):
    """Mamba-2's mixer (transformers' GraniteMoeHybridMambaLayer, Mamba2Mixer): in_proj gives the gate z, the
    convolution's input (x, B, C) and dt; a depthwise causal convolution over the last mamba_conv_kernel tokens and a
    silu, then the scan (A = -exp(A_log), dt = softplus(dt + dt_bias) clamped to [mamba_dt_min, mamba_dt_max]), the
    D skip (y + D x), the gated RMSNorm and out_proj.

    Decoding keeps per row the convolution's last K - 1 inputs ("conv") and the scan's state ("ssm", float32, as the
    reference computes it). Padding enters neither: its inputs are zeroed (as transformers'
    apply_mask_to_padding_states) and its dt is zero, so the state passes a padded token unchanged."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.heads = config.mamba_heads
        self.head_dim = config.mamba_head_dim
        self.state_size = config.mamba_state
        self.groups = config.mamba_groups
        self.chunk_size = config.mamba_chunk_size
        self.dt_min = config.mamba_dt_min
        self.dt_max = config.mamba_dt_max
        self.inner = self.heads * self.head_dim  # the scan's width
        self.conv_dim = self.inner + 2 * self.groups * self.state_size  # x, B and C go through the convolution
        self.width = config.mamba_conv_kernel - 1  # the inputs before a token that its convolution sees
        self.in_proj = nn.Linear(C, self.inner + self.conv_dim + self.heads, bias=config.mamba_proj_bias)
        self.conv = nn.Conv1d(
            self.conv_dim, self.conv_dim, config.mamba_conv_kernel, groups=self.conv_dim, bias=config.mamba_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))  # S4D-real
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.groups, config.norm_eps)
        self.out_proj = nn.Linear(self.inner, C, bias=config.mamba_proj_bias)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        conv_dim = config.mamba_heads * config.mamba_head_dim + 2 * config.mamba_groups * config.mamba_state
        return {
            "conv": StateSpec((conv_dim, config.mamba_conv_kernel - 1)),
            "ssm": StateSpec((config.mamba_heads, config.mamba_head_dim, config.mamba_state), torch.float32),
        }

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None, layer: int = 0) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); with a cache, the convolution and the scan continue each row's state."""
        batch, T, _ = x.shape
        real = None if cache is None or cache.real is None else cache.real[..., None].to(x.dtype)  # (B, T, 1)
        if real is not None:
            x = x * real
        z, xBC, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xBC = xBC.transpose(1, 2)  # (B, conv_dim, T)
        state = None
        if cache is None:
            past = xBC.new_zeros(batch, self.conv_dim, self.width)  # (B, conv_dim, K-1): nothing before
        else:
            state = cache.read_state(layer)
            past = state["conv"].to(xBC.dtype)  # (B, conv_dim, K-1)
        inputs = torch.cat([past, xBC], dim=-1)  # (B, conv_dim, K-1+T)
        xBC = F.silu(self.conv(inputs)).transpose(1, 2)  # (B, T, conv_dim)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)  # (B, T, H)
        if real is not None:
            xBC = xBC * real
            dt = dt * real.float()  # a padded token leaves the state as it was
        xs, B, C = xBC.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        xs = xs.view(batch, T, self.heads, self.head_dim)  # (B, T, H, P)
        B = B.view(batch, T, self.groups, self.state_size)  # (B, T, G, N)
        C = C.view(batch, T, self.groups, self.state_size)  # (B, T, G, N)
        A = -torch.exp(self.A_log.float())  # (H,)
        if state is not None and T == 1:  # a decoded token: the recurrence
            y, ssm = ssd_step(state["ssm"], xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y[:, None]  # (B, 1, H, P)
        else:
            y, ssm = ssd_chunked(xs, dt, A, B, C, self.chunk_size, None if state is None else state["ssm"])
        if cache is not None:
            conv_state = last_inputs(inputs, cache.real, self.width)
            cache.write_state(layer, {"conv": conv_state, "ssm": ssm})
        y = y + self.D.float()[:, None] * xs.float()  # (B, T, H, P): the D skip
        y = self.norm(y.reshape(batch, T, self.inner).to(x.dtype), z)  # (B, T, H*P)
        return self.out_proj(y)


def last_inputs(inputs: torch.Tensor, real: torch.Tensor | None, width: int) -> torch.Tensor:
    """The `width` inputs up to and including each row's last real token: inputs (B, C, width + T) are `width` earlier
    ones, then the call's T; real (B, T), True where a token is its row's own (padding on either side), or None (every
    token) -> (B, C, width)."""
    if real is None:
        return inputs[..., inputs.size(-1) - width :]
    T = real.size(1)
    last = T - 1 - real.flip(-1).to(torch.uint8).argmax(-1)  # (B,) each row's last real token
    index = last[:, None] + 1 + torch.arange(width, device=inputs.device)  # (B, width), in inputs' coordinates
    return inputs.gather(-1, index[:, None, :].expand(-1, inputs.size(1), -1))  # (B, C, width)
