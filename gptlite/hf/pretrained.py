"""In: a transformers checkpoint (a directory, or a GPT-2 name downloaded from the Hub) -> a GPTConfig and gptlite's
state dict, tensor by tensor (GPT.from_pretrained builds the model from them), and the fingerprint of its weights."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from gptlite.config import GPTConfig, check_model_overrides
from gptlite.hf.families import (
    FAMILIES,
    GEMMA3,
    GPT2,
    GRANITE,
    MISTRAL,
    NANOCHAT,
    OLMO2,
    PHI3,
    QWEN2,
    QWEN3,
    SMOLLM3,
    UNSUPPORTED,
    Family,
    entries,
)
from gptlite.hf.weights import WEIGHT_FILES, Weights, read_json

GPT2_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
# buffers some checkpoints store beside their weights (GPT-2's causal masks, old Llamas' RoPE frequencies)
BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")


def check_model_name(name_or_dir: str) -> None:
    """What names a model to read (--model, train.py's --init_from) is a folder here (a gptlite run folder or a
    Hugging Face directory) or a name gptlite downloads (GPT2_NAMES); anything else, a mistyped path most often, is
    a FileNotFoundError that names it and what it may be."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() or name_or_dir in GPT2_NAMES:
        return
    what = "is a file, not a folder" if path.exists() else "is not a folder here, nor a name gptlite downloads"
    raise FileNotFoundError(
        f"{name_or_dir} {what}: a model to read is a gptlite run folder, a Hugging Face directory (config.json and "
        f"model.safetensors; hf download REPO --local-dir DIR fetches one) or one of {', '.join(GPT2_NAMES)}"
    )


def checkpoint_dir(name_or_dir: str, weights: bool = True) -> Path:
    """A local directory holding the checkpoint: name_or_dir itself, or the download of a GPT-2 name."""
    check_model_name(name_or_dir)
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
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
            f"{path} does not exist: {directory} is neither a gptlite run folder (no ckpt_NNNNNN.pt) nor a Hugging "
            "Face checkpoint directory (config.json and its weights); name a run's --out_dir or such a directory"
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
    heads = c["num_attention_heads"]
    hidden = c["hidden_size"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if family is GEMMA3:  # a RoPE per kind of layer
        rope, local_rope = rope.get("full_attention", {}), rope.get("sliding_attention", {})
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
    if family is GRANITE:
        values.update(
            embed_scale=float(c.get("embedding_multiplier", 1.0)),
            residual_scale=float(c.get("residual_multiplier", 1.0)),
            attn_scale=float(c.get("attention_multiplier", 1.0)),
            logits_scaling=float(c.get("logits_scaling", 1.0)),
        )
    if family is NANOCHAT:  # relu^2, parameter-free norms (one on the embeddings too), RoPE the other way round
        softcap = c.get("final_logit_softcapping")
        values.update(
            ffn="relu2",
            norm_weight=False,
            embed_norm=True,
            rope_reverse=True,
            qk_norm=True,
            logit_softcap=float(softcap or 0.0),
        )
    if family is GEMMA3:
        values.update(gemma3_values(c, local_rope))
    if family is OLMO2:  # its norms on the branches' outputs; q and k normalised whole
        values.update(norm_position="post", qk_norm=True, qk_norm_scope="all")
    if family is SMOLLM3:  # no_rope_layers: 1 where a layer rotates q and k, 0 where it has no positions (NoPE)
        rotates = c.get("no_rope_layers") or [
            int((i + 1) % c.get("no_rope_layer_interval", 4) != 0) for i in range(c["num_hidden_layers"])
        ]
        values["nope_layers"] = ",".join(str(i) for i, on in enumerate(rotates) if not on)
    unsupported = []
    act = {NANOCHAT: "relu2", GEMMA3: "gelu_pytorch_tanh"}.get(family, "silu")
    act_key = "hidden_activation" if family is GEMMA3 else "hidden_act"
    if c.get(act_key, act) != act:
        unsupported.append(f"{act_key}={c[act_key]!r} (gptlite's {family.architecture} uses {act})")
    if family is GEMMA3:
        unsupported += gemma3_unsupported(c)
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
    elif rope_type == "longrope" and family is PHI3:
        values.update(longrope_values(c, rope))
    elif rope_type != "default":
        unsupported.append(f"RoPE scaling of type {rope_type!r} (gptlite has llama3's, and Phi-3's longrope)")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1 and family is PHI3:
        values["rope_dims"] = int(head_dim * partial)
    elif partial != 1:
        unsupported.append(f"RoPE on part of each head (partial_rotary_factor={partial}; Phi-3's alone has it here)")
    window = c.get("sliding_window") if family in (MISTRAL, PHI3) or c.get("use_sliding_window") else None
    if family in (QWEN2, QWEN3) and c.get("use_sliding_window"):
        unsupported.append("sliding-window attention in some layers (use_sliding_window=true)")
    if window:
        values["block_size"] = min(values["block_size"], window)  # within the window, attention is exact
    return values, window, unsupported


def longrope_values(c: dict, rope: dict) -> dict:
    """Phi-3's LongRoPE, as transformers computes it, within the original context: there the short factors divide
    the frequencies and cos and sin are scaled by the attention factor (the long factors apply past it)."""
    original = rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
    original = original or c["max_position_embeddings"]
    factor = rope.get("factor") or c["max_position_embeddings"] / original
    attention = rope.get("attention_factor") or (
        1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    )
    return dict(
        rope_scaling="longrope",
        rope_short_factor=",".join(repr(float(f)) for f in rope["short_factor"]),
        rope_long_factor=",".join(repr(float(f)) for f in rope.get("long_factor") or []),
        rope_attention_factor=float(attention),
        rope_original_context=int(original),
        block_size=min(c["max_position_embeddings"], int(original)),  # the long factors apply past it
    )


def gemma3_values(c: dict, local_rope: dict) -> dict:
    """Gemma 3's switches: GeGLU, norms before and after each branch scaling by 1 + weight, per-head q/k norms,
    embeddings times sqrt(hidden), its own attention scale, sliding-window layers with a RoPE base of their own."""
    local = [i for i, kind in enumerate(c.get("layer_types") or []) if kind == "sliding_attention"]
    window = c.get("sliding_window") or 0
    softcap = c.get("final_logit_softcapping")
    return dict(
        ffn="geglu",
        norm_position="both",
        norm_unit_offset=True,
        qk_norm=True,
        embed_scale=c["hidden_size"] ** 0.5,
        attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        logit_softcap=float(softcap or 0.0),
        sliding_window=window if local else 0,
        window_layers=",".join(map(str, local)) if window else "",
        rope_local_theta=float(local_rope.get("rope_theta", 10000.0)) if window and local else 0.0,
    )


def gemma3_unsupported(c: dict) -> list[str]:
    """What of a Gemma 3 config gptlite's switches cannot hold."""
    unsupported = []
    if c.get("attn_logit_softcapping"):
        unsupported.append(f"soft-capped attention scores (attn_logit_softcapping={c['attn_logit_softcapping']})")
    if c.get("use_bidirectional_attention"):
        unsupported.append("bidirectional attention (use_bidirectional_attention=true)")
    local = (c.get("rope_parameters") or {}).get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        unsupported.append(f"RoPE scaling of type {local['rope_type']!r} in the sliding-window layers")
    return unsupported


def to_gptlite(
    family: Family, weights: Weights, config: GPTConfig, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """A transformers checkpoint -> gptlite's state dict for a model of `config`, read and converted tensor by
    tensor (in `dtype`, or the checkpoint's); refuses missing and unknown weights, and weights of a dtype a model
    cannot hold (integers, booleans: cast, they would train and run as nonsense), before any is read."""
    names = {n.removeprefix(family.prefix): n for n in weights.names()}  # the Hub's gpt2 has no prefix
    for name in names.values():
        dtype_ = weights.dtype(name)
        if not dtype_.is_floating_point and not name.endswith(BUFFERS):
            raise ValueError(
                f"{weights.file(name)}: tensor {name} is {str(dtype_).removeprefix('torch.')}, and a model's weights "
                "are floating point (float32, bfloat16, float16); the file is damaged or not a model's weights: "
                "download or save it again"
            )
    state = {}
    used = set()
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
    check_model_overrides(config, overrides, source)
    block_size = overrides.get("block_size", config.block_size)
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
