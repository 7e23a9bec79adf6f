"""Training objectives: what differs between the ways train.py trains, one small object per mode behind one
interface (`Objective`, gptlite.train.objective_base), chosen once at set-up by `make_objective`, as the model's
variants are chosen once when it is built.

The optimizer step is the same for every mode (train.py); an objective owns the rest: which batches a step takes
(or why it takes none), the loss of a micro-batch and the step's figures, each under its name, the extra part of the
step's log line, how the run is judged at each evaluation, and what its state is for a resume. The modes:
- text (`Text`): next-token prediction on windows of a token stream, gptlite's pretraining;
- conversations (`Conversations`): the same on whole conversations, the assistant's tokens alone being targets;
- preference pairs (gptlite.train.preference.DPO): DPO's loss against the start-of-run model;
- prompts and rewards (gptlite.train.rl.RL, --rl): the policy gradient on sampled completions.
A new mode on a new kind of data is a class with Objective's methods and a line in objective_for, the one map from a
kind of data to its objective that train.py (make_objective) and gptlite.evaluate (make_judge) both read; its option
rules sit beside it, in its module: those of its options alone (`option_problems`, which
gptlite.train.run_config.check_training_options gathers as the run is resolved) and those against the data
(`data_problems`, which check_data gathers once the data is read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gptlite.data.loader import ChatLoader, Loader, ShardLoader, make_loaders, make_val_loader
from gptlite.evaluate.bpb import byte_lengths, evaluate_loader
from gptlite.train import preference, rl
from gptlite.train.metrics import Evaluation
from gptlite.train.objective_base import Batches, Objective, ReadsTrainLoader
from gptlite.train.optim import seq_len_at
from gptlite.train.preference import DPO
from gptlite.train.rl import RL, PromptLoader, load_reward, read_prompts, reward_needs_answer
from gptlite.train.router_balance import with_router_balance

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.model.network import Transformer
    from gptlite.tokenizer import Tokenizer


# ---------------------------------------------------------------------------------------------
# The language model's objective: text and conversations


def windows_problems(cfg: TrainConfig, kind: str) -> list[str]:
    """seq_len_start cuts text windows (Text's growing windows): not preference pairs nor RL prompts."""
    if cfg.seq_len_start and (kind == "pairs" or cfg.rl):
        return [
            f"seq_len_start={cfg.seq_len_start} cuts text windows into shorter ones; preference pairs and RL "
            "prompts are whole sequences: leave seq_len_start out"
        ]
    return []


class Text(ReadsTrainLoader):
    """Next-token prediction on text: each step takes grad_accum windows of batch_size x block_size tokens per rank,
    its loss the mean cross-entropy over them. With seq_len_start the windows grow: each (B, T) batch is cut into
    (B * T / seq_len, seq_len) ones, the same tokens. It has no figures of its own; it is judged by the val split's
    loss and bits per byte (gptlite.evaluate.bpb). Its state is the train loader's position."""

    needs_reference = False

    def __init__(
        self,
        cfg: TrainConfig,
        train_loader: ShardLoader | ChatLoader,
        val_loader: ShardLoader | ChatLoader,
        token_bytes: torch.Tensor | None,
        grad_accum: int,
        device: str,
        autocast: contextlib.AbstractContextManager,
        world_size: int,
        log: Callable[[str], None],
    ):
        self.cfg = cfg
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.token_bytes = token_bytes  # each token's UTF-8 bytes, for the val bits per byte (None: unknown)
        self.grad_accum = grad_accum
        self.device = device
        self.autocast = autocast
        self.world_size = world_size
        self.log = log
        self.seq_len: int | None = None  # the training windows' length, from the first step on
        self.reduction = "mean"  # the loss of a micro-batch: the mean over its targets, or (conversations) the sum
        self.weight: float | torch.Tensor = 1.0 / grad_accum  # each micro-batch's share of the step's loss

    def start(self, model: Transformer) -> None:
        pass

    def batches(self, step: int, minutes: float) -> tuple[Batches, str | None]:
        step_len = seq_len_at(step, self.cfg, minutes)  # block_size, or with seq_len_start a warm-up from shorter
        if step_len != self.seq_len and self.cfg.seq_len_start:
            self.log(f"step {step:5d} | training on windows of {step_len} tokens")
        self.seq_len = step_len
        batches = [self.train_loader.next_batch() for _ in range(self.grad_accum)]
        self.reduction, self.weight = self.weighting(batches)
        return batches, None

    def weighting(self, batches: Batches) -> tuple[str, float | torch.Tensor]:
        """(the loss's reduction, each micro-batch's weight) for a step's batches. Every micro-batch of text holds
        B x T targets, so the step's mean loss is the mean over micro-batches."""
        return "mean", 1.0 / self.grad_accum

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.seq_len != self.cfg.model.block_size:
            x, y = x.reshape(-1, self.seq_len), y.reshape(-1, self.seq_len)  # (B * T / seq_len, seq_len) each
        # chunked_loss: the head and the loss a chunk of tokens at a time, never every logit at once
        _, loss = model(x, y, reduction=self.reduction, return_logits=not self.cfg.chunked_loss)
        return loss * self.weight

    def figures(self) -> dict[str, torch.Tensor]:
        return {}

    def log_text(self, figures: dict[str, float]) -> str:
        return ""

    def log_fields(self, figures: dict[str, float]) -> dict[str, float]:
        return {}

    def evaluate(self, model: Transformer) -> Evaluation:
        """The val split's mean loss per target token and bits per byte (None without the data's tokenizer)."""
        val_loss, val_bpb = evaluate_loader(
            model, self.val_loader, self.cfg.eval_iters, self.device, self.autocast, self.token_bytes
        )
        line = f"val loss {val_loss:.4f}" + ("" if val_bpb is None else f" | val bpb {val_bpb:.4f}")
        return Evaluation(val_loss, line, {"val_loss": val_loss, "val_bpb": val_bpb})


class Conversations(Text):
    """Next-token prediction on whole conversations (gptlite.data.loader.ChatLoader), an assistant's tokens alone being
    targets; otherwise as Text."""

    def weighting(self, batches: Batches) -> tuple[str, float | torch.Tensor]:
        """The loss of conversations is the mean over every target token of the step, on every rank: a micro-batch
        with fewer assistant tokens weighs less. So each micro-batch's summed loss is divided by the step's target
        count, times world_size, which DDP's mean over the ranks divides away."""
        n_targets = torch.tensor(float(sum(int((y >= 0).sum()) for _, y in batches)), device=self.device)
        if self.world_size > 1:
            dist.all_reduce(n_targets)
        return "sum", self.world_size / n_targets.clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# The one place the mode is decided


def objective_for(
    kind: str,
    cfg: TrainConfig,
    train_loader: Loader | None,
    val_loader: Loader,
    tokenizer: Tokenizer | None,
    grad_accum: int,
    device: str,
    autocast: contextlib.AbstractContextManager,
    world_size: int,
    log: Callable[[str], None],
) -> Text | DPO:
    """The one map from a kind of data (text, conversations or pairs: what data/prepare.py made, the loaders' `kind`)
    to the objective that trains on it and judges a model on it (no train loader: a judge of the val split alone).
    `tokenizer` is the data's (None if it has none), whose tokens' bytes give text's val bits per byte."""
    if kind == "pairs":
        return DPO(cfg, train_loader, val_loader, grad_accum, device, autocast)
    token_bytes = None if tokenizer is None else byte_lengths(tokenizer, cfg.model.vocab_size).to(device)
    language_model = Conversations if kind == "conversations" else Text
    return language_model(cfg, train_loader, val_loader, token_bytes, grad_accum, device, autocast, world_size, log)


def check_data(cfg: TrainConfig, kind: str, has_tokenizer: bool) -> None:
    """The rules between the options and the data folder they train on, once it is read: `kind` is what it holds
    (text, conversations or pairs), `has_tokenizer` whether it has a tokenizer.json. Each mode's rules sit beside
    the mode (gptlite.train.preference, windows_problems here, gptlite.train.rl); the first problem is a ValueError
    that says the fix."""
    problems = [
        *preference.data_problems(cfg, kind),
        *windows_problems(cfg, kind),
        *rl.data_problems(cfg, kind, has_tokenizer),
    ]
    if problems:
        raise ValueError(problems[0])


def make_objective(
    cfg: TrainConfig,
    tokenizer: Tokenizer | None,
    grad_accum: int,
    device: str,
    autocast: contextlib.AbstractContextManager,
    rank: int,
    world_size: int,
    log: Callable[[str], None],
) -> Objective:
    """The run's objective: --rl's, else the one objective_for gives what the data folder holds (text, conversations or
    preference pairs: data/prepare.py says which). Its inputs are read and checked here, before the run folder is
    claimed: every shard (gptlite.data.loader.make_loaders), the options against the data (check_data), and
    for --rl the reward function and the prompts. `tokenizer` is the data's (None if it has none). A model with
    experts adds their load-balancing loss (gptlite.train.router_balance)."""
    train_loader, val_loader = make_loaders(cfg, rank, world_size)
    kind = train_loader.kind  # "text", "conversations" or "pairs"
    if train_loader.past_block:  # conversations or pairs with no target within the block
        log(
            f"note: {train_loader.past_block:,} of the {len(train_loader.conversations):,} {kind} in "
            f"{cfg.data_dir}'s train split have no target within block_size={cfg.model.block_size}: they train nothing"
        )
    check_data(cfg, kind, has_tokenizer=tokenizer is not None)
    objective = objective_for(
        kind, cfg, train_loader, val_loader, tokenizer, grad_accum, device, autocast, world_size, log
    )
    if cfg.rl:  # the prompts take the train loader's place; the data folder's val split is still evaluated
        reward = load_reward(cfg.reward, cfg.rl_answer_field)
        room = cfg.model.block_size - cfg.rl_max_new_tokens  # a prompt's tokens, that its completion still fits in
        prompts = read_prompts(
            cfg.rl_prompts, tokenizer, cfg.rl_prompt_field, cfg.rl_answer_field, room, reward_needs_answer(cfg.reward)
        )
        loader = PromptLoader(prompts, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world_size)
        objective = RL(cfg, tokenizer, loader, reward, objective, device, rank, world_size)
    return with_router_balance(objective, cfg)  # a mixture of experts' load-balancing loss, in every mode


def make_judge(
    cfg: TrainConfig,
    tokenizer: Tokenizer | None,
    device: str,
    autocast: contextlib.AbstractContextManager,
    log: Callable[[str], None],
) -> Text | DPO:
    """The objective that judges a model on cfg.data_dir's val split, as `python -m gptlite.evaluate` uses it: the
    one objective_for gives the split's kind of data, the val split alone read, and its `evaluate` scores a model as
    train.py's evaluations do (every window or pair when cfg.eval_iters is 0): conversations on the assistant's
    tokens alone, preference pairs by DPO's loss and figures against the reference its `start` is given (the model
    the DPO run began from). It trains nothing: it has no train loader."""
    val_loader = make_val_loader(cfg)  # a split of any size: every window or pair once, the last batch short
    return objective_for(val_loader.kind, cfg, None, val_loader, tokenizer, 1, device, autocast, 1, log)
