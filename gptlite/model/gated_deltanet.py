"""The gated delta rule of Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024, "Gated Delta Networks: Improving Mamba2
with Delta Rule"), the linear attention of three of every four of Qwen3.5's layers (the layer itself:
gptlite.model.network's GatedDeltaNet).

The rule keeps, per value head, a state S (dk, dv) that maps keys to values. At each token it decays the state by
exp(g_t) (g_t <= 0), then writes the token's value under its key by the delta rule, replacing what the state read
there by beta_t of the difference, and reads the output with the query:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

`recurrent_gated_delta_rule` is that recurrence token by token: decoding's step, one token at a time.
`chunked_gated_delta_rule` computes the same outputs a chunk of tokens at a time (prompts and training): within a
chunk the updates are gathered into matrices (the WY representation of the delta rule's products of Householder-like
factors, section 3 of the paper), so that a sequence costs a few matmuls per chunk and one small loop over chunks.
Both take their inputs as the layer makes them and return the output and the final state, in float32 inside; either
could be swapped for a fused kernel (flash-linear-attention's chunk_gated_delta_rule and
fused_recurrent_gated_delta_rule compute the same).

Shape legend: B batch, T tokens, Hk key heads, Hv value heads (each key head serves Hv / Hk consecutive value
heads), dk key width, dv value width, N chunks of c tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of the chunked form: flash-linear-attention's and transformers' choice


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension: the queries' and keys' norm of Gated DeltaNet, with the eps
    inside the root as flash-linear-attention computes it."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def prepared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The rule's inputs in float32, heads first, the queries and keys L2-normalized and as many as the value heads,
    the queries scaled by 1 / sqrt(dk): q, k (B, H, T, dk), v (B, H, T, dv), g, beta (B, H, T)."""
    repeats = v.size(2) // k.size(2)
    if repeats != 1:  # grouped heads: key head j serves value heads j*repeats .. (j+1)*repeats-1
        q = q.repeat_interleave(repeats, dim=2)  # (B, T, Hv, dk)
        k = k.repeat_interleave(repeats, dim=2)  # (B, T, Hv, dk)
    q = l2_normalized(q.float()) * q.size(-1) ** -0.5
    k = l2_normalized(k.float())
    return (
        q.transpose(1, 2),  # (B, H, T, dk)
        k.transpose(1, 2),  # (B, H, T, dk)
        v.float().transpose(1, 2),  # (B, H, T, dv)
        g.float().transpose(1, 2),  # (B, H, T)
        beta.float().transpose(1, 2),  # (B, H, T)
    )


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token. q, k (B, T, Hk, dk), v (B, T, Hv, dv), g (log decay, <= 0) and beta
    (B, T, Hv), state (B, Hv, dk, dv) or None for zeros -> the outputs (B, T, Hv, dv) in v's dtype and the state after
    the last token (B, Hv, dk, dv), float32."""
    out_dtype = v.dtype
    q, k, v, g, beta = prepared(q, k, v, g, beta)
    B, H, T, dk = k.shape
    S = torch.zeros(B, H, dk, v.size(-1), device=v.device) if state is None else state.float()  # (B, H, dk, dv)
    out = []
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()
        read = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)  # what the decayed state holds under the key
        delta = beta[:, :, t, None] * (v[:, :, t] - read)  # (B, H, dv)
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]  # (B, H, dk, dv)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # (B, H, dv)
    o = torch.stack(out, dim=2) if out else v.new_zeros(B, H, 0, v.size(-1))  # (B, H, T, dv)
    return o.transpose(1, 2).to(out_dtype), S


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a chunk of `chunk_size` tokens at a time: the same outputs and final state as
    recurrent_gated_delta_rule (up to rounding), for the same arguments and shapes.

    Within a chunk, with G_i the cumulative log decay up to token i and D_ij = exp(G_i - G_j) for j <= i (0 above
    the diagonal), the delta rule's updates solve one unit lower-triangular system (I + tril(beta_i k_i.k_j D_ij,
    -1)) X = [beta_i v_i | beta_i exp(G_i) k_i]: X's first part is the values each token writes before the state
    that enters the chunk is subtracted (u), its second what that state contributes to them (w). Then per chunk,
    in order: the values written are u - w S, the outputs exp(G_i) q_i S plus the chunk's own causal attention
    (q_i.k_j D_ij) over those values, and the state passed on is exp(G_last) S plus each key, decayed to the chunk's
    end, times its value written."""
    out_dtype = v.dtype
    q, k, v, g, beta = prepared(q, k, v, g, beta)
    B, H, T, dk = k.shape
    dv = v.size(-1)
    pad = -T % chunk_size  # padded tokens have g = 0 and beta = 0: they neither decay nor write the state
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n_chunks = (T + pad) // chunk_size
    q, k, v = (x.reshape(B, H, n_chunks, chunk_size, -1) for x in (q, k, v))  # (B, H, N, c, d)
    G = g.reshape(B, H, n_chunks, chunk_size).cumsum(dim=-1)  # (B, H, N, c)
    beta = beta.reshape(B, H, n_chunks, chunk_size, 1)  # (B, H, N, c, 1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()  # j <= i
    # D_ij, masked before exp so that the positive exponents above the diagonal never overflow
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, H, N, c, c)
    system = (beta * k) @ k.transpose(-1, -2) * D  # (B, H, N, c, c); its diagonal is ignored (unit)
    u = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)  # (B, H, N, c, dv)
    w = torch.linalg.solve_triangular(system, beta * k * G[..., None].exp(), upper=False, unitriangular=True)
    within = q @ k.transpose(-1, -2) * D  # (B, H, N, c, c) the chunk's own causal attention
    q_decayed = q * G[..., None].exp()  # (B, H, N, c, dk) what each query reads of the state entering the chunk
    k_to_end = k * (G[..., -1:] - G)[..., None].exp()  # (B, H, N, c, dk) each key decayed to the chunk's end
    end_decay = G[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    S = torch.zeros(B, H, dk, dv, device=v.device) if state is None else state.float()  # (B, H, dk, dv)
    out = []
    for n in range(n_chunks):
        written = u[:, :, n] - w[:, :, n] @ S  # (B, H, c, dv)
        out.append(q_decayed[:, :, n] @ S + within[:, :, n] @ written)  # (B, H, c, dv)
        S = S * end_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ written
    o = torch.cat(out, dim=2)[:, :, :T]  # (B, H, T, dv)
    return o.transpose(1, 2).to(out_dtype), S
