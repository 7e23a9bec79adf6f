"""Gemma 3's text model (Gemma3ForCausalLM, gemma3_text): ffn="geglu", norms before and after each branch
(norm_position="both") scaling by 1 + weight (norm_unit_offset), per-head q/k norms, embeddings times sqrt(n_embd)
(embed_scale), its own attention scale (attn_scale), local layers attending to a sliding window (sliding_window,
window_layers) with a RoPE base of their own (rope_local_theta), an optional final soft cap; llama.cpp's gemma3."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry
from gptlite.hf.families.llama import LlamaLayout

# Gemma 3's switches, all of them but those of its attention (a scale, a window, the local layers' RoPE base) and
# its final soft cap (FREE); embed_scale is sqrt(n_embd)
SWITCHES = {
    "pos_emb": "rope",
    "norm": "rmsnorm",
    "ffn": "geglu",
    "bias": False,
    "qkv_bias": False,
    "qk_norm": True,
    "qk_norm_scope": "head",
    "rope_scaling": "",
    "norm_position": "both",
    "norm_unit_offset": True,
    "residual_scale": 1.0,
    "logits_scaling": 1.0,
    "nope_layers": "",
    "norm_weight": True,
    "embed_norm": False,
    "rope_reverse": False,
}
FREE = ("attn_scale", "sliding_window", "window_layers", "rope_local_theta", "embed_scale")


class LocalLayers(LlamaLayout):
    """The rules of a family whose layers are of two kinds (layer_types): global ones, and local ones attending to a
    sliding window with a RoPE table of their own (rope_parameters.sliding_attention, without scaling): Gemma 3's,
    OLMo 3's."""

    def rope_tables(self, c: ConfigFile) -> tuple[dict, str, dict | None]:
        """A table per kind of layer, rope_scaling merged into the global layers' (as
        Gemma3TextConfig.convert_rope_params_to_dict does); where the sliding-window layers' table lacks a base, it
        comes from a top-level key (local_values)."""
        scaling = c.table("rope_scaling")
        parameters = c.table("rope_parameters")
        tables = {}
        for kind in ("full_attention", "sliding_attention"):
            table = (parameters or {}).get(kind)
            if table is not None and not isinstance(table, dict):
                raise c.bad(f"rope_parameters.{kind}", table, "a table (a JSON object)")
            tables[kind] = dict(table or {})
        tables["full_attention"].update(scaling or {})
        return tables["full_attention"], "rope_parameters.full_attention", tables["sliding_attention"]

    def layer_types(self, c: ConfigFile, n_layer: int) -> list[str]:
        """Each layer's kind as Gemma3TextConfig and Olmo3Config read it: layer_types (transformers' older
        "attention" is "full_attention"), else every sliding_window_pattern-th layer global and the others sliding."""
        kinds = c.get("layer_types", None)
        if kinds is None:
            pattern = c.integer("sliding_window_pattern")
            return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
        known = ("sliding_attention", "full_attention", "attention")
        if not isinstance(kinds, list) or len(kinds) != n_layer or any(k not in known for k in kinds):
            raise c.bad(
                "layer_types",
                kinds,
                f"a list of num_hidden_layers={n_layer} kinds, each sliding_attention or full_attention",
            )
        return ["full_attention" if k == "attention" else k for k in kinds]

    def local_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None, top: str) -> dict:
        """The local layers' switches: the window, which layers, their RoPE base (the local table's, else the file's
        `top` key)."""
        local = [i for i, kind in enumerate(self.layer_types(c, n_layer)) if kind == "sliding_attention"]
        window = c.integer("sliding_window", nullable=True) if local else None
        if local and window is None:
            raise c.bad("sliding_window", None, "an integer >= 1 where layers are sliding_attention")
        where = dict(table=local_rope, where="rope_parameters.sliding_attention", top=top)
        return dict(
            sliding_window=window or 0,
            window_layers=",".join(map(str, local)),
            rope_local_theta=c.number("rope_theta", **where) if local else 0.0,
        )

    def local_unsupported(self, local_rope: dict | None) -> list[str]:
        if self.rope_type(local_rope) != "default":
            return [f"RoPE scaling of type {self.rope_type(local_rope)!r} in the sliding-window layers"]
        return []

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        """None: the window is its local layers' (local_values), not a bound on the context."""
        return None, []

    def local_config(self, config: GPTConfig, rope: dict) -> dict:
        """The window, its layers and the RoPE table of each kind of layer (`rope` the global layers')."""
        local = config.window_layer_ids
        return {
            "sliding_window": config.sliding_window or None,
            "layer_types": ["sliding_attention" if i in local else "full_attention" for i in range(config.n_layer)],
            "rope_parameters": {
                "full_attention": rope,
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": config.rope_local_theta or config.rope_theta,
                },
            },
        }

    def add_local_hyperparameters(self, writer, config: GPTConfig) -> None:
        """The local layers in llama.cpp's keys: the window, which they are, their RoPE base."""
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([i in config.window_layer_ids for i in range(config.n_layer)])
        writer.add_rope_freq_base_swa(config.rope_local_theta or config.rope_theta)


class Gemma3(LocalLayers):
    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    config_defaults = {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,  # the global layers'
        "rope_local_base_freq": 10_000.0,  # the sliding-window layers'
        "sliding_window": 4096,
        "sliding_window_pattern": 6,  # without layer_types: every 6th layer global
        "query_pre_attn_scalar": 256,
    }
    own_switches = {"norm_unit_offset": False, "sliding_window": 0, "window_layers": "", "rope_local_theta": 0.0}
    soft_cap = True
    activation = "gelu_pytorch_tanh"
    activation_key = "hidden_activation"
    norm_names = ("input_layernorm", "pre_feedforward_layernorm")  # and after each branch: more_layer_entries
    gguf_name = "gemma3"

    def core(self, config: GPTConfig) -> bool:
        return all(getattr(config, k) == v for k, v in SWITCHES.items()) and config.embed_scale == config.n_embd**0.5

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """No other family's switches but its attention's and soft cap."""
        return not [k for k in own if k not in SWITCHES and k not in FREE]

    # -----------------------------------------------------------------------------------------
    # Import

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        """GeGLU, norms before and after each branch scaling by 1 + weight, per-head q/k norms, embeddings times
        sqrt(hidden), its own attention scale, sliding-window layers with a RoPE base of their own."""
        return dict(
            ffn="geglu",
            norm_position="both",
            norm_unit_offset=True,
            qk_norm=True,
            embed_scale=c.integer("hidden_size") ** 0.5,
            attn_scale=c.number("query_pre_attn_scalar") ** -0.5,
            logit_softcap=c.softcap(),
            **self.local_values(c, n_layer, local_rope, top="rope_local_base_freq"),
        )

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        unsupported = []
        if c.get("attn_logit_softcapping", None):
            unsupported.append(
                f"soft-capped attention scores (attn_logit_softcapping={c.get('attn_logit_softcapping')})"
            )
        if c.flag("use_bidirectional_attention", False):
            unsupported.append("bidirectional attention (use_bidirectional_attention=true)")
        return unsupported + self.local_unsupported(local_rope)

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Its activation, attention scale, sliding window with its layers and their RoPE, and soft cap."""
        scalar = config.attn_scale**-2 if config.attn_scale else config.head_width
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            **self.local_config(config, rope),
            "final_logit_softcapping": config.logit_softcap or None,
            "attn_logit_softcapping": None,
        }

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def more_layer_entries(self) -> list[Entry]:
        return [
            ("attn_post_norm.weight", ("post_attention_layernorm.weight",), False),
            ("ffn_post_norm.weight", ("post_feedforward_layernorm.weight",), False),
        ]

    # -----------------------------------------------------------------------------------------
    # GGUF

    def gguf_problem(self, config: GPTConfig) -> str | None:
        if config.attn_scale and config.attn_scale != config.head_width**-0.5:
            return (
                f"llama.cpp's gemma3 scales attention by 1 / sqrt(head width) = {config.head_width**-0.5:.6g}, and "
                f"this model by attn_scale={config.attn_scale:.6g} (query_pre_attn_scalar other than head_dim); GGUF "
                "export needs them equal"
            )
        return None

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        """Its local layers; its final soft cap."""
        self.add_local_hyperparameters(writer, config)
        if config.logit_softcap:
            writer.add_final_logit_softcapping(config.logit_softcap)

    def more_gguf_norms(self, ours: str, theirs: str, norm) -> Iterator[tuple[str, torch.Tensor]]:
        yield f"{theirs}post_attention_norm.weight", norm(f"{ours}attn_post_norm.weight")
        yield f"{theirs}post_ffw_norm.weight", norm(f"{ours}ffn_post_norm.weight")


GEMMA3 = Gemma3()
