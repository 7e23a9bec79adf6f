"""Hugging Face's layout: checkpoints in (`load_pretrained`), gptlite models out (`export_hf`).

Everything that speaks transformers' names lives here, so the model never learns them. Five architectures map
onto gptlite's switches, weight for weight:
    GPT2LMHeadModel     pos_emb="learned", norm="layernorm", ffn="gelu" (GPT-2 has biases everywhere; a model with
                        bias=False exports zeros for them)
    LlamaForCausalLM    pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, with grouped-query attention
                        (n_kv_head), its own head width (head_dim), a tied or untied head, Llama 3's RoPE scaling:
                        Llama 2/3.x, SmolLM2, TinyLlama
    MistralForCausalLM  the same layout (the context at most its sliding window)
    Qwen2ForCausalLM    the same, with biases on q, k and v (qkv_bias)
    Qwen3ForCausalLM    the same, with RMSNorm on each head's q and k (qk_norm)
A checkpoint directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json,
or pytorch_model.bin). The names "gpt2", "gpt2-medium", "gpt2-large" and "gpt2-xl" are downloaded from the Hub.
This module turns a checkpoint into a GPTConfig and a state dict, tensor by tensor (GPT.from_pretrained builds
the model from them, holding one copy of the weights), and a model back into files; it never imports
gptlite.model.

    python -m gptlite.hf export --out_dir=RUN --hf_dir=DIR [--overwrite]   # a run's checkpoint -> DIR
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.config import GPTConfig
from gptlite.files import write_folder
from gptlite.hf.tokenizer_files import gpt2_tokenizer_problem, hf_tokenizer_files
from gptlite.hf.weights import WEIGHT_FILES, Weights, read_json, save_weights
from gptlite.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from gptlite.model import GPT

__all__ = [
    "GPT2_NAMES",
    "export_hf",
    "family_of",
    "fingerprint",
    "gpt2_tokenizer_problem",
    "hf_tokenizer_files",
    "load_pretrained",
    "pretrained_config",
    "read_json",
    "save_weights",
]
GPT2_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
# buffers some checkpoints store beside their weights (GPT-2's causal masks, old Llamas' RoPE frequencies)
BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")
Entry = tuple[str, tuple[str, ...], bool]  # gptlite name, transformers names concatenated along dim 0, transposed


@dataclass(frozen=True)
class Family:
    """One transformers architecture: its class, model_type, what save_pretrained puts before its names, and the
    blocks' prefix (with {i})."""

    architecture: str
    model_type: str
    prefix: str
    layers: str


GPT2 = Family("GPT2LMHeadModel", "gpt2", "transformer.", "h.{i}.")
LLAMA = Family("LlamaForCausalLM", "llama", "", "model.layers.{i}.")
MISTRAL = Family("MistralForCausalLM", "mistral", "", "model.layers.{i}.")
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", "", "model.layers.{i}.")
QWEN3 = Family("Qwen3ForCausalLM", "qwen3", "", "model.layers.{i}.")
FAMILIES = {f.model_type: f for f in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3)}
UNSUPPORTED = {  # model types people ask for, and what gptlite lacks for them
    "gemma": "Gemma's scaled embeddings and GeGLU feed-forward",
    "gemma2": "Gemma 2's soft-capped logits",
    "gemma3": "Gemma 3's scaled embeddings and sliding-window layers",
    "mixtral": "Mixtral's mixture of experts",
    "qwen2_moe": "a mixture of experts",
    "qwen3_moe": "a mixture of experts",
    "phi3": "Phi-3's fused qkv layout",
}
EXPORTABLE = (
    "GPT-2's (ffn='gelu', norm='layernorm', pos_emb='learned') and Llama's (pos_emb='rope', norm='rmsnorm', "
    "ffn='swiglu', bias=false, with any n_kv_head, head_dim, tie_embeddings and rope_scaling; Mistral's when "
    "it came from one), with qkv_bias=true as Qwen2's and with qk_norm=true as Qwen3's"
)


def entries(family: Family, config: GPTConfig) -> list[Entry]:
    """Every weight of a model of `config` in `family`: (gptlite name, transformers names, transposed)."""
    if family is GPT2:
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
    else:
        top = [
            ("tok_emb.weight", ("model.embed_tokens.weight",), False),
            ("norm.weight", ("model.norm.weight",), False),
        ]
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        layer = [
            ("attn_norm.weight", ("input_layernorm.weight",), False),
            ("attn.qkv.weight", tuple(f"{t}.weight" for t in attn), False),
            *([("attn.qkv.bias", tuple(f"{t}.bias" for t in attn), False)] if config.qkv_bias else []),
            ("attn.out_proj.weight", ("self_attn.o_proj.weight",), False),
            *(
                [
                    ("attn.qk_norm.q_norm.weight", ("self_attn.q_norm.weight",), False),
                    ("attn.qk_norm.k_norm.weight", ("self_attn.k_norm.weight",), False),
                ]
                if config.qk_norm
                else []
            ),
            ("ffn_norm.weight", ("post_attention_layernorm.weight",), False),
            # SwiGLU's fc: its first half is the gate (through silu), the second the value
            ("ffn.fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), False),
            ("ffn.out_proj.weight", ("mlp.down_proj.weight",), False),
        ]
    if not config.tie_embeddings:
        top.append(("lm_head.weight", ("lm_head.weight",), False))
    out = list(top)
    for i in range(config.n_layer):
        p = family.layers.format(i=i)
        out += [(f"blocks.{i}.{ours}", tuple(p + t for t in theirs), transposed) for ours, theirs, transposed in layer]
    return out


def part_sizes(ours: str, config: GPTConfig) -> list[int]:
    """The rows of each transformers tensor that a fused gptlite tensor stacks (q, k, v; the gate and value)."""
    if "attn.qkv" in ours:
        return [config.n_head * config.head_width] + [config.kv_heads * config.head_width] * 2
    return [config.ffn_hidden] * 2


def their_name(family: Family, name: str) -> str:
    """A transformers name as save_pretrained writes it (GPT-2's blocks under "transformer.", its head not)."""
    return name if name.startswith("lm_head.") else family.prefix + name


# ---------------------------------------------------------------------------------------------
# In: a transformers checkpoint -> a GPTConfig and a state dict


def checkpoint_dir(name_or_dir: str, weights: bool = True) -> Path:
    """A local directory holding the checkpoint: name_or_dir itself, or the download of a GPT-2 name."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if name_or_dir not in GPT2_NAMES:
        raise FileNotFoundError(
            f"{name_or_dir} is neither a directory nor one of {', '.join(GPT2_NAMES)}; pass a directory in Hugging "
            "Face's layout (config.json and model.safetensors)"
        )
    repo = GPT2_NAMES[name_or_dir]
    offline = (
        f"where you are online, download it (hf download {repo} config.json model.safetensors "
        f"--local-dir DIR) and pass that directory instead of '{name_or_dir}'"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError(
            f"downloading {name_or_dir} needs huggingface_hub (pip install huggingface_hub); or {offline}"
        ) from None
    try:
        return Path(
            snapshot_download(repo, allow_patterns=["config.json", *(["model.safetensors"] if weights else [])])
        )
    except Exception as e:  # huggingface_hub's errors for no network, offline mode, a missing repository, ...
        raise ConnectionError(
            f"could not download {name_or_dir} from the Hugging Face Hub ({type(e).__name__}); {offline}"
        ) from None


def read_config(directory: Path) -> tuple[Family, GPTConfig, int | None]:
    """The family, the GPTConfig and the attention window (None: none) of directory/config.json; what gptlite cannot
    hold is refused in one line naming it."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; a Hugging Face checkpoint directory holds config.json and its weights"
        )
    c = read_json(path, "a Hugging Face config.json")
    kind = c.get("model_type")
    family = FAMILIES.get(kind)
    if family is None:
        what = f"{UNSUPPORTED[kind]}, which gptlite does not have" if kind in UNSUPPORTED else "not supported"
        raise ValueError(
            f"{path}: model_type={kind!r} is {what}; gptlite loads "
            f"{', '.join(f'{f.architecture} ({f.model_type})' for f in FAMILIES.values())}"
        )
    try:
        values, window, unsupported = (gpt2_values if family is GPT2 else llama_values)(c, family)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]}, which a {family.architecture} config needs") from None
    if unsupported:
        raise ValueError(f"{path}: gptlite cannot hold this {family.architecture}: {'; '.join(unsupported)}")
    return family, GPTConfig(**values), window


def gpt2_values(c: dict, family: Family) -> tuple[dict, int | None, list[str]]:
    unsupported = []
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(
            f"activation_function={c['activation_function']!r} (gptlite's GELU is GPT-2's tanh approximation, gelu_new)"
        )
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
        unsupported.append("attention scaled other than by 1/sqrt(head width)")
    values = dict(
        vocab_size=c["vocab_size"],
        block_size=c["n_positions"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        n_embd=c["n_embd"],
        bias=True,
        pos_emb="learned",
        norm="layernorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
        ffn="gelu",
        ffn_hidden=c.get("n_inner") or 4 * c["n_embd"],
        tie_embeddings=c.get("tie_word_embeddings", True) is not False,
    )
    return values, None, unsupported


def llama_values(c: dict, family: Family) -> tuple[dict, int | None, list[str]]:
    """The switches of the Llama layout's families, and what of the config they cannot hold."""
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    values = dict(
        vocab_size=c["vocab_size"],
        block_size=c["max_position_embeddings"],
        n_layer=c["num_hidden_layers"],
        n_head=heads,
        n_kv_head=kv_heads if kv_heads != heads else None,
        n_embd=hidden,
        head_dim=head_dim if head_dim * heads != hidden else None,
        bias=False,
        pos_emb="rope",
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-6),
        ffn="swiglu",
        ffn_hidden=c["intermediate_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=family is QWEN2,
        qk_norm=family is QWEN3,
    )
    unsupported = []
    if c.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={c['hidden_act']!r} (gptlite's SwiGLU uses silu)")
    if c.get("attention_bias") and family is not QWEN2:
        unsupported.append("biases on the attention's projections, its output's too (attention_bias=true)")
    if c.get("mlp_bias"):
        unsupported.append("biases in the feed-forward (mlp_bias=true)")
    if rope_type == "llama3":
        values.update(
            rope_scaling="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_context=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        unsupported.append(f"RoPE scaling of type {rope_type!r} (gptlite has llama3's)")
    window = c.get("sliding_window") if family is MISTRAL or c.get("use_sliding_window") else None
    if family in (QWEN2, QWEN3) and c.get("use_sliding_window"):
        unsupported.append("sliding-window attention in some layers (use_sliding_window=true)")
    if window:
        values["block_size"] = min(values["block_size"], window)  # within the window, attention is exact
    return values, window, unsupported


def to_gptlite(
    family: Family, weights: Weights, config: GPTConfig, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """A transformers checkpoint -> gptlite's state dict for a model of `config`, read and converted tensor by
    tensor (in `dtype`, or the checkpoint's); refuses missing and unknown weights."""
    names = {n.removeprefix(family.prefix): n for n in weights.names()}  # the Hub's gpt2 has no prefix
    state, used = {}, set()
    for ours, theirs, transposed in entries(family, config):
        missing = [t for t in theirs if t not in names]
        if missing:
            raise ValueError(
                f"the checkpoint has no {missing[0]}, which a {family.architecture} of {config.n_layer} layers needs"
            )
        state[ours] = read_fused(weights, [names[t] for t in theirs], transposed, dtype)
        used.update(theirs)
    if "pos_emb.table.weight" in state:  # a smaller block_size keeps the first positions
        state["pos_emb.table.weight"] = state["pos_emb.table.weight"][: config.block_size].clone()
    if config.tie_embeddings and "lm_head.weight" in names:
        head = weights.pop(names["lm_head.weight"])
        if not torch.equal(head.to(state["tok_emb.weight"].dtype), state["tok_emb.weight"]):
            raise ValueError(
                "the checkpoint's lm_head.weight differs from its token embedding though its config ties "
                "them (tie_word_embeddings)"
            )
        used.add("lm_head.weight")
    unknown = sorted(n for n in names if n not in used and not n.endswith(BUFFERS))
    if unknown:
        raise ValueError(
            f"the checkpoint has weights a {family.architecture} of gptlite's kind does not: "
            f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}"
        )
    if config.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def read_fused(weights: Weights, names: list[str], transposed: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensors `names` stacked along dim 0 (gptlite's fused q/k/v, gate/up), or one tensor transposed (GPT-2's
    Conv1D), each read straight into its place in one tensor allocated once (in `dtype`, or the checkpoint's)."""
    if transposed:
        (name,) = names
        return weights.pop(name).t().to(dtype or None).contiguous()
    shapes = [weights.shape(n) for n in names]
    out = torch.empty(
        (sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype or weights.dtype(names[0])
    )  # (rows, ...)
    row = 0
    for name, shape in zip(names, shapes, strict=True):
        weights.pop(name, out=out[row : row + shape[0]])
        row += shape[0]
    return out


def pretrained_config(name_or_dir: str, **overrides) -> GPTConfig:
    """The GPTConfig of a pretrained checkpoint (downloading only its config.json), with `block_size` (at most
    the checkpoint's) and `dropout` overridden if given."""
    _, config, window = read_config(checkpoint_dir(name_or_dir, weights=False))
    return _override(config, overrides, name_or_dir, window)


def _override(config: GPTConfig, overrides: dict, source: str, window: int | None) -> GPTConfig:
    wrong = sorted(set(overrides) - {"block_size", "dropout"})
    if wrong:
        raise ValueError(
            f"{source}: the pretrained model fixes {', '.join(wrong)}; only block_size (smaller) and "
            "dropout can be changed"
        )
    block_size = overrides.get("block_size", config.block_size)
    if config.pos_emb == "learned" and block_size > config.block_size:
        raise ValueError(
            f"block_size={block_size} is more than the {config.block_size} positions {source} learned; "
            f"use block_size <= {config.block_size}"
        )
    if window and block_size > window:
        raise ValueError(
            f"{source}: its sliding window {window} is shorter than block_size={block_size}; gptlite "
            f"attends to the whole context: use block_size <= {window}"
        )
    return GPTConfig(**{**vars(config), **overrides})


def load_pretrained(
    name_or_dir: str, dtype: torch.dtype | None = None, **overrides
) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """The GPTConfig, the gptlite state dict (in `dtype`, or the checkpoint's own) and the transformers class of a
    checkpoint (see the module docstring), for GPT.from_pretrained. `block_size` may be set smaller (learned
    positions are cropped, as nanoGPT does) and `dropout` set for fine-tuning."""
    directory = checkpoint_dir(name_or_dir)
    family, config, window = read_config(directory)
    config = _override(config, overrides, name_or_dir, window)
    return config, to_gptlite(family, Weights(directory), config, dtype), family.architecture


def fingerprint(name_or_dir: str) -> str:
    """The sha256 of a checkpoint's config.json and weight files, in name order: what a LoRA run records of its base
    weights, to find out when they are not the ones its adapters were trained on."""
    directory = checkpoint_dir(name_or_dir)
    names = ["config.json", *WEIGHT_FILES]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names += sorted(set(map(str, read_json(index, "a sharded checkpoint's index").get("weight_map", {}).values())))
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")
    digest = hashlib.sha256()
    for name in names:
        if (directory / name).is_file():
            digest.update(name.encode())
            with open(directory / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Out: GPT -> a directory transformers loads


def family_of(config: GPTConfig, architecture: str | None = None) -> Family:
    """The transformers architecture a model's switches map to (Mistral, which has Llama's, when `architecture` names
    it); others are refused, naming the switches that export."""
    speedrun = [k for k in ("value_embeds", "bigram_vocab", "unet_skips", "logit_softcap") if getattr(config, k)]
    if speedrun:  # modded-nanogpt's techniques: no transformers class computes them
        raise ValueError(
            f"a model with {', '.join(f'{k}={getattr(config, k)}' for k in speedrun)} has no transformers "
            "architecture (these speedrun options change what the model computes); train without them to export"
        )
    if (config.pos_emb, config.norm, config.ffn) == ("learned", "layernorm", "gelu"):
        extra = [k for k in ("n_kv_head", "head_dim", "qkv_bias", "qk_norm", "rope_scaling") if getattr(config, k)]
        if not extra:
            return GPT2
    elif (config.pos_emb, config.norm, config.ffn) == ("rope", "rmsnorm", "swiglu") and not config.bias:
        family = QWEN3 if config.qk_norm else QWEN2 if config.qkv_bias else LLAMA
        if family is LLAMA and architecture == MISTRAL.architecture and not config.rope_scaling:
            family = MISTRAL
        if not (config.qk_norm and config.qkv_bias) and not (config.rope_scaling and family is not LLAMA):
            return family
    raise ValueError(
        f"a model with pos_emb={config.pos_emb!r}, norm={config.norm!r}, ffn={config.ffn!r}, "
        f"bias={config.bias}, qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, "
        f"rope_scaling={config.rope_scaling!r} has no transformers architecture; exportable are {EXPORTABLE}"
    )


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


def hf_config(family: Family, config: GPTConfig, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    """config.json for transformers."""
    eos = tokenizer.eot_id if tokenizer is not None else None
    bos = tokenizer.bos_id if isinstance(tokenizer, HFTokenizer) else eos
    eos = tokenizer.eos_id if isinstance(tokenizer, HFTokenizer) and tokenizer.eos_id is not None else eos
    common = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
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
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
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
        **(windows if family is not LLAMA else {}),
    }


def export_hf(
    model: GPT,
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
    from gptlite.quantize import Int8Linear

    if isinstance(model.lm_head, Int8Linear):
        raise ValueError(
            "an int8-quantized model cannot be exported: its weights are rounded; export the float model "
            "(quantize after loading, e.g. sample.py --quantize=int8)"
        )
    family = family_of(model.config, architecture or model.source_architecture)
    state = model.state_dict()
    dtype = state["tok_emb.weight"].dtype
    weights = from_gptlite(family, state, model.config)
    files = {"config.json": json.dumps(hf_config(family, model.config, dtype, tokenizer), indent=2) + "\n"}
    if tokenizer is not None:
        files.update(hf_tokenizer_files(tokenizer, model.config.block_size))
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

    previous = write_folder(directory, write, overwrite=True, what="export folder")
    if previous and log:
        log(f"moved the earlier contents of {directory} to {previous}")
    return [directory / name for name in names]
