"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): Llama's switches, q/k/v and the gate/value stored fused (as gptlite holds
them); Phi-4-mini's RoPE on part of each head (rope_dims) and LongRoPE within its original context (longrope).
llama.cpp's phi3 is not written: export to transformers and convert with llama.cpp's convert_hf_to_gguf.py."""

from __future__ import annotations

import math

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.llama import LlamaLayout


class Phi3(LlamaLayout):
    architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    config_defaults = {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096}
    own_switches = {"rope_dims": 0}
    by_name = True
    attn_names = ("self_attn.qkv_proj",)
    fc_names = ("mlp.gate_up_proj",)

    def marked(self, config: GPTConfig) -> bool:
        return config.rope_scaling == "longrope" or bool(config.rope_dims)

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return config.rope_scaling in ("", "longrope")

    # -----------------------------------------------------------------------------------------
    # Import

    def rope_type(self, rope: dict) -> str:
        kind = super().rope_type(rope)
        return "longrope" if kind in ("su", "yarn") else kind  # Phi-3's first configs' names for LongRoPE

    def scaled_rope(self, c: ConfigFile, kind: str, at: dict) -> dict | None:
        return self.longrope(c, at) if kind == "longrope" else super().scaled_rope(c, kind, at)

    def original_context(self, c: ConfigFile, at: dict) -> int:
        """Phi-3's config class always has a top-level original_max_position_embeddings (4096 by default), which
        transformers takes over the RoPE table's."""
        return c.integer("original_max_position_embeddings")

    def longrope(self, c: ConfigFile, at: dict) -> dict:
        """LongRoPE, as transformers computes it, within the original context: there the short factors divide the
        frequencies and cos and sin are scaled by the attention factor (the long factors apply past it)."""
        positions = c.integer("max_position_embeddings")
        original = self.original_context(c, at)
        factor = c.number("factor", default=positions / original, **at)
        default_attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        attention = c.number("attention_factor", default=default_attention, **at)
        return dict(
            rope_scaling="longrope",
            rope_short_factor=",".join(repr(f) for f in factor_list(c, "short_factor", at)),
            rope_long_factor=",".join(repr(f) for f in factor_list(c, "long_factor", at)),
            rope_attention_factor=attention,
            rope_original_context=original,
            block_size=min(positions, original),  # the long factors apply past it
        )

    def partial_rope(self, head_dim: int, partial: float) -> dict | None:
        return {"rope_dims": int(head_dim * partial)}

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        return c.integer("sliding_window", nullable=True), []

    # -----------------------------------------------------------------------------------------
    # Export

    def rope_parameters(self, config: GPTConfig) -> dict:
        """The part of each head rotated, and LongRoPE's factors."""
        rope = super().rope_parameters(config)
        if config.rope_dims:
            rope["partial_rotary_factor"] = config.rope_dims / config.head_width
        if config.rope_scaling != "longrope":
            return rope
        short = [float(f) for f in config.rope_short_factor.split(",")]
        long = [float(f) for f in config.rope_long_factor.split(",") if f.strip()] or short
        return {
            **rope,
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long,
            "attention_factor": config.rope_attention_factor,
            "original_max_position_embeddings": config.rope_original_context,
        }

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Its dropouts, and the context its RoPE was trained on (where LongRoPE's long factors start)."""
        original = config.rope_original_context if config.rope_scaling == "longrope" else config.block_size
        return {
            "original_max_position_embeddings": original,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
        }


def factor_list(c: ConfigFile, key: str, at: dict) -> list[float]:
    """A LongRoPE list of factors (short_factor, long_factor: transformers needs both), each a finite number > 0."""
    name, value = c.lookup(key, **at)
    if not isinstance(value, list):
        raise c.bad(name, value, "a list of finite numbers > 0")
    return [c.number(str(i), table={str(i): v for i, v in enumerate(value)}, where=name) for i in range(len(value))]


PHI3 = Phi3()
