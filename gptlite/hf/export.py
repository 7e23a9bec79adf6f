"""Out: a gptlite model -> a directory transformers loads (config.json, model.safetensors and the tokenizer's files)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.config import GPTConfig
from gptlite.files import write_folder
from gptlite.hf.families import (
    GEMMA3,
    GPT2,
    GRANITE,
    LLAMA,
    NANOCHAT,
    PHI3,
    QWEN2,
    QWEN3,
    SMOLLM3,
    Family,
    entries,
    family_of,
    part_sizes,
    their_name,
)
from gptlite.hf.tokenizer_files import hf_tokenizer_files
from gptlite.hf.weights import save_weights
from gptlite.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from gptlite.model.network import Transformer


def from_gptlite(family: Family, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gptlite's state dict -> the transformers names (a tied head left out, as save_pretrained does; GPT-2's
    biases as zeros where the model has none)."""
    out = {}
    for ours, theirs, transposed in entries(family, config):
        w = state.get(ours)
        if w is None:  # a bias of a bias=False model: GPT-2 has them, so they are zeros
            weight = state[ours.removesuffix("bias") + "weight"]
            w = torch.zeros(weight.size(0), dtype=weight.dtype)
        w = w.t() if transposed else w
        parts = w.split(part_sizes(ours, config)) if len(theirs) > 1 else (w,)
        for name, part in zip(theirs, parts, strict=True):
            out[their_name(family, name)] = part.detach().to("cpu").contiguous().clone()
    return out


def special_ids(tokenizer: Tokenizer | None) -> tuple[int | None, int | list[int] | None]:
    """(bos_token_id, eos_token_id) for config.json and generation_config.json: eos is the tokenizer's end_ids (the
    end of a turn first), one id or a list, as transformers' generate takes either."""
    if tokenizer is None:
        return None, None
    stops = tokenizer.end_ids()
    bos = tokenizer.bos_id if isinstance(tokenizer, HFTokenizer) else tokenizer.eot_id
    return bos, (stops[0] if len(stops) == 1 else stops) if stops else None


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json: what transformers' generate() stops at, and the id it pads finished rows with."""
    bos, eos = special_ids(tokenizer)
    stops = tokenizer.end_ids()
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": stops[-1] if stops else None}


def hf_config(family: Family, config: GPTConfig, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    """config.json for transformers."""
    bos, eos = special_ids(tokenizer)
    common = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        # written always: some classes' defaults (SmolLM3's, Phi-3's) are ids past a small vocabulary
        "pad_token_id": generation_config(tokenizer)["pad_token_id"] if tokenizer is not None else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
    }
    if family is GPT2:
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
    rope = {"rope_type": "default", "rope_theta": config.rope_theta, **phi3_rope(config)}
    if config.rope_scaling == "llama3":
        rope = {
            **rope,
            "rope_type": "llama3",
            "factor": config.rope_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_context,
        }
    windows = {
        "sliding_window": None,
        **({"use_sliding_window": False, "max_window_layers": config.n_layer} if family in (QWEN2, QWEN3) else {}),
    }
    return {
        **common,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_width,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": config.dropout,
        # transformers < 5 reads rope_theta and rope_scaling, 5 and later rope_parameters
        "rope_theta": config.rope_theta,
        "rope_scaling": rope if config.rope_scaling else None,
        "rope_parameters": rope,
        **(windows if family not in (LLAMA, GRANITE) else {}),
        **(granite_values(config) if family is GRANITE else {}),
        **(smollm3_values(config) if family is SMOLLM3 else {}),
        **(phi3_values(config) if family is PHI3 else {}),
        **(nanochat_values(config) if family is NANOCHAT else {}),
        **(gemma3_values(config, rope) if family is GEMMA3 else {}),
    }


def gemma3_values(config: GPTConfig, rope: dict) -> dict:
    """Gemma 3's activation, attention scale, sliding window with its layers and their RoPE, and soft cap."""
    scalar = config.attn_scale**-2 if config.attn_scale else config.head_width
    local = config.window_layer_ids
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "sliding_window": config.sliding_window or None,
        "layer_types": ["sliding_attention" if i in local else "full_attention" for i in range(config.n_layer)],
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta or config.rope_theta},
        },
        "final_logit_softcapping": config.logit_softcap or None,
        "attn_logit_softcapping": None,
    }


def nanochat_values(config: GPTConfig) -> dict:
    """nanochat's squared ReLU and its final soft cap (None: none)."""
    return {"hidden_act": "relu2", "final_logit_softcapping": config.logit_softcap or None}


def phi3_rope(config: GPTConfig) -> dict:
    """Phi-3's RoPE parameters: the part of each head rotated, and LongRoPE's factors."""
    out = {"partial_rotary_factor": config.rope_dims / config.head_width} if config.rope_dims else {}
    if config.rope_scaling != "longrope":
        return out
    short = [float(f) for f in config.rope_short_factor.split(",")]
    long = [float(f) for f in config.rope_long_factor.split(",") if f.strip()] or short
    return {
        **out,
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "attention_factor": config.rope_attention_factor,
        "original_max_position_embeddings": config.rope_original_context,
    }


def phi3_values(config: GPTConfig) -> dict:
    """Phi-3's dropouts, and the context its RoPE was trained on (where LongRoPE's long factors start)."""
    original = config.rope_original_context if config.rope_scaling == "longrope" else config.block_size
    return {
        "original_max_position_embeddings": original,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
    }


def smollm3_values(config: GPTConfig) -> dict:
    """SmolLM3's layers without positions: no_rope_layers holds 1 where a layer rotates q and k."""
    return {
        "no_rope_layers": [int(i not in config.nope_layer_ids) for i in range(config.n_layer)],
        "use_sliding_window": False,
    }


def granite_values(config: GPTConfig) -> dict:
    """Granite's multipliers (its attention's scale is always its own: 1 / sqrt(head width) when gptlite's is)."""
    return {
        "embedding_multiplier": config.embed_scale,
        "residual_multiplier": config.residual_scale,
        "attention_multiplier": config.attn_scale or config.head_width**-0.5,
        "logits_scaling": config.logits_scaling,
    }


def export_hf(
    model: Transformer,
    directory: str | Path,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    architecture: str | None = None,
) -> list[Path]:
    """Write config.json and model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained(directory)`
    loads with the same logits, as the class its switches map to (`architecture`, by default the one the model was
    loaded from, tells Mistral from Llama), and, given a tokenizer transformers can reproduce, its files. Everything
    is checked before the first write, and the folder ends holding exactly these files, all written or none: a
    folder that holds anything is replaced only with overwrite=True, and then moves aside whole to
    DIR-previous-TIME (which `log` is told)."""
    from gptlite.inference.quantize import is_quantized

    if is_quantized(model):
        raise ValueError(
            "a quantized model cannot be exported: its weights are rounded; export the float model "
            "(quantize after loading, e.g. sample.py --quantize=int8)"
        )
    family = family_of(model.config, architecture or model.source_architecture)
    state = model.state_dict()
    dtype = state["tok_emb.weight"].dtype
    weights = from_gptlite(family, state, model.config)
    files = {"config.json": json.dumps(hf_config(family, model.config, dtype, tokenizer), indent=2) + "\n"}
    if tokenizer is not None:
        files.update(hf_tokenizer_files(tokenizer, model.config.block_size))
        files["generation_config.json"] = json.dumps(generation_config(tokenizer), indent=2) + "\n"
    directory = Path(directory)
    names = ["model.safetensors", *files]
    if directory.is_dir() and not overwrite:
        held = sorted(p.name for p in directory.iterdir())
        present = [n for n in names if n in held] + [n for n in held if n not in names]
        if present:
            raise FileExistsError(
                f"{directory} already holds {', '.join(present[:3])}{' ...' if len(present) > 3 else ''}"
                "; export to a new directory, or pass overwrite=True (--overwrite) to replace it (the "
                "earlier folder is kept beside it as DIR-previous-TIME)"
            )

    def write(folder: Path) -> None:
        save_weights(weights, folder / "model.safetensors")
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")

    previous = write_folder(directory, write, overwrite=True, what="export folder", log=log)
    if previous and log:
        log(f"moved the earlier contents of {directory} to {previous}")
    return [directory / name for name in names]
