"""nanochat (NanoChatForCausalLM): ffn="relu2" (a two-matrix MLP, fc1 and fc2), parameter-free RMSNorms
(norm_weight=False; per-head q/k norms, qk_norm, and one on the embeddings, embed_norm), RoPE the other way round
(rope_reverse), an untied head, its final logits soft-capped (logit_softcap). llama.cpp has no architecture for it:
export to transformers."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.llama import LlamaLayout

# nanochat's switches, all of them (its final logits soft-capped or not)
SWITCHES = {
    "pos_emb": "rope",
    "norm": "rmsnorm",
    "ffn": "relu2",
    "bias": False,
    "qkv_bias": False,
    "qk_norm": True,
    "rope_scaling": "",
    "norm_weight": False,
    "embed_norm": True,
    "rope_reverse": True,
}


class NanoChat(LlamaLayout):
    architecture = "NanoChatForCausalLM"
    model_type = "nanochat"
    config_defaults = {"final_logit_softcapping": 15.0}
    own_switches = {"norm_weight": True, "embed_norm": False, "rope_reverse": False}
    soft_cap = True
    activation = "relu2"
    fc_names = ("mlp.fc1",)
    down_name = "mlp.fc2"

    def core(self, config: GPTConfig) -> bool:
        return all(getattr(config, k) == v for k, v in SWITCHES.items())

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """No other family's switches."""
        return not [k for k in own if k not in SWITCHES]

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        """relu^2, parameter-free norms (one on the embeddings too), RoPE the other way round."""
        return dict(
            ffn="relu2",
            norm_weight=False,
            embed_norm=True,
            rope_reverse=True,
            qk_norm=True,
            logit_softcap=c.softcap(),
        )

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Its squared ReLU and its final soft cap (None: none)."""
        return {"hidden_act": "relu2", "final_logit_softcapping": config.logit_softcap or None}


NANOCHAT = NanoChat()
