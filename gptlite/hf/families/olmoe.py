"""OLMoE (OlmoeForCausalLM): Llama's layout with RMSNorm over all of q and all of k (qk_norm, qk_norm_scope="all", as
OLMo 2's) and a mixture of experts for every feed-forward, whose top-k weights are the router's softmax as it is
unless norm_topk_prob says otherwise."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.experts import Experts
from gptlite.hf.families.llama import LlamaLayout


class Olmoe(Experts, LlamaLayout):
    architecture = "OlmoeForCausalLM"
    model_type = "olmoe"
    config_defaults = {
        "rms_norm_eps": 1e-5,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.01,
        "clip_qkv": None,
    }
    window_key = False

    def marked(self, config: GPTConfig) -> bool:
        return config.qk_norm_scope == "all"

    gguf_name = "olmoe"
    gguf_always_output = True  # llama.cpp's olmoe always reads an output matrix

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        return config.qk_norm and not config.rope_scaling and own == ["qk_norm_scope"]

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        return dict(**super().own_values(c, n_layer, local_rope), qk_norm=True, qk_norm_scope="all")

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        clip = c.get("clip_qkv")
        return [] if clip is None else [f"q, k and v clipped to +-{clip} (clip_qkv), which gptlite does not do"]

    def gguf_problem(self, config: GPTConfig) -> str | None:
        if config.kv_heads != config.n_head:  # its k norm is n_embd wide: every head has its own keys
            return (
                f"llama.cpp's olmoe has as many key/value heads as query heads, and this model {config.kv_heads} of "
                f"{config.n_head}; GGUF export needs n_kv_head={config.n_head} (OLMoE-1B-7B's kind)"
            )
        return super().gguf_problem(config)

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        return {**super().own_config(config, rope), "clip_qkv": None}


OLMOE = Olmoe()
