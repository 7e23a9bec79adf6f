"""Qwen3-MoE (Qwen3MoeForCausalLM; Qwen3-30B-A3B): Qwen3's rules (RMSNorm on each head's q and k) with a mixture of
experts, moe_intermediate_size wide each, for every feed-forward. Dense feed-forwards among them (mlp_only_layers,
decoder_sparse_step > 1) are refused in one line: the released models have none."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.experts import Experts
from gptlite.hf.families.llama import Qwen3


class Qwen3Moe(Experts, Qwen3):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    config_defaults = {
        "num_key_value_heads": 4,
        "sliding_window": 4096,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    }
    ffn_key = "moe_intermediate_size"  # intermediate_size is the dense feed-forwards'

    gguf_name = "qwen3moe"
    gguf_renorm = True

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return config.qk_norm and not own and super().holds(config, own)

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        n_layer = c.integer("num_hidden_layers")
        step = c.integer("decoder_sparse_step")
        only = c.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in only):
            raise c.bad("mlp_only_layers", only, "a list of layer indices or null")
        dense = [i for i in range(n_layer) if i in only or (i + 1) % step]
        if not dense:
            return []
        return [
            f"dense feed-forwards in layers {','.join(map(str, dense))} among the experts' (mlp_only_layers={only}, "
            f"decoder_sparse_step={step}), which gptlite does not mix"
        ]

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        return {
            **super().own_config(config, rope),
            "moe_intermediate_size": config.ffn_hidden,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        super().add_own_hyperparameters(writer, config)
        writer.add_expert_feed_forward_length(config.ffn_hidden)


QWEN3_MOE = Qwen3Moe()
