"""Preference tuning with DPO: the loss on pairs of a chosen and a rejected answer, measured against the reference
model, the evaluation on val pairs, and `DPO`, train.py's objective on preference data.

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

The reference is the model at the start of the run (gptlite.train.lora.ReferenceModel): with LoRA the same weights with
the adapters switched off, so memory holds one model; without LoRA a frozen copy, which costs a second set of
weights (no gradients, no optimizer state).

Batches come from gptlite.data.loader.PairLoader: 2B rows, the B chosen answers (each after its prompt) then the B
rejected ones, targets -1 except on the answers' tokens.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from gptlite.config import DPO_LOSSES, set_options
from gptlite.data.loader import evaluation_batches
from gptlite.train.lora import ReferenceModel
from gptlite.train.metrics import Evaluation
from gptlite.train.objective_base import ReadsTrainLoader

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.data.loader import PairLoader
    from gptlite.model.network import Transformer


DPO_OPTIONS = ("dpo_beta", "dpo_loss", "dpo_label_smoothing")  # what training on preference pairs alone reads


# ---------------------------------------------------------------------------------------------
# DPO's options: their rules, checked as the run is resolved (option_problems) and once the data is read


def option_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with DPO's options on their own (gptlite.train.run_config.check_training_options reports it
    with the other modes' before anything is read)."""
    problems = []
    if not cfg.dpo_beta > 0:
        problems.append(f"dpo_beta={cfg.dpo_beta} must be > 0 (e.g. 0.1)")
    if not 0 <= cfg.dpo_label_smoothing < 0.5:
        problems.append(f"dpo_label_smoothing={cfg.dpo_label_smoothing} must be in [0, 0.5) (e.g. 0.1)")
    if cfg.dpo_label_smoothing and cfg.dpo_loss != "sigmoid":
        problems.append(
            f"dpo_label_smoothing={cfg.dpo_label_smoothing} applies to dpo_loss=sigmoid only, not "
            f"{cfg.dpo_loss!r}; leave it out or use dpo_loss=sigmoid"
        )
    return problems


def data_problems(cfg: TrainConfig, kind: str) -> list[str]:
    """DPO's options configure training on preference pairs alone (`kind`: what the data folder holds; see
    gptlite.train.objective.check_data)."""
    unread = set_options(cfg, DPO_OPTIONS)
    if kind != "pairs" and unread:
        return [
            f"{', '.join(unread)} configure DPO on preference pairs, and {cfg.data_dir} holds {kind}; leave them "
            "out, or give a data folder prepared with data/prepare.py --preference"
        ]
    return []


# ---------------------------------------------------------------------------------------------
# The loss


class DPOOutput(NamedTuple):
    """One batch of pairs through DPO: the loss (the mean over pairs) and, per pair (B,), the implicit rewards."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor  # beta * (log pi - log pi_ref) of the chosen answer, (B,), detached
    rejected_rewards: torch.Tensor  # the same of the rejected answer, (B,), detached


def sequence_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (R, L) rows of a preference batch -> (the summed log-probability of each row's targets (R,), the number
    of those targets (R,)). The head and its log-softmax go a chunk of tokens at a time (gptlite.model.loss), so the
    (R, L, V) logits are never all in memory."""
    _, nll = model(x, y, reduction="none", return_logits=False)  # (R, L), 0 where y is -1
    return -nll.sum(dim=1), (y >= 0).sum(dim=1)


def dpo_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    answer_tokens: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """The DPO loss of a batch: logps and ref_logps (2B,), each answer's summed log-probability under the policy and
    the reference, chosen answers first; answer_tokens (2B,) their token counts (IPO averages over them)."""
    logratios = logps.float() - ref_logps.float()  # (2B,)
    chosen, rejected = logratios.chunk(2)  # (B,) each
    if loss_type == "sigmoid":
        d = beta * (chosen - rejected)
        losses = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    elif loss_type == "ipo":
        per_token = logratios / answer_tokens.clamp_min(1)
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


FIGURES = ("rewards_chosen", "rewards_rejected", "rewards_accuracy")  # pair_stats' figures, in its order


def reward_figures(chosen: float, rejected: float, accuracy: float) -> dict[str, float]:
    """pair_stats' figures by name, with the margin (the chosen answers' mean reward minus the rejected ones'), as
    training logs them to metrics.jsonl (with "val_" before each name for the val pairs)."""
    return {
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "rewards_accuracy": accuracy,
        "rewards_margin": chosen - rejected,
    }


class Reference(ReferenceModel):
    """DPO's reference model: the policy at the start of the run (gptlite.train.lora.ReferenceModel), scoring whole
    answers."""

    def logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The reference's summed log-probability of each row's targets, (R,)."""
        with self.module() as reference:
            return sequence_logps(reference, x, y)[0]


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
) -> tuple[float, dict[str, float]]:
    """(the loss, reward_figures) over the val pairs, each averaged over pairs: the first `iters` batches, the same
    at every evaluation, or every pair when iters=0 or the split is smaller (gptlite.data.loader.evaluation_batches).
    Under torchrun each rank scores its share and the sums are all-reduced, so every rank gets the same figures."""
    import torch.distributed as dist

    model.eval()
    batches = evaluation_batches(loader, iters)
    sums = torch.zeros(5, device=device)  # loss x pairs, chosen, rejected, right, pairs
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (2B, L) each
        with autocast:
            logps, answer_tokens = sequence_logps(model, x, y)
            out = dpo_loss(logps, reference.logps(x, y), answer_tokens, beta, loss_type, label_smoothing)
        n = out.chosen_rewards.numel()
        right = (out.chosen_rewards > out.rejected_rewards).float().sum()
        sums += torch.stack(
            [out.loss * n, out.chosen_rewards.sum(), out.rejected_rewards.sum(), right, torch.tensor(n, device=device)]
        )
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    loss, chosen, rejected, accuracy = (sums[:4] / sums[4].clamp_min(1)).tolist()
    return loss, reward_figures(chosen, rejected, accuracy)


# ---------------------------------------------------------------------------------------------
# The objective


class DPO(ReadsTrainLoader):
    """train.py's objective on preference pairs (see gptlite.train.objective_base.Objective): each step takes grad_accum
    batches of batch_size pairs, and its loss is DPO's against the start-of-run model. Its figures are the implicit
    rewards of the chosen and the rejected answers and the share of pairs ranked right; it is judged by the same loss
    and figures on the val pairs. Its state is the pair loader's position."""

    needs_reference = True  # --init_from's weights are loaded even on a resume: they are the reference

    def __init__(
        self,
        cfg: TrainConfig,
        train_loader: PairLoader,
        val_loader: PairLoader,
        grad_accum: int,
        device: str,
        autocast: contextlib.AbstractContextManager,
    ):
        self.cfg = cfg
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.grad_accum = grad_accum
        self.device = device
        self.autocast = autocast
        self.reference: Reference | None = None  # taken at start()
        self.weight = 1.0 / grad_accum  # each micro-batch's share of the step's loss
        self.step_figures = torch.zeros(len(FIGURES), device=device)  # pair_stats over the step's micro-batches

    def start(self, model: Transformer) -> None:
        self.reference = Reference.of(model)

    def batches(self, step: int, minutes: float) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
        # DPO's loss is the mean over pairs, and every micro-batch holds batch_size of them: the step's mean loss is
        # the mean over micro-batches (self.weight), as for text
        self.step_figures = torch.zeros(len(FIGURES), device=self.device)
        return [self.train_loader.next_batch() for _ in range(self.grad_accum)], None

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x holds the pairs' chosen answers, then their rejected ones (2B rows). Each answer's log-probability under
        # the model and under the reference; the loss rewards the model for raising the chosen answer's above the
        # reference's more than the rejected one's.
        logps, answer_tokens = sequence_logps(model, x, y)  # (2B,) each
        ref_logps = self.reference.logps(x, y)  # (2B,), no gradient
        cfg = self.cfg
        dpo = dpo_loss(logps, ref_logps, answer_tokens, cfg.dpo_beta, cfg.dpo_loss, cfg.dpo_label_smoothing)
        self.step_figures += pair_stats(dpo) * self.weight
        return dpo.loss * self.weight

    def figures(self) -> dict[str, torch.Tensor]:
        return dict(zip(FIGURES, self.step_figures, strict=True))

    def log_text(self, figures: dict[str, float]) -> str:
        margin = figures["rewards_chosen"] - figures["rewards_rejected"]
        return f" | accuracy {figures['rewards_accuracy']:.3f} | margin {margin:.3f}"

    def log_fields(self, figures: dict[str, float]) -> dict[str, float]:
        return reward_figures(*(figures[name] for name in FIGURES))

    def evaluate(self, model: Transformer) -> Evaluation:
        """DPO's loss, rewards and accuracy on the val pairs."""
        cfg = self.cfg
        val_loss, figures = evaluate_pairs(
            model,
            self.reference,
            self.val_loader,
            cfg.eval_iters,
            self.device,
            self.autocast,
            cfg.dpo_beta,
            cfg.dpo_loss,
            cfg.dpo_label_smoothing,
        )
        line = (
            f"val loss {val_loss:.4f} | val accuracy {figures['rewards_accuracy']:.3f}"
            f" | val margin {figures['rewards_margin']:.3f}"
        )
        return Evaluation(val_loss, line, {"val_loss": val_loss, **{f"val_{k}": v for k, v in figures.items()}})
