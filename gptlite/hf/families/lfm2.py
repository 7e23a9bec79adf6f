"""LFM2 and LFM2.5 (Lfm2ForCausalLM, Liquid AI): Llama's layout (RoPE, RMSNorm, SwiGLU, grouped-query attention) with
RMSNorm on each head's q and k, a tied head, and most layers not attention but LFM2's gated short convolution
(layer_types' "conv": gptlite.model.network's ConvBlock, whose state across decode calls is its last conv_L_cache - 1
inputs). Its feed-forward's width is intermediate_size adjusted as transformers' Lfm2MLP does (two thirds of it, times
block_ffn_dim_multiplier, rounded up to block_multiple_of) where block_auto_adjust_ff_dim says so; gptlite exports the
width itself, with the adjustment off. Its final norm is named embedding_norm."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry, float_weights
from gptlite.hf.families.llama import QWEN3, LlamaLayout

KINDS = ("full_attention", "conv")  # layer_types' kinds, transformers' names and gptlite's


class Lfm2(LlamaLayout):
    architecture = "Lfm2ForCausalLM"
    model_type = "lfm2"
    config_defaults = {
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "num_key_value_heads": 8,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "full_attn_idxs": None,
        "layer_types": None,
    }
    own_switches = {"layer_types": ""}
    by_name = True
    also_takes = (QWEN3,)  # RMSNorm on each head's q and k, as Qwen3's
    qk_norm = True
    window_key = False
    gguf_name = "lfm2"
    layer_kinds = KINDS

    def has_layers(self, config: GPTConfig) -> bool:
        """Attention and conv layers, the attention without an output gate."""
        return set(config.layer_kinds) <= set(KINDS) and not config.attn_output_gate

    def marked(self, config: GPTConfig) -> bool:
        return bool(config.layer_types)

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """Per-head q/k norms, the head width n_embd / n_head, positions in every layer, nothing of another family."""
        plain = not (config.rope_scaling or config.head_dim or config.nope_layers or config.sliding_window)
        others = [k for k in own if k != "layer_types"]
        return config.qk_norm and config.qk_norm_scope == "head" and plain and not others

    # -----------------------------------------------------------------------------------------
    # Import

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        values, window, unsupported = super().values(c)
        if "tie_embedding" in c.values:  # LiquidAI's own name, which transformers takes over tie_word_embeddings
            values["tie_embeddings"] = c.flag("tie_embedding")
        values["norm_eps"] = c.number("norm_eps")
        values["ffn_hidden"] = self.ffn_width(c)
        values["layer_types"] = ",".join(self.kinds(c, values["n_layer"]))
        values["conv_kernel"] = c.integer("conv_L_cache", low=2)
        values["conv_bias"] = c.flag("conv_bias")
        if c.integer("head_dim", nullable=True) not in (None, values["n_embd"] // values["n_head"]):
            unsupported.append("a head width other than hidden_size / num_attention_heads (head_dim)")
        return values, window, unsupported

    def ffn_width(self, c: ConfigFile) -> int:
        """The feed-forward's width as transformers' Lfm2MLP computes it from intermediate_size (or LiquidAI's own
        name for it, block_ff_dim, which transformers takes over intermediate_size)."""
        width = c.integer("block_ff_dim" if "block_ff_dim" in c.values else "intermediate_size")
        if not c.flag("block_auto_adjust_ff_dim"):
            return width
        width = int(2 * width / 3)
        multiplier = c.get("block_ffn_dim_multiplier")
        if multiplier is None:
            return width
        multiple = c.integer("block_multiple_of")
        width = int(c.number("block_ffn_dim_multiplier") * width)
        return multiple * ((width + multiple - 1) // multiple)

    def kinds(self, c: ConfigFile, n_layer: int) -> list[str]:
        """Each layer's kind: layer_types, else full_attn_idxs' layers attention and the others conv (transformers'
        rule), else every layer attention."""
        kinds = c.get("layer_types")
        if kinds is None:
            attends = c.get("full_attn_idxs")
            if attends is None:
                attends = list(range(n_layer))
            if not isinstance(attends, list) or any(not isinstance(i, int) for i in attends):
                raise c.bad("full_attn_idxs", attends, "a list of layer indices")
            kinds = ["full_attention" if i in attends else "conv" for i in range(n_layer)]
        if not isinstance(kinds, list) or len(kinds) != n_layer or any(kind not in KINDS for kind in kinds):
            what = f"a list of num_hidden_layers={n_layer} kinds, each full_attention or conv"
            raise c.bad("layer_types", kinds, what)
        return kinds

    # -----------------------------------------------------------------------------------------
    # Export

    def hf_config(self, config: GPTConfig, common: dict) -> dict:
        out = super().hf_config(config, common)
        for key in ("rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias", "rope_scaling", "head_dim"):
            del out[key]
        kinds = list(config.layer_kinds)
        return {
            **out,
            "norm_eps": config.norm_eps,
            "block_auto_adjust_ff_dim": False,  # intermediate_size is the feed-forward's width itself
            "layer_types": kinds,
            "full_attn_idxs": [i for i, kind in enumerate(kinds) if kind == "full_attention"],
            "conv_L_cache": config.conv_kernel,
            "conv_bias": config.conv_bias,
        }

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def entries(self, config: GPTConfig) -> list[Entry]:
        out = [
            ("tok_emb.weight", ("model.embed_tokens.weight",), False),
            ("norm.weight", ("model.embedding_norm.weight",), False),
        ]
        if not config.tie_embeddings:
            out.append(("lm_head.weight", ("lm_head.weight",), False))
        attention = [
            ("attn_norm.weight", ("operator_norm.weight",), False),
            ("attn.qkv.weight", tuple(f"self_attn.{t}_proj.weight" for t in ("q", "k", "v")), False),
            ("attn.out_proj.weight", ("self_attn.out_proj.weight",), False),
            ("attn.qk_norm.q_norm.weight", ("self_attn.q_layernorm.weight",), False),
            ("attn.qk_norm.k_norm.weight", ("self_attn.k_layernorm.weight",), False),
        ]
        conv = [
            ("conv_norm.weight", ("operator_norm.weight",), False),
            ("conv.in_proj.weight", ("conv.in_proj.weight",), False),
            ("conv.conv.weight", ("conv.conv.weight",), False),
            ("conv.out_proj.weight", ("conv.out_proj.weight",), False),
        ]
        if config.conv_bias:
            conv += [(f"conv.{name}.bias", (f"conv.{name}.bias",), False) for name in ("in_proj", "conv", "out_proj")]
        feed_forward = [
            ("ffn_norm.weight", ("ffn_norm.weight",), False),
            ("ffn.fc.weight", ("feed_forward.w1.weight", "feed_forward.w3.weight"), False),
            ("ffn.out_proj.weight", ("feed_forward.w2.weight",), False),
        ]
        for i, kind in enumerate(config.layer_kinds):
            theirs_prefix = self.layers.format(i=i)
            for ours, theirs, transposed in (attention if kind == "full_attention" else conv) + feed_forward:
                out.append((f"blocks.{i}.{ours}", tuple(theirs_prefix + t for t in theirs), transposed))
        return out

    # -----------------------------------------------------------------------------------------
    # GGUF

    def add_hyperparameters(self, writer, config: GPTConfig) -> None:
        """Llama's keys, then LFM2's as llama.cpp's convert_hf_to_gguf.py writes them: key/value heads per layer
        (0 in a conv layer), the convolution's width (shortconv.l_cache)."""
        super().add_hyperparameters(writer, config)
        kinds = config.layer_kinds
        writer.add_head_count_kv([config.kv_heads if kind == "full_attention" else 0 for kind in kinds])
        writer.add_shortconv_l_cache(config.conv_kernel)

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """llama.cpp's lfm2: the final norm as token_embd_norm, q and k rotated in halves (nothing reordered), a conv
        layer's operator norm as attn_norm and its depthwise kernel (C, K) as shortconv.conv."""
        weight = float_weights(state)
        yield "token_embd.weight", weight("tok_emb.weight")
        yield "token_embd_norm.weight", weight("norm.weight")
        if not config.tie_embeddings:
            yield "output.weight", weight("lm_head.weight")
        q_rows = config.n_head * config.head_width
        kv_rows = config.kv_heads * config.head_width
        for i, kind in enumerate(config.layer_kinds):
            ours = f"blocks.{i}."
            theirs = f"blk.{i}."
            if kind == "full_attention":
                q, k, v = weight(f"{ours}attn.qkv.weight").split([q_rows, kv_rows, kv_rows])
                yield f"{theirs}attn_norm.weight", weight(f"{ours}attn_norm.weight")
                yield f"{theirs}attn_q.weight", q
                yield f"{theirs}attn_k.weight", k
                yield f"{theirs}attn_v.weight", v
                yield f"{theirs}attn_q_norm.weight", weight(f"{ours}attn.qk_norm.q_norm.weight")
                yield f"{theirs}attn_k_norm.weight", weight(f"{ours}attn.qk_norm.k_norm.weight")
                yield f"{theirs}attn_output.weight", weight(f"{ours}attn.out_proj.weight")
            else:
                yield f"{theirs}attn_norm.weight", weight(f"{ours}conv_norm.weight")
                yield f"{theirs}shortconv.conv.weight", weight(f"{ours}conv.conv.weight")[:, 0]  # (C, K)
                yield f"{theirs}shortconv.in_proj.weight", weight(f"{ours}conv.in_proj.weight")
                yield f"{theirs}shortconv.out_proj.weight", weight(f"{ours}conv.out_proj.weight")
            yield f"{theirs}ffn_norm.weight", weight(f"{ours}ffn_norm.weight")
            gate, up = weight(f"{ours}ffn.fc.weight").split([config.ffn_hidden, config.ffn_hidden])
            yield f"{theirs}ffn_gate.weight", gate
            yield f"{theirs}ffn_up.weight", up
            yield f"{theirs}ffn_down.weight", weight(f"{ours}ffn.out_proj.weight")

    def gguf_problem(self, config: GPTConfig) -> str | None:
        if config.conv_bias:
            return (
                "llama.cpp's lfm2 has no biases in its conv layers, and this model has (conv_bias=true); GGUF export "
                "needs conv_bias=false"
            )
        return None


LFM2 = Lfm2()
