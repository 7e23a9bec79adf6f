"""Ministral 3 (Ministral3ForCausalLM; Mistral3ForConditionalGeneration's text model): Mistral's rules with YaRN's
RoPE scaling and q multiplied by a factor that grows with its position, 1 + beta * log(1 + floor(position / original
context)) (query_scale_beta: llama_4_scaling_beta and original_max_position_embeddings of its rope_parameters)."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry, Family
from gptlite.hf.families.llama import MISTRAL, LlamaLayout

# Ministral3Config's RoPE where a config.json has none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


class Ministral3(LlamaLayout):
    architecture = "Ministral3ForCausalLM"
    model_type = "ministral3"
    config_defaults = {"num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5}
    own_switches = {"query_scale_beta": 0.0}
    by_name = True  # a Ministral 3 without its q factor is a Mistral: chosen where the model was loaded as one
    also_takes = (MISTRAL,)
    takes_yarn = True
    gguf_name = None

    def marked(self, config: GPTConfig) -> bool:
        return bool(config.query_scale_beta)

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return config.rope_scaling in ("", "yarn")

    # -----------------------------------------------------------------------------------------
    # Import

    def rope_tables(self, c: ConfigFile) -> tuple[dict, str, dict | None]:
        """Ministral3Config's YaRN table where the file has neither rope_parameters nor rope_scaling."""
        if c.table("rope_parameters") is None and c.table("rope_scaling") is None:
            return dict(DEFAULT_ROPE), "rope_parameters", None
        return super().rope_tables(c)

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        """Llama's, and q's factor: llama_4_scaling_beta of the RoPE table, over its original context (which
        transformers reads from the table too)."""
        values, window, unsupported = super().values(c)
        rope, where, _ = self.rope_tables(c)
        at = dict(table=rope, where=where)
        values["query_scale_beta"] = c.number("llama_4_scaling_beta", low=None, **at)
        if values["query_scale_beta"] < 0:
            raise c.bad(f"{where}.llama_4_scaling_beta", rope["llama_4_scaling_beta"], "a number >= 0")
        values["rope_original_context"] = self.original_context(c, at)
        return values, window, unsupported

    def window(self, c: ConfigFile) -> tuple[int | None, list[str]]:
        """Mistral's: a sliding window bounds the context."""
        return c.integer("sliding_window", nullable=True), []

    # -----------------------------------------------------------------------------------------
    # Export

    def rope_parameters(self, config: GPTConfig) -> dict:
        """q's factor, and the original context it counts in, beside the RoPE base."""
        return {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "llama_4_scaling_beta": config.query_scale_beta,
            "original_max_position_embeddings": config.rope_original_context,
        }


MINISTRAL3 = Ministral3()


class Mistral3Vision(Family):
    """Mistral3ForConditionalGeneration (Ministral 3's checkpoints; Mistral Small 3.1's): a vision tower and its
    projector beside a text model (text_config: a Ministral 3, or a Mistral), of which gptlite reads the text model
    alone, under language_model., with the top level's tie_word_embeddings (as the class ties them). It exports back
    as that text model's class; it is never the family a model of gptlite's switches exports as."""

    architecture = "Mistral3ForConditionalGeneration"
    model_type = "mistral3"
    prefix = "language_model."
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
    config_defaults = {"tie_word_embeddings": True}  # Mistral3Config's
    text_families = {"ministral3": MINISTRAL3, "mistral": MISTRAL}

    def core(self, config: GPTConfig) -> bool:
        return False

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        """The text model's, read from text_config with its own family's rules; tie_word_embeddings the top
        level's."""
        text = c.table("text_config")
        if text is None:
            raise c.bad("text_config", None, "the text model's config (a table)")
        kind = text.get("model_type", "mistral")  # Mistral3Config's default text model
        family = self.text_families.get(kind)
        if family is None:
            raise c.bad("text_config.model_type", kind, f"one of {', '.join(self.text_families)}")
        values, window, unsupported = family.values(ConfigFile(text, c.path, family))
        values["tie_embeddings"] = c.flag("tie_word_embeddings")
        return values, window, unsupported

    def exports_as(self, config: GPTConfig) -> str:
        """Ministral 3's class where the model has its q factor or YaRN, else Mistral's."""
        takes = config.query_scale_beta or config.rope_scaling
        return MINISTRAL3.architecture if takes else MISTRAL.architecture

    def entries(self, config: GPTConfig) -> list[Entry]:
        return MINISTRAL3.entries(config)  # Llama's names, as Mistral's


MISTRAL3_VISION = Mistral3Vision()
