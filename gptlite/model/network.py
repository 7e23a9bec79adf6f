"""The GPT architecture: positions, norms, causal self-attention, feed-forwards, pre-norm blocks, the Transformer.
(The class users build, gptlite.gpt.GPT, is this network with loading, generation and quantization on top.)

Each variant is one module class, picked once from a registry when the model is built:
    pos_emb        POSITIONS  learned (GPT-2) | sinusoidal (Vaswani et al.) | rope (Su et al.; Llama); RoPE with a
                              second base for the sliding-window layers where rope_local_theta is set (Gemma 3)
    norm           NORMS      layernorm | rmsnorm (Llama)
    ffn            FFNS       swiglu (Llama) | gelu (GPT-2's MLP) | relu2 (Primer; modded-nanogpt) | geglu (Gemma);
                              a mixture of SwiGLU experts where n_experts is set (OLMoE, Qwen3-MoE, Granite 3 MoE)
    norm_position  BLOCKS     pre (GPT-2, Llama) | post (OLMo 2) | both (Gemma)
    qk_norm_scope  QK_NORMS   head (Qwen3) | all (OLMo 2)
    layer_types    LAYERS     each layer's block: full_attention (the above; its attention gated on its output where
                              attn_output_gate is set: Qwen3.5) | conv (LFM2's gated short convolution) |
                              linear_attention (Gated DeltaNet: Qwen3.5) | mamba (Mamba-2, gptlite.model.mamba2)

The options of today's open models, off by default: grouped-query attention (n_kv_head), a head width of its
own (head_dim), an untied output head (tie_embeddings=False), biases on q, k, v (qkv_bias), per-head q/k RMSNorm
(qk_norm), Llama 3's and YaRN's RoPE scaling (rope_scaling="llama3", "yarn"), q scaled by its position
(query_scale_beta: Ministral 3); Granite's multipliers (embed_scale, residual_scale,
attn_scale, logits_scaling), SmolLM3's layers without positions (nope_layers), nanochat's parameter-free norms
(norm_weight=False), norm of the embeddings (embed_norm) and RoPE direction (rope_reverse), Gemma's norms scaling by
1 + weight (norm_unit_offset) and its layers attending to a sliding window (sliding_window, window_layers). Each is
set once per layer when the model is built.

The speedrun techniques of modded-nanogpt and nanochat, off by default: value embeddings mixed into attention's
values (value_embeds), an embedding of each token's pair with the one before it (bigram_vocab), U-net skips from
early to late blocks (unet_skips), logit soft-capping (logit_softcap), output projections that start at zero
(zero_init_out).

Generation reads and writes each layer's state through `AttentionCache` (gptlite.model.attention_cache), the interface
the model reads and every cache implements (sample.py's gptlite.inference.kvcache.KVCache, the server's
gptlite.serve.rows.RowCache): keys and values for attention, and whatever a layer's `state_spec` names for the others
(a convolution's last inputs, a recurrent matrix).

Shape legend used in the comments:
    B batch, T sequence length (this call), S keys attended to (cache + T), C = n_embd,
    H = n_head, KV = n_kv_head (H by default), D = head width (C // H by default), F = ffn_hidden, V = vocab_size,
    N = B*T tokens, E = n_experts, K = experts_per_token.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptlite.config import GPTConfig
from gptlite.model.attention_cache import AttentionCache, StateSpec
from gptlite.model.gated_deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule
from gptlite.model.loss import linear_cross_entropy
from gptlite.model.mamba2 import Mamba2, last_inputs

Rotation = tuple[torch.Tensor, torch.Tensor] | None  # RoPE's (cos, sin), (T, D) or (B, T, D); None for the others


# ---------------------------------------------------------------------------------------------
# Positions: `forward(x, pos)` adds position information to the token embeddings x (B, T, C);
# `rotation(pos)` is computed once per forward and handed to every attention layer's `rotate(q, k, rot)`.


class AdditivePositions(nn.Module):
    """A table of position vectors added to the token embeddings; attention's q and k are left alone."""

    can_extend = False  # whether positions past block_size exist (generation with extend_context)

    def rotation(self, pos: torch.Tensor) -> Rotation:
        return None

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class LearnedPositions(AdditivePositions):
    """A trained table of `block_size` position vectors (GPT-2)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.table = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.table(pos)  # pos (T,) or per-row (B, T)


class SinusoidalPositions(AdditivePositions):
    """The fixed sin/cos table of "Attention Is All You Need" (Vaswani et al., 2017), section 3.5:
    PE[p, 2i] = sin(p / 10000^(2i/C)), PE[p, 2i+1] = cos(p / 10000^(2i/C)), a buffer, added times a learned
    gain per channel, `gain` (C,). The gain starts where a learned table starts (vectors of std 0.02; the
    table's RMS is 1/sqrt(2)): added as it is, the table swamps token embeddings of std 0.02 (what was measured:
    docs/training.md, model variants)."""

    can_extend = True

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)
        self.gain = nn.Parameter(torch.full((config.n_embd,), 0.02 * math.sqrt(2)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.table[pos]  # pos (T,) or per-row (B, T)

    def extend(self, n_pos: int) -> None:
        """Cover positions 0..n_pos-1, past block_size if asked (generation with extend_context)."""
        if n_pos > self.table.size(0):
            self.table = sinusoidal_table(n_pos, self.table.size(1)).to(self.table)


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """The (n_pos, dim) sinusoidal position table, computed in float64 for accuracy."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (C/2,)
    table = torch.zeros(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table.float()


class RotaryPositions(nn.Module):
    """Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer", section 3.4): nothing is added to the
    token embeddings; every attention layer rotates coordinate pairs (i, i + D/2) of q and k by the angle
    pos * theta^(-2i/D), the "rotate_half" layout of Hugging Face's Llama. So q . k depends only on the
    offset between the two positions. Angles are computed in float32 for any position, as Llama does."""

    can_extend = True

    def __init__(self, config: GPTConfig):
        super().__init__()
        D = config.rope_dims or config.head_width  # Phi-4-mini rotates the leading rope_dims coordinates only
        powers = config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)  # (D/2,)
        inv_freq = 1.0 / powers
        if config.rope_scaling == "llama3":
            inv_freq = llama3_scaled(inv_freq, config)
        # LongRoPE (Ding et al., 2024) within the original context: each frequency divided by its short factor, and
        # cos and sin scaled by the attention factor
        self.attention_factor = 1.0
        if config.rope_scaling == "longrope":
            inv_freq = 1.0 / (torch.tensor([float(f) for f in config.rope_short_factor.split(",")]) * powers)
            self.attention_factor = config.rope_attention_factor
        if config.rope_scaling == "yarn":
            inv_freq = yarn_scaled(inv_freq, config)
            self.attention_factor = config.rope_attention_factor
        if config.rope_reverse:  # nanochat rotates by -angle: cos is the same, sin changes sign
            inv_freq = -inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x

    def rotation(self, pos: torch.Tensor) -> Rotation:
        freqs = pos[..., None].float() * self.inv_freq  # (T, D/2) or (B, T, D/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (T, D) or (B, T, D)
        if self.attention_factor != 1:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, T, D) rotated by their positions' angles."""
        cos, sin = rot
        if cos.dim() == 3:  # per-row positions (B, T, D): the same angles for every head
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    @staticmethod
    def rotate_partial(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, T, D) with their leading rope_dims coordinates rotated, the others left as they are."""
        n = rot[0].size(-1)
        q, k = (q[..., :n], q[..., n:]), (k[..., :n], k[..., n:])
        q_rot, k_rot = RotaryPositions.rotate(q[0], k[0], rot)
        return torch.cat([q_rot, q[1]], dim=-1), torch.cat([k_rot, k[1]], dim=-1)

    def extend(self, n_pos: int) -> None:
        """Every position has its angles already."""


class DualRotaryPositions(RotaryPositions):
    """RoPE with a base of its own in the sliding-window layers (Gemma 3: rope_local_theta there, rope_theta in the
    global layers): `rotation` gives both layers' kinds of angles, (global, local), and each attention layer's
    `rotate` (rotate_global or rotate_local) takes its own."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        local = RotaryPositions(dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=""))
        self.register_buffer("local_inv_freq", local.inv_freq, persistent=False)

    def rotation(self, pos: torch.Tensor) -> Rotation:
        local = pos[..., None].float() * self.local_inv_freq  # (T, D/2) or (B, T, D/2)
        local = torch.cat([local, local], dim=-1)  # (T, D) or (B, T, D)
        return super().rotation(pos), (local.cos(), local.sin())

    @staticmethod
    def rotate_global(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        return RotaryPositions.rotate(q, k, rot[0])

    @staticmethod
    def rotate_local(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        return RotaryPositions.rotate(q, k, rot[1])


class TemperedRotaryPositions(RotaryPositions):
    """RoPE, and q multiplied by a factor that grows with the position: 1 + beta * log(1 + floor(pos / L)), beta
    query_scale_beta and L rope_original_context (Llama 4's attention temperature tuning, as Ministral 3 has it), so
    that attention stays sharp over contexts many times the original one. `rotation` gives the angles and each
    position's factor, ((cos, sin), factor), and `rotate_tempered` applies both."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.beta = config.query_scale_beta
        self.length = config.rope_original_context

    def rotation(self, pos: torch.Tensor) -> Rotation:
        factor = 1 + self.beta * torch.log1p(torch.floor(pos.float() / self.length))  # (T,) or (B, T)
        return super().rotation(pos), factor[..., None]  # (T, 1) or (B, T, 1)

    @staticmethod
    def rotate_tempered(q: torch.Tensor, k: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, T, D) rotated, and q then multiplied by its position's factor (in q's dtype, as
        transformers' Ministral 3 does)."""
        angles, factor = rot
        q, k = RotaryPositions.rotate(q, k, angles)
        if factor.dim() == 3:  # per-row positions (B, T, 1): the same factor for every head
            factor = factor[:, None]  # (B, 1, T, 1)
        return q * factor.to(q.dtype), k


def positions(config: GPTConfig) -> nn.Module:
    """The model's positions module: POSITIONS' choice, RoPE with a second base for the window layers, or RoPE with
    q's position-dependent factor (query_scale_beta)."""
    if config.rope_local_theta:
        return DualRotaryPositions(config)
    if config.query_scale_beta:
        return TemperedRotaryPositions(config)
    return POSITIONS[config.pos_emb](config)


def llama3_scaled(inv_freq: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (Meta's reference code, and transformers' rope_type "llama3"): frequencies whose
    wavelength is longer than original_context / low_freq_factor are divided by factor, those shorter than
    original_context / high_freq_factor kept, and the ones between blended smoothly; (D/2,) -> (D/2,)."""
    wavelen = 2 * math.pi / inv_freq
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    slow = torch.where(wavelen > config.rope_original_context / low, inv_freq / config.rope_factor, inv_freq)
    smooth = (config.rope_original_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slow / config.rope_factor + smooth * slow
    between = (wavelen >= config.rope_original_context / high) & (wavelen <= config.rope_original_context / low)
    return torch.where(between, blended, slow)


def yarn_scaled(inv_freq: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """YaRN's RoPE scaling (Peng et al., 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
    section 3.2, as transformers' rope_type "yarn" computes it): frequencies that turn more than rope_beta_fast
    times within the original context are kept, those turning fewer than rope_beta_slow times divided by rope_factor,
    and a linear ramp over the pairs between (its ends rounded outwards, transformers' truncate); (D/2,) -> (D/2,)."""
    D = 2 * inv_freq.numel()
    base = config.rope_theta
    original = config.rope_original_context

    def pair_turning(turns: float) -> float:
        """The pair index (fractional) whose frequency turns `turns` times within the original context."""
        return D * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(config.rope_beta_fast)), 0)
    high = min(math.ceil(pair_turning(config.rope_beta_slow)), D - 1)
    if low == high:
        high += 0.001  # transformers' guard against a ramp of no width
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (D/2,): 0 kept, 1 divided
    return inv_freq / config.rope_factor * ramp + inv_freq * (1 - ramp)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) for the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


POSITIONS = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions, "rope": RotaryPositions}


# ---------------------------------------------------------------------------------------------
# Norms


class LayerNorm(nn.LayerNorm):
    """Layer normalisation (Ba et al., 2016), with a bias only if config.bias."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, eps=config.norm_eps, bias=config.bias)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * weight (+ bias if
    config.bias), normalised in float32 and scaled in the input's dtype, as Hugging Face's Llama does; without a
    weight or a bias where config.norm_weight is false (nanochat)."""

    def __init__(self, config: GPTConfig, dim: int | None = None, bias: bool | None = None):
        super().__init__()
        dim = dim or config.n_embd
        self.eps = config.norm_eps
        # Gemma scales by 1 + weight, so its weight starts at 0
        self.unit_offset = config.norm_unit_offset
        start = torch.zeros(dim) if self.unit_offset else torch.ones(dim)
        self.weight = nn.Parameter(start) if config.norm_weight else None
        with_bias = config.norm_weight and (config.bias if bias is None else bias)
        self.bias = nn.Parameter(torch.zeros(dim)) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        if self.unit_offset:  # Gemma: 1 + weight, and the product, in float32 (1 + weight in bf16 loses its digits)
            y = (y * (1.0 + self.weight.float())).to(x.dtype)
        elif self.weight is not None:
            y = self.weight * y.to(x.dtype)
        else:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


# ---------------------------------------------------------------------------------------------
# Attention


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, through PyTorch's fused SDPA kernels. With n_kv_head < n_head
    (grouped-query attention; Ainslie et al., 2023) each key/value head serves n_head / n_kv_head query heads, and
    the KV cache holds only n_kv_head heads. q, k and v come from one fused projection (rows q, then k, then v)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_width
        self.sizes = (config.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim)
        self.dropout = config.dropout
        self.scale = config.attn_scale or None  # None: SDPA's 1 / sqrt(D); Granite sets its own
        self.qkv = nn.Linear(config.n_embd, sum(self.sizes), bias=config.bias or config.qkv_bias)
        self.out_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        # Qwen3: each head's q and k through an RMSNorm; OLMo 2: all of q, and all of k
        self.qk_norm = QK_NORMS[config.qk_norm_scope](config) if config.qk_norm else None
        # RoPE rotates q and k; the other schemes, and SmolLM3's NoPE layers, do nothing here; Gemma 3's layers take
        # their kind's angles
        local = layer in config.window_layer_ids
        self.rotate = POSITIONS[config.pos_emb].rotate
        if config.rope_dims:
            self.rotate = RotaryPositions.rotate_partial
        if layer in config.nope_layer_ids:
            self.rotate = AdditivePositions.rotate
        elif config.rope_local_theta:
            self.rotate = DualRotaryPositions.rotate_local if local else DualRotaryPositions.rotate_global
        elif config.query_scale_beta:
            self.rotate = TemperedRotaryPositions.rotate_tempered
        self.window = config.sliding_window if local else 0  # Gemma 3's local layers see the last `window` positions
        # value_embeds: v <- value_mix[0] v + value_mix[1] ve, ve this layer's embedding of the tokens (GPT.value_emb)
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if config.value_embeds else None

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); ve (B, T, KV*D), the tokens' value embedding where config.value_embeds."""
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)  # split's backward writes one contiguous gradient
        return self.resid_drop(self.out_proj(self.attend(q, k, v, rot, cache, layer, ve)))

    def stacked_rows(self) -> tuple[nn.Parameter, tuple[int, ...]]:
        """The fused input projection's weight and the rows of each matrix it stacks: q, k, v."""
        return self.qkv.weight, self.sizes

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rot: Rotation,
        cache: AttentionCache | None,
        layer: int,
        ve: torch.Tensor | None,
    ) -> torch.Tensor:
        """The projections q (B, T, H*D), k and v (B, T, KV*D) -> the heads' attention outputs side by side,
        (B, T, H*D), before the output projection."""
        B, T, _ = q.shape
        if ve is not None:  # value embeddings (modded-nanogpt): a token's own vector in every head's values
            v = self.value_mix[0] * v + self.value_mix[1] * ve  # (B, T, KV*D)
        q = q.view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim) for t in (k, v))  # (B, T, KV, D) each
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, KV, T, D) x 2
        q, k = self.rotate(q, k, rot)
        grouped = self.n_kv_head != self.n_head
        if cache is None and not (self.window and T > self.window):
            # training and scoring: each position sees itself and the positions before it
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale, enable_gqa=grouped
            )
        elif cache is None:  # the same within a sliding window: the last `window` positions
            dropout = self.dropout if self.training else 0.0
            near = sliding_window_mask(torch.arange(T, device=q.device), torch.arange(T, device=q.device), self.window)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=near, dropout_p=dropout, scale=self.scale, enable_gqa=grouped
            )
        else:  # generation: earlier keys and values come from layer's cache, whose mask says which to see
            k, v = cache.update(layer, k, v)  # (B, KV, S, D)
            mask = cache.mask
            if self.window:
                # a cache without key_pos holds each row's tokens at slots = positions (the server's RowCache)
                key_pos = getattr(cache, "key_pos", None)
                key_pos = torch.arange(k.size(2), device=k.device) if key_pos is None else key_pos[..., : k.size(2)]
                near = sliding_window_mask(cache.pos, key_pos, self.window)[:, None]  # (B, 1, T, S)
                mask = near if mask is None else mask & near
            y = masked_attention(q, k, v, mask, self.scale)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H*D)


class GatedSelfAttention(CausalSelfAttention):
    """Attention with a gate on its output (Qwen3.5's full attention; Qiu et al., 2025, "Gated Attention for Large
    Language Models"): each head's output times sigmoid of a gate of its own width, projected from the block's
    input, before the output projection. The gate comes out of the fused projection beside the query: its first
    2*H*D rows hold, head by head, the head's D query rows and then its D gate rows (transformers' q_proj), then k and
    v as in CausalSelfAttention."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__(config, layer)
        kv_rows = self.n_kv_head * self.head_dim
        self.sizes = (2 * config.n_head * self.head_dim, kv_rows, kv_rows)
        self.qkv = nn.Linear(config.n_embd, sum(self.sizes), bias=config.bias or config.qkv_bias)

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        query_gate, k, v = self.qkv(x).split(self.sizes, dim=-1)
        q, gate = query_gate.view(B, T, self.n_head, 2 * self.head_dim).chunk(2, dim=-1)  # (B, T, H, D) each
        y = self.attend(q.reshape(B, T, -1), k, v, rot, cache, layer, ve)  # (B, T, H*D)
        return self.resid_drop(self.out_proj(y * torch.sigmoid(gate.reshape(B, T, -1))))


def attention(config: GPTConfig, layer: int = 0) -> nn.Module:
    """A full_attention layer: with an output gate where config.attn_output_gate (Qwen3.5), else plain."""
    return GatedSelfAttention(config, layer) if config.attn_output_gate else CausalSelfAttention(config, layer)


class QKNorm(nn.Module):
    """RMSNorm over each head's q and over each head's k (Qwen3), one weight of head_dim for each."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.q_norm = RMSNorm(config, config.head_width, bias=False)
        self.k_norm = RMSNorm(config, config.head_width, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (B, T, H, D), (B, T, KV, D)


class WholeQKNorm(nn.Module):
    """RMSNorm over all of q (every head's together) and over all of k (OLMo 2), one weight of H*D and one of KV*D."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.q_norm = RMSNorm(config, config.n_head * config.head_width, bias=False)
        self.k_norm = RMSNorm(config, config.kv_heads * config.head_width, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q.flatten(-2)).view_as(q), self.k_norm(k.flatten(-2)).view_as(k)  # (B, T, H, D), ...


QK_NORMS = {"head": QKNorm, "all": WholeQKNorm}


def sliding_window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a query may attend to a key in a sliding window: the key is at most `window` - 1 positions
    before the query, and not after it (transformers' sliding_window). query_pos (T,) or (B, T), key_pos (S,) or
    (B, S) -> (T, S) or (B, T, S)."""
    behind = query_pos[..., :, None] - key_pos[..., None, :]  # (T, S) or (B, T, S)
    return (behind >= 0) & (behind < window)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale where mask, else -inf) v for q (B, H, T, D), k and v (B, KV, S, D) (each key/value
    head serves H / KV query heads), mask (B, 1, T, S) or None, scale 1 / sqrt(D) unless given. SDPA's kernel runs it,
    except in a compiled step on
    the CPU, where the math written out lets inductor fuse it with its neighbours, which makes decode steps faster
    than SDPA's kernel inside the graph (figures: docs/generation.md)."""
    grouped = q.size(1) != k.size(1)  # grouped-query attention: k and v have fewer heads
    if not (torch.compiler.is_compiling() and q.device.type == "cpu"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)
    if grouped:
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))  # (B, H, S, D) each
    scores = (q @ k.transpose(-2, -1)).float() * (scale or q.size(-1) ** -0.5)  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


# ---------------------------------------------------------------------------------------------
# Feed-forwards


class SwiGLU(nn.Module):
    """out_proj(silu(W1 x) * W3 x) (Shazeer, 2020, "GLU Variants Improve Transformer").
    W1 and W3 are fused into one matrix `fc`: its first F rows are W1, the last F rows W3."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.ffn_hidden, bias=config.bias)
        self.out_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out_proj(swiglu_gate(self.fc(x))))  # (B, T, C)


def swiglu_gate(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * value for h = [gate | value] (B, T, 2F) -> (B, T, F). Through SwiGLUGate where an eager
    backward will follow; otherwise as plain math: without gradients (generation, evaluation) there is no
    backward to help, and in a compiled graph inductor fuses the math into one kernel (dynamo cannot trace
    SwiGLUGate's writes into halves of a tensor)."""
    if h.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return SwiGLUGate.apply(h)
    gate, value = h.chunk(2, dim=-1)  # (B, T, F) each
    return F.silu(gate) * value


class GeGLU(SwiGLU):
    """out_proj(gelu(W1 x) * W3 x) with GELU's tanh approximation (Shazeer, 2020; Gemma's feed-forward), fused as
    SwiGLU's: `fc`'s first F rows are W1, the last F rows W3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc(x).chunk(2, dim=-1)  # (B, T, F) each
        return self.drop(self.out_proj(F.gelu(gate, approximate="tanh") * value))  # (B, T, C)


class SwiGLUGate(torch.autograd.Function):
    """silu(gate) * value, the same math as chunking h, but the backward writes both halves' gradients into
    one (B, T, 2F) tensor, where chunk's backward would concatenate two: a cat per block, a visible part of a
    small model's eager step on a CPU (figures: docs/training.md)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        gate, value = h.chunk(2, dim=-1)  # (B, T, F) each
        act = F.silu(gate)
        ctx.save_for_backward(gate, value, act)
        return act * value  # (B, T, F)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate, value, act = ctx.saved_tensors
        grad_h = torch.empty((*grad.shape[:-1], 2 * grad.size(-1)), dtype=grad.dtype, device=grad.device)
        grad_gate, grad_value = grad_h.chunk(2, dim=-1)  # views into grad_h, (B, T, F) each
        torch.mul(grad, act, out=grad_value)
        torch.mul(grad, value, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)  # in place
        return grad_h  # (B, T, 2F)


class MLP(nn.Module):
    """out_proj(activation(fc x)), ffn_hidden wide: the feed-forward of two matrices, whose subclasses say the
    activation."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.out_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out_proj(self.activation(self.fc(x))))  # (B, T, C)

    @staticmethod
    def activation(h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GeluMLP(MLP):
    """GPT-2's MLP: out_proj(gelu(fc x)), with GELU's tanh approximation (Hendrycks & Gimpel, 2016) as
    GPT-2 computes it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    @staticmethod
    def activation(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h, approximate="tanh")


class ReluSquaredMLP(MLP):
    """out_proj(relu(fc x)^2): the squared ReLU of Primer (So et al., 2021, "Primer: Searching for Efficient
    Transformers for Language Modeling", section 4), modded-nanogpt's and nanochat's MLP."""

    @staticmethod
    def activation(h: torch.Tensor) -> torch.Tensor:
        return F.relu(h).square()


FFNS = {"swiglu": SwiGLU, "gelu": GeluMLP, "relu2": ReluSquaredMLP, "geglu": GeGLU}


class StackedLinear(nn.Module):
    """The weights of n linear layers without biases, stacked: `weight` (n, out, in), row e the e-th layer's, as
    transformers' experts hold theirs (gate_up_proj, down_proj) and llama.cpp's (ffn_*_exps)."""

    def __init__(self, n: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class MixtureOfExperts(nn.Module):
    """A mixture of SwiGLU experts (Shazeer et al., 2017, "Outrageously Large Neural Networks"; Fedus et al., 2021,
    "Switch Transformers"): a router (a linear layer to E logits, then softmax) picks each token's top k experts, and
    the token's output is the sum of theirs, each times its softmax weight, those k weights divided by their sum
    where config.experts_renorm (Qwen3-MoE's norm_topk_prob; Granite's softmax over the top k logits is the same).
    Expert e is SwiGLU with fc.weight[e] (its first F rows the gate) and out_proj.weight[e].

    The tokens are grouped by expert (sorted by the expert they chose) and each expert runs once, on its own tokens:
    a token's work is its k experts', never all E. In training the router's logits of the last forward stay in
    `router_logits`, for the load-balancing loss (Transformer.router_aux_loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.experts_per_token
        self.renorm = config.experts_renorm
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.fc = StackedLinear(config.n_experts, config.n_embd, 2 * config.ffn_hidden)  # (E, 2F, C)
        self.out_proj = StackedLinear(config.n_experts, config.ffn_hidden, config.n_embd)  # (E, C, F)
        self.drop = nn.Dropout(config.dropout)
        self.router_logits: torch.Tensor | None = None  # (N, E), N = B*T: the last training forward's

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (each token's top-k weights (N, K) in the logits' dtype, their experts (N, K)):
        the softmax in float32, as transformers takes it, then the top k."""
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, K) each
        if self.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)  # (N, C)
        logits = self.router(x)  # (N, E)
        if self.training and torch.is_grad_enabled():
            self.router_logits = logits
        weights, experts = self.route(logits)  # (N, K) each
        # every (token, choice) pair, sorted by its expert: each expert's tokens lie together
        order = experts.flatten().argsort(stable=True)  # (N*K,)
        tokens = order // self.top_k  # (N*K,) the token of each pair, in that order
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts).tolist()  # pairs per expert
        outputs = []
        for e, group in enumerate(x[tokens].split(counts)):  # (n_e, C) each
            if len(group):
                h = swiglu_gate(F.linear(group, self.fc.weight[e]))  # (n_e, F)
                outputs.append(F.linear(h, self.out_proj.weight[e]))  # (n_e, C)
        y = torch.cat(outputs) * weights.flatten()[order, None]  # (N*K, C)
        # (N, C): each token's k experts summed, in x's dtype (under autocast the experts' outputs are in its own)
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        return self.drop(out.view(B, T, C))


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The auxiliary load-balancing loss of Switch Transformers (Fedus et al., 2021, equations 4-6), as transformers'
    load_balancing_loss_func computes it, over every layer's router logits (N, E) together: E * sum_e f_e * P_e, with
    f_e the (token, choice) pairs that went to expert e and P_e expert e's summed softmax probability, each divided by
    the tokens of all layers. Smallest (top_k) where the experts share the tokens evenly; the gradient flows through
    P_e only (the choices are counts)."""
    n_experts = router_logits[0].size(-1)
    probs = torch.cat([torch.softmax(logits.float(), dim=-1) for logits in router_logits])  # (L*N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, K)
    share = torch.bincount(chosen.flatten(), minlength=n_experts).float() / probs.size(0)  # (E,) f_e
    return n_experts * (share * probs.mean(dim=0)).sum()


def feed_forward(config: GPTConfig) -> nn.Module:
    """A block's feed-forward: FFNS' choice, or a mixture of experts where config.n_experts is set."""
    return MixtureOfExperts(config) if config.n_experts else FFNS[config.ffn](config)


# ---------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + ffn(norm(x)); each branch's output times
    residual_scale (Granite's residual_multiplier; 1 elsewhere) as it is added."""

    def __init__(self, config: GPTConfig, layer: int = 0, mixer=None):
        super().__init__()
        self.residual_scale = config.residual_scale
        self.attn_norm = NORMS[config.norm](config)
        # the token mixer: attention (gated on its output where attn_output_gate is set), unless a subclass says
        self.attn = (mixer or attention)(config, layer)
        self.ffn_norm = NORMS[config.norm](config)
        self.ffn = feed_forward(config)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        """Nothing besides its keys and values, which the caches keep as the attention cache (`update`)."""
        return {}

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = torch.add(x, self.attn(self.attn_norm(x), rot, cache, layer, ve), alpha=self.residual_scale)
        return torch.add(x, self.ffn(self.ffn_norm(x)), alpha=self.residual_scale)


class PostNormBlock(Block):
    """OLMo 2's block: x + norm(attn(x)), then x + norm(ffn(x)), each norm on its branch's output, inside the
    residual (OLMo 2, "2 OLMo 2 Furious", 2024: the norms reordered for a stabler training)."""

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = torch.add(x, self.attn_norm(self.attn(x, rot, cache, layer, ve)), alpha=self.residual_scale)
        return torch.add(x, self.ffn_norm(self.ffn(x)), alpha=self.residual_scale)


class SandwichBlock(Block):
    """Gemma's block: x + norm(attn(norm(x))), then x + norm(ffn(norm(x))): norms both before and after each
    branch."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__(config, layer)
        self.attn_post_norm = NORMS[config.norm](config)
        self.ffn_post_norm = NORMS[config.norm](config)

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.attn_post_norm(self.attn(self.attn_norm(x), rot, cache, layer, ve))
        x = torch.add(x, h, alpha=self.residual_scale)
        return torch.add(x, self.ffn_post_norm(self.ffn(self.ffn_norm(x))), alpha=self.residual_scale)


BLOCKS = {"pre": Block, "post": PostNormBlock, "both": SandwichBlock}


# ---------------------------------------------------------------------------------------------
# Layers with a decode state of their own: each class says what it keeps per row across calls (`state_spec`), which
# the caches allocate and hand back through AttentionCache's read_state / write_state. An attention block keeps only
# its keys and values, which the caches hold as they always have (`update`).


class ShortConv(nn.Module):
    """LFM2's gated short convolution (Liquid AI, 2025; transformers' Lfm2ShortConv): in_proj gives three gates b, c
    and x (B, T, C) each; the product b * x runs through a depthwise causal convolution over the last conv_kernel
    tokens, its output gated by c, then out_proj. Decoding keeps each row's last conv_kernel - 1 inputs of the
    convolution (b * x): the "conv" state."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.width = config.conv_kernel - 1  # the inputs before a token that its output sees
        self.in_proj = nn.Linear(C, 3 * C, bias=config.conv_bias)
        self.conv = nn.Conv1d(C, C, config.conv_kernel, groups=C, bias=config.conv_bias)
        self.out_proj = nn.Linear(C, C, bias=config.conv_bias)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        return {"conv": StateSpec((config.n_embd, config.conv_kernel - 1))}

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None, layer: int = 0) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); with a cache, the convolution continues each row's earlier inputs."""
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # (B, T, C) each
        h = (b * h).transpose(1, 2)  # (B, C, T): the convolution's input
        if cache is None:
            past = h.new_zeros(h.size(0), h.size(1), self.width)  # (B, C, K-1): nothing before the first token
        else:
            if cache.real is not None:  # padding enters neither the outputs nor the state
                h = h * cache.real[:, None, :].to(h.dtype)
            past = cache.read_state(layer)["conv"]  # (B, C, K-1)
        inputs = torch.cat([past, h], dim=-1)  # (B, C, K-1+T)
        if cache is not None:
            cache.write_state(layer, {"conv": last_inputs(inputs, cache.real, self.width)})
        y = c * self.conv(inputs).transpose(1, 2)  # (B, T, C)
        return self.out_proj(y)


class ConvBlock(nn.Module):
    """LFM2's convolution block: x + conv(norm(x)), then x + ffn(norm(x)), each branch's output times residual_scale.
    Its attention layers are Blocks; which a layer is comes from config.layer_types (LAYERS)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.residual_scale = config.residual_scale
        self.conv_norm = NORMS[config.norm](config)
        self.conv = ShortConv(config)
        self.ffn_norm = NORMS[config.norm](config)
        self.ffn = FFNS[config.ffn](config)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        return ShortConv.state_spec(config)

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = torch.add(x, self.conv(self.conv_norm(x), cache, layer), alpha=self.residual_scale)
        return torch.add(x, self.ffn(self.ffn_norm(x)), alpha=self.residual_scale)


# Gated DeltaNet: Qwen3.5's linear attention, on the gated delta rule of gptlite.model.gated_deltanet


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, scaled by its weight (not 1 + weight: it starts at ones), times silu of
    the gate z: Gated DeltaNet's output norm, normalised in float32 as transformers' Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z (B, T, Hv, dv) -> (B, T, Hv, dv)."""
        y = self.weight * F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer: one input projection `in_proj` gives q, k, v (through a depthwise causal
    convolution of `linear_conv_kernel` taps and silu), the output gate z, beta's logits b and the decay's a; the
    gated delta rule runs on L2-normalised q and k with beta = sigmoid(b) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias) (Mamba-2's discretisation); each value head's output goes through the
    gated RMSNorm with z, then `out_proj`. It takes the attention layer's arguments (rotation and value embeddings
    are unused: it has no positions), so that a Block holds either (DeltaNetBlock). Decoding keeps each row's last
    linear_conv_kernel - 1 inputs of the convolution and the rule's state (B, Hv, dk, dv) in the cache.

    Padding (`cache.real`) is zeroed before the projections, as transformers' apply_mask_to_padding_states does, and
    neither decays nor writes the state (g = 0, beta = 0 there): a padded row keeps the state of its last real
    token, whether the padding is on its left (KVCache) or its right (the server's prefills)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.k_heads = config.linear_k_heads
        self.v_heads = config.linear_v_heads
        self.k_dim = config.linear_k_dim
        self.v_dim = config.linear_v_dim
        key_width = self.k_heads * self.k_dim
        value_width = self.v_heads * self.v_dim
        self.conv_sizes = (key_width, key_width, value_width)  # the convolved channels: q, k, v
        # rows of in_proj: q, k, v (convolved), z, b, a
        self.sizes = (sum(self.conv_sizes), value_width, self.v_heads, self.v_heads)
        self.in_proj = nn.Linear(config.n_embd, sum(self.sizes), bias=False)
        channels = sum(self.conv_sizes)
        self.conv = nn.Conv1d(channels, channels, config.linear_conv_kernel, groups=channels, bias=False)
        self.width = config.linear_conv_kernel - 1  # the inputs before a token that its convolution sees
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        # A = exp(A_log) in [1, 16] at the start, as Mamba-2 starts it
        self.A_log = nn.Parameter(torch.empty(self.v_heads).uniform_(1, 16).log())
        self.norm = GatedRMSNorm(self.v_dim, config.norm_eps)
        self.out_proj = nn.Linear(value_width, config.n_embd, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)

    def stacked_rows(self) -> tuple[nn.Parameter, tuple[int, ...]]:
        """The fused input projection's weight and the rows of each matrix it stacks: q, k, v, z, b, a."""
        return self.in_proj.weight, (*self.conv_sizes, *self.sizes[1:])

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        """The convolution's last linear_conv_kernel - 1 inputs (q, k, v before it), and the delta rule's state per
        value head, kept in float32 as the rule computes it."""
        channels = 2 * config.linear_k_heads * config.linear_k_dim + config.linear_v_heads * config.linear_v_dim
        return {
            "conv": StateSpec((channels, config.linear_conv_kernel - 1)),
            "recurrent": StateSpec((config.linear_v_heads, config.linear_k_dim, config.linear_v_dim), torch.float32),
        }

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C): a whole sequence through the chunked rule from a zero state; with a cache, from
        each row's state, one decode token through the recurrence, and the state after the call kept."""
        B, T, _ = x.shape
        real = None if cache is None else cache.real  # (B, T) False for padding, or None
        if real is not None:  # padding enters neither the convolution nor the state (transformers zeroes it too)
            x = x * real[..., None].to(x.dtype)
        mixed, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        h = mixed.transpose(1, 2)  # (B, K, T): the convolution's input, K = 2 Hk dk + Hv dv channels
        state = None if cache is None else cache.read_state(layer)
        past = h.new_zeros(B, h.size(1), self.width) if state is None else state["conv"]  # (B, K, W-1)
        inputs = torch.cat([past, h], dim=-1)  # (B, K, W-1+T)
        mixed = F.silu(self.conv(inputs)).transpose(1, 2)  # (B, T, K)
        q, k, v = mixed.split(self.conv_sizes, dim=-1)
        q = q.reshape(B, T, self.k_heads, self.k_dim)  # (B, T, Hk, dk)
        k = k.reshape(B, T, self.k_heads, self.k_dim)  # (B, T, Hk, dk)
        v = v.reshape(B, T, self.v_heads, self.v_dim)  # (B, T, Hv, dv)
        beta = b.sigmoid()  # (B, T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, Hv), float32: A may be large
        if real is not None:  # a padded token neither decays nor writes: the state stays at its row's last real token
            beta = beta * real[..., None].to(beta.dtype)
            g = g * real[..., None]
        if state is None:
            y, _ = chunked_gated_delta_rule(q, k, v, g, beta)  # (B, T, Hv, dv)
        else:
            rule = recurrent_gated_delta_rule if T == 1 else chunked_gated_delta_rule  # decoding's step, or a prompt
            y, recurrent = rule(q, k, v, g, beta, state=state["recurrent"])
            cache.write_state(layer, {"conv": last_inputs(inputs, real, self.width), "recurrent": recurrent})
        y = self.norm(y, z.reshape(B, T, self.v_heads, self.v_dim))
        return self.resid_drop(self.out_proj(y.reshape(B, T, -1)))  # (B, T, C)


class DeltaNetBlock(Block):
    """Qwen3.5's linear-attention block: a pre-norm Block whose token mixer is Gated DeltaNet, which keeps each row's
    convolution inputs and recurrent state across decode calls (`state_spec`)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__(config, layer, mixer=GatedDeltaNet)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        return GatedDeltaNet.state_spec(config)


class MambaBlock(nn.Module):
    """A Mamba-2 layer's block (Granite 4-H's): x + mamba(norm(x)), then x + ffn(norm(x)), each branch's output times
    residual_scale; the mixer is gptlite.model.mamba2's, its state the convolution's last inputs and the scan's."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.residual_scale = config.residual_scale
        self.mamba_norm = NORMS[config.norm](config)
        self.mamba = Mamba2(config)
        self.ffn_norm = NORMS[config.norm](config)
        self.ffn = FFNS[config.ffn](config)

    @staticmethod
    def state_spec(config: GPTConfig) -> dict[str, StateSpec]:
        return Mamba2.state_spec(config)

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = torch.add(x, self.mamba(self.mamba_norm(x), cache, layer), alpha=self.residual_scale)
        return torch.add(x, self.ffn(self.ffn_norm(x)), alpha=self.residual_scale)


def attention_block(config: GPTConfig) -> type[nn.Module]:
    """A full_attention layer's block: BLOCKS' choice for the model's norm_position."""
    return BLOCKS[config.norm_position]


def conv_block(config: GPTConfig) -> type[nn.Module]:
    """A conv layer's block (LFM2's)."""
    return ConvBlock


def mamba_block(config: GPTConfig) -> type[nn.Module]:
    """A mamba layer's block (Granite 4-H's)."""
    return MambaBlock


def deltanet_block(config: GPTConfig) -> type[nn.Module]:
    """A linear_attention layer's block (Qwen3.5's: pre-norm)."""
    return DeltaNetBlock


# each layer kind of GPTConfig.layer_types -> the class of its block, given the config
LAYERS = {
    "full_attention": attention_block,
    "conv": conv_block,
    "linear_attention": deltanet_block,
    "mamba": mamba_block,
}


def layer_block(config: GPTConfig, layer: int) -> type[nn.Module]:
    """The class of layer `layer`'s block, from its kind (config.layer_kinds)."""
    return LAYERS[config.layer_kinds[layer]](config)


def layer_states(config: GPTConfig) -> list[dict[str, StateSpec]]:
    """What each layer keeps per row across decode calls besides keys and values (its block's `state_spec`; empty for
    attention): what a cache allocates (gptlite.inference.kvcache's state_buffers)."""
    return [layer_block(config, i).state_spec(config) for i in range(config.n_layer)]


def previous_tokens(idx: torch.Tensor) -> torch.Tensor:
    """idx (B, T) -> each token's previous one in its row (B, T), -1 for the first: what the bigram embedding
    pairs each token with in a forward without a cache."""
    return torch.cat([torch.full_like(idx[:, :1], -1), idx[:, :-1]], dim=1)


class Transformer(nn.Module):
    """A decoder-only Transformer language model whose output head is tied to the token embedding (unless
    config.tie_embeddings is false). `checkpoint_blocks` (train.py's --activation_checkpointing) trades a second
    forward pass of each block in backward for its activations: training memory no longer grows with depth.
    `source_architecture` is the Hugging Face architecture a pretrained model was read as (GPT.from_pretrained), which
    says how it exports back (gptlite.hf); None for a model built here."""

    checkpoint_blocks = False
    source_architecture: str | None = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        # bigram_vocab: each (previous, current) token pair's own vector, added to the token's (see bigram_ids)
        self.bigram_emb = nn.Embedding(config.bigram_vocab, config.n_embd) if config.bigram_vocab else None
        self.pos_emb = positions(config)
        self.drop = nn.Dropout(config.dropout)
        self.emb_norm = NORMS[config.norm](config) if config.embed_norm else None  # nanochat's
        self.blocks = nn.ModuleList(layer_block(config, i)(config, i) for i in range(config.n_layer))
        # value_embeds: a token embedding per layer, as wide as its values, that attention mixes into them
        value_width = config.kv_heads * config.head_width
        self.value_emb = (
            nn.ModuleList(nn.Embedding(config.vocab_size, value_width) for _ in range(config.n_layer))
            if config.value_embeds
            else None
        )
        # unet_skips: the first n_layer // 2 blocks' outputs, each added to its mirror block's input with a weight
        self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2)) if config.unet_skips else None
        self.norm = NORMS[config.norm](config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf, 2017): one tensor
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer), two per block; zero_init_out (modded-nanogpt,
        # nanochat): zeros, so that every block starts as the identity and the residual stream as the embedding
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") and config.zero_init_out:
                nn.init.zeros_(p)
            elif name.endswith("out_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
        return_logits: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, V) and the cross-entropy against targets (B, T), where a target of
        -1 is ignored (a conversation's non-assistant tokens, padding): its mean over the other targets, with
        reduction="sum" its sum, or with reduction="none" each token's (B, T), 0 where the target is -1; the loss is
        None without targets.

        return_logits=False (training) gives (None, loss), the output head and the loss computed a chunk of tokens
        at a time (gptlite.model.loss), so that the (B, T, V) logits, their softmax and its gradient are never all in
        memory at once."""
        if targets is not None:
            self._check_targets(idx, targets)
        if targets is not None and not return_logits and type(self.lm_head) is nn.Linear:  # not LoRA'd, not int8
            h = self.hidden(idx).flatten(0, 1)  # (B*T, C)
            if self.config.logits_scaling != 1:  # logits / s = lm_head(h / s): the head has no bias
                h = h / self.config.logits_scaling
            softcap = self.config.logit_softcap
            loss = linear_cross_entropy(h, self.lm_head.weight, targets.reshape(-1), reduction, softcap=softcap)
            return None, loss.view(targets.shape) if reduction == "none" else loss
        logits = self.head(self.hidden(idx))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1), ignore_index=-1, reduction=reduction)
        return (logits if return_logits else None), loss.view(targets.shape) if reduction == "none" else loss

    def hidden(self, idx: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """The final-norm hidden states (B, T, C) of idx (B, T). Without a cache the tokens are at positions
        0..T-1; with one (generation: any gptlite.inference.kvcache.AttentionCache) their positions and mask come from
        the cache, as its `prepare` set them up."""
        if cache is None:  # generation checks its prompts once, not at every step
            self._check_input(idx)
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device) if cache is None else cache.pos  # (T,) or (B, T)
        x = self.tok_emb(idx)  # (B, T, C)
        if self.config.embed_scale != 1:  # Granite's embedding_multiplier
            x = x * self.config.embed_scale
        if self.bigram_emb is not None:  # a cache knows the token before its call's first ones
            prev = previous_tokens(idx) if cache is None else cache.previous_tokens(idx)  # (B, T)
            x = x + self.bigram_emb(self.bigram_ids(idx, prev))
        x = self.drop(self.pos_emb(x, pos))  # (B, T, C)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        rot = self.pos_emb.rotation(pos)  # once for every layer
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        n_skips = 0 if self.skip_weights is None else self.skip_weights.numel()
        skips = []  # unet_skips: the outputs of the first n_skips blocks, the latest last
        for i, block in enumerate(self.blocks):
            ve = None if self.value_emb is None else self.value_emb[i](idx)  # (B, T, KV*D)
            if i >= len(self.blocks) - n_skips:  # block i takes block n_layer-1-i's output, weighted
                x = x + self.skip_weights[len(self.blocks) - 1 - i] * skips.pop()
            if recompute:  # keep each block's input only, redo it in backward
                x = checkpoint(block, x, rot, None, i, ve, use_reentrant=False)
            else:
                x = block(x, rot, cache, i, ve)
            if i < n_skips:
                skips.append(x)
        return self.norm(x)

    def router_aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss (load_balancing_loss) of the router logits the experts kept in the last training
        forward, which it lets go; None where there are none (a model without experts, or no training forward)."""
        experts = [block.ffn for block in self.blocks if isinstance(block.ffn, MixtureOfExperts)]
        logits = [ffn.router_logits for ffn in experts if ffn.router_logits is not None]
        for ffn in experts:
            ffn.router_logits = None
        return load_balancing_loss(logits, self.config.experts_per_token) if logits else None

    def bigram_ids(self, idx: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The bigram embedding's rows of tokens idx (B, T) after tokens prev (B, T), -1 where a token is its
        sequence's first: modded-nanogpt's bigram hash embedding, with the plainest hash, the pair's index
        prev * vocab_size + idx modulo bigram_vocab - 1, and the last row for a first token. With bigram_vocab - 1 at
        least vocab_size**2 the hash is the identity: every pair has its own row."""
        rows = self.config.bigram_vocab
        pair = (prev * self.config.vocab_size + idx) % (rows - 1)
        return torch.where(prev < 0, rows - 1, pair)  # (B, T)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., C) -> logits (..., V): the output head, divided by logits_scaling where it is set
        (Granite), then logit_softcap's cap * tanh(logits / cap) where it is set (Gemma 2; modded-nanogpt), which keeps
        every logit within (-cap, cap)."""
        logits = self.lm_head(h)
        if self.config.logits_scaling != 1:
            logits = logits / self.config.logits_scaling
        cap = self.config.logit_softcap
        return logits if not cap else cap * torch.tanh(logits / cap)

    def step(self, idx: torch.Tensor, cache: AttentionCache, last: torch.Tensor | None = None) -> torch.Tensor:
        """Generation: feed idx (B, T) through the cache (see gptlite.inference.kvcache); logits (B, V) of the last
        token, or of token last[b] of row b (B,) where the rows are prompts padded on the right to one length."""
        x = self.hidden(idx, cache)  # (B, T, C)
        x = x[:, -1] if last is None else x[torch.arange(x.size(0), device=x.device), last]  # (B, C)
        return self.head(x)  # (B, V)

    @torch.no_grad()
    def grow_vocab(self, vocab_size: int) -> None:
        """Give the token embedding (and an untied head) vocab_size rows, the new ones the mean of the existing rows,
        for tokens a tokenizer added (a chat template's markers). The mean is what transformers'
        resize_token_embeddings starts added tokens from: an average token, where random rows would be noise that
        the first steps must undo, and large ones would dominate the logits."""
        old = self.tok_emb.weight  # (V, C)
        assert vocab_size > old.shape[0], (vocab_size, old.shape)
        grown = torch.cat([old, old.mean(0, keepdim=True).expand(vocab_size - old.shape[0], -1)])  # (V', C)
        self.tok_emb = nn.Embedding.from_pretrained(grown, freeze=False)
        if self.config.tie_embeddings:
            self.lm_head = nn.Linear(self.config.n_embd, vocab_size, bias=False, device=old.device, dtype=old.dtype)
            self.lm_head.weight = self.tok_emb.weight
        else:
            head = self.lm_head.weight  # (V, C)
            self.lm_head = nn.Linear(self.config.n_embd, vocab_size, bias=False, device=old.device, dtype=old.dtype)
            self.lm_head.weight.copy_(torch.cat([head, head.mean(0, keepdim=True).expand(len(grown) - len(head), -1)]))
        self.config = dataclasses.replace(self.config, vocab_size=vocab_size)

    def check_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Check that a state dict holds exactly this model's tensors with their shapes, floating point where the
        model's are (before load_state_dict, whose errors are tracebacks and which casts integers silently); a
        mismatch is one ValueError naming `source` and the first differing tensor."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{source}: the weights do not fit the model its config describes (missing: "
                f"{', '.join(missing[:3]) or 'none'}; unexpected: {', '.join(unexpected[:3]) or 'none'}): "
                "it comes from "
                "another program or gptlite version (a sinusoidal-position model saved before gptlite learned the "
                "table's gain, pos_emb.gain, must be retrained)"
            )
        wrong = next((k for k, v in state.items() if v.shape != expected[k].shape), None)
        if wrong is not None:
            raise ValueError(
                f"{source}: tensor {wrong} has shape {tuple(state[wrong].shape)} but the config describes "
                f"{tuple(expected[wrong].shape)}; the config and the weights do not belong together: put back the "
                "config saved with these weights, or download or save the model again"
            )
        cast = next(
            (k for k, v in state.items() if expected[k].is_floating_point() and not v.is_floating_point()), None
        )
        if cast is not None:  # load_state_dict would cast it into the float tensor: nonsense weights, no error
            raise ValueError(
                f"{source}: tensor {cast} is {str(state[cast].dtype).removeprefix('torch.')}, and the model holds "
                "floating-point weights there; the file is damaged or not this model's weights"
            )

    def _check_input(self, idx: torch.Tensor) -> None:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(
                f"idx must be a tensor of token ids of shape (B, T), got {type(idx).__name__}; e.g. torch.tensor([ids])"
            )
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}; use idx.long()")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}; a single sequence is idx[None]")
        if idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence of length {idx.size(1)} is longer than block_size={self.config.block_size}; "
                "crop the input or train a model with a larger block_size"
            )
        if torch.compiler.is_compiling() or idx.numel() == 0:
            return  # value checks would break the graph; the data loader checks ids before training
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size}); "
                "check the tokenizer and vocab_size"
            )

    @staticmethod
    def _check_targets(idx: torch.Tensor, targets: torch.Tensor) -> None:
        if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise TypeError(
                f"targets must be a tensor of integer token ids (-1 = ignore), got "
                f"{getattr(targets, 'dtype', type(targets).__name__)}"
            )
        if isinstance(idx, torch.Tensor) and targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx, {tuple(idx.shape)}, got {tuple(targets.shape)}")

    def num_params(self, exclude_positions: bool = False) -> int:
        """Parameter count; the tied head and embedding are one tensor and are counted once."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_positions and isinstance(self.pos_emb, LearnedPositions):
            n -= self.pos_emb.table.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6N for the matmuls plus 12*L*H*D*T for attention
        scores and values (PaLM, Chowdhery et al. 2022, appendix B; H*D = C by default). T defaults to block_size.
        RoPE's rotations and the norms are elementwise work, left out as the formula does."""
        T = seq_len or self.config.block_size
        cfg = self.config
        n = self.num_params(exclude_positions=True)
        if not cfg.tie_embeddings:  # an untied embedding is a lookup: no matmul
            n -= self.tok_emb.weight.numel()
        if self.value_emb is not None:  # value embeddings too
            n -= sum(table.weight.numel() for table in self.value_emb)
        if self.bigram_emb is not None:  # and the bigram embedding
            n -= self.bigram_emb.weight.numel()
        if cfg.n_experts:  # a token goes through experts_per_token of the n_experts experts only
            per_expert = 3 * cfg.n_embd * cfg.ffn_hidden
            n -= cfg.n_layer * (cfg.n_experts - cfg.experts_per_token) * per_expert
        return 6 * n + 12 * len(cfg.attention_layer_ids) * cfg.n_head * cfg.head_width * T
