"""The rules every mixture-of-experts family of Llama's layout shares (`Experts`, mixed in before the family's dense
rules): a router and n_experts SwiGLU experts in every block's feed-forward (gptlite.model.network.MixtureOfExperts),
read from config.json's counts, written back, and their weights named both ways, one tensor per expert or all
experts stacked; in GGUF, the router and the experts stacked as llama.cpp's olmoe, qwen3moe and granitemoe read
them."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry

# transformers' names of the SwiGLU parts of expert e, where a checkpoint holds a tensor per expert
EXPERT = "mlp.experts.{e}."


class Experts:
    """A mixin for a LlamaLayout family whose feed-forward is a mixture of experts: its import, export and weights'
    names for the experts; the rest (attention, norms, multipliers) are the dense family's it is mixed into."""

    experts = True
    experts_keys = ("num_experts", "num_local_experts")  # config.json's count of experts, either (attribute_map)
    router_name = "mlp.gate"
    renorm_key: str | None = "norm_topk_prob"  # None: the family always divides the top k by their sum (Granite)

    # -----------------------------------------------------------------------------------------
    # Import

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        key = next((k for k in self.experts_keys if k in c.values), self.experts_keys[0])
        return dict(
            **super().own_values(c, n_layer, local_rope),
            n_experts=c.integer(key),
            experts_per_token=c.integer("num_experts_per_tok"),
            experts_renorm=c.flag(self.renorm_key) if self.renorm_key else True,
            router_aux_loss_coef=c.number("router_aux_loss_coef", low=None),
        )

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """The dense family's keys, and the experts' count, top k, their weights' division and the load-balancing
        loss's weight."""
        keys = {
            **super().own_config(config, rope),
            self.experts_keys[0]: config.n_experts,
            "num_experts_per_tok": config.experts_per_token,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": False,
        }
        if self.renorm_key:
            keys[self.renorm_key] = config.experts_renorm
        return keys

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def ffn_entries(self, config: GPTConfig) -> list[Entry]:
        """The router, then every expert's gate and value (fused as gptlite's fc) and its output, a tensor each."""
        experts = [EXPERT.format(e=e) for e in range(config.n_experts)]
        return [
            ("ffn.router.weight", (f"{self.router_name}.weight",), False),
            ("ffn.fc.weight", tuple(f"{x}{part}.weight" for x in experts for part in ("gate_proj", "up_proj")), False),
            ("ffn.out_proj.weight", tuple(f"{x}down_proj.weight" for x in experts), False),
        ]

    # -----------------------------------------------------------------------------------------
    # GGUF

    gguf_renorm = False  # llama.cpp's architecture divides the top k's weights by their sum (it has no key for it)

    def gguf_problem(self, config: GPTConfig) -> str | None:
        if config.experts_renorm != self.gguf_renorm:
            does = "divides" if self.gguf_renorm else "does not divide"
            return (
                f"llama.cpp's {self.gguf_name} {does} the chosen experts' weights by their sum, and this model has "
                f"experts_renorm={config.experts_renorm}; GGUF export needs experts_renorm={self.gguf_renorm}"
            )
        return super().gguf_problem(config)

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        super().add_own_hyperparameters(writer, config)
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.experts_per_token)

    def gguf_ffn(self, ours: str, theirs: str, weight, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """The router (ffn_gate_inp) and the experts stacked as gptlite stacks them: their gates, values and
        outputs (ffn_gate_exps, ffn_up_exps, ffn_down_exps), (E, out, in) each."""
        yield f"{theirs}ffn_gate_inp.weight", weight(f"{ours}ffn.router.weight")
        gate, up = weight(f"{ours}ffn.fc.weight").split([config.ffn_hidden, config.ffn_hidden], dim=1)
        yield f"{theirs}ffn_gate_exps.weight", gate.contiguous()
        yield f"{theirs}ffn_up_exps.weight", up.contiguous()
        yield f"{theirs}ffn_down_exps.weight", weight(f"{ours}ffn.out_proj.weight")
