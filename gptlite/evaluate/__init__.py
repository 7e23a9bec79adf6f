"""Scoring a model: bits per byte over token windows (gptlite.evaluate.bpb), zero-shot HellaSwag accuracy
(gptlite.evaluate.hellaswag_task), the CORE metric as nanochat computes it (gptlite.evaluate.core), any task of
EleutherAI's lm-eval harness, in this process (gptlite.evaluate.lm_harness), and the rewards of completions to
held-out prompts (gptlite.train.rl); `python -m gptlite.evaluate` runs them (gptlite.evaluate.command).

This file holds only the names the rest of gptlite and its tests import from gptlite.evaluate. The command is not
among them: it scores a run by its training objective (gptlite.train.objective), which builds on the scores here.
"""

from gptlite.evaluate.bpb import byte_lengths, evaluate_loader, evaluate_windows, loss_and_bpb, loss_sums
from gptlite.evaluate.core import core_bundle, core_score, read_bundle
from gptlite.evaluate.hellaswag_task import (
    HELLASWAG_FILE,
    HELLASWAG_URL,
    ending_losses,
    ending_rows,
    hellaswag,
    hellaswag_row,
    no_hellaswag_file,
    read_hellaswag,
)

__all__ = [
    "HELLASWAG_FILE",
    "HELLASWAG_URL",
    "byte_lengths",
    "core_bundle",
    "core_score",
    "ending_losses",
    "ending_rows",
    "evaluate_loader",
    "evaluate_windows",
    "hellaswag",
    "hellaswag_row",
    "loss_and_bpb",
    "loss_sums",
    "no_hellaswag_file",
    "read_bundle",
    "read_hellaswag",
]
