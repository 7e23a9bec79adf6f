"""Granite 3 (GraniteForCausalLM): Llama's layout with multipliers on the embeddings, the residual branches,
attention's scores and the logits (embed_scale, residual_scale, attn_scale, logits_scaling); llama.cpp's granite."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.llama import LlamaLayout

# Granite's multipliers, with the value a model of the others has: a model that sets any of them is a Granite
SCALES = {"embed_scale": 1.0, "residual_scale": 1.0, "attn_scale": 0.0, "logits_scaling": 1.0}


class Granite(LlamaLayout):
    architecture = "GraniteForCausalLM"
    model_type = "granite"
    config_defaults = {
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "logits_scaling": 1.0,
    }
    own_switches = SCALES
    by_name = True
    window_key = False
    gguf_name = "granite"
    gguf_interleaved = True

    def marked(self, config: GPTConfig) -> bool:
        return any(getattr(config, k) != v for k, v in SCALES.items())

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        return dict(
            embed_scale=c.number("embedding_multiplier"),
            residual_scale=c.number("residual_multiplier"),
            attn_scale=c.number("attention_multiplier"),
            logits_scaling=c.number("logits_scaling"),
        )

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Its multipliers (its attention's scale is always its own: 1 / sqrt(head width) when gptlite's is)."""
        return {
            "embedding_multiplier": config.embed_scale,
            "residual_multiplier": config.residual_scale,
            "attention_multiplier": config.attn_scale or config.head_width**-0.5,
            "logits_scaling": config.logits_scaling,
        }

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        writer.add_embedding_scale(config.embed_scale)
        writer.add_residual_scale(config.residual_scale)
        writer.add_attention_scale(config.attn_scale or config.head_width**-0.5)
        writer.add_logit_scale(config.logits_scaling)


GRANITE = Granite()
