"""Configuration: the model and training dataclasses, TOML loading and `--key=value` overrides.

Precedence is defaults < TOML file < command line. Every value is converted to its field's type,
unknown keys get a "did you mean" hint, and all problems are reported together in one ValueError.
This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

FFN_MULTIPLE = 64  # SwiGLU width is rounded up to this, so matmuls tile well on GPUs
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # every command's --dtype (see gptlite.device)
DPO_LOSSES = ("sigmoid", "ipo")  # train.py's losses on preference pairs (gptlite.train.preference.dpo_loss)
RL_LOSSES = ("reinforce", "grpo")  # train.py --rl's policy-gradient losses (gptlite.train.rl.policy_loss)
# Options that one optimizer alone reads: set where it does not run, each would do nothing, so it is refused (see
# set_options; each mode of training refuses its own likewise: gptlite.train.preference, gptlite.train.rl)
MUON_OPTIONS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns", "normuon", "normuon_beta2")
# GPTConfig.layer_types' kinds (gptlite.model.network's LAYERS builds each): attention over the whole context, LFM2's
# gated short convolution, Gated DeltaNet's linear attention with a recurrent state (Qwen3.5), Mamba-2 (Granite 4-H)
LAYER_TYPES = ("full_attention", "conv", "linear_attention", "mamba")
QUANTIZE_CHOICES = ("", "int8", "int4")  # weight-only quantizations gptlite.inference.quantize does ("" = none)
TRUE_WORDS = ("true", "1", "yes", "on")  # how a boolean is written in TOML strings and on the command line
FALSE_WORDS = ("false", "0", "no", "off")


def option(
    default: typing.Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple = (),
    positional: bool = False,
    short: str = "",
    default_factory: typing.Any = dataclasses.MISSING,
) -> typing.Any:
    """A dataclass field that is a command-line option (see gptlite.cli): its help text, its allowed values, whether
    it is given by position (a list field: the command's plain arguments), and a one-letter alias (short="h")."""
    meta = {"help": help, "choices": tuple(choices), "positional": positional, "short": short}
    return field(default=default, default_factory=default_factory, metadata=meta)


def choice_list(choices: tuple) -> str:
    """A choice list as errors and --help show it: "'', int8, int4" (an empty choice, which means none, as '', what
    the command line takes)."""
    return ", ".join(repr(choice) if choice == "" else str(choice) for choice in choices)


def choice_problems(cls: type, values: typing.Mapping[str, typing.Any]) -> list[str]:
    """The values (field name -> value) that are not one of the choices their field's `option` declares: the one
    check of every choice list, for the configs here and every command's options (gptlite.cli)."""
    problems = []
    for f in fields(cls):
        choices = f.metadata.get("choices")
        if choices and f.name in values and values[f.name] not in choices:
            problems.append(f"{f.name}={values[f.name]!r} must be one of {choice_list(choices)}")
    return problems


def set_options(config, names: tuple[str, ...]) -> list[str]:
    """The options among `names` that `config` sets to other than their defaults, as 'name=value'."""
    defaults = {f.name: f.default for f in fields(config)}
    return [f"{name}={getattr(config, name)}" for name in names if getattr(config, name) != defaults[name]]


def check_model_overrides(config, overrides: dict, source: str) -> None:
    """What a command may change of a model it reads (`source`: a run folder or pretrained weights): a smaller
    block_size and another dropout, nothing else; learned positions stop at the block they learned."""
    wrong = sorted(set(overrides) - {"block_size", "dropout"})
    if wrong:
        raise ValueError(
            f"{source}: the pretrained model fixes {', '.join(wrong)}; only block_size (smaller) and "
            "dropout can be changed"
        )
    block_size = overrides.get("block_size", config.block_size)
    if config.pos_emb == "learned" and block_size > config.block_size:
        raise ValueError(
            f"block_size={block_size} is more than the {config.block_size} positions {source} learned; "
            f"use block_size <= {config.block_size}"
        )


@dataclass
class GPTConfig:
    """Shape of a GPT model. The defaults are gptlite's own model; GPT-2's is pos_emb="learned",
    norm="layernorm", ffn="gelu", bias=True, and Llama's pos_emb="rope", norm="rmsnorm", ffn="swiglu".
    `ffn_hidden=None` picks 4 * n_embd for gelu and, for swiglu, the width with the same parameter count."""

    vocab_size: int = option(50304, "token ids the model knows (from the data's tokenizer.json when not given)")
    block_size: int = option(1024, "the context: tokens per training window")
    n_layer: int = option(12, "Transformer blocks")
    n_head: int = option(12, "attention heads")
    n_embd: int = option(768, "the width of the residual stream")
    dropout: float = option(0.0, "dropout probability")
    bias: bool = option(False, "biases in every linear layer and norm (GPT-2 has them; the tied head never does)")
    pos_emb: str = option(
        "learned", "positions: learned (GPT-2), sinusoidal or rope (Llama)", choices=("learned", "sinusoidal", "rope")
    )
    rope_theta: float = option(10000.0, "RoPE's base wavelength (pos_emb=rope)")
    norm: str = option("layernorm", "layernorm or rmsnorm (Llama)", choices=("layernorm", "rmsnorm"))
    norm_eps: float = option(1e-5, "the norms' epsilon")
    ffn: str = option(
        "swiglu",
        "feed-forward: swiglu (Llama), gelu (GPT-2's MLP), relu2 (ReLU squared: Primer, modded-nanogpt) or geglu "
        "(Gemma's gated tanh-GELU)",
        choices=("swiglu", "gelu", "relu2", "geglu"),
    )
    ffn_hidden: int | None = option(
        None, "feed-forward width (none: 4 * n_embd for gelu and relu2, the same parameter count for swiglu)"
    )
    # the options of today's open models (all off by default: gptlite's own model is unchanged)
    n_kv_head: int | None = option(
        None,
        "key/value heads: fewer than n_head is grouped-query attention, whose KV "
        "cache is that much smaller (none = n_head)",
    )
    head_dim: int | None = option(None, "the width of a head (none = n_embd / n_head; Qwen3 sets its own)")
    tie_embeddings: bool = option(True, "the output head is the token embedding (false: a head of its own)")
    qkv_bias: bool = option(False, "biases on q, k and v only (Qwen2)")
    qk_norm: bool = option(False, "RMSNorm on each head's q and k before the rotation (Qwen3)")
    rope_scaling: str = option(
        "",
        "RoPE's frequencies scaled as Llama 3.1 does (llama3), as Phi-3.5/Phi-4-mini do within their original "
        "context (longrope) or by YaRN (yarn: OLMo 3's global layers, Ministral 3); '' = none",
        choices=("", "llama3", "longrope", "yarn"),
    )
    rope_factor: float = option(8.0, "llama3 and yarn scaling: how much longer the context than the original")
    rope_low_freq_factor: float = option(1.0, "llama3 scaling: wavelengths above original / this are scaled")
    rope_high_freq_factor: float = option(4.0, "llama3 scaling: wavelengths below original / this are kept")
    rope_original_context: int = option(
        8192, "llama3, longrope and yarn scaling, query_scale_beta: the context the model was first trained on"
    )
    rope_short_factor: str = option(
        "", "longrope: the comma-separated divisors of RoPE's frequencies within the original context, one per pair"
    )
    rope_long_factor: str = option(
        "", "longrope: those past the original context (kept for the export; gptlite stays within that context)"
    )
    rope_attention_factor: float = option(1.0, "longrope and yarn: RoPE's cos and sin are multiplied by this")
    rope_beta_fast: float = option(
        32.0, "yarn: frequencies turning more than this often in the original context are kept"
    )
    rope_beta_slow: float = option(1.0, "yarn: those turning less often than this are divided by rope_factor")
    query_scale_beta: float = option(
        0.0,
        "> 0: q is multiplied by 1 + this * log(1 + floor(position / rope_original_context)) (Ministral 3's, Llama 4's "
        "attention temperature); 0 = none",
    )
    rope_dims: int = option(0, "the leading coordinates of each head that RoPE rotates (0 = all; Phi-4-mini: 3/4)")
    embed_scale: float = option(1.0, "the token embeddings are multiplied by this (Granite's embedding_multiplier)")
    residual_scale: float = option(
        1.0,
        "attention's and the feed-forward's outputs are multiplied by this as they join the residual stream "
        "(Granite's residual_multiplier)",
    )
    attn_scale: float = option(0.0, "attention's scores are q . k times this (0 = 1 / sqrt(head width); Granite's)")
    logits_scaling: float = option(1.0, "the logits are divided by this (Granite's logits_scaling)")
    norm_position: str = option(
        "pre",
        "pre: x + f(norm(x)) (GPT-2, Llama); post: x + norm(f(x)), each norm on its branch's output, inside the "
        "residual (OLMo 2); both: x + norm(f(norm(x))) (Gemma)",
        choices=("pre", "post", "both"),
    )
    qk_norm_scope: str = option(
        "head",
        "qk_norm over each head's q and k (Qwen3) or over all of q and all of k (OLMo 2)",
        choices=("head", "all"),
    )
    norm_unit_offset: bool = option(False, "the RMSNorms scale by 1 + weight, their weight starting at 0 (Gemma)")
    sliding_window: int = option(0, "> 0: window_layers attend to the last this many positions only (Gemma 3)")
    window_layers: str = option("", "comma-separated indices of the layers with a sliding window (Gemma 3's local)")
    rope_local_theta: float = option(0.0, "> 0: RoPE's base wavelength in window_layers (Gemma 3); 0 = rope_theta")
    norm_weight: bool = option(True, "the RMSNorms scale by a learned weight (false: parameter-free, as nanochat's)")
    embed_norm: bool = option(False, "the token embeddings go through a norm before the first block (nanochat)")
    rope_reverse: bool = option(False, "RoPE rotates by minus the angle: nanochat's convention")
    nope_layers: str = option(
        "", "comma-separated indices of the layers whose attention has no positions (SmolLM3's NoPE layers; rope)"
    )
    layer_types: str = option(
        "",
        "comma-separated kind of each layer, transformers' names: full_attention, conv (LFM2's gated short "
        "convolution), linear_attention (Gated DeltaNet, Qwen3.5's) or mamba (Mamba-2, as Granite 4-H's); "
        "'' = every layer full_attention",
    )
    conv_kernel: int = option(3, "the width of the conv layers' causal convolution, in tokens (LFM2's L_cache)")
    conv_bias: bool = option(False, "biases in the conv layers' projections and convolution (LFM2's conv_bias)")
    attn_output_gate: bool = option(
        False, "attention's output times sigmoid of a gate projected from the block's input, per channel (Qwen3.5)"
    )
    linear_k_heads: int = option(16, "linear_attention layers: query/key heads")
    linear_v_heads: int = option(32, "linear_attention layers: value heads, a multiple of linear_k_heads")
    linear_k_dim: int = option(128, "linear_attention layers: the width of a query/key head")
    linear_v_dim: int = option(128, "linear_attention layers: the width of a value head")
    linear_conv_kernel: int = option(4, "linear_attention layers: the taps of the causal convolution of q, k, v")
    mamba_heads: int = option(8, "the mamba layers' scan heads (mamba_n_heads)")
    mamba_head_dim: int = option(16, "the width of each mamba head (mamba_d_head)")
    mamba_state: int = option(16, "the size of each mamba head's state per channel (mamba_d_state)")
    mamba_groups: int = option(1, "groups of mamba heads sharing B and C, and the gated norm's groups (mamba_n_groups)")
    mamba_conv_kernel: int = option(4, "the width of the mamba layers' causal convolution, in tokens (mamba_d_conv)")
    mamba_chunk_size: int = option(256, "tokens per chunk of the mamba layers' chunked scan (mamba_chunk_size)")
    mamba_conv_bias: bool = option(True, "a bias in the mamba layers' convolution (mamba_conv_bias)")
    mamba_proj_bias: bool = option(False, "biases in the mamba layers' in_proj and out_proj (mamba_proj_bias)")
    mamba_dt_min: float = option(0.0, "the mamba layers' time steps are clamped to at least this (time_step_limit)")
    mamba_dt_max: float = option(float("inf"), "and to at most this (time_step_limit)")
    # a mixture of experts (Fedus et al., 2021, "Switch Transformers"; OLMoE, Qwen3-MoE, Granite 3 MoE): off by default
    n_experts: int = option(
        0,
        "> 0: every feed-forward is this many SwiGLU experts, ffn_hidden wide each, of which a router picks "
        "experts_per_token for each token (0 = one feed-forward)",
    )
    experts_per_token: int = option(0, "n_experts: the experts each token goes through, the router's top k")
    experts_renorm: bool = option(
        False,
        "n_experts: the chosen experts' weights are divided by their sum (Qwen3-MoE's norm_topk_prob; Granite's "
        "softmax over the top k); false: the router's softmax over all experts as it is (OLMoE)",
    )
    router_aux_loss_coef: float = option(
        0.0,
        "n_experts, training: the weight of the load-balancing loss (Switch Transformer's) added to the loss "
        "(0 = none)",
    )
    # the speedrun techniques of modded-nanogpt and nanochat (all off by default; docs/training.md measures them)
    value_embeds: bool = option(
        False, "every layer adds a token embedding of its own to attention's values, with learned weights"
    )
    bigram_vocab: int = option(
        0,
        "> 0: a second embedding, of each (previous, current) token pair hashed into this many rows, added to the "
        "token embedding; vocab_size**2 + 1 rows give every pair a row of its own (0 = none)",
    )
    unet_skips: bool = option(
        False, "U-net skips: block i's output is added, times a learned weight, to block n_layer-1-i's input"
    )
    logit_softcap: float = option(0.0, "> 0: the logits are softcap * tanh(logits / softcap) (Gemma 2); 0 = none")
    zero_init_out: bool = option(
        False, "attention's and the feed-forward's output projections start at zero: each block starts as identity"
    )

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head."""
        return self.n_kv_head or self.n_head

    @property
    def nope_layer_ids(self) -> frozenset[int]:
        """The layers of nope_layers: attention without RoPE's rotation."""
        return frozenset(int(i) for i in self.nope_layers.split(",") if i.strip())

    @property
    def window_layer_ids(self) -> frozenset[int]:
        """The layers of window_layers: attention over the last sliding_window positions."""
        return frozenset(int(i) for i in self.window_layers.split(",") if i.strip())

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind (layer_types, one per layer): what the model builds there, and what it keeps across
        decode calls (gptlite.model.network's LAYERS)."""
        if not self.layer_types:
            return ("full_attention",) * self.n_layer
        return tuple(kind.strip() for kind in self.layer_types.split(","))

    @property
    def attention_layer_ids(self) -> frozenset[int]:
        """The layers that attend: the ones a KV cache keeps keys and values for."""
        return frozenset(i for i, kind in enumerate(self.layer_kinds) if kind == "full_attention")

    @property
    def head_width(self) -> int:
        """The width of every q, k and v head: head_dim, or n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    def __post_init__(self) -> None:
        if self.ffn_hidden is None and isinstance(self.n_embd, int) and self.n_embd > 0:
            self.ffn_hidden = default_ffn_hidden(self.n_embd, self.ffn)
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_hidden"):
            value = getattr(self, name)
            if name == "ffn_hidden" and value is None:  # its default comes from n_embd, already named above
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        for name in (
            "bias",
            "tie_embeddings",
            "qkv_bias",
            "qk_norm",
            "value_embeds",
            "unet_skips",
            "zero_init_out",
            "norm_weight",
            "embed_norm",
            "rope_reverse",
            "norm_unit_offset",
            "conv_bias",
            "attn_output_gate",
            "mamba_conv_bias",
            "mamba_proj_bias",
            "experts_renorm",
        ):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("n_kv_head", "head_dim", "rope_original_context"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                problems.append(
                    f"{name}={value!r} must be a positive integer"
                    + (", or none" if name != "rope_original_context" else "")
                )
        if not problems and self.n_head % self.kv_heads:
            problems.append(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}: each key/value head "
                "serves the same number of query heads"
            )
        if self.rope_scaling and self.pos_emb != "rope":
            problems.append(f"rope_scaling={self.rope_scaling!r} needs pos_emb='rope'")
        problems += self._rope_problems()
        if self.rope_scaling == "yarn" and not (self.rope_factor >= 1 and self.rope_beta_fast > self.rope_beta_slow):
            problems.append(
                f"yarn scaling needs rope_factor >= 1 and rope_beta_fast > rope_beta_slow, got {self.rope_factor}, "
                f"{self.rope_beta_fast}, {self.rope_beta_slow}"
            )
        if self.rope_scaling == "llama3" and not (
            self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            problems.append(
                f"llama3 scaling needs rope_factor >= 1 and 0 < rope_low_freq_factor < rope_high_freq_factor, "
                f"got {self.rope_factor}, {self.rope_low_freq_factor}, {self.rope_high_freq_factor}"
            )
        if not problems and self.head_dim is None and self.n_embd % self.n_head != 0:
            problems.append(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head "
                f"(e.g. n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))})"
            )
        if not problems and self.pos_emb == "sinusoidal" and (self.n_embd % 2) != 0:
            problems.append(f"n_embd={self.n_embd} must be even for pos_emb='sinusoidal'")
        if not problems and self.pos_emb == "rope" and self.head_width % 2 != 0:
            problems.append(
                f"the head width n_embd / n_head = {self.head_width} must be even for "
                "pos_emb='rope', which rotates pairs of its coordinates; change n_embd or n_head"
            )
        if not (isinstance(self.bigram_vocab, int) and not isinstance(self.bigram_vocab, bool)) or not (
            self.bigram_vocab == 0 or self.bigram_vocab >= 2
        ):
            problems.append(
                f"bigram_vocab={self.bigram_vocab!r} must be 0 (none) or at least 2 rows, e.g. vocab_size**2 + 1 "
                "for a row per pair"
            )
        softcap = self.logit_softcap
        if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
            problems.append(f"logit_softcap={softcap!r} must be a finite number >= 0 (0 = no cap; modded-nanogpt: 15)")
        if self.unet_skips is True and isinstance(self.n_layer, int) and self.n_layer < 2:
            problems.append(
                f"unet_skips=true joins block i's output to block n_layer-1-i's input, and n_layer={self.n_layer} "
                "has no such pair; use n_layer >= 2 or leave unet_skips out"
            )
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout!r} must be in [0, 1)")
        problems += choice_problems(type(self), vars(self))
        for name in (
            "rope_theta",
            "norm_eps",
            "rope_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
            "rope_beta_fast",
            "rope_beta_slow",
            "embed_scale",
            "residual_scale",
            "logits_scaling",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        problems += self._layer_list_problems("nope_layers")
        problems += self._layer_list_problems("window_layers")
        problems += self._window_problems()
        problems += self._layer_type_problems()
        problems += self._experts_problems()
        if self.norm_weight is False and self.norm != "rmsnorm":
            problems.append(f"norm_weight=false makes the RMSNorms parameter-free; norm={self.norm!r} is no RMSNorm")
        if self.rope_reverse is True and self.pos_emb != "rope":
            problems.append(f"rope_reverse=true says which way RoPE rotates; pos_emb={self.pos_emb!r} is no RoPE")
        if self.qk_norm_scope == "all" and not self.qk_norm:
            problems.append("qk_norm_scope='all' says how qk_norm normalises q and k; it needs qk_norm=true")
        beta = self.query_scale_beta
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta >= 0:
            problems.append(f"query_scale_beta={beta!r} must be a number >= 0 (0 = none)")
        elif beta and (self.pos_emb != "rope" or self.rope_dims or self.rope_local_theta):
            problems.append(
                f"query_scale_beta={beta} scales q by its RoPE position; it needs pos_emb='rope' rotating the whole "
                "head (rope_dims=0) with one base (rope_local_theta=0)"
            )
        scale = self.attn_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale >= 0:
            problems.append(f"attn_scale={scale!r} must be a number >= 0 (0 = 1 / sqrt(head width))")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    def _layer_type_problems(self) -> list[str]:
        """layer_types: one known kind per layer; conv_kernel a width of at least 2 tokens; the linear_attention
        layers' sizes."""
        problems = []
        kernel = self.conv_kernel
        if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 2:
            problems.append(f"conv_kernel={kernel!r} must be an integer >= 2 (the token and at least one before it)")
        problems += self._mamba_problems()
        if not self.layer_types:
            return problems
        if not isinstance(self.layer_types, str):
            example = "e.g. 'conv,full_attention'"
            return problems + [f"layer_types={self.layer_types!r} must be comma-separated layer kinds, {example}"]
        kinds = [kind.strip() for kind in self.layer_types.split(",")]
        unknown = next((kind for kind in kinds if kind not in LAYER_TYPES), None)
        if unknown is not None:
            problems.append(f"layer_types names {unknown!r}; the kinds are {', '.join(LAYER_TYPES)}")
        if isinstance(self.n_layer, int) and len(kinds) != self.n_layer:
            problems.append(f"layer_types={self.layer_types!r} names {len(kinds)} layers; n_layer={self.n_layer}")
        stateful = any(kind != "full_attention" for kind in kinds)
        if stateful and self.value_embeds:
            problems.append("value_embeds mixes into attention's values; it needs every layer in layer_types to attend")
        if "linear_attention" in kinds:
            problems += self._linear_attention_problems()
        return problems

    def _linear_attention_problems(self) -> list[str]:
        """The linear_attention layers' sizes: positive, each key head serving as many value heads."""
        problems = []
        names = ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "linear_conv_kernel")
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not problems and self.linear_v_heads % self.linear_k_heads:
            problems.append(
                f"linear_v_heads={self.linear_v_heads} is not a multiple of linear_k_heads={self.linear_k_heads}: "
                "each key head serves the same number of value heads"
            )
        return problems

    def _mamba_problems(self) -> list[str]:
        """The mamba sizes: positive integers, the heads split into mamba_groups; time steps 0 <= min <= max."""
        problems = []
        for name in ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups", "mamba_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        kernel = self.mamba_conv_kernel
        if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 2:
            problems.append(f"mamba_conv_kernel={kernel!r} must be an integer >= 2 (the token and at least one before)")
        heads = self.mamba_heads
        groups = self.mamba_groups
        if isinstance(heads, int) and isinstance(groups, int) and groups >= 1 and heads % groups:
            problems.append(f"mamba_groups={groups} must divide mamba_heads={heads}")
        low = self.mamba_dt_min
        high = self.mamba_dt_max
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or not 0 <= low <= high:
            problems.append(f"mamba_dt_min={low!r}, mamba_dt_max={high!r} must be numbers with 0 <= min <= max")
        return problems

    def _layer_list_problems(self, name: str) -> list[str]:
        """nope_layers and window_layers: comma-separated indices of existing layers."""
        value = getattr(self, name)
        if not value:
            return []
        try:
            layers = frozenset(int(i) for i in value.split(",") if i.strip())
        except (ValueError, AttributeError):
            return [f"{name}={value!r} must be comma-separated layer indices, e.g. '3,7'"]
        problems = []
        wrong = sorted(i for i in layers if not (isinstance(self.n_layer, int) and 0 <= i < self.n_layer))
        if wrong:
            problems.append(f"{name}={value!r} names layer {wrong[0]}; the layers are 0..n_layer-1")
        if name == "nope_layers" and self.pos_emb != "rope":
            problems.append(f"nope_layers={value!r} needs pos_emb='rope' (other layers rotate q and k)")
        return problems

    def _rope_problems(self) -> list[str]:
        """rope_dims and longrope's factors."""
        dims = self.rope_dims
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 0 or dims % 2:
            return [f"rope_dims={dims!r} must be an even integer >= 0 (0 = the whole head)"]
        if dims and (self.pos_emb != "rope" or self.rope_local_theta):
            return [f"rope_dims={dims} needs pos_emb='rope' without rope_local_theta"]
        if dims and isinstance(self.n_embd, int) and isinstance(self.n_head, int) and dims > self.head_width:
            return [f"rope_dims={dims} is more than the head width {self.head_width}"]
        if self.rope_scaling != "longrope":
            return []
        try:
            short = [float(f) for f in self.rope_short_factor.split(",")]
            [float(f) for f in self.rope_long_factor.split(",") if f.strip()]
        except (ValueError, AttributeError):
            return ["longrope needs rope_short_factor (and rope_long_factor) as comma-separated numbers"]
        pairs = (dims or self.head_width) // 2
        if len(short) != pairs:
            return [f"longrope needs one rope_short_factor per rotated pair, {pairs}; got {len(short)}"]
        if isinstance(self.block_size, int) and self.block_size > self.rope_original_context:
            return [
                f"block_size={self.block_size} is past longrope's original context {self.rope_original_context}, "
                f"where its long factors would apply, which gptlite does not have: use block_size <= "
                f"{self.rope_original_context}"
            ]
        return []

    def _experts_problems(self) -> list[str]:
        """n_experts and the switches that say how its router weighs them."""
        experts = self.n_experts
        top_k = self.experts_per_token
        coef = self.router_aux_loss_coef
        for name, value in (("n_experts", experts), ("experts_per_token", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return [f"{name}={value!r} must be an integer >= 0"]
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not (math.isfinite(coef) and coef >= 0):
            return [f"router_aux_loss_coef={coef!r} must be a finite number >= 0 (0 = no load-balancing loss)"]
        if not experts:
            problems = [
                f"{name}={getattr(self, name)!r} says how a mixture of experts routes tokens; it needs n_experts > 0"
                for name in ("experts_per_token", "experts_renorm", "router_aux_loss_coef")
                if getattr(self, name)
            ]
            return problems
        if not 1 <= top_k <= experts:
            return [f"experts_per_token={top_k} must be in 1..n_experts={experts}: the experts each token goes through"]
        if self.ffn != "swiglu":
            return [f"n_experts={experts} makes SwiGLU experts; ffn={self.ffn!r} is no SwiGLU (use ffn=swiglu)"]
        if self.bias is True:
            return [f"n_experts={experts} makes experts without biases; bias=true needs one feed-forward (n_experts=0)"]
        return []

    def _window_problems(self) -> list[str]:
        window, theta = self.sliding_window, self.rope_local_theta
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            return [f"sliding_window={window!r} must be an integer >= 0 (0 = none)"]
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta < 0:
            return [f"rope_local_theta={theta!r} must be a number >= 0 (0 = rope_theta)"]
        if bool(window) != bool(self.window_layers):
            return [
                f"sliding_window={window} and window_layers={self.window_layers!r} go together: the window's size "
                "and the layers that have it"
            ]
        if theta and not (self.window_layers and self.pos_emb == "rope"):
            return [f"rope_local_theta={theta} is the RoPE base of window_layers; it needs them and pos_emb='rope'"]
        return []


def default_ffn_hidden(n_embd: int, ffn: str = "swiglu") -> int:
    """GPT-2's MLP is 4 * n_embd wide. SwiGLU has three matrices, so 8/3 * n_embd (rounded up to a multiple
    of FFN_MULTIPLE) keeps the parameter count of that MLP."""
    if ffn in ("gelu", "relu2"):
        return 4 * n_embd  # geglu has SwiGLU's three matrices
    hidden = int(8 * n_embd / 3)
    return FFN_MULTIPLE * ((hidden + FFN_MULTIPLE - 1) // FFN_MULTIPLE)


# What --resume and --init_from cannot change: every field that shapes the weights or the function the model
# computes. Dropout may change (a run can fine-tune with more or less of it), and zero_init_out, which only
# says how a fresh model starts.
# router_aux_loss_coef only weighs a training loss: a fine-tuning run may set its own.
MODEL_SHAPE_KEYS = tuple(
    f.name for f in fields(GPTConfig) if f.name not in ("dropout", "zero_init_out", "router_aux_loss_coef")
)


def model_changes(
    values: dict[str, typing.Any], base: dict[str, typing.Any]
) -> list[tuple[str, typing.Any, typing.Any]]:
    """(key, value, base's value) for every model shape key that `values` (raw strings or typed) sets to another
    value than `base` (a flat config; a key it lacks has GPTConfig's default). Values are compared as the field's
    type, so --rope_theta=10000 equals 10000.0."""
    types = typing.get_type_hints(GPTConfig)
    changes = []
    for key in MODEL_SHAPE_KEYS:
        if key not in values:
            continue
        old = base.get(key, getattr(GPTConfig(), key))
        try:
            new = convert(key, values[key], types[key])
        except ValueError:  # not even of the field's type: a change, which build_config would refuse anyway
            new = values[key]
        if new != old:
            changes.append((key, values[key], old))
    return changes


@dataclass
class TrainConfig:
    """Everything train.py needs. Model fields live in `model`; on the command line both are flat keys."""

    model: GPTConfig = field(default_factory=GPTConfig)
    # data and output
    data_dir: str = option("", "the folder of *train*.bin / *val*.bin shards that data/prepare.py writes")
    out_dir: str = option("out", "the run folder: checkpoints, metrics.jsonl, the data's tokenizer.json")
    resume: bool = option(False, "continue the run in out_dir from its newest intact checkpoint")
    overwrite: bool = option(
        False, "a fresh run into a folder that holds an earlier run moves its files into out_dir/previous-TIME/ first"
    )
    init_from: str = option(
        "",
        "start from another model's weights: a gptlite run folder (its newest checkpoint), a Hugging Face "
        "directory, or gpt2, gpt2-medium, gpt2-large, gpt2-xl (downloaded); the model's shape comes from it "
        "('' = from scratch)",
    )
    # LoRA: freeze the pretrained model and train low-rank adapters (gptlite/train/lora.py) on these layers
    lora_rank: int | None = option(
        None, "train LoRA adapters of this rank on a frozen --init_from model (none = train every weight)"
    )
    lora_alpha: float = option(16.0, "LoRA's scale: the update is (lora_alpha / lora_rank) B A")
    lora_dropout: float = option(0.0, "dropout on the adapters' input")
    lora_targets: str = option(
        "attn.qkv,attn.out_proj,ffn.fc,ffn.out_proj", "comma-separated ends of the layer names that get adapters"
    )
    # DPO: on preference data (data/prepare.py --preference) the loss is DPO's, against the start-of-run model
    dpo_beta: float = option(
        0.1, "preference data: DPO's beta, how far the model may move from the reference (higher: less far)"
    )
    dpo_loss: str = option(
        "sigmoid",
        "preference data: DPO's sigmoid loss, or IPO's squared one (gptlite/train/preference.py)",
        choices=DPO_LOSSES,
    )
    dpo_label_smoothing: float = option(
        0.0, "preference data, sigmoid loss: the share of pairs taken to be mislabelled (conservative DPO)"
    )
    # RL on verifiable rewards (gptlite/train/rl.py): sample completions of prompts, score them, train on the advantages
    rl: bool = option(
        False,
        "reinforcement learning: each step samples rl_samples completions of batch_size prompts of rl_prompts per "
        "device and trains on their rewards minus their group's mean (gptlite/train/rl.py)",
    )
    rl_prompts: str = option("", "rl: a JSONL file of prompts (text, or a list of messages) with their answers")
    reward: str = option(
        "",
        "rl: gsm8k, exact, package.module:function or path/to/file.py:function, called as "
        "function(prompt, completion, record) -> float",
    )
    rl_prompt_field: str = option("prompt", "rl: the records' prompt field (text, or a list of messages)")
    rl_answer_field: str = option("answer", "rl: the records' answer field (what gsm8k and exact compare with)")
    rl_samples: int = option(8, "rl: completions per prompt: a group, whose mean reward is each one's baseline")
    rl_max_new_tokens: int = option(256, "rl: the longest completion, in tokens")
    rl_temperature: float = option(1.0, "rl: the sampling temperature")
    rl_loss: str = option(
        "reinforce",
        "rl: reinforce (nanochat's: -advantage x log-probability over the generated tokens) or grpo "
        "(DeepSeekMath's clipped ratio and KL to the start-of-run model)",
        choices=RL_LOSSES,
    )
    rl_clip: float = option(0.2, "rl_loss=grpo: the ratio's clip, epsilon")
    rl_kl_beta: float = option(0.04, "rl_loss=grpo: the weight of the KL to the start-of-run model (0 = none)")
    # batch
    batch_size: int = option(12, "sequences per device per micro-step (preference data: pairs)")
    total_batch_size: int = option(
        0, "tokens per optimizer step across all devices (0 = one micro-step, no gradient accumulation)"
    )
    max_iters: int = option(5000, "optimizer steps")
    # the optimizer and its schedule: linear warmup to learning_rate, cosine decay to min_lr at lr_decay_iters, or
    # with lr_schedule="time" at the end of the max_minutes budget; Muon's learning rate follows in proportion
    optimizer: str = option(
        "adamw",
        "adamw, or muon: Muon (gptlite/train/optim.py) for the matrices inside the blocks, "
        "AdamW for the embedding, positions and vectors",
        choices=("adamw", "muon"),
    )
    learning_rate: float = option(6e-4, "AdamW's peak learning rate")
    min_lr: float = option(6e-5, "the learning rate at the end of the cosine decay")
    warmup_iters: int = option(100, "steps of linear warmup")
    lr_decay_iters: int = option(0, "the step where the decay reaches min_lr (0 = max_iters)")
    lr_schedule: str = option("steps", "steps, or time: decay over max_minutes (speedruns)", choices=("steps", "time"))
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay on matrices")
    beta1: float = option(0.9, "AdamW's beta1")
    beta2: float = option(0.95, "AdamW's beta2")
    grad_clip: float = option(1.0, "clip the gradient norm to this (0 = off)")
    muon_lr: float = option(0.02, "Muon's peak learning rate (for a square matrix; see gptlite.train.optim.lr_scale)")
    muon_momentum: float = option(0.95, "Muon's Nesterov momentum")
    muon_weight_decay: float = option(
        0.0, "Muon's decoupled weight decay: each step multiplies the matrices by 1 - lr * muon_weight_decay"
    )
    muon_ns: str = option(
        "quintic",
        "Muon's Newton-Schulz coefficients: quintic (Keller Jordan's, five times) or polar_express (Amsel et al.)",
        choices=("quintic", "polar_express"),
    )
    normuon: bool = option(False, "Muon: NorMuon's per-neuron normalisation of the orthogonalised update")
    normuon_beta2: float = option(0.95, "normuon: the decay of each neuron's running mean square")
    # the speedrun's schedules and weight averaging (docs/training.md measures them)
    seq_len_start: int = option(
        0,
        "> 0: train on windows this long first, doubling over the first seq_len_warmup of the run up to block_size "
        "(each batch's rows cut into shorter ones: the same tokens; 0 = block_size throughout)",
    )
    seq_len_warmup: float = option(
        0.3, "seq_len_start: the share of the run (its steps, or with lr_schedule=time its budget) the windows grow in"
    )
    ema_decay: float = option(
        0.0,
        "> 0: keep an exponential moving average of the weights (this decay per step) and evaluate and save it "
        "at the end of the run (0 = none)",
    )
    # evaluation, logging, checkpoints
    eval_interval: int = option(250, "steps between evaluations; each saves out_dir/ckpt_NNNNNN.pt")
    eval_iters: int = option(20, "batches per evaluation (0 = every window of the val split)")
    log_interval: int = option(10, "steps between log lines (and rows of out_dir/metrics.jsonl)")
    core_every: int = option(0, "steps between CORE evaluations (gptlite.evaluate.core), and one at the end (0 = none)")
    core_bundle: str = option(
        "", "CORE's eval bundle folder ('' = data/eval_bundle, downloaded once from nanochat's eval_bundle.zip)"
    )
    core_max_per_task: int | None = option(None, "CORE: the first N items of each task (none = all)")
    keep_last: int = option(3, "checkpoints kept, plus best.pt, the lowest val loss")
    wandb_log: bool = option(False, "log to Weights & Biases too")
    wandb_project: str = option("gptlite", "the wandb project")
    wandb_run_name: str = option("", "the wandb run's name")
    tensorboard: bool = option(
        False, "also write TensorBoard event files to OUT_DIR/tensorboard (tensorboard --logdir OUT_DIR)"
    )
    # system
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = option("auto", "autocast precision: auto (bfloat16 on CUDA, float32 elsewhere)", choices=DTYPE_CHOICES)
    compile: bool = option(False, "torch.compile the model")
    activation_checkpointing: bool = option(
        False,
        "keep each block's input only and recompute the block in backward: "
        "activations no longer grow with depth, for ~1/3 more compute",
    )
    chunked_loss: bool = option(
        True,
        "the output head and cross-entropy a chunk of tokens at a time, never all the "
        "logits at once (gptlite.model.loss); false computes them whole",
    )
    fsdp: bool = option(False, "under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP")
    seed: int = option(1337, "the seed of the initial weights, the data order and dropout")
    # faults
    on_nan: str = option(
        "skip", "a non-finite loss or gradient norm: skip that update, or stop the run", choices=("skip", "stop")
    )
    max_minutes: float = option(0.0, "> 0: end the run with a checkpoint once this much wall-clock time has passed")
    budget: str = option(
        "",
        "derive the recipe from a budget: 90s, 20min, 3h (the whole command's wall-clock), 1e15flops, 50Mtokens; "
        "every key given besides wins (gptlite.scaling)",
    )
    scaling_laws: str = option("", "--budget: the laws.json to derive from (default: this data's on this machine)")

    def __post_init__(self) -> None:
        """Every problem of the values, reported together in one ValueError; each concern checks its own fields.
        The rules of one way of training's options (LoRA's, DPO's, RL's) sit beside that way, in gptlite.train, and
        are checked where the run is resolved (gptlite.train.run_config.check_training_options)."""
        problems = self._finite_problems()
        if problems:  # NaN passes every comparison below, and a NaN learning rate skips every update
            raise ValueError("invalid training config: " + "; ".join(problems))
        problems = [
            *self._range_problems(),
            *self._optimizer_problems(),
            *self._schedule_problems(),
            *self._evaluation_problems(),
            *self._system_problems(),
        ]
        if problems:
            raise ValueError("invalid training config: " + "; ".join(problems))

    def _finite_problems(self) -> list[str]:
        return [
            f"{f.name}={getattr(self, f.name)} must be a finite number"
            for f in fields(self)
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))
        ]

    def _range_problems(self) -> list[str]:
        """Counts that must be positive, sizes and rates that must not be negative, and every choice list."""
        problems = []
        positive = ("batch_size", "max_iters", "eval_interval", "log_interval", "keep_last")
        for name in positive:
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        for name in (
            "total_batch_size",
            "warmup_iters",
            "lr_decay_iters",
            "eval_iters",
            "grad_clip",
            "weight_decay",
            "max_minutes",
            "muon_lr",
            "muon_weight_decay",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        return problems + choice_problems(type(self), vars(self))

    def _optimizer_problems(self) -> list[str]:
        """AdamW's betas, Muon's momentum, NorMuon's and the weight average's decays."""
        problems = []
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1) (AdamW's betas, e.g. 0.9 and 0.95)")
        if not 0 <= self.muon_momentum < 1:
            problems.append(f"muon_momentum={self.muon_momentum} must be in [0, 1) (e.g. 0.95)")
        if not 0 <= self.normuon_beta2 < 1:
            problems.append(f"normuon_beta2={self.normuon_beta2} must be in [0, 1) (e.g. 0.95)")
        if not 0 <= self.ema_decay < 1:
            problems.append(f"ema_decay={self.ema_decay} must be in [0, 1) (0 = no average; e.g. 0.99)")
        muon = set_options(self, MUON_OPTIONS)
        if self.optimizer != "muon" and muon:
            problems.append(
                f"{', '.join(muon)} configure Muon, and optimizer={self.optimizer} trains without it; add "
                "--optimizer=muon or leave them out"
            )
        if self.fsdp and (self.normuon or self.ema_decay):
            problems.append(
                "normuon=true and ema_decay work on whole matrices, each rank alone; they run without fsdp=true"
            )
        return problems

    def _schedule_problems(self) -> list[str]:
        """The windows' warm-up (seq_len_start) and the learning rate's schedule."""
        problems = []
        if self.seq_len_start:
            ratio = self.model.block_size / self.seq_len_start if self.seq_len_start > 0 else 0
            if self.seq_len_start < 0 or ratio < 1 or ratio != 2 ** round(math.log2(ratio)):
                problems.append(
                    f"seq_len_start={self.seq_len_start} must be block_size={self.model.block_size} divided by a power "
                    f"of two (e.g. {max(1, self.model.block_size // 4)}), which the windows double from"
                )
            if not 0 < self.seq_len_warmup <= 1:
                problems.append(f"seq_len_warmup={self.seq_len_warmup} must be in (0, 1]: a share of the run")
        if self.learning_rate < 0 or self.min_lr < 0 or 0 < self.learning_rate < self.min_lr:
            problems.append(
                f"learning_rate={self.learning_rate}, min_lr={self.min_lr}: need 0 <= min_lr <= learning_rate "
                "(learning_rate=0 trains nothing and ignores min_lr: an evaluation-only run)"
            )
        if self.lr_schedule == "time" and not self.max_minutes:
            problems.append("lr_schedule='time' decays over the time budget; set max_minutes > 0")
        return problems

    def _evaluation_problems(self) -> list[str]:
        """CORE's schedule and its options."""
        problems = []
        if self.core_every < 0 or (self.core_max_per_task is not None and self.core_max_per_task < 1):
            problems.append(
                f"core_every={self.core_every} must be >= 0 and core_max_per_task={self.core_max_per_task} >= 1"
            )
        if not self.core_every and (self.core_bundle or self.core_max_per_task is not None):
            problems.append(
                "core_bundle and core_max_per_task choose how CORE is scored, and core_every=0 scores it never; "
                "set core_every=N (steps)"
            )
        return problems

    def _system_problems(self) -> list[str]:
        problems = []
        if self.fsdp and self.dtype == "float16":
            problems.append(
                "fsdp=true trains in bfloat16 or float32, not float16 (no sharded loss scaler here); use dtype=bfloat16"
            )
        return problems


# ---------------------------------------------------------------------------------------------
# Loading: defaults < TOML < --key=value


def flat_fields() -> dict[str, tuple[type, typing.Any]]:
    """Map every flat key to (dataclass, field type). Model and training keys never collide."""
    out: dict[str, tuple[type, typing.Any]] = {}
    for cls in (GPTConfig, TrainConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name != "model":
                out[f.name] = (cls, hints[f.name])
    return out


def convert(key: str, value: typing.Any, typ: typing.Any) -> typing.Any:
    """Convert a TOML or command-line value to the field's type, or raise ValueError naming the key."""
    allowed = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    # the word "none" means None only for a field that allows it: a str field keeps it as text
    if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in allowed):
        if type(None) in allowed:
            return None
        raise ValueError(f"{key}=None is not allowed; give a {allowed[0].__name__}")
    base = next(t for t in allowed if t is not type(None))
    if base is bool:
        return parse_bool(key, value)
    if base is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not an integer")
        if isinstance(value, (int, str)):
            try:
                return int(value)  # exact at any size (a round trip through float is not above 2**53)
            except ValueError:
                pass
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not an integer") from None
        if not as_float.is_integer():
            raise ValueError(f"{key}={value!r} is not an integer")
        return int(as_float)  # accepts 1e3 and 1_000
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a number") from None
    return str(value)


def parse_bool(key: str, value: typing.Any) -> bool:
    """A boolean option's value: True or False, or one of TRUE_WORDS / FALSE_WORDS in any case; else ValueError
    naming the key. The one place true and false are read."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS:
        return True
    if isinstance(value, str) and value.lower() in FALSE_WORDS:
        return False
    raise ValueError(f"{key}={value!r} is not a boolean; use true or false")


# nanoGPT's config keys that gptlite names or does otherwise: the pointer a user gets instead of "unknown key"
NANOGPT_KEYS = {
    "gradient_accumulation_steps": "gptlite sets the optimizer step in tokens: --total_batch_size=N, and the "
    "micro-steps are N / (batch_size * block_size * number of GPUs)",
    "eval_only": "for an evaluation-only run use --learning_rate=0 --max_iters=1 (one step that changes nothing, "
    "then an evaluation)",
    "always_save_checkpoint": "gptlite saves a checkpoint at every evaluation and keeps the newest --keep_last=N "
    "plus best.pt, the one with the lowest val loss",
    "decay_lr": "the learning rate always decays from learning_rate to min_lr; for a constant rate set --min_lr to "
    "the --learning_rate",
    "backend": "the process-group backend is picked for you: nccl with CUDA GPUs, gloo otherwise",
    "dataset": "use --data_dir=DIR, the folder of *train*.bin / *val*.bin shards that data/prepare.py writes",
}


def unknown_key(key: str, known: typing.Iterable[str], what: str = "config key", prefix: str = "") -> str:
    """The message for an unknown key: a pointer for nanoGPT's keys, else the closest known key."""
    if key in NANOGPT_KEYS:
        return f"'{key}' is nanoGPT's key: {NANOGPT_KEYS[key]}"
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else "; run with --help to list the keys"
    return f"unknown {what} '{prefix}{key}'{hint}"


def read_toml(path: str | Path) -> dict[str, typing.Any]:
    """Read a flat TOML config file (a [model] table is also accepted) with a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; see configs/ for presets")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"config file {path}: 'model' must be a table")
    return {**data, **model}


def build_config(values: dict[str, typing.Any]) -> TrainConfig:
    """Build a TrainConfig from flat key -> value pairs (strings or typed), reporting every problem."""
    known = flat_fields()
    problems = []
    model_kw: dict[str, typing.Any] = {}
    train_kw: dict[str, typing.Any] = {}
    for key, value in values.items():
        if key not in known:
            problems.append(unknown_key(key, known))
            continue
        cls, typ = known[key]
        try:
            converted = convert(key, value, typ)
        except ValueError as e:
            problems.append(str(e))
            continue
        (model_kw if cls is GPTConfig else train_kw)[key] = converted
    if problems:
        raise ValueError("; ".join(problems))
    model_error = None
    try:
        model = GPTConfig(**model_kw)
    except ValueError as e:
        model_error, model = str(e), GPTConfig()
    try:
        cfg = TrainConfig(model=model, **train_kw)
    except ValueError as e:
        raise ValueError("; ".join(filter(None, [model_error, str(e)]))) from None
    if model_error:
        raise ValueError(model_error)
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict[str, typing.Any]:
    """A flat, JSON- and checkpoint-friendly dict; `build_config(config_to_dict(c)) == c`."""
    flat = dataclasses.asdict(cfg)
    return {**flat.pop("model"), **flat}
