"""Llama's layout (RoPE, RMSNorm, SwiGLU, no biases; grouped-query attention, a head width of its own, a tied or
untied head, Llama 3's RoPE scaling), the rules every family of that layout shares (`LlamaLayout`), and the families
that are those rules with a switch or two:
    LlamaForCausalLM    Llama 2/3.x, SmolLM2, TinyLlama
    MistralForCausalLM  the same (the context at most its sliding window)
    Qwen2ForCausalLM    biases on q, k and v (qkv_bias)
    Qwen3ForCausalLM    RMSNorm on each head's q and k (qk_norm)
    SmolLM3ForCausalLM  layers whose attention has no positions (nope_layers)
In llama.cpp: llama (q and k rows reordered from the halves gptlite rotates to llama.cpp's interleaved pairs; Llama
3's RoPE scaling as the per-frequency factors of a rope_freqs tensor), qwen2 and qwen3 (halves: nothing reordered),
smollm3."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry, Family, float_weights


class LlamaLayout(Family):
    """The rules of Llama's layout in both directions, with a hook for what each family of it adds (`own_values`,
    `own_unsupported`, `own_config`, `add_own_hyperparameters`, ...) and class attributes for its names."""

    # transformers' names in a block
    attn_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    fc_names = ("mlp.gate_proj", "mlp.up_proj")  # SwiGLU's fc: its first half is the gate (through silu)
    down_name = "mlp.down_proj"
    norm_names = ("input_layernorm", "post_attention_layernorm")
    # config.json: the activation and its key, the feed-forward's width, what the class always has
    activation = "silu"
    activation_key = "hidden_act"
    ffn_key = "intermediate_size"
    qkv_bias = False  # q, k and v always have biases (Qwen2; its config has no attention_bias)
    qk_norm = False  # RMSNorm on each head's q and k (Qwen3)
    window_key = True  # its config class has a sliding_window (written null: gptlite attends to the whole context)
    takes_yarn = False  # its class reads YaRN's RoPE scaling (rope_type "yarn"), and gptlite's export writes it
    partial_rotary_default = 1.0  # the part of each head RoPE rotates where the config.json leaves it out
    experts = False  # its feed-forward is a mixture of experts (gptlite.hf.families.experts)
    # llama.cpp
    gguf_interleaved = False  # llama.cpp's architecture rotates pairs (0, 1), (2, 3), ...: q and k rows reordered
    gguf_norm_names = ("attn_norm", "ffn_norm")
    gguf_always_output = False  # the architecture reads an output matrix even where the head is tied

    def core(self, config: GPTConfig) -> bool:
        layout = (config.pos_emb, config.norm, config.ffn) == ("rope", "rmsnorm", "swiglu") and not config.bias
        return layout and bool(config.n_experts) == self.experts

    # -----------------------------------------------------------------------------------------
    # Import

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        n_layer = c.integer("num_hidden_layers")
        heads = c.integer("num_attention_heads")
        hidden = c.integer("hidden_size")
        kv_heads = c.integer("num_key_value_heads", nullable=True) or heads
        head_dim = c.integer("head_dim", nullable=True) or hidden // heads
        rope, rope_name, local_rope = self.rope_tables(c)
        at = dict(table=rope, where=rope_name)  # a RoPE value: the table's, else the top level's, else the default
        values = dict(
            vocab_size=c.integer("vocab_size"),
            block_size=c.integer("max_position_embeddings"),
            n_layer=n_layer,
            n_head=heads,
            n_kv_head=kv_heads if kv_heads != heads else None,
            n_embd=hidden,
            head_dim=head_dim if head_dim * heads != hidden else None,
            bias=False,
            pos_emb="rope",
            rope_theta=c.number("rope_theta", **at),
            norm="rmsnorm",
            norm_eps=c.number("rms_norm_eps"),
            ffn="swiglu",
            ffn_hidden=c.integer(self.ffn_key),
            tie_embeddings=c.flag("tie_word_embeddings"),
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
        )
        values.update(self.own_values(c, n_layer, local_rope))
        unsupported = []
        key = self.activation_key
        act = self.activation
        if c.get(key, act) != act:
            unsupported.append(f"{key}={c.get(key)!r} (gptlite's {self.architecture} uses {act})")
        unsupported += self.own_unsupported(c, local_rope)
        if c.flag("attention_bias", False) and not self.qkv_bias:
            unsupported.append("biases on the attention's projections, its output's too (attention_bias=true)")
        if c.flag("mlp_bias", False):
            unsupported.append("biases in the feed-forward (mlp_bias=true)")
        kind = self.rope_type(rope)
        scaled = self.scaled_rope(c, kind, at)
        if scaled is None:
            unsupported.append(f"RoPE scaling of type {kind!r} (gptlite has llama3's, and Phi-3's longrope)")
        else:
            values.update(scaled)
        partial = c.number("partial_rotary_factor", high=1.0, default=self.partial_rotary_default, **at)
        if partial != 1:
            part = self.partial_rope(head_dim, partial)
            if part is None:
                unsupported.append(
                    f"RoPE on part of each head (partial_rotary_factor={partial}; Phi-3's alone has it here)"
                )
            else:
                values.update(part)
        window, problems = self.window(c)
        unsupported += problems
        if window:
            values["block_size"] = min(values["block_size"], window)  # within the window, attention is exact
        return values, window, unsupported

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        """The switches this family sets beyond Llama's."""
        return {}

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        """What of this family's own keys gptlite cannot hold, one phrase each."""
        return []

    def rope_tables(self, c: ConfigFile) -> tuple[dict, str, dict | None]:
        """(The RoPE table, its name in the file, the sliding-window layers' table or None), as transformers reads
        them: the older rope_scaling before rope_parameters. Values a table lacks come from the top level
        (rope_theta), else the family's default."""
        scaling = c.table("rope_scaling")
        parameters = c.table("rope_parameters")
        return dict(scaling or parameters or {}), "rope_scaling" if scaling else "rope_parameters", None

    def rope_type(self, rope: dict) -> str:
        return rope.get("rope_type", rope.get("type", "default"))

    def scaled_rope(self, c: ConfigFile, kind: str, at: dict) -> dict | None:
        """The switches of RoPE scaling `kind` (none for the default), or None where gptlite has no such scaling."""
        if kind == "default":
            return {}
        if kind == "yarn" and self.takes_yarn:
            return self.yarn_rope(c, at)
        if kind != "llama3":
            return None
        return dict(
            rope_scaling="llama3",
            rope_factor=c.number("factor", **at),
            rope_low_freq_factor=c.number("low_freq_factor", **at),
            rope_high_freq_factor=c.number("high_freq_factor", **at),
            rope_original_context=self.original_context(c, at),
        )

    def yarn_rope(self, c: ConfigFile, at: dict) -> dict:
        """YaRN's switches as transformers' _compute_yarn_parameters reads them: the factor, the original context,
        the frequencies' bounds (beta_fast, beta_slow: 32 and 1 where null or absent) and the factor cos and sin are
        scaled by (attention_factor, else computed from factor, mscale and mscale_all_dim)."""
        factor = c.number("factor", **at)
        table = at["table"]
        if table.get("truncate", True) is not True:
            raise c.bad(f"{at['where']}.truncate", table["truncate"], "true (gptlite's YaRN rounds its ramp's ends)")
        attention = table.get("attention_factor")
        if attention is not None:
            attention = c.number("attention_factor", **at)
        elif table.get("mscale") and table.get("mscale_all_dim"):
            mscale = c.number("mscale", **at)
            mscale_all_dim = c.number("mscale_all_dim", **at)
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
        return dict(
            rope_scaling="yarn",
            rope_factor=factor,
            rope_original_context=self.original_context(c, at),
            rope_attention_factor=attention,
            rope_beta_fast=c.number("beta_fast", **at) if table.get("beta_fast") else 32.0,
            rope_beta_slow=c.number("beta_slow", **at) if table.get("beta_slow") else 1.0,
        )

    def original_context(self, c: ConfigFile, at: dict) -> int:
        """original_max_position_embeddings as transformers' standardize_rope_params takes it for a scaled RoPE: a
        top-level one over the RoPE table's, else max_position_embeddings."""
        if "original_max_position_embeddings" in c.values:
            return c.integer("original_max_position_embeddings")
        return c.integer("original_max_position_embeddings", default=c.get("max_position_embeddings"), **at)

    def partial_rope(self, head_dim: int, partial: float) -> dict | None:
        """The switches of RoPE on `partial` of each head, or None where the family has no such RoPE."""
        return None

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        """(The attention window or None, what of it gptlite cannot hold): a window where use_sliding_window says
        so."""
        if c.flag("use_sliding_window", False):
            return c.integer("sliding_window", nullable=True), []
        return None, []

    # -----------------------------------------------------------------------------------------
    # Export

    def hf_config(self, config: GPTConfig, common: dict) -> dict:
        rope = self.rope_parameters(config)
        if config.rope_scaling == "llama3":
            rope = {
                **rope,
                "rope_type": "llama3",
                "factor": config.rope_factor,
                "low_freq_factor": config.rope_low_freq_factor,
                "high_freq_factor": config.rope_high_freq_factor,
                "original_max_position_embeddings": config.rope_original_context,
            }
        if config.rope_scaling == "yarn":
            rope = {
                **rope,
                "rope_type": "yarn",
                "factor": config.rope_factor,
                "original_max_position_embeddings": config.rope_original_context,
                "attention_factor": config.rope_attention_factor,
                "beta_fast": config.rope_beta_fast,
                "beta_slow": config.rope_beta_slow,
            }
        return {
            **common,
            "hidden_size": config.n_embd,
            "intermediate_size": config.ffn_hidden,
            "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_width,
            "max_position_embeddings": config.block_size,
            "rms_norm_eps": config.norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": config.dropout,
            # transformers < 5 reads rope_theta and rope_scaling, 5 and later rope_parameters
            "rope_theta": config.rope_theta,
            "rope_scaling": rope if config.rope_scaling else None,
            "rope_parameters": rope,
            **self.window_config(config),
            **self.own_config(config, rope),
        }

    def rope_parameters(self, config: GPTConfig) -> dict:
        """rope_parameters before Llama 3's scaling (Phi-3 adds its own)."""
        return {"rope_type": "default", "rope_theta": config.rope_theta}

    def window_config(self, config: GPTConfig) -> dict:
        """The window's keys: none (gptlite attends to the whole context)."""
        return {"sliding_window": None} if self.window_key else {}

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """The keys this family adds to Llama's (those of the same name replace Llama's)."""
        return {}

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def entries(self, config: GPTConfig) -> list[Entry]:
        top = [
            ("tok_emb.weight", ("model.embed_tokens.weight",), False),
            ("norm.weight", ("model.norm.weight",), False),
        ]
        norms = self.norm_names
        layer = [
            ("attn_norm.weight", (f"{norms[0]}.weight",), False),
            ("attn.qkv.weight", tuple(f"{t}.weight" for t in self.attn_names), False),
            *([("attn.qkv.bias", tuple(f"{t}.bias" for t in self.attn_names), False)] if config.qkv_bias else []),
            ("attn.out_proj.weight", ("self_attn.o_proj.weight",), False),
            *(
                [
                    ("attn.qk_norm.q_norm.weight", ("self_attn.q_norm.weight",), False),
                    ("attn.qk_norm.k_norm.weight", ("self_attn.k_norm.weight",), False),
                ]
                if config.qk_norm
                else []
            ),
            ("ffn_norm.weight", (f"{norms[1]}.weight",), False),
            *self.ffn_entries(config),
            *self.more_layer_entries(),
        ]
        if not config.norm_weight:  # parameter-free norms (nanochat's) have no tensors
            top = [entry for entry in top if not entry[0].startswith("norm.")]
            layer = [entry for entry in layer if "norm." not in entry[0]]
        return self.every_block(top, layer, config)

    def ffn_entries(self, config: GPTConfig) -> list[Entry]:
        """The feed-forward's weights in a block: SwiGLU's gate and value (fused as gptlite's fc) and its output."""
        return [
            ("ffn.fc.weight", tuple(f"{t}.weight" for t in self.fc_names), False),
            ("ffn.out_proj.weight", (f"{self.down_name}.weight",), False),
        ]

    def more_layer_entries(self) -> list[Entry]:
        """A block's weights beyond Llama's (Gemma 3's norms after each branch)."""
        return []

    # -----------------------------------------------------------------------------------------
    # GGUF

    def gguf_problem(self, config: GPTConfig) -> str | None:
        """YaRN: gptlite writes none of its keys, and llama.cpp would rotate without it."""
        if config.rope_scaling == "yarn":
            return (
                f"gptlite writes llama.cpp's {self.gguf_name} without YaRN's RoPE scaling, and this model has "
                "rope_scaling='yarn'; export it with python -m gptlite.hf export and convert that directory with "
                "llama.cpp's convert_hf_to_gguf.py"
            )
        return None

    def add_hyperparameters(self, writer, config: GPTConfig) -> None:
        writer.add_head_count_kv(self.gguf_kv_heads(config))
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_rope_dimension_count(config.head_width)
        if config.head_width * config.n_head != config.n_embd:
            writer.add_key_length(config.head_width)
            writer.add_value_length(config.head_width)
        self.add_own_hyperparameters(writer, config)

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        """The GGUF keys of this family's own switches."""

    def gguf_kv_heads(self, config: GPTConfig) -> int | list[int]:
        """head_count_kv: the key-value heads of every layer (a list: each layer's)."""
        return config.kv_heads

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        weight = float_weights(state)
        shift = 1.0 if config.norm_unit_offset else 0.0  # llama.cpp scales by the weight, Gemma by 1 + weight
        norm = lambda name: weight(name) + shift  # noqa: E731

        yield "token_embd.weight", weight("tok_emb.weight")
        yield "output_norm.weight", norm("norm.weight")
        if not config.tie_embeddings or self.gguf_always_output:
            yield "output.weight", weight("lm_head.weight")
        if config.rope_scaling == "llama3":
            yield "rope_freqs.weight", rope_factors(config)
        for i in range(config.n_layer):
            yield from self.gguf_layer(i, weight, norm, config)

    def gguf_layer(self, i: int, weight, norm, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Block i's tensors in llama.cpp's names and layout (`weight` and `norm` give gptlite's in float32)."""
        ours = f"blocks.{i}."
        theirs = f"blk.{i}."
        q_rows = config.n_head * config.head_width
        kv_rows = config.kv_heads * config.head_width
        q, k, v = weight(f"{ours}attn.qkv.weight").split([q_rows, kv_rows, kv_rows])
        if self.gguf_interleaved:
            q = llama_rows(q, config.n_head)
            k = llama_rows(k, config.kv_heads)
        norms = self.gguf_norm_names
        yield f"{theirs}{norms[0]}.weight", norm(f"{ours}attn_norm.weight")
        yield f"{theirs}attn_q.weight", q
        yield f"{theirs}attn_k.weight", k
        yield f"{theirs}attn_v.weight", v
        if config.qkv_bias:
            for name, b in zip(
                ("q", "k", "v"), weight(f"{ours}attn.qkv.bias").split([q_rows, kv_rows, kv_rows]), strict=True
            ):
                yield f"{theirs}attn_{name}.bias", b
        if config.qk_norm:
            yield f"{theirs}attn_q_norm.weight", norm(f"{ours}attn.qk_norm.q_norm.weight")
            yield f"{theirs}attn_k_norm.weight", norm(f"{ours}attn.qk_norm.k_norm.weight")
        yield f"{theirs}attn_output.weight", weight(f"{ours}attn.out_proj.weight")
        yield f"{theirs}{norms[1]}.weight", norm(f"{ours}ffn_norm.weight")
        yield from self.more_gguf_norms(ours, theirs, norm)
        yield from self.gguf_ffn(ours, theirs, weight, config)

    def gguf_ffn(self, ours: str, theirs: str, weight, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """A block's feed-forward in llama.cpp's names: SwiGLU's gate, value and output (`weight` gives a gptlite
        tensor in float32)."""
        gate, up = weight(f"{ours}ffn.fc.weight").split([config.ffn_hidden, config.ffn_hidden])
        yield f"{theirs}ffn_gate.weight", gate
        yield f"{theirs}ffn_up.weight", up
        yield f"{theirs}ffn_down.weight", weight(f"{ours}ffn.out_proj.weight")

    def more_gguf_norms(self, ours: str, theirs: str, norm) -> Iterator[tuple[str, torch.Tensor]]:
        """A block's norms beyond Llama's, in llama.cpp's names (Gemma 3's after each branch)."""
        yield from ()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` times the original (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def llama_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from the halves gptlite rotates (the first half of a head's width against the second) to the
    interleaved pairs (0, 1), (2, 3), ... that llama.cpp's llama architecture rotates."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(config: GPTConfig) -> torch.Tensor:
    """Llama 3's RoPE scaling as the factor each frequency's wavelength is stretched by (llama.cpp's rope_freqs)."""
    dim = config.head_width
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    low_wavelength = config.rope_original_context / config.rope_low_freq_factor
    high_wavelength = config.rope_original_context / config.rope_high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < high_wavelength:
            factors.append(1.0)
        elif wavelength > low_wavelength:
            factors.append(config.rope_factor)
        else:
            smooth = (config.rope_original_context / wavelength - config.rope_low_freq_factor) / (
                config.rope_high_freq_factor - config.rope_low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / config.rope_factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# The families


class Llama(LlamaLayout):
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    window_key = False
    suggested_flags = {"pos_emb": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False}
    gguf_name = "llama"
    gguf_interleaved = True

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return config.rope_scaling != "yarn"  # YaRN: the families that take it (takes_yarn)


class Mistral(LlamaLayout):
    """Llama's rules; attention within a sliding window, which bounds the context (within it, attention is
    exact)."""

    architecture = "MistralForCausalLM"
    model_type = "mistral"
    config_defaults = {"num_key_value_heads": 8, "sliding_window": 4096}
    by_name = True
    gguf_name = "llama"
    gguf_interleaved = True

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return not config.rope_scaling

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        return c.integer("sliding_window", nullable=True), []


class Qwen(LlamaLayout):
    """Qwen2's and Qwen3's shared rules: no RoPE scaling, and no sliding-window layers."""

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return not config.rope_scaling

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        window, problems = super().window(c)
        if c.flag("use_sliding_window", False):
            problems = [*problems, "sliding-window attention in some layers (use_sliding_window=true)"]
        return window, problems

    def window_config(self, config: GPTConfig) -> dict:
        return {**super().window_config(config), "use_sliding_window": False, "max_window_layers": config.n_layer}


class Qwen2(Qwen):
    """Biases on q, k and v."""

    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    config_defaults = {"num_key_value_heads": 32, "sliding_window": 4096}
    qkv_bias = True
    gguf_name = "qwen2"

    def marked(self, config: GPTConfig) -> bool:
        return config.qkv_bias


class Qwen3(Qwen):
    """RMSNorm on each head's q and k."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    config_defaults = {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096}
    qk_norm = True
    gguf_name = "qwen3"

    def marked(self, config: GPTConfig) -> bool:
        return config.qk_norm and config.qk_norm_scope == "head"


class SmolLM3(LlamaLayout):
    """Layers whose attention has no positions (NoPE): no_rope_layers holds 1 where a layer rotates q and k."""

    architecture = "SmolLM3ForCausalLM"
    model_type = "smollm3"
    config_defaults = {"tie_word_embeddings": True, "rope_theta": 2_000_000.0, "no_rope_layer_interval": 4}
    own_switches = {"nope_layers": ""}
    by_name = True
    gguf_name = "smollm3"
    gguf_interleaved = True

    def marked(self, config: GPTConfig) -> bool:
        return bool(config.nope_layers)

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        return {"nope_layers": ",".join(str(i) for i, on in enumerate(self.rotates(c, n_layer)) if not on)}

    def rotates(self, c: ConfigFile, n_layer: int) -> list[int]:
        """no_rope_layers (1 where a layer rotates q and k), or every no_rope_layer_interval-th layer without."""
        rotates: Any = c.get("no_rope_layers", None)
        if rotates is None:
            interval = c.integer("no_rope_layer_interval")
            return [int((i + 1) % interval != 0) for i in range(n_layer)]
        if not isinstance(rotates, list) or len(rotates) != n_layer or any(r not in (0, 1) for r in rotates):
            raise c.bad("no_rope_layers", rotates, f"a list of num_hidden_layers={n_layer} 0s and 1s")
        return rotates

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        return {
            "no_rope_layers": [int(i not in config.nope_layer_ids) for i in range(config.n_layer)],
            "use_sliding_window": False,
        }

    def gguf_problem(self, config: GPTConfig) -> str | None:
        problem = super().gguf_problem(config)
        if problem:
            return problem
        # llama.cpp's smollm3 has no key for its NoPE layers: every fourth layer is one
        every_fourth = ",".join(str(i) for i in range(config.n_layer) if (i + 1) % 4 == 0)
        if config.nope_layers.replace(" ", "") != every_fourth:
            return (
                f"llama.cpp's smollm3 has no positions in every fourth layer ({every_fourth or 'none here'}), and "
                f"this model in layers {config.nope_layers}; GGUF export needs nope_layers={every_fourth!r}"
            )
        return None


LLAMA = Llama()
MISTRAL = Mistral()
QWEN2 = Qwen2()
QWEN3 = Qwen3()
SMOLLM3 = SmolLM3()
