"""Granite 4 (GraniteMoeHybridForCausalLM without experts): Granite 3's rules, the feed-forward its shared MLP
(shared_mlp, gate and value fused in input_linear as gptlite holds them), RoPE or no positions at all
(position_embedding_type, the whole model's). Its layers are attention (Granite 4.0 350M, 1B, micro) or Mamba-2 among
attention (Granite 4-H: layer_types "mamba", gptlite.model.mamba2, with the mamba_* sizes of its config). A mixture
of experts is refused in one line. In llama.cpp an attention-only model is a granite and one with Mamba-2 layers a
granitehybrid (as llama.cpp's own convert_hf_to_gguf.py writes them), without RoPE where it has no positions."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import torch

from gptlite.config import GPTConfig
from gptlite.hf.families.base import ConfigFile, Entry
from gptlite.hf.families.granite import GRANITE, Granite
from gptlite.hf.families.llama import SMOLLM3

# transformers 5 writes an infinite float as a table (PreTrainedConfig._encode_special_floats), strict JSON
SPECIAL_FLOATS = {json.dumps({"__float__": "Infinity"}): math.inf, json.dumps({"__float__": "-Infinity"}): -math.inf}
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
        "mamba_n_heads": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_head": "auto",  # mamba_expand * hidden_size / mamba_n_heads
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "time_step_limit": [0.0, float("inf")],
    }
    own_switches = {}  # none: it takes Granite's multipliers and SmolLM3's NoPE layers (all layers or none)
    by_name = True  # its switches are Granite's: chosen where the model was loaded as one
    also_takes = (GRANITE, SMOLLM3)
    ffn_key = "shared_intermediate_size"  # intermediate_size is the experts'
    fc_names = ("shared_mlp.input_linear",)
    down_name = "shared_mlp.output_linear"
    layer_kinds = ("full_attention", "mamba")

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
        kinds = self.layer_kinds_of(c, n_layer)
        if "mamba" in kinds:
            values.update(layer_types=",".join(kinds), **self.mamba_values(c))
        return values

    def layer_kinds_of(self, c: ConfigFile, n_layer: int) -> list[str]:
        """Each layer's kind in gptlite's names (layer_types: IBM's attention/mamba or transformers' full_attention/
        linear_attention; null: every layer Mamba-2, as transformers makes it)."""
        kinds = c.get("layer_types")
        if kinds is None:
            kinds = ["mamba"] * n_layer
        if not isinstance(kinds, list) or len(kinds) != n_layer or any(k not in ATTENTION + MAMBA for k in kinds):
            raise c.bad("layer_types", kinds, f"a list of num_hidden_layers={n_layer} kinds, each attention or mamba")
        return ["mamba" if kind in MAMBA else "full_attention" for kind in kinds]

    def mamba_values(self, c: ConfigFile) -> dict:
        """The Mamba-2 layers' sizes (GPTConfig's mamba_*): heads of mamba_d_head channels, mamba_expand * hidden_size
        of them in all, as transformers' check requires."""
        heads = c.integer("mamba_n_heads")
        inner = c.integer("mamba_expand") * c.integer("hidden_size")
        head_dim = c.get("mamba_d_head")
        if head_dim == "auto":
            head_dim = inner // heads
        else:
            head_dim = c.integer("mamba_d_head")
        if head_dim * heads != inner:
            raise c.bad("mamba_d_head", head_dim, f"mamba_expand * hidden_size / mamba_n_heads = {inner / heads:g}")
        written = c.get("time_step_limit")
        limit = [0.0, float("inf")] if written is None else written  # transformers' null: no limit
        if isinstance(limit, list):
            limit = [SPECIAL_FLOATS.get(json.dumps(v, sort_keys=True), v) for v in limit]
        if not isinstance(limit, list) or len(limit) != 2 or not all(isinstance(v, (int, float)) for v in limit):
            raise c.bad("time_step_limit", written, "[min, max], two numbers")
        return dict(
            mamba_heads=heads,
            mamba_head_dim=head_dim,
            mamba_state=c.integer("mamba_d_state"),
            mamba_groups=c.integer("mamba_n_groups"),
            mamba_conv_kernel=c.integer("mamba_d_conv", low=2),
            mamba_chunk_size=c.integer("mamba_chunk_size"),
            mamba_conv_bias=c.flag("mamba_conv_bias"),
            mamba_proj_bias=c.flag("mamba_proj_bias"),
            mamba_dt_min=float(limit[0]),
            mamba_dt_max=float(limit[1]),
        )

    def own_unsupported(self, c: ConfigFile, local_rope: dict | None) -> list[str]:
        unsupported = []
        experts = c.integer("num_local_experts", low=0)
        if experts:
            unsupported.append(f"a mixture of experts (num_local_experts={experts}), which gptlite does not have")
        return unsupported

    # -----------------------------------------------------------------------------------------
    # Export

    def own_config(self, config: GPTConfig, rope: dict) -> dict:
        """Granite's multipliers; the shared MLP alone, each layer attention or mamba (in IBM's names, which
        llama.cpp's converter reads), its positions, and the Mamba-2 layers' sizes (where there are none, sizes
        transformers' check takes for any width)."""
        kinds = config.layer_kinds
        return {
            **super().own_config(config, rope),
            "shared_intermediate_size": config.ffn_hidden,
            "num_local_experts": 0,
            "num_experts_per_tok": 0,
            "layer_types": ["mamba" if kind == "mamba" else "attention" for kind in kinds],
            "position_embedding_type": None if config.nope_layers else "rope",
            **(self.mamba_config(config) if "mamba" in kinds else {"mamba_n_heads": 1}),
        }

    def mamba_config(self, config: GPTConfig) -> dict:
        """The Mamba-2 layers' keys (their width as mamba_expand times hidden_size, as transformers holds it)."""
        inner = config.mamba_heads * config.mamba_head_dim
        return {
            "mamba_n_heads": config.mamba_heads,
            "mamba_d_head": config.mamba_head_dim,
            "mamba_expand": inner // config.n_embd if inner % config.n_embd == 0 else inner / config.n_embd,
            "mamba_d_state": config.mamba_state,
            "mamba_n_groups": config.mamba_groups,
            "mamba_d_conv": config.mamba_conv_kernel,
            "mamba_chunk_size": config.mamba_chunk_size,
            "mamba_conv_bias": config.mamba_conv_bias,
            "mamba_proj_bias": config.mamba_proj_bias,
            "time_step_limit": [their_float(config.mamba_dt_min), their_float(config.mamba_dt_max)],
        }

    # -----------------------------------------------------------------------------------------
    # The weights' names

    def every_block(self, top: list[Entry], layer: list[Entry], config: GPTConfig) -> list[Entry]:
        """An attention layer's weights as Granite's; a mamba layer's mixer and its norm in attention's place, the
        shared MLP the same in both."""
        out = super().every_block(top, [], config)  # the embedding, the final norm, an untied head
        ffn = [entry for entry in layer if entry[0].startswith("ffn")]
        attention = [entry for entry in layer if not entry[0].startswith("ffn")]
        for i, kind in enumerate(config.layer_kinds):
            theirs_prefix = self.layers.format(i=i)
            own = self.mamba_entries(config) if kind == "mamba" else attention
            for ours, theirs, transposed in own + ffn:
                out.append((f"blocks.{i}.{ours}", tuple(theirs_prefix + t for t in theirs), transposed))
        return out

    def mamba_entries(self, config: GPTConfig) -> list[Entry]:
        """A mamba layer's norm and mixer (GraniteMoeHybridMambaLayer's names; the convolution is conv1d there)."""
        names = ["in_proj.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]
        if config.mamba_proj_bias:
            names += ["in_proj.bias", "out_proj.bias"]
        entries = [("mamba_norm.weight", ("input_layernorm.weight",), False)]
        entries += [(f"mamba.{name}", (f"mamba.{name}",), False) for name in names]
        entries.append(("mamba.conv.weight", ("mamba.conv1d.weight",), False))
        if config.mamba_conv_bias:
            entries.append(("mamba.conv.bias", ("mamba.conv1d.bias",), False))
        return entries

    # -----------------------------------------------------------------------------------------
    # GGUF

    def gguf_architecture(self, config: GPTConfig) -> str | None:
        return "granitehybrid" if "mamba" in config.layer_kinds else self.gguf_name

    def gguf_problem(self, config: GPTConfig) -> str | None:
        """llama.cpp's Mamba-2 layers: a bias on the convolution, none on the projections, time steps unclamped."""
        if "mamba" not in config.layer_kinds:
            return None
        problems = []
        if not config.mamba_conv_bias:
            problems.append("a convolution without a bias (mamba_conv_bias=false)")
        if config.mamba_proj_bias:
            problems.append("biases on in_proj and out_proj (mamba_proj_bias=true)")
        if config.mamba_dt_min > 0 or config.mamba_dt_max != math.inf:
            problems.append(f"time steps clamped to [{config.mamba_dt_min}, {config.mamba_dt_max}] (time_step_limit)")
        if not problems:
            return None
        return (
            f"llama.cpp's granitehybrid has no Mamba-2 layers with {' or '.join(problems)}; GGUF export cannot hold it"
        )

    def gguf_kv_heads(self, config: GPTConfig) -> int | list[int]:
        """Each layer's: a Mamba-2 layer has none, which is how llama.cpp's granitehybrid tells it from attention."""
        if "mamba" not in config.layer_kinds:
            return config.kv_heads
        return [0 if kind == "mamba" else config.kv_heads for kind in config.layer_kinds]

    def add_own_hyperparameters(self, writer, config: GPTConfig) -> None:
        super().add_own_hyperparameters(writer, config)
        if "mamba" in config.layer_kinds:  # llama.cpp's ssm keys: its time_step_rank is the scan's heads
            writer.add_ssm_conv_kernel(config.mamba_conv_kernel)
            writer.add_ssm_state_size(config.mamba_state)
            writer.add_ssm_group_count(config.mamba_groups)
            writer.add_ssm_inner_size(config.mamba_heads * config.mamba_head_dim)
            writer.add_ssm_time_step_rank(config.mamba_heads)
        if config.nope_layers:  # llama.cpp's granite rotates q and k where rope.scaling.finetuned says so
            writer.add_rope_scaling_finetuned(False)

    def gguf_layer(self, i: int, weight, norm, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """A Mamba-2 layer as llama.cpp's converter writes it: A as -exp(A_log) and D, one column each; the
        convolution's kernel without its channel axis; the gated norm's weight one row per group."""
        if config.layer_kinds[i] != "mamba":
            yield from super().gguf_layer(i, weight, norm, config)
            return
        ours = f"blocks.{i}."
        theirs = f"blk.{i}."
        heads = config.mamba_heads
        yield f"{theirs}attn_norm.weight", norm(f"{ours}mamba_norm.weight")
        yield f"{theirs}ssm_in.weight", weight(f"{ours}mamba.in_proj.weight")
        yield f"{theirs}ssm_conv1d.weight", weight(f"{ours}mamba.conv.weight")[:, 0]  # (channels, K)
        yield f"{theirs}ssm_conv1d.bias", weight(f"{ours}mamba.conv.bias")
        yield f"{theirs}ssm_dt.bias", weight(f"{ours}mamba.dt_bias")
        yield f"{theirs}ssm_a", -torch.exp(weight(f"{ours}mamba.A_log")).reshape(heads, 1)
        yield f"{theirs}ssm_d", weight(f"{ours}mamba.D").reshape(heads, 1)
        yield f"{theirs}ssm_norm.weight", weight(f"{ours}mamba.norm.weight").reshape(config.mamba_groups, -1)
        yield f"{theirs}ssm_out.weight", weight(f"{ours}mamba.out_proj.weight")
        yield f"{theirs}ffn_norm.weight", norm(f"{ours}ffn_norm.weight")
        gate, up = weight(f"{ours}ffn.fc.weight").split([config.ffn_hidden, config.ffn_hidden])
        yield f"{theirs}ffn_gate.weight", gate
        yield f"{theirs}ffn_up.weight", up
        yield f"{theirs}ffn_down.weight", weight(f"{ours}ffn.out_proj.weight")


GRANITE4 = Granite4()


def their_float(value: float) -> float | dict:
    """A float as transformers 5 writes it in config.json: an infinity as its table."""
    if math.isinf(value):
        return {"__float__": "Infinity" if value > 0 else "-Infinity"}
    return value
