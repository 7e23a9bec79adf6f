"""Granite 4's attention-only models (GraniteMoeHybridForCausalLM with every layer "attention" and no experts:
Granite 4.0 350M, 1B, micro): Granite 3's rules, the feed-forward its shared MLP (shared_mlp, gate and value fused in
input_linear as gptlite holds them), RoPE or no positions at all (position_embedding_type, the whole model's).
Granite 4-H's Mamba-2 layers and a mixture of experts are refused in one line. In llama.cpp such a model is a granite
(as llama.cpp's own convert_hf_to_gguf.py writes one), without RoPE where it has no positions."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.granite import GRANITE, Granite
from gptlite.hf.families.llama import SMOLLM3

ATTENTION = ("attention", "full_attention")  # layer_types' names of an attention layer: IBM's, transformers' own
MAMBA = ("mamba", "linear_attention")


class Granite4(Granite):
    architecture = "GraniteMoeHybridForCausalLM"
    model_type = "granitemoehybrid"
    config_defaults = {
        **Granite.config_defaults,
        "shared_intermediate_size": 1024,
        "position_embedding_type": None,  # no positions
        "layer_types": None,  # every layer Mamba-2
        "num_local_experts": 8,
    }
    own_switches = {}  # none: it takes Granite's multipliers and SmolLM3's NoPE layers (all layers or none)
    by_name = True  # its switches are Granite's: chosen where the model was loaded as one
    also_takes = (GRANITE, SMOLLM3)
    ffn_key = "shared_intermediate_size"  # intermediate_size is the experts'
    fc_names = ("shared_mlp.input_linear",)
    down_name = "shared_mlp.output_linear"

    def marked(self, config: GPTConfig) -> bool:
        return False  # nothing is its own: Granite's multipliers are Granite's

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """Positions in every layer or in none (position_embedding_type is the whole model's)."""
        return config.nope_layer_ids in (frozenset(), frozenset(range(config.n_layer)))

    # -----------------------------------------------------------------------------------------
    # Import

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        values = super().own_values(c, n_layer, local_rope)
        positions = c.get("position_embedding_type")
        if positions not in ("rope", None):
            raise c.bad("position_embedding_type", positions, '"rope" or null (no positions)')
        if positions is None:
            values["nope_layers"] = ",".join(map(str, range(n_layer)))
        return values

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        unsupported = []
        n_layer = c.integer("num_hidden_layers")
        kinds = c.get("layer_types")
        if kinds is None:  # transformers makes every layer Mamba-2
            kinds = ["mamba"] * n_layer
        if not isinstance(kinds, list) or len(kinds) != n_layer or any(k not in ATTENTION + MAMBA for k in kinds):
            raise c.bad("layer_types", kinds, f"a list of num_hidden_layers={n_layer} kinds, each attention or mamba")
        mamba = sum(kind in MAMBA for kind in kinds)
        if mamba:
            unsupported.append(
                f"Mamba-2 layers (layer_types names {mamba} of its {n_layer} layers mamba, as Granite 4-H's), which "
                "gptlite does not have"
            )
        experts = c.integer("num_local_experts", low=0)
        if experts:
            unsupported.append(f"a mixture of experts (num_local_experts={experts}), which gptlite does not have")
        return unsupported

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Granite's multipliers; the shared MLP alone, every layer attention (in IBM's name for it, which
        llama.cpp's converter reads), its positions, and Mamba sizes transformers' check takes for any width (there
        are no Mamba layers)."""
        return {
            **super().own_config(config, rope),
            "shared_intermediate_size": config.ffn_hidden,
            "num_local_experts": 0,
            "num_experts_per_tok": 0,
            "layer_types": ["attention"] * config.n_layer,
            "position_embedding_type": None if config.nope_layers else "rope",
            "mamba_n_heads": 1,
        }

    # -----------------------------------------------------------------------------------------
    # GGUF

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        super().add_own_hyperparameters(writer, config)
        if config.nope_layers:  # llama.cpp's granite rotates q and k where rope.scaling.finetuned says so
            writer.add_rope_scaling_finetuned(False)


GRANITE4 = Granite4()
