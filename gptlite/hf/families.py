"""The transformers architectures gptlite's model maps onto, weight for weight: each family's names (`entries`), and
the family a model's switches export as (`family_of`). See gptlite.hf for the list."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from gptlite.config import GPTConfig

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
GRANITE = Family("GraniteForCausalLM", "granite", "", "model.layers.{i}.")
SMOLLM3 = Family("SmolLM3ForCausalLM", "smollm3", "", "model.layers.{i}.")
PHI3 = Family("Phi3ForCausalLM", "phi3", "", "model.layers.{i}.")
OLMO2 = Family("Olmo2ForCausalLM", "olmo2", "", "model.layers.{i}.")
NANOCHAT = Family("NanoChatForCausalLM", "nanochat", "", "model.layers.{i}.")
GEMMA3 = Family("Gemma3ForCausalLM", "gemma3_text", "", "model.layers.{i}.")
FAMILIES = {
    f.model_type: f for f in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, GRANITE, SMOLLM3, PHI3, OLMO2, NANOCHAT, GEMMA3)
}
# What transformers takes for a key a config.json leaves out ("*": every family's, then each family's own; each
# family's config class in transformers 5 has them): gptlite.hf.pretrained.ConfigFile reads a file with them, so
# that a file without a key is the model transformers builds from it
CONFIG_DEFAULTS: dict[str, dict] = {
    "*": {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "num_key_value_heads": None,  # as many as the attention heads
        "head_dim": None,  # hidden_size / num_attention_heads
        "sliding_window": None,
        "final_logit_softcapping": None,
    },
    "gpt2": {
        "tie_word_embeddings": True,
        "layer_norm_epsilon": 1e-5,
        "n_inner": None,
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
    },
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096},
    "granite": {
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "logits_scaling": 1.0,
    },
    "smollm3": {"tie_word_embeddings": True, "rope_theta": 2_000_000.0, "no_rope_layer_interval": 4},
    "phi3": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    "olmo2": {"rms_norm_eps": 1e-5},
    "nanochat": {"final_logit_softcapping": 15.0},
    "gemma3_text": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,  # the global layers'
        "rope_local_base_freq": 10_000.0,  # the sliding-window layers'
        "sliding_window": 4096,
        "sliding_window_pattern": 6,  # without layer_types: every 6th layer global
        "query_pre_attn_scalar": 256,
    },
}
# Granite's multipliers: a model that sets any of them is a Granite
GRANITE_SCALES = {"embed_scale": 1.0, "residual_scale": 1.0, "attn_scale": 0.0, "logits_scaling": 1.0}
# the switches of one family each, with their defaults (what a model of the others has)
OWN_SWITCHES = {
    **GRANITE_SCALES,
    "nope_layers": "",
    "norm_position": "pre",
    "qk_norm_scope": "head",
    "norm_weight": True,
    "embed_norm": False,
    "rope_reverse": False,
    "norm_unit_offset": False,
    "sliding_window": 0,
    "window_layers": "",
    "rope_local_theta": 0.0,
    "rope_dims": 0,
}
# Gemma 3's switches, all of them but those of its attention (a scale, a window, the local layers' RoPE base) and
# its final soft cap; embed_scale is sqrt(n_embd)
GEMMA3_SWITCHES = {
    "pos_emb": "rope",
    "norm": "rmsnorm",
    "ffn": "geglu",
    "bias": False,
    "qkv_bias": False,
    "qk_norm": True,
    "qk_norm_scope": "head",
    "rope_scaling": "",
    "norm_position": "both",
    "norm_unit_offset": True,
    "residual_scale": 1.0,
    "logits_scaling": 1.0,
    "nope_layers": "",
    "norm_weight": True,
    "embed_norm": False,
    "rope_reverse": False,
}
GEMMA3_FREE = ("attn_scale", "sliding_window", "window_layers", "rope_local_theta", "embed_scale")
# nanochat's switches, all of them (its final logits soft-capped or not)
NANOCHAT_SWITCHES = {
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
UNSUPPORTED = {  # model types people ask for, and what gptlite lacks for them
    "gemma": "Gemma's scaled embeddings and GeGLU feed-forward",
    "gemma2": "Gemma 2's soft-capped logits",
    "gemma3": "Gemma 3's vision tower with its text model (Gemma3ForConditionalGeneration)",
    "mixtral": "Mixtral's mixture of experts",
    "qwen2_moe": "a mixture of experts",
    "qwen3_moe": "a mixture of experts",
}
# the switches of GPT-2's and Llama's layouts, and those that a model of neither may need set back to their defaults:
# what the refusal of a model with no transformers architecture tells its user to train with (export_flags)
CORE_SWITCHES = {
    GPT2: {"pos_emb": "learned", "norm": "layernorm", "ffn": "gelu"},
    LLAMA: {"pos_emb": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False},
}
SPEEDRUN_SWITCHES = ("value_embeds", "bigram_vocab", "unet_skips", "logit_softcap")
OTHER_SWITCHES = ("n_kv_head", "head_dim", "qkv_bias", "qk_norm", "rope_scaling", *OWN_SWITCHES, *SPEEDRUN_SWITCHES)


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
        # Phi-3 stores q, k and v as one matrix, and the gate and value, as gptlite does
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        fc, out = ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"
        if family is PHI3:
            attn, fc = ("self_attn.qkv_proj",), ("mlp.gate_up_proj",)
        if family is NANOCHAT:  # a two-matrix MLP
            fc, out = ("mlp.fc1",), "mlp.fc2"
        # OLMo 2's norms are on the branches' outputs, under their own names
        norms = ("input_layernorm", "post_attention_layernorm")
        if family is OLMO2:
            norms = ("post_attention_layernorm", "post_feedforward_layernorm")
        if family is GEMMA3:  # norms before and after each branch
            norms = ("input_layernorm", "pre_feedforward_layernorm")
        layer = [
            ("attn_norm.weight", (f"{norms[0]}.weight",), False),
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
            ("ffn_norm.weight", (f"{norms[1]}.weight",), False),
            # SwiGLU's fc: its first half is the gate (through silu), the second the value
            ("ffn.fc.weight", tuple(f"{t}.weight" for t in fc), False),
            ("ffn.out_proj.weight", (f"{out}.weight",), False),
        ]
        if family is GEMMA3:
            layer += [
                ("attn_post_norm.weight", ("post_attention_layernorm.weight",), False),
                ("ffn_post_norm.weight", ("post_feedforward_layernorm.weight",), False),
            ]
        if not config.norm_weight:  # parameter-free norms (nanochat's) have no tensors
            top = [entry for entry in top if not entry[0].startswith("norm.")]
            layer = [entry for entry in layer if "norm." not in entry[0]]
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


def family_of(config: GPTConfig, architecture: str | None = None) -> Family:
    """The transformers architecture a model's switches map to (Mistral's and Phi-3's, which have Llama's switches,
    when `architecture` names them); others are refused in one line naming the train.py flags that make a model of
    GPT-2's or Llama's layout that exports (export_flags)."""
    speedrun = speedrun_options(config)
    if speedrun:  # modded-nanogpt's techniques: no transformers class computes them
        raise ValueError(
            f"a model with {', '.join(f'{k}={getattr(config, k)}' for k in speedrun)} has no transformers "
            "architecture (these speedrun options change what the model computes); train without them to export"
        )
    family = matching_family(config, architecture)
    if family is None:
        raise ValueError(
            f"a model with {switches_of(config)} has no transformers architecture; "
            + trained_with(config, lambda c: matching_family(c, architecture), lambda f: f.architecture)
        )
    return family


def is_nanochat(config: GPTConfig) -> bool:
    """Whether `config` has nanochat's switches, all of them, and no other family's."""
    return all(getattr(config, k) == v for k, v in NANOCHAT_SWITCHES.items()) and not [
        k for k in own_switches(config) if k not in NANOCHAT_SWITCHES
    ]


def is_gemma3(config: GPTConfig) -> bool:
    """Whether `config` has Gemma 3's switches, and no other family's but its attention's and soft cap."""
    return (
        all(getattr(config, k) == v for k, v in GEMMA3_SWITCHES.items())
        and config.embed_scale == config.n_embd**0.5
        and not [k for k in own_switches(config) if k not in GEMMA3_SWITCHES and k not in GEMMA3_FREE]
    )


def speedrun_options(config: GPTConfig) -> list[str]:
    """The speedrun options `config` sets that no transformers class computes (nanochat's and Gemma's own cap their
    logits)."""
    capped = is_nanochat(config) or is_gemma3(config)
    return [k for k in SPEEDRUN_SWITCHES if getattr(config, k) and not (capped and k == "logit_softcap")]


def matching_family(config: GPTConfig, architecture: str | None = None) -> Family | None:
    """The family `config`'s switches map to (see family_of), or None."""
    if speedrun_options(config):
        return None
    if is_nanochat(config):
        return NANOCHAT
    if is_gemma3(config):
        return GEMMA3
    if (config.pos_emb, config.norm, config.ffn) == ("learned", "layernorm", "gelu"):
        extra = [k for k in ("n_kv_head", "head_dim", "qkv_bias", "qk_norm", "rope_scaling") if getattr(config, k)]
        if not extra and not own_switches(config):
            return GPT2
    elif (config.pos_emb, config.norm, config.ffn) == ("rope", "rmsnorm", "swiglu") and not config.bias:
        return llama_family(config, architecture)
    return None


def switches_of(config: GPTConfig) -> str:
    """A model's layout in a few words: its positions, norm and feed-forward, and each other switch of a family it
    sets ("pos_emb='learned', norm='layernorm', ffn='swiglu'")."""
    names = ["pos_emb", "norm", "ffn", *(["bias"] if config.bias else []), *changed(config, OTHER_SWITCHES)]
    return ", ".join(f"{name}={getattr(config, name)!r}" for name in names)


def changed(config: GPTConfig, names: tuple[str, ...]) -> list[str]:
    """The switches among `names` that `config` sets to other than GPTConfig's defaults."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    return [name for name in names if getattr(config, name) != defaults[name]]


def export_flags(config: GPTConfig, accepts: Callable[[GPTConfig], Family | None]) -> list[tuple[str, Family]]:
    """(train.py's flags, the family they make) for each of GPT-2's and Llama's layouts: the fewest changes of
    `config` that make a model `accepts` takes (it returns the family, or None), fewest flags first. Each layout's
    own switches are set, and as few of the others (OTHER_SWITCHES) as it takes set back to their defaults."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    others = changed(config, OTHER_SWITCHES)
    # every subset of the other switches, smallest first; past a handful of them only none or all
    subsets = [()]
    if others:
        sizes = range(1, len(others) + 1) if len(others) <= 8 else [len(others)]
        subsets += [subset for size in sizes for subset in itertools.combinations(others, size)]
    found = []
    for core in CORE_SWITCHES.values():
        changes = {name: value for name, value in core.items() if getattr(config, name) != value}
        for subset in subsets:
            trial = {**changes, **{name: defaults[name] for name in subset}}
            try:
                family = accepts(replace(config, **trial)) if trial else None
            except (ValueError, TypeError):  # a combination GPTConfig refuses
                continue
            if family is not None:
                found.append((" ".join(f"--{name}={flag_value(value)}" for name, value in trial.items()), family))
                break
    return sorted(found, key=lambda pair: pair[0].count("--"))


def flag_value(value) -> str:
    """A value as train.py's command line takes it: true/false, none, '' for an empty text."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    return "''" if value == "" else str(value)


def trained_with(
    config: GPTConfig, accepts: Callable[[GPTConfig], Family | None], name: Callable[[Family], str]
) -> str:
    """The end of a refusal: the train.py flags that make `config` a model `accepts` takes, each with the `name` of
    what it makes, or where the switches that export are listed."""
    options = [f"{flags} ({name(family)})" for flags, family in export_flags(config, accepts)]
    if not options:
        return "docs/models.md lists the switches that export"
    return f"a model trained with {' or '.join(options)} exports"


def own_switches(config: GPTConfig) -> list[str]:
    """The switches of the families below that `config` sets to other than their defaults."""
    return [k for k, v in OWN_SWITCHES.items() if getattr(config, k) != v]


def llama_family(config: GPTConfig, architecture: str | None) -> Family | None:
    """The family of Llama's layout whose own switches `config` sets (None where it sets two families' switches);
    with none set, the family `architecture` names where it has Llama's switches, or Llama."""
    own = {
        QWEN2: config.qkv_bias,
        QWEN3: config.qk_norm and config.qk_norm_scope == "head",
        OLMO2: config.norm_position == "post" or config.qk_norm_scope == "all",
        GRANITE: any(getattr(config, k) != v for k, v in GRANITE_SCALES.items()),
        SMOLLM3: bool(config.nope_layers),
        PHI3: config.rope_scaling == "longrope" or bool(config.rope_dims),
    }
    chosen = [family for family, on in own.items() if on]
    if len(chosen) > 1 or (config.rope_scaling and chosen and chosen[0] in (QWEN2, QWEN3)):
        return None
    if chosen == [PHI3] and config.rope_scaling == "llama3":
        return None
    if chosen == [OLMO2] and not (config.norm_position == "post" and config.qk_norm_scope == "all"):
        return None  # OLMo 2 has both
    if chosen:
        return chosen[0]
    named = {f.architecture: f for f in (MISTRAL, GRANITE, SMOLLM3, PHI3)}.get(architecture)
    return LLAMA if named is None or (named in (MISTRAL, PHI3) and config.rope_scaling) else named
