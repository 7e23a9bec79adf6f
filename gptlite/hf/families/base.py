"""What a model family's file provides (`Family`), and the reader of a transformers config.json its import rules read
with (`ConfigFile`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gptlite.config import GPTConfig

Entry = tuple[str, tuple[str, ...], bool]  # gptlite name, transformers names concatenated along dim 0, transposed
REQUIRED = object()  # ConfigFile.get's default: a key without a default of its family is required
# What transformers takes for a key a config.json leaves out, in every family's config class (each family adds its
# own, Family.config_defaults): ConfigFile reads a file with them, so that a file without a key is the model
# transformers builds from it
COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "num_key_value_heads": None,  # as many as the attention heads
    "head_dim": None,  # hidden_size / num_attention_heads
    "sliding_window": None,
    "final_logit_softcapping": None,
}


class Family:
    """One transformers architecture and everything gptlite knows of it, side by side: which gptlite models it is
    (`core`, `marked`, `holds`), what its config.json means as gptlite's switches (`values`, import) and what
    gptlite's switches mean as its config.json (`hf_config`, export), its weights' names both ways (`entries`), and
    its GGUF form (`gguf_name`, `gguf_problem`, `add_hyperparameters`, `gguf_tensors`). A family's file subclasses
    this (or another family whose rules it shares) and gptlite.hf.families registers one instance of it.

    Which family a model's switches export as (gptlite.hf.matching.matching_family) goes by layout: the families
    whose `core` a model has are its candidates, the first of them the layout's default (Llama for Llama's layout).
    A candidate whose own switches the model sets (`marked`) is the only one that can take it, if it `holds` the rest;
    with none marked, the family the model was loaded as (`by_name`) where it holds the model, else the default."""

    architecture: str  # the transformers class, as config.json's "architectures" names it
    model_type: str  # config.json's "model_type"
    prefix = ""  # what save_pretrained puts before the names (GPT-2's "transformer.")
    layers = "model.layers.{i}."  # the blocks' prefix
    config_defaults: dict[str, Any] = {}  # transformers' defaults for keys a config.json may leave out
    own_switches: dict[str, Any] = {}  # gptlite switches this family alone has, with the value a model of others has
    by_name = False  # chosen for a model of the layout's default when the model was loaded as this class
    # the families whose own switches this one takes too: when chosen by name, and when both are marked
    also_takes: tuple[Family, ...] = ()
    soft_cap = False  # its class soft-caps the final logits (else logit_softcap is a speedrun option)
    suggested_flags: dict[str, Any] = {}  # train.py's flags that make a model of this layout (a refusal's advice)
    gguf_name: str | None = None  # llama.cpp's architecture; None: gptlite writes no GGUF for it
    # the prefixes of a checkpoint's weights gptlite does not read (a vision tower's), said in one note line
    vision_prefixes: tuple[str, ...] = ()
    layer_kinds: tuple[str, ...] = ("full_attention",)  # the kinds of layer its class has (GPTConfig.layer_types)

    # -----------------------------------------------------------------------------------------
    # Which gptlite models

    def core(self, config: GPTConfig) -> bool:
        """Whether `config` has this family's layout (its positions, norm and feed-forward)."""
        raise NotImplementedError

    def marked(self, config: GPTConfig) -> bool:
        """Whether `config` sets a switch of this family alone (a model no other family of the layout holds)."""
        return False

    def holds(self, config: GPTConfig, own: list[str]) -> bool:
        """Whether this family's class computes all of what a model of `config` does, once chosen; `own` names the
        switches of one family each (OWN_SWITCHES) that `config` sets."""
        return True

    def has_layers(self, config: GPTConfig) -> bool:
        """Whether its class has every kind of layer `config` has (layer_types), and attention gated on its output
        where `config`'s is (attn_output_gate): by default, attention layers only, without a gate."""
        return set(config.layer_kinds) <= set(self.layer_kinds) and not config.attn_output_gate

    # -----------------------------------------------------------------------------------------
    # Import: config.json -> gptlite's switches

    def text_config(self, c: dict, path: Path) -> dict:
        """The text model's config of the config.json `c` read from `path`: the file itself (a vision-language
        checkpoint nests it)."""
        return c

    def left_out(self, names: list[str]) -> list[str]:
        """The checkpoint's weights (of `names`) that are not the text model's, left out as it is read (a
        vision-language checkpoint's vision tower, said so in one line): none."""
        return []

    def values(self, c: ConfigFile) -> tuple[dict, int | None, list[str]]:
        """(GPTConfig's values, the attention window or None, what of the file gptlite cannot hold, one phrase
        each) of the config.json `c`."""
        raise NotImplementedError

    def exports_as(self, config: GPTConfig) -> str:
        """The transformers class a model read from this family exports back as: its own (a vision-language
        checkpoint's: its text model's)."""
        return self.architecture

    # -----------------------------------------------------------------------------------------
    # Export: gptlite's switches -> config.json

    def hf_config(self, config: GPTConfig, common: dict) -> dict:
        """config.json: `common` (the architecture, the vocabulary, the special ids, the dtype) and this family's
        keys."""
        raise NotImplementedError

    # -----------------------------------------------------------------------------------------
    # The weights' names, both ways

    def entries(self, config: GPTConfig) -> list[Entry]:
        """Every weight of a model of `config`: (gptlite name, transformers names, transposed)."""
        raise NotImplementedError

    def every_block(self, top: list[Entry], layer: list[Entry], config: GPTConfig) -> list[Entry]:
        """`top` (with the head where the model's is untied), then `layer`'s entries for each block in turn."""
        if not config.tie_embeddings:
            top = [*top, ("lm_head.weight", ("lm_head.weight",), False)]
        out = list(top)
        for i in range(config.n_layer):
            theirs_prefix = self.layers.format(i=i)
            for ours, theirs, transposed in layer:
                out.append((f"blocks.{i}.{ours}", tuple(theirs_prefix + t for t in theirs), transposed))
        return out

    def their_name(self, name: str) -> str:
        """A transformers name as save_pretrained writes it (GPT-2's blocks under "transformer.", its head not)."""
        return name if name.startswith("lm_head.") else self.prefix + name

    # -----------------------------------------------------------------------------------------
    # GGUF: llama.cpp's architecture, hyperparameters and tensors

    def gguf_problem(self, config: GPTConfig) -> str | None:
        """What llama.cpp's architecture cannot hold of this model, in one line (None: nothing)."""
        return None

    def gguf_architecture(self, config: GPTConfig) -> str | None:
        """llama.cpp's architecture for a model of `config` (gguf_name, unless a family's models go to several)."""
        return self.gguf_name

    def add_hyperparameters(self, writer, config: GPTConfig) -> None:
        """This family's GGUF keys, after those every architecture has (gptlite.hf.gguf.add_hyperparameters)."""
        raise NotImplementedError

    def gguf_tensors(self, state: dict[str, torch.Tensor], config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(llama.cpp's name, the tensor in float32) of every weight, in llama.cpp's layout."""
        raise NotImplementedError


def part_sizes(ours: str, config: GPTConfig) -> list[int]:
    """The rows of each transformers tensor that a fused gptlite tensor stacks (q, k, v; the gate and value; Gated
    DeltaNet's input projections; each expert's gate and value, or output, where transformers has a tensor per
    expert), of its rows flattened."""
    if "attn.qkv" in ours:  # the query rows with the output gate's where attention has one (attn_output_gate)
        q_rows = config.n_head * config.head_width * (2 if config.attn_output_gate else 1)
        return [q_rows] + [config.kv_heads * config.head_width] * 2
    if "attn.in_proj" in ours:  # Gated DeltaNet's q, k and v, then z, b and a
        key_rows = config.linear_k_heads * config.linear_k_dim
        value_rows = config.linear_v_heads * config.linear_v_dim
        return [2 * key_rows + value_rows, value_rows, config.linear_v_heads, config.linear_v_heads]
    if config.n_experts and ours.endswith("ffn.out_proj.weight"):
        return [config.n_embd] * config.n_experts
    if config.n_experts:
        return [config.ffn_hidden] * 2 * config.n_experts
    return [config.ffn_hidden] * 2


def experts_view(ours: str, w: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """An experts' weight read from one transformers tensor per expert, their rows one after another (E * rows, in),
    as gptlite stacks it, (E, rows, in); any other weight as it is."""
    stacked = ours.endswith(("ffn.fc.weight", "ffn.out_proj.weight")) and config.n_experts and w.dim() == 2
    return w.view(config.n_experts, -1, w.size(-1)) if stacked else w


def float_weights(state: dict[str, torch.Tensor]):
    """A function that gives a weight of `state` in float32 on the CPU, as GGUF files are written from."""
    return lambda name: state[name].detach().to("cpu", torch.float32)


class ConfigFile:
    """A Hugging Face config.json, each value read where it is used with its type and range checked (a bad one is a
    one-line ValueError naming the file and the key), a key it leaves out taking the default transformers gives it
    for the family (COMMON_DEFAULTS, Family.config_defaults): every layout transformers reads maps to the same model.

    A value may come from a nested table first (`table`, named `where`: rope_parameters' rope_theta before the
    top-level one, as transformers takes it), then from the file's top level (`top`, by default the same key)."""

    def __init__(self, values: dict, path: Path, family: Family):
        self.values = values
        self.path = path
        self.family = family
        self.defaults = {**COMMON_DEFAULTS, **family.config_defaults}

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

    def softcap(self) -> float:
        """final_logit_softcapping: a number > 0, or null for none (0)."""
        return 0.0 if self.get("final_logit_softcapping") is None else self.number("final_logit_softcapping")
