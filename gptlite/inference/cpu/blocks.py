"""The CPU decode view's one-call steps: a decode step's attention (`NativeAttention`) and a block's whole decode step
(`NativeBlock`) in one call of gptlite's compiled kernels (gptlite.inference.cpu.native), each a wrapper around the
view's copy of the model's own module, whose forward it falls back to where the kernels do not apply.

The model knows nothing of the kernels: which of its modules a step computes is decided here, by their types
(`one_call_variant`), and the kernels' names for its blocks, norms and feed-forwards are tables here (BLOCK_KINDS:
norms before each branch, on its output as OLMo 2's, or both as Gemma's; NORM_KERNELS, Gemma's unit offset among
them; ACTIVATION_KERNELS; HEAD_NORM_WIDTHS), each keyed by the exact class, so that a subclass, which may compute
something else, is not taken for its parent; each is read once, where the view makes a block's step
(`block_options`), never per call. Rotary positions reach the kernels as the angles the model's own positions module
computed for the step (`rot`, each row's at its position: llama3 and LongRoPE scaling, a base per layer kind and
nanochat's reversed direction are in the numbers), the rotation each layer applies picked by its `rotate` (ANGLES);
q/k norms as their weights (one head's, or all heads' for OLMo 2's); Gemma 3's sliding window as its width.

Through PyTorch, a decode step's attention took a dozen operator calls a layer, as long as streaming the layer's qkv
weights on the Intel Xeon, and a block's step called its modules and half a dozen operators between its matrices (two
norms, the attention's call, GELU, two residual additions), each call starting with the CPU's caches full of the matrix
before's weights (figures: docs/generation.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

from gptlite.inference.cpu import native
from gptlite.inference.cpu.direct import global_hook_count, hook_count, made
from gptlite.inference.cpu.linears import NativeLinear
from gptlite.inference.quantize import INT8_DOT, Int4Linear, Int8Linear
from gptlite.model.network import (
    AdditivePositions,
    Block,
    CausalSelfAttention,
    DualRotaryPositions,
    GeGLU,
    GeluMLP,
    LayerNorm,
    PostNormBlock,
    QKNorm,
    ReluSquaredMLP,
    RMSNorm,
    RotaryPositions,
    Rotation,
    SandwichBlock,
    SwiGLU,
    WholeQKNorm,
)

if TYPE_CHECKING:
    from gptlite.model.attention_cache import AttentionCache


class OneCallCache(Protocol):
    """A cache whose decode step a one-call step writes itself: gptlite.inference.kvcache.KVCache after `prepare(1)`,
    the server's gptlite.serve.rows.RowCache after a `prepare` of one token per row (named by what it offers, since
    those modules import this one's view)."""

    decode_slot: int | None

    def decode_buffers(self, layer: int) -> tuple:
        """native.CacheSlot's fields, in order (the last, each row's own slot, where the rows' lengths differ)."""
        ...


# the block step's name for each norm it computes, by its class and whether it scales by 1 + weight (Gemma's unit
# offset: `norm_kind`)
NORM_KERNELS: dict[tuple[type[nn.Module], bool], str] = {
    (LayerNorm, False): "layernorm",
    (RMSNorm, False): "rmsnorm",
    (RMSNorm, True): "rmsnorm_unit_offset",
}
# the block step's name for where each kind of block puts its norms (BlockOptions.position), and the block's norms in
# the step's order (BlockWeights': the attention's, the feed-forward's, then the post-norms of a block with both)
BLOCK_KINDS: dict[type[nn.Module], str] = {Block: "pre", PostNormBlock: "post", SandwichBlock: "both"}
BLOCK_NORMS = {
    "pre": lambda block: (block.attn_norm, block.ffn_norm),
    "post": lambda block: (block.attn_norm, block.ffn_norm),
    "both": lambda block: (block.attn_norm, block.ffn_norm, block.attn_post_norm, block.ffn_post_norm),
}
# for each kind of q/k norms the kernels compute, the widths of its q and k weights: one head's (Qwen3's) or all
# heads' (OLMo 2's), which is how the kernels tell them apart
HEAD_NORM_WIDTHS = {
    QKNorm: lambda attn: (attn.head_dim, attn.head_dim),
    WholeQKNorm: lambda attn: (attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim),
}
# the block step's name for each feed-forward's activation
ACTIVATION_KERNELS: dict[type[nn.Module], str] = {
    GeluMLP: "gelu_tanh",
    ReluSquaredMLP: "relu_squared",
    SwiGLU: "silu_gate",
    GeGLU: "gelu_gate",
}


# for each way an attention layer rotates q and k (its `rotate`), the (cos, sin) of the model's rotation `rot` that it
# takes, None for none: the whole rotation or its leading rope_dims coordinates (cos's width says which), or Gemma 3's
# global or local layers' own
ANGLES = {
    AdditivePositions.rotate: lambda rot: None,
    RotaryPositions.rotate: lambda rot: rot,
    RotaryPositions.rotate_partial: lambda rot: rot,
    DualRotaryPositions.rotate_global: lambda rot: rot[0],
    DualRotaryPositions.rotate_local: lambda rot: rot[1],
}


def step_angles(attn: CausalSelfAttention, rot: Rotation) -> native.Angles | None:
    """The angles `attn` rotates a decode step's q and k by, from the model's rotation `rot` for that step ((1, 1, R)
    or (B, 1, R) cos and sin: one position for every row, or each row's), as the kernels take them: (1 or B, R)
    float32. None where the layer does not rotate."""
    angles = ANGLES[attn.rotate](rot)
    if angles is None:
        return None
    cos, sin = (t.reshape(-1, t.size(-1)).to(torch.float32) for t in angles)  # (1 or B, R)
    return native.Angles(cos, sin)


def head_norm_weight(norm: RMSNorm, width: int) -> torch.Tensor:
    """The factor a q or k norm (an RMSNorm of `width` numbers: one head's, or all heads') multiplies the normalized
    numbers by: its weight, 1 + weight where it has Gemma's unit offset (in float32, as RMSNorm computes it), ones
    where it has none (nanochat's parameter-free norms; times 1 is exact)."""
    if norm.weight is None:
        return torch.ones(width)
    if norm.unit_offset:
        return 1.0 + norm.weight.float()
    return norm.weight


def step_head_norms(attn: CausalSelfAttention) -> native.HeadNorms | None:
    """`attn`'s q/k norms as the kernels take them, read at every step; None where it has none."""
    if attn.qk_norm is None:
        return None
    norms = attn.qk_norm
    q_width, k_width = HEAD_NORM_WIDTHS[type(norms)](attn)
    q = head_norm_weight(norms.q_norm, q_width)
    k = head_norm_weight(norms.k_norm, k_width)
    return native.HeadNorms(q, k, norms.q_norm.eps)


def cache_slot(cache: OneCallCache, layer: int) -> native.CacheSlot:
    """What the kernels' decode step of layer `layer` reads and writes in `cache` (after a `prepare` that set its
    `decode_slot`: sample.py's KVCache, the server's RowCache)."""
    return native.CacheSlot(*cache.decode_buffers(layer))


def offers_one_call(cache: AttentionCache | None) -> bool:
    """Whether `cache` takes a one-call step now: a decode step of a cache that names its slot (sample.py's KVCache
    after `prepare(1)`, the server's RowCache after a `prepare` of one token per row, each row at its own slot)."""
    return getattr(cache, "decode_slot", None) is not None


class NativeAttention(nn.Module):
    """The view's copy of a CausalSelfAttention (`attn`), whose decode steps run in one call through a cache that
    offers it (`offers_one_call`): its q and k normalized and rotated where the layer does so, the token's keys and
    values written into the cache and its heads' attention, within its sliding window where it has one
    (`native.cached_attention`). Prompts, and caches without it, take the layer's own forward."""

    def __init__(self, attn: CausalSelfAttention):
        super().__init__()
        self.attn = attn
        self.n_head = attn.n_head
        self.scale = attn.scale or attn.head_dim**-0.5
        self.window = attn.window

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.size(1) != 1 or not offers_one_call(cache):
            return self.attn(x, rot, cache, layer, ve)
        attn = self.attn
        qkv = attn.qkv(x)  # (B, 1, (H + 2 KV) D)
        y = native.cached_attention(
            qkv,
            cache_slot(cache, layer),
            n_head=self.n_head,
            scale=self.scale,
            angles=step_angles(attn, rot),
            head_norms=step_head_norms(attn),
            window=self.window,
        )  # (B, 1, H D)
        return attn.resid_drop(attn.out_proj(y))


class NativeBlock(nn.Module):
    """The view's copy of a Block, PostNormBlock or SandwichBlock (`block`: BLOCK_KINDS), whose decode steps run in
    one call of the compiled kernels (`native.block_step`) through a cache that offers it: the norms where the block
    puts them, the four matrices (float32, or int8 or int4 after `quantize`, as their ways multiply them:
    `matrix_operands`), the attention over the cache, the activation and the residual additions. Prompts, more rows
    than the kernels multiply in one pass over a weight
    (`native.max_rows()`), and caches without it take the block's own forward, its attention
    still in one call where it can (NativeAttention)."""

    def __init__(self, block: Block, options: native.BlockOptions):
        super().__init__()
        self.block = block
        self.options = options
        # plain tuples, not submodules: the block holds them, and the step reads their tensors
        self.norms = BLOCK_NORMS[options.position](block)
        self.matrices = tuple(block_matrices(block))

    def forward(
        self,
        x: torch.Tensor,
        rot: Rotation = None,
        cache: AttentionCache | None = None,
        layer: int = 0,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.size(1) != 1 or x.size(0) > native.max_rows() or not offers_one_call(cache):
            return self.block(x, rot, cache, layer, ve)
        angles = step_angles(block_attention(self.block), rot)
        return native.block_step(x, self.weights(), cache_slot(cache, layer), self.options, angles)  # (B, 1, C)

    def weights(self) -> native.BlockWeights:
        """The block's tensors as the step takes them, read at every step (a module may replace a buffer, an int8
        layer's scales among them)."""
        qkv, attn_out, fc, ffn_out = (matrix_operands(layer) for layer in self.matrices)
        attn_norm, ffn_norm, *post_norms = (native.Norm(norm.weight, norm.bias) for norm in self.norms)
        head_norms = step_head_norms(block_attention(self.block))
        weights = native.BlockWeights(attn_norm, qkv, attn_out, ffn_norm, fc, ffn_out, head_norms)
        if post_norms:  # a block with norms on both sides of each branch
            return weights._replace(attn_post_norm=post_norms[0], ffn_post_norm=post_norms[1])
        return weights


def one_call_variant(module: nn.Module) -> type[nn.Module] | None:
    """The wrapper whose decode steps run `module`'s in one call of the compiled kernels: NativeAttention for an
    attention layer whose step they compute (`attention_runs_in_one_call`), NativeBlock for a block of a kind they
    compute (BLOCK_KINDS, `block_runs_in_one_call`); None for other modules. Exact classes only: a subclass may compute
    something else."""
    if type(module) is CausalSelfAttention and attention_runs_in_one_call(module):
        return NativeAttention
    if type(module) in BLOCK_KINDS and block_runs_in_one_call(module):
        return NativeBlock
    return None


def attention_runs_in_one_call(attn: CausalSelfAttention) -> bool:
    """Whether `native.cached_attention` computes what `attn` does in a decode step: q and k rotated as ANGLES knows
    (or not at all), q and k through RMSNorms without a bias (over each head, Qwen3's QKNorm, or over all of them,
    OLMo 2's WholeQKNorm) or no norm, within a sliding window or not, and no value embeddings."""
    return (
        attn.rotate in ANGLES
        and (attn.qk_norm is None or head_norms_run_in_one_call(attn.qk_norm))
        and attn.value_mix is None
    )


def head_norms_run_in_one_call(norms: nn.Module) -> bool:
    """Whether the kernels compute the q/k norms `norms`: a kind they know (HEAD_NORM_WIDTHS) whose two norms are
    RMSNorms without a bias."""
    pair = (getattr(norms, "q_norm", None), getattr(norms, "k_norm", None))
    return type(norms) in HEAD_NORM_WIDTHS and all(type(norm) is RMSNorm and norm.bias is None for norm in pair)


def norm_kind(norm: nn.Module) -> str | None:
    """The block step's name for `norm` (NORM_KERNELS), None for a norm it does not compute."""
    return NORM_KERNELS.get((type(norm), bool(getattr(norm, "unit_offset", False))))


def block_runs_in_one_call(block: Block) -> bool:
    """Whether `native.block_step` computes what `block` (a kind BLOCK_KINDS names) does in a decode step: attention
    it computes in one call, norms of one kind it knows (NORM_KERNELS) and one epsilon, and a feed-forward whose
    activation it knows (ACTIVATION_KERNELS). The view makes a block a NativeBlock only where its matrices can take the
    step too (`multiplies_in_one_call`)."""
    norms = BLOCK_NORMS[BLOCK_KINDS[type(block)]](block)
    kinds = {norm_kind(norm) for norm in norms}
    return (
        one_call_variant(block.attn) is NativeAttention
        and len(kinds) == 1
        and None not in kinds
        and len({norm.eps for norm in norms}) == 1
        and type(block.ffn) in ACTIVATION_KERNELS
    )


def block_options(block: Block) -> native.BlockOptions:
    """What the step computes besides `block`'s tensors, chosen once here for its kind: the kernels' names for its
    norms, their position and its activation, the norms' epsilon, its heads, the attention's scale (SDPA's
    1 / sqrt(D) unless the model sets its own) and window, and the residual scale."""
    attn = block.attn
    return native.BlockOptions(
        norm=norm_kind(block.attn_norm),
        eps=block.attn_norm.eps,
        activation=ACTIVATION_KERNELS[type(block.ffn)],
        n_head=attn.n_head,
        scale=attn.scale or attn.head_dim**-0.5,
        residual_scale=block.residual_scale,
        position=BLOCK_KINDS[type(block)],
        window=attn.window,
    )


def block_attention(block: nn.Module) -> CausalSelfAttention:
    """The block's attention layer (in the view, it may already be a NativeAttention around its copy)."""
    return block.attn.attn if isinstance(block.attn, NativeAttention) else block.attn


def block_matrices(block: nn.Module) -> list[nn.Module]:
    """The linear layers whose weights the block step multiplies itself, in its order: qkv, the attention's out_proj,
    fc and the feed-forward's out_proj."""
    attn = block_attention(block)
    return [attn.qkv, attn.out_proj, block.ffn.fc, block.ffn.out_proj]


# the ways of each quantized layer type a block's step multiplies as that layer's own kernel does (exact types: a
# grouped int8 table or a LoRA'd layer is another)
STEP_WAYS: dict[type[nn.Module], tuple[str, ...]] = {Int8Linear: ("native", INT8_DOT), Int4Linear: (INT8_DOT,)}


def runs_in_block_step(layer: nn.Module, rows: int) -> bool:
    """Whether a block's step may multiply `layer` (the view's, at up to `rows` rows): where the compiled kernel was to
    multiply it anyway, a float32 layer the view made a NativeLinear, or an int8 layer with a scale per row or an int4
    layer whose way measured (or forced) for `rows` rows of float32 activations is a compiled kernel the step runs
    (STEP_WAYS). Not a grouped int8 table, a LoRA'd layer or one measured faster another way."""
    if isinstance(layer, NativeLinear):
        return True
    return type(layer) in STEP_WAYS and layer.way(rows, torch.float32) in STEP_WAYS[type(layer)]


def matrix_operands(layer: nn.Module) -> native.Matrix:
    """A layer `runs_in_block_step` takes, as the step multiplies it: a float32 weight without a scale; the int8
    codes with the float32 scales of their rows, or the int4 codes with their groups', multiplying float32
    activations or int8 ones as the layer's way does; the bias in float32. The way is the one chosen for one row:
    every row count multiplies what it does (gptlite.inference.quantize's `choose`)."""
    if isinstance(layer, NativeLinear):
        return native.Matrix(layer.weight, None, layer.bias)
    bias = None if layer.bias is None else layer.bias.to(torch.float32)
    inputs = "int8" if layer.way(1, torch.float32) == INT8_DOT else "float32"
    if isinstance(layer, Int4Linear):
        return native.Matrix(layer.nibbles, layer.scale, bias, inputs)
    return native.Matrix(layer.weight, layer.scales(torch.float32), bias, inputs)


def multiplies_in_one_call(original: Block, view: nn.Module, rows: int) -> bool:
    """Whether a block's step may replace the view's copy `view` of `original`: each of its matrices takes the step
    (`runs_in_block_step`), no hook waits on a module it would not call, and nothing is dropped out (it computes eval
    mode's block)."""
    native_matrices = all(runs_in_block_step(layer, rows) for layer in block_matrices(view))
    hooked = global_hook_count() or any(hook_count(m) for m in original.modules())
    return native_matrices and not hooked and not original.training


def one_call_step(original: nn.Module, view: nn.Module, rows: int) -> nn.Module | None:
    """The view's module for `original`, whose copy with the view's submodules is `view`, where its decode steps run
    in one call (at up to `rows` rows): a NativeAttention or a NativeBlock around `view`, or None where they do not."""
    variant = one_call_variant(original)
    if variant is NativeAttention:
        return made(NativeAttention, view)
    if variant is NativeBlock and multiplies_in_one_call(original, view, rows):
        return made(NativeBlock, view, block_options(original))
    return None
