"""Training objectives (gptlite/train/objective.py): make_objective picks each mode from the config and the data, and
refuses what a mode cannot train on; each objective's micro-step on a tiny model gives the loss its formula gives,
and its figures under their names, as train.py logs them."""

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPT
from gptlite.config import TrainConfig
from gptlite.data.prepare import prepare
from gptlite.data.prepare.preference import prepare_preference
from gptlite.data.shards import write_shard
from gptlite.tokenizer import TOKENIZER_FILE, load_tokenizer
from gptlite.train.objective import Conversations, Text, make_objective
from gptlite.train.preference import DPO
from gptlite.train.rl import RL
from tests.conftest import tiny_config
from tests.tokenizer.test_chat import write_chats
from tests.train.test_preference import digits_pairs, write_jsonl
from tests.train.test_rl import digit_prompts

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A data folder of each kind: text, conversations and preference pairs (byte tokens), the toy RL task's text
    (char tokens) with its prompts, and text shards without a tokenizer.json."""
    root = tmp_path_factory.mktemp("objectives")
    (root / "text.txt").write_text("".join(f"{i} green bottles hanging on the wall.\n" for i in range(400)))
    prepare([str(root / "text.txt")], "byte", root / "text", **QUIET)
    prepare([str(write_chats(root / "chats.jsonl", 60))], "byte", root / "chat", chat=True, block_size=64, **QUIET)
    prepare_preference([str(write_jsonl(root / "pairs.jsonl", digits_pairs(60)))], "byte", root / "pairs", **QUIET)
    (root / "digits.txt").write_text("".join(f"{r['prompt']}{r['answer']}\n" for r in digit_prompts(300, seed=3)))
    prepare([str(root / "digits.txt")], "char", root / "digits", **QUIET)
    write_jsonl(root / "prompts.jsonl", digit_prompts(40, seed=1))
    (root / "bare").mkdir()
    for split, seed in (("train", 0), ("val", 1)):
        tokens = torch.randint(0, 97, (2000,), generator=torch.Generator().manual_seed(seed))
        write_shard(root / "bare" / f"{split}_000000.bin", tokens.numpy(), 97)
    return root


def objective_for(folder, grad_accum=1, log=lambda *a: None, **options):
    """make_objective on a data folder, for a tiny model of the folder's vocabulary; the config keys over these."""
    vocab_size = 97
    if (folder / TOKENIZER_FILE).is_file():
        vocab_size = load_tokenizer(folder / TOKENIZER_FILE).vocab_size
    model_keys = {k: options.pop(k) for k in ("block_size",) if k in options}
    cfg = TrainConfig(
        model=tiny_config(vocab_size=vocab_size, **{"block_size": 32, **model_keys}),
        data_dir=str(folder),
        **{"batch_size": 4, "eval_iters": 2, **options},
    )
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE) if (folder / TOKENIZER_FILE).is_file() else None
    objective = make_objective(cfg, tokenizer, grad_accum, "cpu", contextlib.nullcontext(), 0, 1, log)
    torch.manual_seed(0)
    return objective, GPT(cfg.model).train()


def micro_steps(objective, model, step=0):
    """One optimizer step's forward and backward passes: (its micro-batches, the step's loss, its figures)."""
    objective.start(model)
    batches, no_update = objective.batches(step, 0.0)
    assert no_update is None and batches
    step_loss = 0.0
    for x, y in batches:
        loss = objective.loss(model, x, y)
        loss.backward()
        step_loss += loss.item()
    return batches, step_loss, {name: value.item() for name, value in objective.figures().items()}


def test_text_is_the_mean_cross_entropy_over_its_micro_batches(folders):
    objective, model = objective_for(folders / "text", grad_accum=2)
    assert type(objective) is Text and not objective.needs_reference
    position = objective.state()
    batches, step_loss, figures = micro_steps(objective, model)
    with torch.no_grad():
        expected = sum(F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item() for x, y in batches) / 2
    assert step_loss == pytest.approx(expected, rel=1e-5)
    assert figures == {} and objective.log_text(figures) == "" and objective.log_fields(figures) == {}
    evaluation = objective.evaluate(model)
    assert list(evaluation.fields) == ["val_loss", "val_bpb"] and evaluation.loss == evaluation.fields["val_loss"]
    assert evaluation.line == f"val loss {evaluation.loss:.4f} | val bpb {evaluation.fields['val_bpb']:.4f}"
    objective.restore(position)  # a resumed run takes the same batches again
    again, _ = objective.batches(0, 0.0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, batches, strict=True))


def test_growing_windows_cut_the_same_tokens_into_shorter_rows(folders):
    logged = []
    objective, model = objective_for(folders / "text", seq_len_start=8, max_iters=10, log=logged.append)
    position = objective.state()
    _, step_loss, _ = micro_steps(objective, model)
    assert logged == ["step     0 | training on windows of 8 tokens"]
    objective.restore(position)
    x, y = objective.train_loader.next_batch()  # (4, 32) each
    with torch.no_grad():
        short = model(x.reshape(-1, 8), y.reshape(-1, 8))[1].item()  # (16, 8) each
    assert step_loss == pytest.approx(short, rel=1e-5)
    objective.batches(1, 0.0)
    assert len(logged) == 1  # the same length: no second line


def test_conversations_weigh_every_target_token_of_the_step_alike(folders):
    objective, model = objective_for(folders / "chat", grad_accum=2, block_size=64)
    assert type(objective) is Conversations
    batches, step_loss, figures = micro_steps(objective, model)
    with torch.no_grad():
        logits = torch.cat([model(x)[0].flatten(0, 1) for x, _ in batches])
        targets = torch.cat([y.flatten() for _, y in batches])
    assert (targets == -1).any()  # the users' turns and the padding are no targets
    assert step_loss == pytest.approx(F.cross_entropy(logits, targets, ignore_index=-1).item(), rel=1e-5)
    assert figures == {} and list(objective.evaluate(model).fields) == ["val_loss", "val_bpb"]


def test_dpo_starts_at_log_2_against_its_reference_with_its_figures_named(folders):
    objective, model = objective_for(folders / "pairs", grad_accum=2)
    assert type(objective) is DPO and objective.needs_reference
    batches, step_loss, figures = micro_steps(objective, model)
    assert batches[0][0].shape[0] == 2 * 4  # the chosen answers, then the rejected ones
    # at the start the model is its reference: every implicit reward 0, no pair ranked right
    assert step_loss == pytest.approx(math.log(2), abs=1e-6)
    assert figures == {"rewards_chosen": 0.0, "rewards_rejected": 0.0, "rewards_accuracy": 0.0}
    assert objective.log_text(figures) == " | accuracy 0.000 | margin 0.000"
    assert list(objective.log_fields(figures)) == [
        "rewards_chosen",
        "rewards_rejected",
        "rewards_accuracy",
        "rewards_margin",
    ]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    evaluation = objective.evaluate(model)
    assert list(evaluation.fields) == [
        "val_loss",
        "val_rewards_chosen",
        "val_rewards_rejected",
        "val_rewards_accuracy",
        "val_rewards_margin",
    ]
    assert evaluation.loss == pytest.approx(math.log(2), abs=1e-6) and evaluation.line.startswith("val loss 0.6931 |")


@pytest.mark.parametrize("loss", ["reinforce", "grpo"])
def test_rl_takes_a_group_of_completions_with_its_figures_named(folders, loss):
    objective, model = objective_for(
        folders / "digits",
        rl=True,
        rl_prompts=str(folders / "prompts.jsonl"),
        reward="exact",
        rl_samples=4,
        rl_max_new_tokens=4,
        block_size=16,
        rl_loss=loss,
    )
    assert type(objective) is RL and objective.needs_reference == (loss == "grpo")
    batches, step_loss, figures = micro_steps(objective, model)
    (ids, mask), *more = batches
    assert not more and ids.shape[0] == mask.shape[0] == 4 * 4 and mask.shape[1] == ids.shape[1] - 1
    assert list(figures) == ["mean_reward", "pass@4", "completion_tokens", "cut_at_max_tokens", "kl"]
    assert 0 < figures["completion_tokens"] <= 4 and math.isfinite(step_loss)
    assert figures["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference at the first step
    assert objective.log_text(figures).startswith(f" | reward {figures['mean_reward']:.3f} | pass@4 ")
    assert objective.log_fields(figures) == figures
    # the data folder's val split is judged as the text objective judges it
    assert list(objective.evaluate(model).fields) == ["val_loss", "val_bpb"]
    assert objective.state() == {"epoch": 0, "position": 4, "prompts": 40}


def test_an_rl_step_whose_reward_fails_has_no_batches_and_says_why(folders, tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def reward(prompt, completion, record):\n    raise KeyError('x')\n")
    objective, model = objective_for(
        folders / "digits",
        rl=True,
        rl_prompts=str(folders / "prompts.jsonl"),
        reward=f"{tmp_path / 'broken.py'}:reward",
        rl_samples=2,
        rl_max_new_tokens=4,
        block_size=16,
    )
    objective.start(model)
    assert objective.batches(0, 0.0) == ([], "reward_error")
    assert "warning: step 1: reward function" in capsys.readouterr().out
    assert {name: value.item() for name, value in objective.figures().items()} == dict.fromkeys(
        ["mean_reward", "pass@2", "completion_tokens", "cut_at_max_tokens", "kl"], 0.0
    )


@pytest.mark.parametrize(
    "folder, message",
    [
        ("pairs", "needs a data folder with a tokenizer.json and a val split of text or conversations .*holds "),
        ("bare", "needs a data folder with a tokenizer.json .*bare has no tokenizer.json"),
    ],
)
def test_rl_refuses_a_data_folder_it_cannot_evaluate(folders, folder, message):
    with pytest.raises(ValueError, match=message):
        objective_for(folders / folder, rl=True, rl_prompts="p.jsonl", reward="exact", rl_max_new_tokens=4)


def test_without_a_tokenizer_text_is_judged_by_its_loss_alone(folders):
    objective, model = objective_for(folders / "bare")
    evaluation = objective.evaluate(model)
    assert evaluation.fields["val_bpb"] is None and evaluation.line == f"val loss {evaluation.loss:.4f}"
    assert json.dumps(evaluation.fields)  # metrics.jsonl writes it as it is


@pytest.mark.parametrize("kind", ["chat", "pairs"])
def test_a_val_split_smaller_than_a_batch_is_scored_whole(folders, kind):
    """A few dozen records leave a val split of fewer conversations or pairs than a batch: it is scored as it is,
    each item once in one short batch, as evaluate scores it (every item, a batch at a time)."""
    small, model = objective_for(folders / kind, batch_size=8, eval_iters=20)
    assert small.val_loader.size < 8
    small.start(model)
    whole, _ = objective_for(folders / kind, batch_size=2, eval_iters=0)
    whole.start(model)
    assert small.evaluate(model).loss == pytest.approx(whole.evaluate(model).loss, rel=1e-5)


@pytest.mark.parametrize("kind,items", [("chat", "conversations"), ("pairs", "preference pairs")])
def test_a_train_split_smaller_than_a_batch_names_the_largest_batch_that_fits(folders, kind, items):
    with pytest.raises(ValueError, match=rf"^train split: 54 {items} in 1 shard\(s\) .* are fewer than one batch of "
                                         r"64; use more data or --batch_size=54 or less$"):  # fmt: skip
        objective_for(folders / kind, batch_size=64)
