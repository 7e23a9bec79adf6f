"""OLMo 2 (Olmo2ForCausalLM): Llama's layout with each norm on its branch's output (norm_position="post") and RMSNorm
over all of q and all of k (qk_norm, qk_norm_scope="all"); llama.cpp's olmo2."""

from __future__ import annotations

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile
from gptlite.hf.families.llama import LlamaLayout


class Olmo2(LlamaLayout):
    architecture = "Olmo2ForCausalLM"
    model_type = "olmo2"
    config_defaults = {"rms_norm_eps": 1e-5}
    own_switches = {"norm_position": "pre", "qk_norm_scope": "head"}
    # its norms are on the branches' outputs, under their own names
    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")
    gguf_name = "olmo2"
    gguf_norm_names = ("post_attention_norm", "post_ffw_norm")
    gguf_always_output = True  # llama.cpp's olmo2 always reads an output matrix

    def marked(self, config: GPTConfig) -> bool:
        return (config.norm_position == "post" or config.qk_norm_scope == "all") and not config.sliding_window

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        # OLMo 2 has both, and no sliding-window layers (OLMo 3's)
        return config.norm_position == "post" and config.qk_norm_scope == "all" and not config.sliding_window

    def own_values(self, c: ConfigFile, n_layer: int, local_rope: dict | None) -> dict:
        return dict(norm_position="post", qk_norm=True, qk_norm_scope="all")


OLMO2 = Olmo2()
