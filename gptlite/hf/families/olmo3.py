"""OLMo 3 (Olmo3ForCausalLM): OLMo 2 whose layers are of two kinds, three local ones attending to a sliding window
to each global one (layer_types; by default every fourth layer global), both kinds with one RoPE base, the global
layers' alone scaled (YaRN, in the long-context models). llama.cpp's olmo2 (in the llama.cpp of the test extra)
attends to the whole context in every layer: GGUF export is refused for a model with sliding-window layers."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.gemma3 import LocalLayers
from gptlite.hf.families.olmo2 import OLMO2, Olmo2


class Olmo3(LocalLayers, Olmo2):
    architecture = "Olmo3ForCausalLM"
    model_type = "olmo3"
    config_defaults = {
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,  # without layer_types: every fourth layer global
        # the sliding-window layers' base where their table has none: Olmo3Config's default_theta, never a top-level
        # rope_theta (convert_rope_params_to_dict hands that to the global layers alone)
        "default_theta": 500_000.0,
    }
    own_switches = {}  # OLMo 2's, and the window Gemma 3's switches name
    by_name = True  # an OLMo 3 without local layers is an OLMo 2: chosen where the model was loaded as one
    also_takes = (OLMO2,)
    takes_yarn = True

    def marked(self, config: GPTConfig) -> bool:
        """OLMo 2's switches with sliding-window layers."""
        return (config.norm_position == "post" or config.qk_norm_scope == "all") and bool(config.sliding_window)

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """OLMo 2's norms, with or without local layers; YaRN or no RoPE scaling."""
        both = config.norm_position == "post" and config.qk_norm_scope == "all"
        return both and config.rope_scaling in ("", "yarn")

    # -----------------------------------------------------------------------------------------
    # Import

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        """OLMo 2's, and the local layers: the window, which they are, their RoPE base."""
        return {
            **super().own_values(c, n_layer, local_rope),
            **self.local_values(c, n_layer, local_rope, "default_theta"),
        }

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        return self.local_unsupported(local_rope)

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        return self.local_config(config, rope)

    # -----------------------------------------------------------------------------------------
    # GGUF

    def gguf_problem(self, config: GPTConfig) -> str | None:
        """llama.cpp's olmo2 (the llama.cpp of gptlite's test extra) attends to the whole context in every layer, and
        has no YaRN of the global layers alone."""
        if config.sliding_window:
            return (
                f"llama.cpp's olmo2 attends to the whole context in every layer, and this model's layers "
                f"{config.window_layers} to a sliding window of {config.sliding_window}; GGUF export needs an OLMo 3 "
                "without sliding-window layers"
            )
        if config.rope_scaling:
            return (
                "gptlite writes llama.cpp's olmo2 without RoPE scaling, and this model has "
                f"rope_scaling={config.rope_scaling!r}"
            )
        return None


OLMO3 = Olmo3()
