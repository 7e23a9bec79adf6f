"""The load-balancing loss of a mixture of experts in training: `RouterBalance` wraps the run's objective, whatever
its mode, and adds router_aux_loss_coef times the experts' auxiliary loss (gptlite.model.network.load_balancing_loss,
Switch Transformer's, as transformers adds it to its loss) to every micro-batch's loss, and the loss itself to the
step's figures as router_aux_loss. Chosen once at set-up (`with_router_balance`), where the model has experts and
the coefficient is above 0; the loop never asks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.model.network import Transformer
    from gptlite.train.metrics import Evaluation
    from gptlite.train.objective_base import Batches, Objective

FIGURE = "router_aux_loss"  # its name in the step's figures, the log line and metrics.jsonl


def with_router_balance(objective: Objective, cfg: TrainConfig) -> Objective:
    """The run's objective, with the load-balancing loss added where the model has experts and router_aux_loss_coef
    is above 0."""
    if not (cfg.model.n_experts and cfg.model.router_aux_loss_coef > 0):
        return objective
    return RouterBalance(objective, cfg.model.router_aux_loss_coef)


class RouterBalance:
    """An objective (gptlite.train.objective_base.Objective) that is `objective` with coef times the load-balancing
    loss of the router logits each training forward leaves in the model's experts (Transformer.router_aux_loss) added
    to each micro-batch's loss, divided among the step's micro-batches as the step's loss is. Its figure is the
    step's mean load-balancing loss, unweighted; the rest is the wrapped objective's."""

    def __init__(self, objective: Objective, coef: float):
        self.objective = objective
        self.coef = coef
        self.needs_reference = objective.needs_reference
        self.model: Transformer | None = None
        self.micro_batches = 1
        self.total: torch.Tensor | None = None  # this step's load-balancing losses, summed, on the device
        self.count = 0

    def start(self, model: Transformer) -> None:
        self.model = model
        self.objective.start(model)

    def batches(self, step: int, minutes: float) -> tuple[Batches, str | None]:
        batches, event = self.objective.batches(step, minutes)
        self.micro_batches = max(1, len(batches))
        self.total = None
        self.count = 0
        return batches, event

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.objective.loss(model, x, y)
        aux = self.model.router_aux_loss()
        if aux is None:  # no forward with gradients: nothing was routed in training
            return loss
        self.total = aux.detach() if self.total is None else self.total + aux.detach()
        self.count += 1
        return loss + self.coef * aux / self.micro_batches

    def figures(self) -> dict[str, torch.Tensor]:
        device = self.model.lm_head.weight.device
        mean = self.total / self.count if self.count else torch.zeros((), device=device)
        return {**self.objective.figures(), FIGURE: mean}

    def log_text(self, figures: dict[str, float]) -> str:
        return self.objective.log_text(figures) + f" | router aux {figures[FIGURE]:.4f}"

    def log_fields(self, figures: dict[str, float]) -> dict[str, float]:
        return {**self.objective.log_fields(figures), FIGURE: figures[FIGURE]}

    def evaluate(self, model: Transformer) -> Evaluation:
        return self.objective.evaluate(model)

    def identity(self) -> dict[str, str]:
        return self.objective.identity()

    def state(self) -> dict:
        return self.objective.state()

    def restore(self, state: dict) -> None:
        self.objective.restore(state)
