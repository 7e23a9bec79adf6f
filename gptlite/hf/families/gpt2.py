"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU, biases everywhere (a model with bias=False exports
zeros for them), its linear layers stored transposed (Conv1D); llama.cpp's gpt2, q, k and v fused."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry, Family, float_weights


class GPT2Family(Family):
    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"
    prefix = "transformer."
    layers = "h.{i}."
    config_defaults = {
        "tie_word_embeddings": True,
        "layer_norm_epsilon": 1e-5,
        "n_inner": None,
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
    }
    suggested_flags = {"pos_emb": "learned", "norm": "layernorm", "ffn": "gelu"}
    gguf_name = "gpt2"

    def core(self, config: GPTConfig) -> bool:
        return (config.pos_emb, config.norm, config.ffn) == ("learned", "layernorm", "gelu")

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        extra = [k for k in ("n_kv_head", "head_dim", "qkv_bias", "qk_norm", "rope_scaling") if getattr(config, k)]
        return not extra and not own

    # -----------------------------------------------------------------------------------------
    # Import

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        unsupported = []
        activation = c.get("activation_function")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            unsupported.append(
                f"activation_function={activation!r} (gptlite's GELU is GPT-2's tanh approximation, gelu_new)"
            )
        if c.flag("scale_attn_by_inverse_layer_idx") or not c.flag("scale_attn_weights"):
            unsupported.append("attention scaled other than by 1/sqrt(head width)")
        n_embd = c.integer("n_embd")
        values = dict(
            vocab_size=c.integer("vocab_size"),
            block_size=c.integer("n_positions"),
            n_layer=c.integer("n_layer"),
            n_head=c.integer("n_head"),
            n_embd=n_embd,
            bias=True,
            pos_emb="learned",
            norm="layernorm",
            norm_eps=c.number("layer_norm_epsilon"),
            ffn="gelu",
            ffn_hidden=c.integer("n_inner", nullable=True) or 4 * n_embd,
            tie_embeddings=c.flag("tie_word_embeddings"),
        )
        return values, None, unsupported

    # -----------------------------------------------------------------------------------------
    # Export

    def hf_config(self, config: GPTConfig, common: dict) -> dict:
        return {
            **common,
            "n_positions": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.ffn_hidden,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "scale_attn_weights": True,
        }

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def entries(self, config: GPTConfig) -> list[Entry]:
        top = [
            ("tok_emb.weight", ("wte.weight",), False),
            ("pos_emb.table.weight", ("wpe.weight",), False),
            ("norm.weight", ("ln_f.weight",), False),
            ("norm.bias", ("ln_f.bias",), False),
        ]
        layer = [
            ("attn_norm", "ln_1", False),
            ("attn.qkv", "attn.c_attn", True),
            ("attn.out_proj", "attn.c_proj", True),
            ("ffn_norm", "ln_2", False),
            ("ffn.fc", "mlp.c_fc", True),
            ("ffn.out_proj", "mlp.c_proj", True),
        ]
        layer = [
            (f"{ours}.{p}", (f"{theirs}.{p}",), transposed and p == "weight")
            for ours, theirs, transposed in layer
            for p in ("weight", "bias")
        ]
        return self.every_block(top, layer, config)

    # -----------------------------------------------------------------------------------------
    # GGUF

    def add_hyperparameters(self, writer, config: GPTConfig) -> None:
        writer.add_layer_norm_eps(config.norm_eps)

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        weight = float_weights(state)

        def bias(name: str, rows: int) -> torch.Tensor:  # GPT-2's layout has biases; a bias=False model's are zeros
            return weight(name) if name in state else torch.zeros(rows)

        yield "token_embd.weight", weight("tok_emb.weight")
        yield "position_embd.weight", weight("pos_emb.table.weight")
        yield "output_norm.weight", weight("norm.weight")
        yield "output_norm.bias", bias("norm.bias", config.n_embd)
        if not config.tie_embeddings:
            yield "output.weight", weight("lm_head.weight")
        for i in range(config.n_layer):
            ours = f"blocks.{i}."
            theirs = f"blk.{i}."
            for name, gguf_name, rows in (
                ("attn_norm", "attn_norm", config.n_embd),
                ("attn.qkv", "attn_qkv", 3 * config.n_embd),
                ("attn.out_proj", "attn_output", config.n_embd),
                ("ffn_norm", "ffn_norm", config.n_embd),
                ("ffn.fc", "ffn_up", config.ffn_hidden),
                ("ffn.out_proj", "ffn_down", config.n_embd),
            ):
                yield f"{theirs}{gguf_name}.weight", weight(f"{ours}{name}.weight")
                yield f"{theirs}{gguf_name}.bias", bias(f"{ours}{name}.bias", rows)


GPT2 = GPT2Family()
