"""In: a transformers checkpoint (a directory, or a GPT-2 name downloaded from the Hub) -> a GPTConfig and gptlite's
state dict, tensor by tensor (GPT.from_pretrained builds the model from them), and the fingerprint of its weights."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from gptlite.config import GPTConfig, check_model_overrides
from gptlite.hf.families import (
    CONFIG_DEFAULTS,
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
REQUIRED = object()  # ConfigFile.get's default: a key without a default of its family is required


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


class ConfigFile:
    """A Hugging Face config.json, each value read where it is used with its type and range checked (a bad one is a
    one-line ValueError naming the file and the key), a key it leaves out taking the default transformers gives it
    for the family (CONFIG_DEFAULTS): every layout transformers reads maps to the same model.

    A value may come from a nested table first (`table`, named `where`: rope_parameters' rope_theta before the
    top-level one, as transformers takes it), then from the file's top level (`top`, by default the same key)."""

    def __init__(self, values: dict, path: Path, family: Family):
        self.values = values
        self.path = path
        self.family = family
        self.defaults = {**CONFIG_DEFAULTS["*"], **CONFIG_DEFAULTS.get(family.model_type, {})}

    def lookup(
        self, key: str, table: dict | None = None, where: str = "", top: str = "", default: Any = REQUIRED
    ) -> tuple[str, Any]:
        """(Where the value was found, the value): in `table`, else the file's `top` key, else `default` (by
        default the family's; a key without one is required)."""
        if table is not None and key in table:
            return f"{where}.{key}", table[key]
        top = top or key
        if top in self.values:
            return top, self.values[top]
        if default is REQUIRED:
            default = self.defaults.get(top, REQUIRED)
        if default is REQUIRED:
            raise ValueError(f"{self.path} has no {top}, which a {self.family.architecture} config needs")
        return top, default

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        """The file's value of `key` as it is, or its default."""
        return self.lookup(key, default=default)[1]

    def bad(self, name: str, value: Any, what: str) -> ValueError:
        return ValueError(
            f"{self.path}: {name}={json.dumps(value)} must be {what}; correct it there, or download the file again"
        )

    def integer(self, key: str, low: int = 1, nullable: bool = False, **where: Any) -> Any:
        """An integer >= low; with `nullable`, None where the value is null."""
        name, value = self.lookup(key, **where)
        if value is None and nullable:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.bad(name, value, f"an integer >= {low}" + (" or null" if nullable else ""))
        return value

    def number(self, key: str, low: float | None = 0.0, high: float | None = None, **where: Any) -> float:
        """A finite number above `low` (None: any) and at most `high` (None: any)."""
        name, value = self.lookup(key, **where)
        what = "a finite number" + (f" > {low:g}" if low is not None else "") + (f", at most {high:g}" if high else "")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(name, value, what)
        if (low is not None and value <= low) or (high is not None and value > high):
            raise self.bad(name, value, what)
        return float(value)

    def flag(self, key: str, default: Any = REQUIRED) -> bool:
        """A JSON true or false (null: false)."""
        value = self.get(key, default)
        if value is not None and not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return bool(value)

    def table(self, key: str) -> dict | None:
        """A nested table (rope_parameters, rope_scaling): a JSON object, or None where it is null or absent."""
        value = self.get(key, None)
        if value is not None and not isinstance(value, dict):
            raise self.bad(key, value, "a table (a JSON object) or null")
        return value


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
    values, window, unsupported = (gpt2_values if family is GPT2 else llama_values)(ConfigFile(c, path, family))
    if unsupported:
        raise ValueError(f"{path}: gptlite cannot hold this {family.architecture}: {'; '.join(unsupported)}")
    try:
        return family, GPTConfig(**values), window
    except ValueError as e:  # the values together (the heads' width, ...): the file's
        raise ValueError(f"{path}: {e}") from None


def gpt2_values(c: ConfigFile) -> tuple[dict, int | None, list[str]]:
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


def rope_tables(c: ConfigFile) -> tuple[dict, str, dict | None]:
    """(The RoPE table, its name in the file, Gemma 3's sliding-window layers' table or None), as transformers reads
    them: the older rope_scaling before rope_parameters; Gemma 3's a table per kind of layer, rope_scaling merged into
    the global layers' (Gemma3TextConfig.convert_rope_params_to_dict). Values a table lacks come from the top level
    (rope_theta, Gemma 3's rope_local_base_freq), else the family's default: see llama_values."""
    scaling = c.table("rope_scaling")
    parameters = c.table("rope_parameters")
    if c.family is not GEMMA3:
        return dict(scaling or parameters or {}), "rope_scaling" if scaling else "rope_parameters", None
    tables = {}
    for kind in ("full_attention", "sliding_attention"):
        table = (parameters or {}).get(kind)
        if table is not None and not isinstance(table, dict):
            raise c.bad(f"rope_parameters.{kind}", table, "a table (a JSON object)")
        tables[kind] = dict(table or {})
    tables["full_attention"].update(scaling or {})
    return tables["full_attention"], "rope_parameters.full_attention", tables["sliding_attention"]


def rope_kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def llama_values(c: ConfigFile) -> tuple[dict, int | None, list[str]]:
    """The switches of the Llama layout's families, and what of the config they cannot hold."""
    family = c.family
    n_layer = c.integer("num_hidden_layers")
    heads = c.integer("num_attention_heads")
    hidden = c.integer("hidden_size")
    kv_heads = c.integer("num_key_value_heads", nullable=True) or heads
    head_dim = c.integer("head_dim", nullable=True) or hidden // heads
    rope, rope_name, local_rope = rope_tables(c)
    at = dict(table=rope, where=rope_name)  # a RoPE value: the table's, else the top level's, else the default
    values = dict(
        vocab_size=c.integer("vocab_size"),
        block_size=c.integer("max_position_embeddings"),
        n_layer=n_layer,
        n_head=heads,
        n_kv_head=kv_heads if kv_heads != heads else None,
        n_embd=hidden,
        head_dim=head_dim if head_dim * heads != hidden else None,
        bias=False,
        pos_emb="rope",
        rope_theta=c.number("rope_theta", **at),
        norm="rmsnorm",
        norm_eps=c.number("rms_norm_eps"),
        ffn="swiglu",
        ffn_hidden=c.integer("intermediate_size"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        qkv_bias=family is QWEN2,
        qk_norm=family is QWEN3,
    )
    if family is GRANITE:
        values.update(
            embed_scale=c.number("embedding_multiplier"),
            residual_scale=c.number("residual_multiplier"),
            attn_scale=c.number("attention_multiplier"),
            logits_scaling=c.number("logits_scaling"),
        )
    if family is NANOCHAT:  # relu^2, parameter-free norms (one on the embeddings too), RoPE the other way round
        values.update(
            ffn="relu2",
            norm_weight=False,
            embed_norm=True,
            rope_reverse=True,
            qk_norm=True,
            logit_softcap=softcap(c),
        )
    if family is GEMMA3:
        values.update(gemma3_values(c, n_layer, local_rope))
    if family is OLMO2:  # its norms on the branches' outputs; q and k normalised whole
        values.update(norm_position="post", qk_norm=True, qk_norm_scope="all")
    if family is SMOLLM3:  # no_rope_layers: 1 where a layer rotates q and k, 0 where it has no positions (NoPE)
        values["nope_layers"] = ",".join(str(i) for i, on in enumerate(smollm3_rotates(c, n_layer)) if not on)
    unsupported = []
    act = {NANOCHAT: "relu2", GEMMA3: "gelu_pytorch_tanh"}.get(family, "silu")
    act_key = "hidden_activation" if family is GEMMA3 else "hidden_act"
    if c.get(act_key, act) != act:
        unsupported.append(f"{act_key}={c.get(act_key)!r} (gptlite's {family.architecture} uses {act})")
    if family is GEMMA3:
        unsupported += gemma3_unsupported(c, local_rope)
    if c.flag("attention_bias", False) and family is not QWEN2:
        unsupported.append("biases on the attention's projections, its output's too (attention_bias=true)")
    if c.flag("mlp_bias", False):
        unsupported.append("biases in the feed-forward (mlp_bias=true)")
    kind = rope_kind(rope)
    if family is PHI3 and kind in ("su", "yarn"):  # Phi-3's first configs' names for LongRoPE
        kind = "longrope"
    if kind == "llama3":
        values.update(
            rope_scaling="llama3",
            rope_factor=c.number("factor", **at),
            rope_low_freq_factor=c.number("low_freq_factor", **at),
            rope_high_freq_factor=c.number("high_freq_factor", **at),
            rope_original_context=original_context(c, at),
        )
    elif kind == "longrope" and family is PHI3:
        values.update(longrope_values(c, at))
    elif kind != "default":
        unsupported.append(f"RoPE scaling of type {kind!r} (gptlite has llama3's, and Phi-3's longrope)")
    partial = c.number("partial_rotary_factor", high=1.0, default=1.0, **at)
    if partial != 1 and family is PHI3:
        values["rope_dims"] = int(head_dim * partial)
    elif partial != 1:
        unsupported.append(f"RoPE on part of each head (partial_rotary_factor={partial}; Phi-3's alone has it here)")
    window = None
    if family in (MISTRAL, PHI3) or (family is not GEMMA3 and c.flag("use_sliding_window", False)):
        window = c.integer("sliding_window", nullable=True)
    if family in (QWEN2, QWEN3) and c.flag("use_sliding_window", False):
        unsupported.append("sliding-window attention in some layers (use_sliding_window=true)")
    if window:
        values["block_size"] = min(values["block_size"], window)  # within the window, attention is exact
    return values, window, unsupported


def softcap(c: ConfigFile) -> float:
    """final_logit_softcapping: a number > 0, or null for none (0)."""
    return 0.0 if c.get("final_logit_softcapping") is None else c.number("final_logit_softcapping")


def smollm3_rotates(c: ConfigFile, n_layer: int) -> list[int]:
    """SmolLM3's no_rope_layers (1 where a layer rotates q and k), or every no_rope_layer_interval-th layer without."""
    rotates = c.get("no_rope_layers", None)
    if rotates is None:
        interval = c.integer("no_rope_layer_interval")
        return [int((i + 1) % interval != 0) for i in range(n_layer)]
    if not isinstance(rotates, list) or len(rotates) != n_layer or any(r not in (0, 1) for r in rotates):
        raise c.bad("no_rope_layers", rotates, f"a list of num_hidden_layers={n_layer} 0s and 1s")
    return rotates


def original_context(c: ConfigFile, at: dict) -> int:
    """original_max_position_embeddings as transformers' standardize_rope_params takes it for a scaled RoPE: a
    top-level one (Phi-3's config class always has one, 4096 by default) over the RoPE table's, else
    max_position_embeddings."""
    if "original_max_position_embeddings" in c.values or c.family is PHI3:
        return c.integer("original_max_position_embeddings")
    return c.integer("original_max_position_embeddings", default=c.get("max_position_embeddings"), **at)


def longrope_values(c: ConfigFile, at: dict) -> dict:
    """Phi-3's LongRoPE, as transformers computes it, within the original context: there the short factors divide
    the frequencies and cos and sin are scaled by the attention factor (the long factors apply past it)."""
    positions = c.integer("max_position_embeddings")
    original = original_context(c, at)
    factor = c.number("factor", default=positions / original, **at)
    default_attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = c.number("attention_factor", default=default_attention, **at)
    return dict(
        rope_scaling="longrope",
        rope_short_factor=",".join(repr(f) for f in factor_list(c, "short_factor", at)),
        rope_long_factor=",".join(repr(f) for f in factor_list(c, "long_factor", at)),
        rope_attention_factor=attention,
        rope_original_context=original,
        block_size=min(positions, original),  # the long factors apply past it
    )


def factor_list(c: ConfigFile, key: str, at: dict) -> list[float]:
    """A LongRoPE list of factors (short_factor, long_factor: transformers needs both), each a finite number > 0."""
    name, value = c.lookup(key, **at)
    if not isinstance(value, list):
        raise c.bad(name, value, "a list of finite numbers > 0")
    return [c.number(str(i), table={str(i): v for i, v in enumerate(value)}, where=name) for i in range(len(value))]


def gemma3_layer_types(c: ConfigFile, n_layer: int) -> list[str]:
    """Each layer's kind as Gemma3TextConfig reads it: layer_types (transformers' older "attention" is
    "full_attention"), else every sliding_window_pattern-th layer global and the others sliding."""
    kinds = c.get("layer_types", None)
    if kinds is None:
        pattern = c.integer("sliding_window_pattern")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    known = ("sliding_attention", "full_attention", "attention")
    if not isinstance(kinds, list) or len(kinds) != n_layer or any(k not in known for k in kinds):
        raise c.bad(
            "layer_types",
            kinds,
            f"a list of num_hidden_layers={n_layer} kinds, each sliding_attention or full_attention",
        )
    return ["full_attention" if k == "attention" else k for k in kinds]


def gemma3_values(c: ConfigFile, n_layer: int, local_rope: dict) -> dict:
    """Gemma 3's switches: GeGLU, norms before and after each branch scaling by 1 + weight, per-head q/k norms,
    embeddings times sqrt(hidden), its own attention scale, sliding-window layers with a RoPE base of their own."""
    local = [i for i, kind in enumerate(gemma3_layer_types(c, n_layer)) if kind == "sliding_attention"]
    window = c.integer("sliding_window", nullable=True) if local else None
    if local and window is None:
        raise c.bad("sliding_window", None, "an integer >= 1 where layers are sliding_attention")
    where = dict(table=local_rope, where="rope_parameters.sliding_attention", top="rope_local_base_freq")
    return dict(
        ffn="geglu",
        norm_position="both",
        norm_unit_offset=True,
        qk_norm=True,
        embed_scale=c.integer("hidden_size") ** 0.5,
        attn_scale=c.number("query_pre_attn_scalar") ** -0.5,
        logit_softcap=softcap(c),
        sliding_window=window or 0,
        window_layers=",".join(map(str, local)),
        rope_local_theta=c.number("rope_theta", **where) if local else 0.0,
    )


def gemma3_unsupported(c: ConfigFile, local_rope: dict) -> list[str]:
    """What of a Gemma 3 config gptlite's switches cannot hold."""
    unsupported = []
    if c.get("attn_logit_softcapping", None):
        unsupported.append(f"soft-capped attention scores (attn_logit_softcapping={c.get('attn_logit_softcapping')})")
    if c.flag("use_bidirectional_attention", False):
        unsupported.append("bidirectional attention (use_bidirectional_attention=true)")
    if rope_kind(local_rope) != "default":
        unsupported.append(f"RoPE scaling of type {rope_kind(local_rope)!r} in the sliding-window layers")
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
                f"{weights.directory}: the checkpoint has no {missing[0]}, which a {family.architecture} of "
                f"{config.n_layer} layers needs; its weights are incomplete or do not match its config.json "
                "(tie_word_embeddings, num_hidden_layers): download or save the model again"
            )
        state[ours] = read_fused(weights, [names[t] for t in theirs], transposed, dtype)
        used.update(theirs)
    if "pos_emb.table.weight" in state:  # a smaller block_size keeps the first positions
        state["pos_emb.table.weight"] = state["pos_emb.table.weight"][: config.block_size].clone()
    if config.tie_embeddings and "lm_head.weight" in names:
        head = weights.pop(names["lm_head.weight"])
        if not torch.equal(head.to(state["tok_emb.weight"].dtype), state["tok_emb.weight"]):
            raise ValueError(
                f"{weights.directory}: the checkpoint's lm_head.weight differs from its token embedding though its "
                "config.json ties them (tie_word_embeddings): set tie_word_embeddings to false there, or download "
                "the model again"
            )
        used.add("lm_head.weight")
    unknown = sorted(n for n in names if n not in used and not n.endswith(BUFFERS))
    if unknown:
        raise ValueError(
            f"{weights.directory}: the checkpoint has weights a {family.architecture} of gptlite's kind does not: "
            f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}; its config.json does not describe "
            "them (a variant gptlite cannot hold, or a damaged config.json): download or save the model again"
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
