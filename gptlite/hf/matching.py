"""Which transformers family a gptlite model's switches export as (`family_of`), asking the registry's families, and
the one-line refusal of a model none of them takes, with the train.py flags that make one that exports."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import fields, replace

from gptlite.config import GPTConfig
from gptlite.hf.families import FAMILIES, OWN_SWITCHES, Family

SPEEDRUN_SWITCHES = ("value_embeds", "bigram_vocab", "unet_skips", "logit_softcap")
# the switches beyond a layout's own (positions, norm, feed-forward) that a model of one layout may set and another
# may need set back to their defaults: what the refusal of a model with no family tells its user (export_flags)
OTHER_SWITCHES = ("n_kv_head", "head_dim", "qkv_bias", "qk_norm", "rope_scaling", *OWN_SWITCHES, *SPEEDRUN_SWITCHES)


def family_of(config: GPTConfig, architecture: str | None = None) -> Family:
    """The transformers family a model's switches map to (Mistral's and Phi-3's, which have Llama's switches,
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


def own_switches(config: GPTConfig) -> list[str]:
    """The switches of one family each that `config` sets to other than their defaults."""
    return [k for k, v in OWN_SWITCHES.items() if getattr(config, k) != v]


def speedrun_options(config: GPTConfig) -> list[str]:
    """The speedrun options `config` sets that no transformers class computes (nanochat's and Gemma's own cap their
    logits)."""
    own = own_switches(config)
    capped = any(f.soft_cap and f.core(config) and f.holds(config, own) for f in FAMILIES.values())
    return [k for k in SPEEDRUN_SWITCHES if getattr(config, k) and not (capped and k == "logit_softcap")]


def matching_family(config: GPTConfig, architecture: str | None = None) -> Family | None:
    """The family `config`'s switches map to (see family_of and Family), or None."""
    if speedrun_options(config):
        return None
    # the layout's families whose classes have its kinds of layer, the layout's default first
    members = [family for family in FAMILIES.values() if family.core(config) and family.has_layers(config)]
    if not members:
        return None
    own = own_switches(config)
    marked = [family for family in members if family.marked(config)]
    named = next((f for f in members if f.by_name and f.architecture == architecture), None)
    if named is not None and all(f is named or f in named.also_takes for f in marked) and named.holds(config, own):
        return named
    # a marked family whose switches another marked family takes too is that one's part (LFM2's q/k norms, Qwen3's)
    marked = [f for f in marked if not any(f in other.also_takes for other in marked if other is not f)]
    if len(marked) > 1:  # two families' switches
        return None
    if marked:
        return marked[0] if marked[0].holds(config, own) else None
    return members[0] if members[0].holds(config, own) else None


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
    """(train.py's flags, the family they make) for each layout whose flags a refusal suggests (GPT-2's and
    Llama's): the fewest changes of `config` that make a model `accepts` takes (it returns the family, or None),
    fewest flags first. Each layout's own switches are set, and as few of the others (OTHER_SWITCHES) as it takes
    set back to their defaults."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    others = changed(config, OTHER_SWITCHES)
    # every subset of the other switches, smallest first; past a handful of them only none or all
    subsets = [()]
    if others:
        sizes = range(1, len(others) + 1) if len(others) <= 8 else [len(others)]
        subsets += [subset for size in sizes for subset in itertools.combinations(others, size)]
    found = []
    for core in (f.suggested_flags for f in FAMILIES.values() if f.suggested_flags):
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
