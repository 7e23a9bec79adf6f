"""A training recipe from a budget: `parse_budget` reads what `train.py --budget=` says (a time, FLOPs or tokens),
`derive` turns it into train.py's keys with the reason for each, from the scaling laws fitted for this data on this
machine (gptlite.scaling.laws), and `recipe` is the family of recipes the sweep measures and the derivation picks
from: one knob, the model's width, sets the rest.

The family (`recipe`): the 90-second CPU speedrun's techniques as its ingredients (docs/training.md measured each):
rotary positions, SwiGLU three times the width, Muon for the block matrices and AdamW for the rest, windows that
grow from 64 to 512 tokens over the first 60% of the run, and for a vocabulary of at most 256 (characters, bytes)
the bigram embedding of every pair. Its shape: one layer per 48 of width, heads of 24 (the hand-tuned 2 layers 96
wide at 90 s is width 96). Learning rates transfer across widths as nanochat scales them: Muon's is the same at every
width (its update is orthonormalised, so its size does not grow with the width), AdamW's shrinks as 1/sqrt(width)
from 4e-3 at width 96. A run of fewer than SHORT_STEPS steps trains at both rates times SHORT_STEPS / steps, at most
2x (`horizon_scale`: twice the rates up to 300 steps, falling to the family's at 600): the hand grids of
docs/scaling.md measured the doubled rates better than the family's in every cell under 340 steps but one, twice the
rates better than 1.5-1.7x at 217 steps, and the family's better at 430 steps and more on characters at 5 minutes,
as Bjorck et al. 2024 ("Scaling Optimal LR Across Token Horizons") find the best rate falling as a run grows longer.

A run too short for STEP_FLOOR steps of the family's 3,072 tokens trains on fewer windows a step, in proportion
(`windows_per_step`, at least one): so short a run is limited by its steps more than by its tokens. Early in training
the gradient noise scale is small, so a small batch wastes few tokens (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"), and each step moves the weights by at most about the learning rate. Where it pays was
measured on two CPU cores (docs/scaling.md, "The batch of a short run"): far fewer windows for a BPE run of tens of
steps, a few fewer around 250 steps, none on characters at 450 steps and more.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

ASPECT = 48  # width per layer
HEAD_DIM = 24
WIDTHS = (24, 48, 72, 96, 120, 144, 192, 240, 288, 384, 480, 576, 768)  # the sizes, multiples of HEAD_DIM
BASE_WIDTH = 96  # the width the learning rates were tuned at (the 90-s recipe)
ADAMW_LR = 4e-3  # at BASE_WIDTH
MUON_LR = 0.03
TOKENS_PER_STEP = 3072  # 6 windows of 512: the family's batch
BLOCK_SIZE = 512
FULL_WINDOWS = TOKENS_PER_STEP // BLOCK_SIZE
STEP_FLOOR = 350  # steps: a run that would take fewer at the family's batch trains on fewer windows a step
SHORT_RUN = 2000  # steps: a run shorter than this trains with Muon's momentum at 0.8, a longer one at 0.95
SHORT_STEPS = 600  # steps: a run shorter than this trains at higher learning rates (horizon_scale)
MAX_HORIZON_SCALE = 2.0

UNITS = {
    "s": ("seconds", 1),
    "sec": ("seconds", 1),
    "min": ("seconds", 60),
    "h": ("seconds", 3600),
    "flops": ("flops", 1),
    "tokens": ("tokens", 1),
}
PREFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)(s|sec|min|h|flops|tokens)\s*$")
# What a budget of each kind may be (seconds, FLOPs, tokens). Past them the laws' powers leave what a float holds (a
# budget read as infinity, a size or a loss that overflows), and no run comes near them: 1e8 s is three years, 1e30
# FLOPs far past any training run to date. A FLOPs or tokens budget of less than one is no run at all.
BUDGET_RANGES = {"seconds": (0.0, 1e8), "flops": (1.0, 1e30), "tokens": (1.0, 1e16)}


@dataclass(frozen=True)
class Budget:
    """What a run may spend: `kind` seconds (the whole command's wall-clock, start-up and the final evaluation
    included), flops (training FLOPs, Transformer.flops_per_token per token) or tokens (trained on)."""

    kind: str
    amount: float
    text: str


def parse_budget(text: str, option: str = "--budget") -> Budget:
    """'90s', '20min', '3h', '1e15flops', '50Mtokens' -> Budget; anything else, or an amount outside BUDGET_RANGES, a
    one-line ValueError naming `option` (the command's own: the sweep reads its --budgets with this too)."""
    match = BUDGET_RE.match(text)
    if not match or (match[2] and match[3] in ("s", "sec", "min", "h")):
        raise ValueError(
            f"{option}={text!r} is not a budget; give a time (90s, 20min, 3h), FLOPs (1e15flops, 2Pflops) or "
            "tokens (50Mtokens, 2e9tokens)"
        )
    kind, unit = UNITS[match[3]]
    amount = float(match[1]) * PREFIXES[match[2]] * unit
    if amount <= 0:
        raise ValueError(f"{option}={text!r} must be more than nothing")
    low, high = BUDGET_RANGES[kind]
    if not low <= amount <= high:
        raise ValueError(
            f"{option}={text!r} is {amount:g} {kind}, outside what gptlite can plan a run for: give "
            f"{'up to' if low == 0 else f'{low:g} to'} {high:g} {kind}"
        )
    return Budget(kind, amount, text)


def shape(width: int) -> dict[str, int]:
    """The model of the family at `width`: layers, heads and the feed-forward's width."""
    return {
        "n_layer": max(1, round(width / ASPECT)),
        "n_embd": width,
        "n_head": width // HEAD_DIM,
        "ffn_hidden": 3 * width,
    }


def horizon_scale(steps: int) -> float:
    """The factor on both learning rates for a run of `steps`: SHORT_STEPS / steps, between 1 and
    MAX_HORIZON_SCALE (the module's docstring says what measured it)."""
    return min(MAX_HORIZON_SCALE, max(1.0, SHORT_STEPS / max(1, steps)))


def windows_per_step(steps: float) -> int:
    """The windows of BLOCK_SIZE tokens a step trains on, for a run that would take `steps` steps of the family's
    FULL_WINDOWS: all of them from STEP_FLOOR steps on, fewer in proportion below it, at least one (the module's
    docstring says why)."""
    if steps >= STEP_FLOOR:
        return FULL_WINDOWS
    return max(1, int(FULL_WINDOWS * steps / STEP_FLOOR))


def recipe(width: int, vocab_size: int, steps: int, seconds: float | None = None, windows: int = FULL_WINDOWS) -> dict:
    """train.py's keys for the family's model at `width` trained for `seconds` of training time (lr_schedule="time":
    the learning rate decays and the windows grow over the time budget, `steps` being the steps expected in it) or
    else for `steps` optimizer steps, each of `windows` windows of BLOCK_SIZE tokens (windows_per_step). The step
    count sets Muon's momentum: 0.8 below SHORT_RUN steps, where less momentum measured better (docs/training.md),
    else the usual 0.95, and a run under SHORT_STEPS steps trains at higher learning rates (horizon_scale)."""
    scale = horizon_scale(steps)
    adamw_lr = ADAMW_LR * math.sqrt(BASE_WIDTH / width) * scale
    keys = {
        **shape(width),
        "vocab_size": vocab_size,
        "block_size": BLOCK_SIZE,
        "pos_emb": "rope",
        "dropout": 0.0,
        "bigram_vocab": vocab_size * vocab_size + 1 if vocab_size <= 256 else 0,
        "batch_size": windows,
        "seq_len_start": 64,
        "seq_len_warmup": 0.6,
        "optimizer": "muon",
        "muon_lr": MUON_LR * scale,
        "learning_rate": adamw_lr,
        "min_lr": adamw_lr / 40,
        "warmup_iters": max(1, min(50, steps // 20)),  # the tuned 50 of ~1,350 steps; at most a twentieth of a run
        "weight_decay": 0.1,
        "beta2": 0.99,
        "eval_iters": 0,  # the final evaluation: every window of the val split
        "keep_last": 1,
    }
    if seconds is not None:  # the clock ends the run, and the one evaluation comes at its end
        keys["lr_schedule"] = "time"
        keys["max_minutes"] = seconds / 60
        keys["max_iters"] = 1_000_000_000
        keys["eval_interval"] = 1_000_000_000
    else:
        keys["lr_schedule"] = "steps"
        keys["max_iters"] = steps
        keys["eval_interval"] = steps
    keys["log_interval"] = 250
    keys["muon_momentum"] = 0.8 if steps < SHORT_RUN else 0.95
    return keys
