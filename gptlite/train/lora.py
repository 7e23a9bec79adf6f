"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen model whose chosen
linear layers learn a low-rank update, W x + (alpha / r) B A x, with A (r, in) and B (out, r), B starting at zero so
that training starts from the base model exactly.

`add_lora(model, rank, ...)` turns the layers named by `targets` (suffixes of module names: the attention's fused
qkv and output projection, the feed-forward's input and output by default) into LoRALinear in place, keeping their
weight tensors (no copy, the same state-dict names) and freezing every other parameter; `merge_lora(model)` folds
the updates into the weights and turns them back into plain nn.Linear. `lora_state_dict(model)` is what a LoRA
checkpoint saves: the adapters alone, megabytes where the model is gigabytes. `adapters_off(model)` runs the base
model, the adapters skipped. `ReferenceModel` is the model as a run began, that DPO (gptlite.train.preference) and
GRPO's KL term (gptlite.train.rl) measure the policy against: the base model with the adapters off where there are
adapters, else a frozen copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.model.network import Transformer

TARGETS = ("attn.qkv", "attn.out_proj", "ffn.fc", "ffn.out_proj")  # every projection of attention and feed-forward
LORA_KEYS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An nn.Linear (its weight and bias frozen) plus the trainable low-rank update (alpha / rank) B A."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same tensors: nothing is copied
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = linear.weight.device, linear.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear and PEFT initialise A
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.drop = nn.Dropout(dropout)
        self.enabled = True  # adapters_off() clears it: the layer is then the base layer alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.drop(x), self.lora_A), self.lora_B)  # (..., out)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def delta(self) -> torch.Tensor:
        """The update to the weight, (alpha / rank) B A, (out, in)."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def option_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with the LoRA options (gptlite.train.run_config.check_training_options reports it with the
    modes' before anything is read); check_lora checks the targets against the model once it is built."""
    problems = []
    if cfg.lora_rank is not None:
        if cfg.lora_rank < 1:
            problems.append(f"lora_rank={cfg.lora_rank} must be >= 1 (leave it out to train every weight)")
        if not cfg.init_from:
            problems.append("lora_rank needs --init_from: LoRA adapts a pretrained model, whose weights stay frozen")
        if not 0 <= cfg.lora_dropout < 1:
            problems.append(f"lora_dropout={cfg.lora_dropout} must be in [0, 1)")
    return problems


def check_lora(model: Transformer, rank: int, targets: tuple[str, ...] = TARGETS) -> list[str]:
    """The names of the layers `targets` select; a rank outside 1..min(in, out) or a target that names no linear
    layer is a one-line ValueError."""
    if not targets or not all(targets):
        raise ValueError(
            f"lora_targets={','.join(targets)!r} names no layer; choose among {', '.join(TARGETS)} (and lm_head)"
        )
    # a mixture of experts' fc and out_proj are each E matrices stacked in one weight, no linear layer
    stacked = ("ffn.fc", "ffn.out_proj") if model.config.n_experts else ()
    experts = [t for t in targets if any(name.endswith(t) for name in stacked)]
    if experts:
        raise ValueError(
            f"lora_targets: {', '.join(experts)} name this model's experts, n_experts={model.config.n_experts} "
            "matrices stacked in one weight, which LoRA does not adapt; target the attention: "
            "--lora_targets=attn.qkv,attn.out_proj"
        )
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.endswith(targets)]
    unmatched = [t for t in targets if not any(name.endswith(t) for name in names)]
    if unmatched:
        raise ValueError(
            f"lora_targets: {', '.join(unmatched)} name no linear layer of this model; choose among "
            f"{', '.join(TARGETS)} (and lm_head)"
        )
    narrowest = min(min(model.get_submodule(n).in_features, model.get_submodule(n).out_features) for n in names)
    if not isinstance(rank, int) or not 1 <= rank <= narrowest:
        raise ValueError(
            f"lora_rank={rank} must be between 1 and {narrowest}, the narrowest targeted layer's width "
            "(leave lora_rank out to train every weight)"
        )
    return names


def add_lora(
    model: Transformer, rank: int, alpha: float = 16.0, dropout: float = 0.0, targets: tuple[str, ...] = TARGETS
) -> Transformer:
    """Freeze `model` and give the linear layers that `targets` name trainable low-rank updates, in place; returns
    the model. A tied head stays tied: LoRA on lm_head is refused for a tied model (it would change the embedding)."""
    names = check_lora(model, rank, targets)
    if "lm_head" in names and model.lm_head.weight is model.tok_emb.weight:
        raise ValueError("lora_targets: lm_head is tied to the token embedding in this model; leave lm_head out")
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every LoRALinear of `model` computes its base layer alone, so the model computes what it
    did before add_lora: the same weight tensors, nothing copied. The adapters come back on leaving the block."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode whose parameters take no gradients: the reference of a run without LoRA."""
    return copy.deepcopy(model).eval().requires_grad_(False)


class ReferenceModel:
    """The model as a run began, that a loss measures the policy against (DPO's reference, GRPO's KL term). With LoRA
    it is `model` itself with its adapters off (`frozen` is None): memory holds one model. Without, it is `frozen`, a
    copy of the start-of-run weights (frozen_copy), which costs a second set of weights (no gradients, no optimizer
    state). Either way it runs in eval mode (no dropout) and without gradients."""

    def __init__(self, model: nn.Module, frozen: nn.Module | None):
        assert frozen is not None or lora_layers(model), "without a frozen copy the reference is LoRA's base model"
        self.model = model
        self.frozen = frozen

    @classmethod
    def of(cls, model: nn.Module) -> ReferenceModel:
        """`model` as it is now, before it trains (and before a resume loads other weights into it): its adapters
        off where it has LoRA layers, else a frozen copy."""
        return cls(model, None if lora_layers(model) else frozen_copy(model))

    @contextlib.contextmanager
    def module(self) -> Iterator[nn.Module]:
        """Within the block, the reference as a module to call, without gradients. With LoRA, the model's mode and
        adapters come back on leaving the block."""
        if self.frozen is not None:
            with torch.no_grad():
                yield self.frozen
            return
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), adapters_off(self.model):
                yield self.model
        finally:
            self.model.train(training)


def lora_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a state dict (its lora_A and lora_B tensors)."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in LORA_KEYS}


@torch.no_grad()
def merge_lora(model: Transformer) -> Transformer:
    """Fold every LoRALinear's update into its weight and make it a plain nn.Linear again, in place; returns the
    model, which then computes what it computed before."""
    for name, layer in lora_layers(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight, linear.bias = layer.weight, layer.bias
        linear.weight += layer.delta().to(linear.weight.dtype)
        setattr(parent, child, linear)
    return model
