"""What every training objective is: the interface train.py calls (`Objective`), a step's micro-batches (`Batches`),
and `ReadsTrainLoader`, what the objectives that train on a train loader share. The modes themselves and the one map
that chooses among them are in gptlite.train.objective; this module lies below them all (gptlite.train.preference and
gptlite.train.rl import it), so that no mode imports the module that chooses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from gptlite.data.loader import data_identity

if TYPE_CHECKING:
    from gptlite.data.loader import ChatLoader, PairLoader, ShardLoader
    from gptlite.model.network import Transformer
    from gptlite.train.metrics import Evaluation

Batches = list[tuple[torch.Tensor, torch.Tensor]]  # a step's micro-batches, each (x, y)


class Objective(Protocol):
    """One way of training: train.py calls these in this order, and nothing else differs between the modes."""

    needs_reference: bool  # it measures the model against the start-of-run model: --init_from loads on a resume too

    def start(self, model: Transformer) -> None:
        """The model is built (with its LoRA adapters, if any), before it trains or a resume loads its weights: the
        moment to take the start-of-run reference, and the model that samples."""

    def batches(self, step: int, minutes: float) -> tuple[Batches, str | None]:
        """The micro-batches of optimizer step `step` (`minutes` into the run), on the CPU or the device; with none,
        the event that metrics.jsonl records for the step, which makes no update."""

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss (its backward adds its share of the gradient), computed by `model`
        (compiled and wrapped for DDP where they apply); the step's figures are accumulated on the way."""

    def figures(self) -> dict[str, torch.Tensor]:
        """The step's figures by name, each a 0-d tensor on the device: train.py averages them over the ranks with the
        loss, in its one all-reduce."""

    def log_text(self, figures: dict[str, float]) -> str:
        """The end of a step's log line, from its averaged figures ("" for none)."""

    def log_fields(self, figures: dict[str, float]) -> dict[str, float]:
        """The fields the step's metrics.jsonl row adds, from its averaged figures."""

    def evaluate(self, model: Transformer) -> Evaluation:
        """How the run is judged at an evaluation (every rank calls it); its loss picks best.pt."""

    def identity(self) -> dict[str, str]:
        """What it trains on (gptlite.data.loader.data_identity, and an RL run's prompts), saved in every checkpoint (as
        "data"): a resume on other data is refused before anything is restored."""

    def state(self) -> dict:
        """Its position in its data, saved in every checkpoint (as "loader")."""

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's `state()`."""


class ReadsTrainLoader:
    """For an objective that trains on a train loader (`train_loader`): what it trains on (`identity`, kept in every
    checkpoint) and its position there (`state`, `restore`) are the loader's."""

    train_loader: ShardLoader | ChatLoader | PairLoader

    def identity(self) -> dict[str, str]:
        return data_identity(self.train_loader.files, self.train_loader.kind)

    def state(self) -> dict:
        return self.train_loader.state()

    def restore(self, state: dict) -> None:
        self.train_loader.restore(state)
