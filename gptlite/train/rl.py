"""Reinforcement learning on verifiable rewards: the reward functions (built in, or a user's), the prompts file and
its reproducible order, sampling a group of completions per prompt, group advantages and the policy-gradient loss.

A step of `train.py --rl` (see docs/chat.md, "Rewards"):
1. Each rank takes `batch_size` prompts (`PromptLoader`) and samples `rl_samples` completions of each with the KV
   cache's batched generation (`sample_group`), stopping at the end of a turn or of text, or at
   `rl_max_new_tokens`.
2. A reward function scores every completion: `(prompt, completion, record) -> float`, where `prompt` is what the
   record holds (text or messages), `completion` the generated text and `record` the whole JSON record. Built in:
   `gsm8k` (the number after "####", commas removed, equal to the answer's, as nanochat's tasks/gsm8k.py scores
   GSM8K) and `exact` (the completion, stripped, equal to the answer, stripped). A user's function is
   `--reward=package.module:function` (importable) or `--reward=path/to/file.py:function`.
3. The advantage of a completion is its reward minus the mean reward of its prompt's group (nanochat's chat_rl.py;
   GRPO's division by the group's standard deviation is left out, as Dr. GRPO argues, Liu et al., 2025).
4. The loss (`policy_loss`) is nanochat's REINFORCE form by default: -advantage x log-probability summed over the
   generated tokens and divided by the number of generated tokens in the batch (DAPO's token-level
   normalisation, Yu et al., 2025). `rl_loss=grpo` is DeepSeekMath's GRPO (Shao et al., 2024, eq. 3): the ratio to
   the sampling policy clipped to [1 - eps, 1 + eps] as in PPO, minus beta x the KL divergence to a reference model
   (the model at the start of the run) by the k3 estimator, averaged per completion and then over completions.

A reward function that raises or returns something other than a finite number never ends a run: the step makes no
update, is counted, and a one-line warning names the function and the record.

`RL` is train.py's objective for --rl (a gptlite.train.objective_base.Objective): these steps, their figures, their
state.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import numbers
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gptlite.config import RL_LOSSES, set_options
from gptlite.files import read_jsonl
from gptlite.inference.generate import PAD, generate_tokens
from gptlite.train.lora import ReferenceModel

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.model.network import Transformer
    from gptlite.tokenizer import Tokenizer
    from gptlite.train.metrics import Evaluation
    from gptlite.train.objective_base import Objective

GSM8K_NUMBER = re.compile(r"#### (\-?[0-9\.\,]+)")  # nanochat's tasks/gsm8k.py, from OpenAI's grade-school-math
RL_OPTIONS = (  # what --rl alone reads; rl_prompts and reward have a message of their own
    "rl_prompt_field",
    "rl_answer_field",
    "rl_samples",
    "rl_max_new_tokens",
    "rl_temperature",
    "rl_loss",
    "rl_clip",
    "rl_kl_beta",
)


# ---------------------------------------------------------------------------------------------
# RL's options: their rules, checked as the run is resolved (option_problems) and once the data is read


def option_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with --rl's options (gptlite.train.run_config.check_training_options reports it with the other
    modes' before anything is read): what --rl needs, what it cannot run with, and its options set without it."""
    problems = []
    if cfg.rl:
        if not (cfg.rl_prompts and cfg.reward):
            problems.append(
                "rl=true needs --rl_prompts=FILE.jsonl (prompts with answers) and --reward=gsm8k|exact|module:function"
            )
        if cfg.rl_samples < 2:
            problems.append(
                f"rl_samples={cfg.rl_samples} must be >= 2: a completion's baseline is its group's mean reward, "
                "which a group of one equals"
            )
        if not 1 <= cfg.rl_max_new_tokens < cfg.model.block_size:
            problems.append(
                f"rl_max_new_tokens={cfg.rl_max_new_tokens} must be in [1, block_size={cfg.model.block_size}): "
                "the prompt and its completion share the context"
            )
        if not cfg.rl_temperature > 0:
            problems.append(
                f"rl_temperature={cfg.rl_temperature} must be > 0: greedy completions of a prompt are all alike, "
                "and their advantages all 0"
            )
        if cfg.total_batch_size:
            problems.append(
                "rl=true takes batch_size prompts per device per step, rl_samples completions each, in one "
                f"micro-step; leave total_batch_size={cfg.total_batch_size} out"
            )
        if cfg.fsdp:
            problems.append("rl=true samples from whole weights and runs alone or under DDP; drop fsdp=true")
    elif cfg.rl_prompts or cfg.reward:
        problems.append("rl_prompts and reward configure reinforcement learning; add --rl to train with them")
    elif set_options(cfg, RL_OPTIONS):
        problems.append(
            f"{', '.join(set_options(cfg, RL_OPTIONS))} configure reinforcement learning (--rl), which this run "
            "does not do; add --rl or leave them out"
        )
    if not cfg.rl_clip > 0 or cfg.rl_kl_beta < 0:
        problems.append(f"rl_clip={cfg.rl_clip} must be > 0 and rl_kl_beta={cfg.rl_kl_beta} >= 0")
    return problems


def data_problems(cfg: TrainConfig, kind: str, has_tokenizer: bool) -> list[str]:
    """--rl decodes its completions and evaluates the data folder's val split of text or conversations (`kind`: what
    the folder holds; `has_tokenizer`: whether it has a tokenizer.json; see gptlite.train.objective.check_data)."""
    if cfg.rl and (not has_tokenizer or kind == "pairs"):
        return [
            "--rl samples completions of --rl_prompts, and needs a data folder with a tokenizer.json and a val "
            f"split of text or conversations (what the model was fine-tuned on); {cfg.data_dir} "
            + ("holds preference pairs" if kind == "pairs" else "has no tokenizer.json")
        ]
    return []


# ---------------------------------------------------------------------------------------------
# Rewards


def gsm8k_number(text: str) -> str | None:
    """The final answer of a GSM8K solution: the number after "####", commas removed; None if there is none."""
    match = GSM8K_NUMBER.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def gsm8k_reward(completion: str, answer: Any) -> float:
    """1.0 if the completion's number after "####" equals the answer's, else 0.0. The answer is a GSM8K solution
    (its "#### N" is read) or the number itself."""
    answer = str(answer)
    reference = gsm8k_number(answer) if "####" in answer else answer.strip().replace(",", "")
    predicted = gsm8k_number(completion)
    return float(predicted is not None and predicted == reference)


def exact_reward(completion: str, answer: Any) -> float:
    """1.0 if the completion, stripped of surrounding white space, equals the answer, stripped; else 0.0."""
    return float(completion.strip() == str(answer).strip())


BUILTIN_REWARDS = {"gsm8k": gsm8k_reward, "exact": exact_reward}


class RewardError(Exception):
    """A reward function raised or returned something other than a finite number; the message is one line."""


@dataclass
class Reward:
    """A reward function and the name --reward gave it. Calling it scores one completion, as a float, or raises
    RewardError naming the function and the record."""

    name: str
    function: Callable[[Any, str, dict], Any]

    def __call__(self, prompt: Any, completion: str, record: dict, where: str) -> float:
        try:
            value = self.function(prompt, completion, record)
        except (Exception, SystemExit) as e:  # the user's code: any exception (exit() too) is reported, never lost
            first = str(e).splitlines()[0] if str(e) else ""
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {first} on {where}") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(
                f"reward function {self.name} returned {value!r} on {where}; it must return a finite number"
            )
        return float(value)


def load_reward(spec: str, answer_field: str = "answer") -> Reward:
    """The reward function `spec` names: a built-in (gsm8k, exact; they compare with the record's `answer_field`),
    `package.module:function` importable from here, or `path/to/file.py:function`."""
    if spec in BUILTIN_REWARDS:
        builtin = BUILTIN_REWARDS[spec]

        def against_answer(prompt: Any, completion: str, record: dict) -> float:
            return builtin(completion, record[answer_field])

        return Reward(spec, against_answer)
    fix = (
        f"give --reward={', '.join(BUILTIN_REWARDS)}, package.module:function (importable from here) or "
        "path/to/file.py:function"
    )
    module_name, colon, name = spec.rpartition(":")
    if not colon or not module_name or not name:
        raise ValueError(f"--reward={spec!r} names no function; {fix}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"file {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(f"gptlite_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: whatever its import raises
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--reward={spec}: cannot import {module_name} ({type(e).__name__}: {first}); {fix}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(
            f"--reward={spec}: {module_name} has no function {name!r}; define {name}(prompt, completion, record) -> "
            "float there, or name another"
        )
    return Reward(spec, function)


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass
class Prompt:
    """One record of the prompts file: its prompt as the record holds it (text or messages), its token ids (the
    chat template's generation prompt after messages), the record, and where it came from ("record N of FILE",
    for messages)."""

    prompt: Any
    ids: list[int]
    record: dict
    where: str


def encode_prompt(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """Token ids of a prompt: text as it is, messages through the chat template with the assistant's turn opened."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True)


def read_prompts(
    path: str | Path,
    tokenizer: Tokenizer,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    max_prompt_tokens: int | None = None,
    need_answer: bool = True,
) -> list[Prompt]:
    """Every record of a JSONL prompts file, encoded; each holds `prompt_field` (text, or a list of {role, content}
    messages) and, when `need_answer` (a built-in reward), `answer_field`. A record that is not so, or whose prompt
    is longer than `max_prompt_tokens`, is a ValueError naming its line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist; give --rl_prompts=FILE.jsonl")
    prompts = []

    def where_of(number: int) -> str:  # how errors name a line
        return f"record {number} of {path}"

    for where, record in read_jsonl(path, "write one JSON object per line", where_of):
        if not isinstance(record, dict) or prompt_field not in record:
            raise ValueError(f"{where} has no {prompt_field!r} field; name the prompt's field with --rl_prompt_field")
        if need_answer and answer_field not in record:
            raise ValueError(
                f"{where} has no {answer_field!r} field, which the built-in reward compares with; name it with "
                "--rl_answer_field"
            )
        answer = record.get(answer_field)
        if need_answer and (not isinstance(answer, (str, int, float)) or isinstance(answer, bool)):
            raise ValueError(
                f"{where}: its {answer_field!r} is {json.dumps(answer)[:40]}, and the built-in reward compares the "
                "completion with text or a number; write the answer as one, or score the record with your own "
                "--reward=module:function"
            )
        prompt = record[prompt_field]
        messages = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)
        if not (isinstance(prompt, str) and prompt) and not (messages and prompt):
            raise ValueError(
                f"{where}: {prompt_field!r} must be non-empty text or a list of {{role, content}} messages"
            )
        ids = encode_prompt(tokenizer, prompt)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise ValueError(
                f"{where}: its prompt is {len(ids)} tokens, and block_size leaves {max_prompt_tokens} before "
                "rl_max_new_tokens; shorten the prompt, raise block_size or lower rl_max_new_tokens"
            )
        prompts.append(Prompt(prompt, ids, record, where))
    if not prompts:
        raise ValueError(f"prompts file {path} holds no records; write one JSON object per line")
    return prompts


@dataclass
class PromptLoader:
    """The prompts in a seeded order, reshuffled every pass: each step takes `batch_size` x world_size of them and
    rank r the r-th slice, so that ranks never share a prompt within a step. `state` and `restore` resume the
    order exactly (as the shard loaders do)."""

    prompts: list[Prompt]
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    position: int = 0
    order: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = self._order(self.epoch)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Prompt]:
        """This rank's prompts of the next step."""
        step = []
        for _ in range(self.batch_size * self.world_size):
            if self.position == len(self.order):
                self.epoch = self.epoch + 1
                self.position = 0
                self.order = self._order(self.epoch)
            step.append(self.prompts[self.order[self.position]])
            self.position += 1
        return step[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "prompts": len(self.prompts)}

    def restore(self, state: dict) -> None:
        if state.get("prompts") != len(self.prompts):
            raise ValueError(
                f"the checkpoint's run read a prompts file of {state.get('prompts')} records and --rl_prompts holds "
                f"{len(self.prompts)}; resume with the same file, or start a new run"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.order = self._order(self.epoch)


# ---------------------------------------------------------------------------------------------
# Sampling and scoring


@dataclass
class Group:
    """The completions of a step: P prompts x S samples, rows in prompt order (each prompt's S rows together).

    ids (N, L): each row's prompt and completion, padded on the right with 0; mask (N, L - 1): 1.0 where the
    target ids[:, 1:] is a generated token (the stop token included: the policy learns when to stop);
    lengths: each completion's tokens; texts: each completion's text (the stop token left out)."""

    prompts: list[Prompt]
    samples: int
    ids: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]
    texts: list[str]


@torch.no_grad()
def sample_group(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> Group:
    """Sample `samples` completions of every prompt with the KV cache (one prefill per prompt, shared by its
    samples) in eval mode; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    stops = tokenizer.end_ids()  # the tokens that end a completion
    try:
        steps = list(
            generate_tokens(
                model,
                [p.ids for p in prompts],
                max_new_tokens,
                temperature,
                generator=generator,
                num_samples=samples,
                stop_tokens=stops,
                vocab_limit=tokenizer.vocab_size,
            )
        )
    finally:
        model.train(was_training)
    new = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(len(prompts) * samples)]  # (N, new)
    rows = []
    completions = []
    texts = []
    for i, tokens in enumerate(new):
        tokens = [t for t in tokens if t != PAD]
        prompt = prompts[i // samples].ids
        rows.append(prompt + tokens)
        completions.append((len(prompt), len(tokens)))
        texts.append(tokenizer.decode([t for t in tokens if t not in stops]))
    L = max(len(r) for r in rows)
    device = model.tok_emb.weight.device
    ids = torch.zeros(len(rows), L, dtype=torch.long)  # (N, L)
    mask = torch.zeros(len(rows), L - 1)  # (N, L - 1)
    for i, (row, (start, n)) in enumerate(zip(rows, completions, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, start - 1 : start - 1 + n] = 1.0  # the target at position t is token t + 1
    return Group(prompts, samples, ids.to(device), mask.to(device), [n for _, n in completions], texts)


def score_group(group: Group, reward: Reward) -> torch.Tensor:
    """The rewards of a group's completions, (P, S); RewardError from the first that fails."""
    rewards = [
        reward(p.prompt, group.texts[i], p.record, p.where)
        for i, p in enumerate(p for p in group.prompts for _ in range(group.samples))
    ]
    return torch.tensor(rewards, dtype=torch.float32).view(len(group.prompts), group.samples)  # (P, S)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (P, S) -> advantages (P * S,): each reward minus the mean of its prompt's group."""
    return (rewards - rewards.mean(dim=1, keepdim=True)).flatten()


def pass_at_k(rewards: torch.Tensor) -> float:
    """rewards (P, S) -> the fraction of prompts with at least one of their S completions rewarded above 0."""
    return float((rewards > 0).any(dim=1).float().mean())


def step_generator(seed: int, step: int, rank: int, device: str) -> torch.Generator:
    """The sampling stream of one step on one rank, seeded from (seed, step, rank): a resumed run samples what the
    straight run would have, and no two ranks sample alike."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) * 1009 + rank)


def rollout(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    reward: Reward,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> tuple[Group, torch.Tensor | None, str | None]:
    """A step's group of completions and their rewards (P, S); when the reward function fails, no rewards and the
    one-line reason."""
    group = sample_group(model, tokenizer, prompts, samples, max_new_tokens, temperature, generator)
    try:
        return group, score_group(group, reward), None
    except RewardError as e:
        return group, None, str(e)


def group_figures(group: Group, rewards: torch.Tensor, max_new_tokens: int) -> dict[str, float]:
    """What a step logs of its group: its mean reward, pass@k (k = its samples), mean completion length in tokens
    and the share of completions cut at max_new_tokens."""
    lengths = torch.tensor(group.lengths, dtype=torch.float32)
    return {
        "mean_reward": float(rewards.mean()),
        f"pass@{group.samples}": pass_at_k(rewards),
        "completion_tokens": float(lengths.mean()),
        "cut_at_max_tokens": float((lengths >= max_new_tokens).float().mean()),
    }


def no_signal_note(rewards: torch.Tensor, samples: int) -> str | None:
    """What a step whose every group scored alike (rewards (P, S), each row a prompt's samples) teaches: nothing, as
    each completion's advantage, its reward minus its group's mean, is 0; and what to try. None where some group's
    rewards differ."""
    if not bool((rewards == rewards[:, :1]).all()):
        return None
    if not bool(rewards.any()):
        scored = "no completion scored (every reward is 0)"
        advice = (
            f"try more samples per prompt (--rl_samples, now {samples}), a longer --rl_max_new_tokens where answers "
            "are cut (cut_at_max_tokens in metrics.jsonl), an easier reward, or first fine-tune on answers in the "
            "reward's format"
        )
    else:
        scored = "every sample of each prompt scored the same"
        advice = f"try more samples per prompt (--rl_samples, now {samples}) or prompts the model gets right at times"
    return (
        f"{scored}, so every advantage (a reward minus its group's mean) is 0 and such a step learns nothing; "
        f"{advice} (said once)"
    )


# ---------------------------------------------------------------------------------------------
# The loss


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids (N, L) -> the log-probability of each next token, (N, L - 1), in float32: minus the per-token
    cross-entropy, computed a chunk of tokens at a time (gptlite.model.loss), never all the logits at once."""
    _, losses = model(ids[:, :-1], ids[:, 1:], reduction="none", return_logits=False)  # (N, L - 1)
    return -losses


def policy_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    kind: str = "reinforce",
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    clip: float = 0.2,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss of a group, and its KL to the reference (0.0 without one).

    logprobs (N, T): the policy's, with gradients; mask (N, T): 1.0 on generated tokens; advantages (N,).
    reinforce: -sum(A_i * logp_it * m_it) / sum(m_it), over the whole batch (nanochat; DAPO's normalisation).
    grpo: old_logprobs (N, T), the sampling policy's, and ref_logprobs (N, T), the reference's (needed when
    kl_beta > 0); per token, r = exp(logp - old), the surrogate min(r A, clip(r, 1 - clip, 1 + clip) A) minus
    kl_beta * (exp(ref - logp) - (ref - logp) - 1), averaged over each completion's tokens, then over completions,
    negated (DeepSeekMath, eq. 3 and 4)."""
    if kind not in RL_LOSSES:
        raise ValueError(f"rl_loss={kind!r} must be one of {', '.join(RL_LOSSES)}")
    mask = mask.to(logprobs.dtype)
    A = advantages.to(logprobs.dtype)[:, None]  # (N, 1)
    if kind == "reinforce":
        return -(A * logprobs * mask).sum() / mask.sum().clamp_min(1.0), {"kl": 0.0}
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * A, torch.clamp(ratio, 1 - clip, 1 + clip) * A)  # (N, T)
    kl = torch.zeros_like(logprobs)
    if kl_beta > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, and never negative
    per_token = surrogate - kl_beta * kl  # (N, T)
    per_completion = (per_token * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (N,)
    mean_kl = float(((kl.detach() * mask).sum(1) / mask.sum(1).clamp_min(1.0)).mean())
    return -per_completion.mean(), {"kl": mean_kl}


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def score_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    reward: Reward,
    samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 32,
) -> dict[str, float]:
    """A model's scores on prompts: pass@1 and the mean reward of its greedy completion, and with `samples` sampled
    completions at `temperature`, their mean reward, pass@k (k = samples) and mean length in tokens. A reward
    function that fails is a ValueError naming it and the record."""
    generator = torch.Generator(device=model.tok_emb.weight.device).manual_seed(seed)
    greedy, sampled, lengths = [], [], []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        try:
            best = sample_group(model, tokenizer, batch, 1, max_new_tokens, 0.0)
            greedy.append(score_group(best, reward))
            group = sample_group(model, tokenizer, batch, samples, max_new_tokens, temperature, generator)
            sampled.append(score_group(group, reward))
        except RewardError as e:
            raise ValueError(f"{e}; fix the function, or have it return 0.0 for what it cannot score") from None
        lengths += group.lengths
    greedy_rewards, rewards = torch.cat(greedy), torch.cat(sampled)  # (P, 1), (P, S)
    return {
        "prompts": len(prompts),
        "greedy_reward": float(greedy_rewards.mean()),
        "pass@1": pass_at_k(greedy_rewards),
        "mean_reward": float(rewards.mean()),
        f"pass@{samples}": pass_at_k(rewards),
        "mean_length": sum(lengths) / len(lengths),
    }


def reward_needs_answer(spec: str) -> bool:
    """Whether --reward is a built-in, which compares with the record's answer field."""
    return spec in BUILTIN_REWARDS


# ---------------------------------------------------------------------------------------------
# The objective


class RL:
    """train.py --rl's objective (gptlite.train.objective_base.Objective). A step's one micro-batch is rl_samples
    completions of each of its batch_size prompts, sampled with the KV cache and scored by the reward function; its loss
    is the policy gradient (policy_loss), with GRPO's KL to the start-of-run model where rl_kl_beta > 0. Its figures are
    the group's rewards, lengths and KL. The data folder's val split is evaluated by `fine_tuning`, the objective the
    model was fine-tuned with there, which shows how far the policy drifts from that data. Its state is the prompts'
    order."""

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Tokenizer,
        prompts: PromptLoader,
        reward: Reward,
        fine_tuning: Objective,
        device: str,
        rank: int,
        world_size: int,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.reward = reward
        self.fine_tuning = fine_tuning
        self.device = device
        self.rank = rank
        self.world_size = world_size
        # GRPO's KL term measures the policy against the start-of-run model, as DPO does
        self.needs_reference = cfg.rl_loss == "grpo" and cfg.rl_kl_beta > 0
        self.model: Transformer | None = None  # the model that samples, given at start()
        self.reference: ReferenceModel | None = None
        self.rewards: torch.Tensor | None = None  # the step's group's rewards, (P, S)
        # the step's figures: group_figures' and the KL, which the loss gives; all 0.0 for a step without a group
        self.names = ("mean_reward", f"pass@{cfg.rl_samples}", "completion_tokens", "cut_at_max_tokens", "kl")
        self.step_figures = dict.fromkeys(self.names, 0.0)
        self.said_no_signal = False  # a step that learns nothing, as every group scored alike, is said once

    def start(self, model: Transformer) -> None:
        self.model = model
        self.reference = ReferenceModel.of(model) if self.needs_reference else None

    def batches(self, step: int, minutes: float) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
        # A reward function that fails on any rank skips the step on every rank (DDP's backward needs them all):
        # counted as a reward_error event, and said in one line.
        cfg = self.cfg
        generator = step_generator(cfg.seed, step, self.rank, self.device)
        group, rewards, problem = rollout(
            self.model,
            self.tokenizer,
            self.prompts.next_batch(),
            self.reward,
            cfg.rl_samples,
            cfg.rl_max_new_tokens,
            cfg.rl_temperature,
            generator,
        )
        failed = torch.tensor(float(problem is not None), device=self.device)
        if self.world_size > 1:
            dist.all_reduce(failed)
        if problem:
            print(f"warning: step {step + 1}: {problem}; the step makes no update", flush=True)
        self.step_figures = dict.fromkeys(self.names, 0.0)
        if failed.item():
            return [], "reward_error"
        self.rewards = rewards
        self.step_figures.update(group_figures(group, rewards, cfg.rl_max_new_tokens))
        note = None if self.said_no_signal else no_signal_note(rewards, cfg.rl_samples)
        if note and self.rank == 0:
            print(f"note: step {step + 1}: {note}", flush=True)
            self.said_no_signal = True
        return [(group.ids, group.mask)], None  # (N, L) and (N, L - 1): the rows and their generated tokens

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The policy gradient: each generated token's log-probability weighted by its completion's advantage, its
        # reward minus its group's mean. GRPO's ratio is to the policy that sampled, this one (one update per
        # group), so its clip is inactive; its KL is to the start-of-run model. The group's loss is a mean already:
        # the step's one micro-batch weighs 1.
        cfg = self.cfg
        logprobs = token_logprobs(model, x)  # (N, L - 1)
        ref = None
        if self.reference is not None:
            with self.reference.module() as reference:
                ref = token_logprobs(reference, x)  # (N, L - 1), no gradient
        advantages = group_advantages(self.rewards).to(self.device)  # (N,)
        loss, info = policy_loss(
            logprobs, y, advantages, cfg.rl_loss, logprobs.detach(), ref, cfg.rl_clip, cfg.rl_kl_beta
        )
        self.step_figures["kl"] = info["kl"]
        return loss

    def figures(self) -> dict[str, torch.Tensor]:
        values = torch.tensor(list(self.step_figures.values())).to(self.device)  # one copy to the device
        return dict(zip(self.step_figures, values, strict=True))

    def log_text(self, figures: dict[str, float]) -> str:
        samples = self.cfg.rl_samples
        return (
            f" | reward {figures['mean_reward']:.3f} | pass@{samples} {figures[f'pass@{samples}']:.3f}"
            f" | {figures['completion_tokens']:.1f} tokens"
        )

    def log_fields(self, figures: dict[str, float]) -> dict[str, float]:
        return dict(figures)

    def evaluate(self, model: Transformer) -> Evaluation:
        return self.fine_tuning.evaluate(model)

    def identity(self) -> dict[str, str]:
        prompts = hashlib.sha256(Path(self.cfg.rl_prompts).read_bytes()).hexdigest()[:16]
        return {**self.fine_tuning.identity(), "prompts": prompts}

    def state(self) -> dict:
        return self.prompts.state()

    def restore(self, state: dict) -> None:
        self.prompts.restore(state)
