"""Preference tuning with DPO: the loss on pairs of a chosen and a rejected answer, the reference model it is measured
against, and the evaluation on val pairs.

DPO (Rafailov et al., 2023, "Direct Preference Optimization", https://arxiv.org/abs/2305.18290) trains the policy
pi directly on preferences, with no reward model and no sampling: with the log-ratios r = log pi(y|x) - log
pi_ref(y|x) of each answer, summed over its tokens, the loss of a pair is -log sigmoid(beta (r_chosen - r_rejected)).
beta * r is the answer's implicit reward; a pair is "right" when the chosen answer's reward is the higher. Two
variants, as TRL's DPOTrainer computes them:
- label smoothing eps (conservative DPO, Mitchell 2023, https://ericmitchell.ai/cdpo.pdf): each label is taken to
  be flipped with probability eps, so the loss is -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d);
- IPO (Azar et al., 2023, https://arxiv.org/abs/2310.12036, eq. 17): (d' - 1 / (2 beta))^2, a squared loss that
  does not push the margin to infinity, where d' takes each answer's log-ratio averaged over its tokens (TRL's
  choice, which the IPO authors confirmed matches the paper's results).

The reference is the model at the start of the run. With LoRA it is the same weights with the adapters switched
off (gptlite.lora.adapters_off): memory holds one model. Without LoRA it is a frozen copy, which costs a second
set of weights (no gradients, no optimizer state).

Batches come from gptlite.data.PairLoader: 2B rows, the B chosen answers (each after its prompt) then the B
rejected ones, targets -1 except on the answers' tokens.
"""

from __future__ import annotations

import contextlib
import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gptlite.config import DPO_LOSSES
from gptlite.lora import adapters_off, lora_layers


class DPOOutput(NamedTuple):
    """One batch of pairs through DPO: the loss (the mean over pairs) and, per pair (B,), the implicit rewards."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor  # beta * (log pi - log pi_ref) of the chosen answer, (B,), detached
    rejected_rewards: torch.Tensor  # the same of the rejected answer, (B,), detached


def sequence_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (R, L) rows of a preference batch -> (the summed log-probability of each row's targets (R,), the number
    of those targets (R,)). The head and its log-softmax go a chunk of tokens at a time (gptlite.loss), so the
    (R, L, V) logits are never all in memory."""
    _, nll = model(x, y, reduction="none", return_logits=False)  # (R, L), 0 where y is -1
    return -nll.sum(dim=1), (y >= 0).sum(dim=1)


def dpo_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    lengths: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """The DPO loss of a batch: logps and ref_logps (2B,), each answer's summed log-probability under the policy and
    the reference, chosen answers first; lengths (2B,) their token counts (IPO averages over them)."""
    logratios = logps.float() - ref_logps.float()  # (2B,)
    chosen, rejected = logratios.chunk(2)  # (B,) each
    if loss_type == "sigmoid":
        d = beta * (chosen - rejected)
        losses = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    elif loss_type == "ipo":
        per_token = logratios / lengths.clamp_min(1)
        n_chosen, n_rejected = per_token.chunk(2)
        losses = (n_chosen - n_rejected - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss={loss_type!r} must be one of {', '.join(DPO_LOSSES)}")
    return DPOOutput(losses.mean(), beta * chosen.detach(), beta * rejected.detach())


def pair_stats(out: DPOOutput) -> torch.Tensor:
    """(mean chosen reward, mean rejected reward, preference accuracy) of a batch, (3,): what training logs beside
    the loss (the margin is the difference of the two rewards). Accuracy: the share of pairs whose chosen answer has
    the higher reward."""
    right = (out.chosen_rewards > out.rejected_rewards).float()
    return torch.stack([out.chosen_rewards.mean(), out.rejected_rewards.mean(), right.mean()])


STAT_NAMES = ("rewards_chosen", "rewards_rejected", "rewards_accuracy")  # pair_stats' order


def stats_dict(stats: list[float], prefix: str = "") -> dict[str, float]:
    """pair_stats' numbers by name, with the margin (chosen minus rejected reward), for the log and metrics.jsonl."""
    named = dict(zip(STAT_NAMES, stats, strict=True))
    named["rewards_margin"] = named["rewards_chosen"] - named["rewards_rejected"]
    return {prefix + k: v for k, v in named.items()}


class Reference:
    """DPO's reference model: the policy at the start of the run. With LoRA, `model` itself with its adapters off
    (`frozen` is None); otherwise `frozen`, a copy of the start-of-run weights (see frozen_copy). Either way it runs
    in eval mode (no dropout) and without gradients."""

    def __init__(self, model: torch.nn.Module, frozen: torch.nn.Module | None):
        assert frozen is not None or lora_layers(model), "without a frozen copy the reference is LoRA's base model"
        self.model = model
        self.frozen = frozen

    @torch.no_grad()
    def logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The reference's summed log-probability of each row's targets, (R,)."""
        if self.frozen is not None:
            return sequence_logps(self.frozen, x, y)[0]
        training = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model):
                return sequence_logps(self.model, x, y)[0]
        finally:
            self.model.train(training)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` in eval mode whose parameters take no gradients: the reference of a run without LoRA."""
    return copy.deepcopy(model).eval().requires_grad_(False)


@torch.no_grad()
def evaluate_pairs(
    model: torch.nn.Module,
    reference: Reference,
    loader,
    iters: int,
    device: str,
    autocast: contextlib.AbstractContextManager,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[float, list[float]]:
    """(the loss, pair_stats) over the val pairs, each averaged over pairs: the first `iters` batches, the same
    at every evaluation, or every pair when iters=0. Under torchrun each rank scores its share and the sums are
    all-reduced, so every rank gets the same figures."""
    import torch.distributed as dist

    model.eval()
    loader.restore({"epoch": 0, "index": 0})
    batches = loader.every_window() if iters == 0 else (loader.next_batch() for _ in range(iters))
    sums = torch.zeros(5, device=device)  # loss x pairs, chosen, rejected, right, pairs
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (2B, L) each
        with autocast:
            logps, lengths = sequence_logps(model, x, y)
            out = dpo_loss(logps, reference.logps(x, y), lengths, beta, loss_type, label_smoothing)
        n = out.chosen_rewards.numel()
        right = (out.chosen_rewards > out.rejected_rewards).float().sum()
        sums += torch.stack(
            [out.loss * n, out.chosen_rewards.sum(), out.rejected_rewards.sum(), right, torch.tensor(n, device=device)]
        )
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    loss, *stats = (sums[:4] / sums[4].clamp_min(1)).tolist()
    return loss, stats
