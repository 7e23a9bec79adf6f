"""Qwen3.5's text model (Qwen3_5ForCausalLM, qwen3_5_text), and the text tower of its vision-language checkpoints
(Qwen3_5ForConditionalGeneration, qwen3_5), the form Qwen3.5 is released in: Llama's layout with its layers of two
kinds (layer_types: three of every four Gated DeltaNet's linear attention, gptlite.model.gated_deltanet, the fourth
full attention), the full attention gated on its output (attn_output_gate) with per-head q/k norms and RoPE on part
of each head (rope_dims), every RMSNorm scaling by 1 + weight (norm_unit_offset).

Its RoPE is multimodal (mrope_section): each of three sections of the rotated pairs takes the positions of its own
axis (time, height, width), and for text all three are the token's position, so that it is plain RoPE on the rotated
part. A vision-language checkpoint's vision tower (model.visual.*) is left out, and said so in one warning line; the
model exports as the text model's class. GGUF is not written (gptlite has no writer for llama.cpp's qwen35 yet)."""

from __future__ import annotations

import warnings
from pathlib import Path

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry
from gptlite.hf.families.llama import LlamaLayout

LINEAR_KEYS = {  # GPTConfig's sizes of the linear_attention layers -> config.json's keys
    "linear_k_heads": "linear_num_key_heads",
    "linear_v_heads": "linear_num_value_heads",
    "linear_k_dim": "linear_key_head_dim",
    "linear_v_dim": "linear_value_head_dim",
    "linear_conv_kernel": "linear_conv_kernel_dim",
}
KINDS = ("linear_attention", "full_attention")  # layer_types' kinds in its class
# the switches of other families Qwen3.5's class has too: Gemma's norms, Qwen3's q/k norms, Phi-4-mini's partial RoPE
TAKEN = ("norm_unit_offset", "rope_dims", "qk_norm_scope")


class Qwen35(LlamaLayout):
    architecture = "Qwen3_5ForCausalLM"
    model_type = "qwen3_5_text"
    config_defaults = {  # Qwen3_5TextConfig's
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "intermediate_size": 12288,
        "vocab_size": 248320,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,  # without layer_types: every fourth layer full attention
    }
    # its own switches, with the value a model of every other family has
    own_switches = {
        "layer_types": "",
        "attn_output_gate": False,
        **{name: GPTConfig.__dataclass_fields__[name].default for name in LINEAR_KEYS},
    }
    qk_norm = True
    window_key = False  # Qwen3_5TextConfig has no sliding window
    text_prefix = "model."  # where the text model's weights are (the vision-language class nests them)
    partial_rotary_default = 0.25  # Qwen3_5TextConfig's where rope_parameters leaves it out

    def has_layers(self, config: GPTConfig) -> bool:
        """Layers of its two kinds, its attention always gated on its output."""
        return set(config.layer_kinds) <= set(KINDS) and config.attn_output_gate

    def marked(self, config: GPTConfig) -> bool:
        return True  # the output gate is its own

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """Its class always has the norms scaling by 1 + weight and per-head q/k norms, and no RoPE scaling; no other
        family's switches but those it shares."""
        other = [k for k in own if k not in self.own_switches and k not in TAKEN]
        return (
            not other
            and config.norm_unit_offset
            and config.qk_norm
            and config.qk_norm_scope == "head"
            and not config.rope_scaling
            and not config.qkv_bias
        )

    # -----------------------------------------------------------------------------------------
    # Import

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        """Its layers' kinds and the linear ones' sizes, the gated attention, the norms scaling by 1 + weight."""
        values = dict(
            layer_types=",".join(self.layer_types(c, n_layer)),
            attn_output_gate=True,
            norm_unit_offset=True,
        )
        for ours, theirs in LINEAR_KEYS.items():
            values[ours] = c.integer(theirs)
        return values

    def layer_types(self, c: ConfigFile, n_layer: int) -> list[str]:
        """Each layer's kind as Qwen3_5TextConfig reads it: layer_types, else every full_attention_interval-th layer
        full attention and the others linear."""
        kinds = c.get("layer_types", None)
        if kinds is None:
            interval = c.integer("full_attention_interval")
            return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
        if not isinstance(kinds, list) or len(kinds) != n_layer or any(k not in KINDS for k in kinds):
            raise c.bad(
                "layer_types",
                kinds,
                f"a list of num_hidden_layers={n_layer} kinds, each linear_attention or full_attention",
            )
        return kinds

    def partial_rope(self, head_dim: int, partial: float) -> dict | None:
        return {"rope_dims": int(head_dim * partial)}

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Its layers' kinds, the linear layers' sizes, the part of each head RoPE rotates."""
        rotated = (config.rope_dims or config.head_width) / config.head_width
        return {
            "layer_types": list(config.layer_kinds),
            **{theirs: getattr(config, ours) for ours, theirs in LINEAR_KEYS.items()},
            "rope_parameters": {**rope, "partial_rotary_factor": rotated},
            "rope_scaling": None,
        }

    # -----------------------------------------------------------------------------------------
    # The weights' names

    left_out_parts = {"mtp.": "multi-token prediction (mtp.*)"}  # weight prefixes that are not the text model's

    def left_out(self, names: list[str]) -> list[str]:
        """Multi-token prediction's weights (mtp.*: a draft head for speculative decoding, which transformers leaves
        out too), and a vision-language checkpoint's vision tower: left out, said so in one warning line."""
        dropped = [n for n in names if n.startswith(tuple(self.left_out_parts))]
        if dropped:
            parts = [what for prefix, what in self.left_out_parts.items() if any(n.startswith(prefix) for n in dropped)]
            warnings.warn(
                f"{self.architecture}: the text model is loaded and {len(dropped)} weights of "
                f"{' and '.join(parts)} are left out: gptlite reads text only",
                stacklevel=4,
            )
        return dropped

    def entries(self, config: GPTConfig) -> list[Entry]:
        """The blocks' weights by the kind of each layer: attention's under self_attn, Gated DeltaNet's under
        linear_attn (q, k, v, z, b and a stacked in gptlite's in_proj; the convolution's taps as they are)."""
        top = [
            ("tok_emb.weight", (f"{self.text_prefix}embed_tokens.weight",), False),
            ("norm.weight", (f"{self.text_prefix}norm.weight",), False),
        ]
        if not config.tie_embeddings:
            top.append(("lm_head.weight", ("lm_head.weight",), False))
        shared = [
            ("attn_norm.weight", ("input_layernorm.weight",), False),
            ("ffn_norm.weight", ("post_attention_layernorm.weight",), False),
            ("ffn.fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), False),
            ("ffn.out_proj.weight", ("mlp.down_proj.weight",), False),
        ]
        attention = [
            (
                "attn.qkv.weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                False,
            ),
            ("attn.out_proj.weight", ("self_attn.o_proj.weight",), False),
            ("attn.qk_norm.q_norm.weight", ("self_attn.q_norm.weight",), False),
            ("attn.qk_norm.k_norm.weight", ("self_attn.k_norm.weight",), False),
        ]
        projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        linear = [
            ("attn.in_proj.weight", tuple(f"linear_attn.{name}.weight" for name in projections), False),
            ("attn.conv.weight", ("linear_attn.conv1d.weight",), False),
            ("attn.dt_bias", ("linear_attn.dt_bias",), False),
            ("attn.A_log", ("linear_attn.A_log",), False),
            ("attn.norm.weight", ("linear_attn.norm.weight",), False),
            ("attn.out_proj.weight", ("linear_attn.out_proj.weight",), False),
        ]
        out = list(top)
        for i, kind in enumerate(config.layer_kinds):
            theirs_prefix = f"{self.text_prefix}layers.{i}."
            for ours, theirs, transposed in [*shared, *(linear if kind == "linear_attention" else attention)]:
                out.append((f"blocks.{i}.{ours}", tuple(theirs_prefix + t for t in theirs), transposed))
        return out


class Qwen35VisionLanguage(Qwen35):
    """The vision-language checkpoint: the text model's config under text_config, its weights under
    model.language_model., the vision tower's under model.visual. (left out); multi-token prediction's (mtp.*),
    which transformers leaves out too. It is only ever read: a model loaded from one exports as Qwen3_5ForCausalLM,
    the class AutoModelForCausalLM builds from it."""

    architecture = "Qwen3_5ForConditionalGeneration"
    model_type = "qwen3_5"
    text_prefix = "model.language_model."
    left_out_parts = {"model.visual.": "the vision tower (model.visual.*)", **Qwen35.left_out_parts}

    def core(self, config: GPTConfig) -> bool:
        return False  # exports as the text model

    def text_config(self, c: dict, path: Path) -> dict:
        text = c.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(
                f"{path}: a {self.architecture} config needs its text model's config under text_config (a JSON "
                "object); download the file again"
            )
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in c:  # the head's tie, said at the top level
            return {**text, "tie_word_embeddings": c["tie_word_embeddings"]}
        return text


QWEN35 = Qwen35()
QWEN35_VL = Qwen35VisionLanguage()
