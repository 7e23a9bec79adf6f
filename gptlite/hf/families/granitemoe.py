"""Granite 3 MoE (GraniteMoeForCausalLM; Granite 3.0/3.1 1B-A400M, 3B-A800M): Granite 3's multipliers with a mixture
of experts for every feed-forward, its top-k weights a softmax over the top k logits (the router's softmax divided by
the top k's sum: experts_renorm), its experts stacked in one tensor each (input_linear, output_linear)."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import Entry
from gptlite.hf.families.experts import Experts
from gptlite.hf.families.granite import Granite

MOE = "block_sparse_moe."


class GraniteMoe(Experts, Granite):
    architecture = "GraniteMoeForCausalLM"
    model_type = "granitemoe"
    config_defaults = {
        **Granite.config_defaults,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    }
    experts_keys = ("num_local_experts",)
    renorm_key = None

    gguf_name = "granitemoe"
    gguf_renorm = True

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """Its router divides the top k by their sum; its attention has no q/k norm."""
        return config.experts_renorm and not config.qk_norm and not config.rope_scaling

    def ffn_entries(self, config: GPTConfig) -> list[Entry]:
        return [
            ("ffn.router.weight", (f"{MOE}router.layer.weight",), False),
            ("ffn.fc.weight", (f"{MOE}input_linear.weight",), False),
            ("ffn.out_proj.weight", (f"{MOE}output_linear.weight",), False),
        ]


GRANITE_MOE = GraniteMoe()
