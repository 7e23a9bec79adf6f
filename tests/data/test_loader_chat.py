"""Conversations as training data: roles files beside the token shards, whole conversations per row with only the
assistant's tokens as targets, the loss averaged over target tokens, exact resume."""

import shutil

import numpy as np
import pytest
import torch

from gptlite import GPT
from gptlite.data.loader import ChatLoader, find_shards, is_chat_data, read_roles
from gptlite.data.shards import START, TARGET, roles_path, write_roles, write_shard
from gptlite.train.metrics import read_metrics
from gptlite.train.run_config import resolve_config
from tests.conftest import run_train

V = 40  # ids: 0-25 letters, 30 = user marker, 31 = assistant marker, 32 = end of turn, 33.. the answer


def conversation(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """A user turn of random letters, then the assistant's fixed answer: (tokens, roles)."""
    user = [30, *rng.integers(0, 26, int(rng.integers(3, 12))).tolist()]
    answer = [31, 33, 34, 35, 36, 32]
    tokens = user + answer
    roles = [START] + [0] * (len(user) - 1) + [0] + [TARGET] * (len(answer) - 1)  # the marker is context
    return tokens, roles


def write_split(folder, split: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    conversations = [conversation(rng) for _ in range(n)]
    tokens = [t for c in conversations for t in c[0]]
    roles = [r for c in conversations for r in c[1]]
    write_shard(folder / f"{split}_000000.bin", tokens, V)
    write_roles(roles_path(folder / f"{split}_000000.bin"), roles)
    return conversations


@pytest.fixture
def chat_data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text('{"type": "byte", "vocab_size": 256, "eot_id": null}')
    return data, write_split(data, "train", 200, 0), write_split(data, "val", 20, 1)


def test_rows_are_whole_conversations_with_assistant_targets_only(chat_data):
    data, convs, _ = chat_data
    loader = ChatLoader([data / "train_000000.bin"], batch_size=4, block_size=32, seed=0)
    seen = []
    for _ in range(50):  # one epoch
        x, y = loader.next_batch()
        assert x.shape == y.shape and x.shape[1] % ChatLoader.PAD_MULTIPLE == 0
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            length = next(i for i in range(len(row_x)) if row_x[i] == 32 or i == len(row_x) - 1) + 1
            tokens = row_x[: length - 1] + [row_y[length - 2]]
            seen.append(tuple(row_x[: row_x.index(31) + 1]))
            assert [t for t in row_y if t >= 0] == [33, 34, 35, 36, 32]  # the answer and the end of turn only
            assert all(t == -1 for t in row_y[row_x.index(31) + 5 :]) and tokens[0] == 30
    assert sorted(seen) == sorted(tuple(c[0][: c[0].index(31) + 1]) for c in convs)  # each conversation once


def test_roles_files_are_checked_against_their_shard(chat_data, tmp_path):
    data, _, _ = chat_data
    path = roles_path(data / "train_000000.bin")
    with pytest.raises(ValueError, match=r"holds \d+ role bytes \(header: \d+\) for a shard of 5 tokens"):
        read_roles(path, 5)
    (tmp_path / "bad.roles").write_bytes(b"\0" * 2000)
    with pytest.raises(ValueError, match=r"bad\.roles is not a gptlite roles file"):
        read_roles(tmp_path / "bad.roles", 976)


def test_a_chat_folder_without_its_roles_files_is_refused_not_trained_on_every_token(chat_data, tmp_path):
    data, _, _ = chat_data
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    (copy / "manifest.json").write_text('{"chat": {"block_size": 0, "too_long": "drop"}}')  # what --chat records
    assert is_chat_data(find_shards(copy, "train"))
    roles_path(copy / "train_000000.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"train_000000\.roles is missing: .* holds conversations"):
        is_chat_data(find_shards(copy, "train"))


def test_the_loss_is_averaged_over_every_target_token_of_the_step(chat_data, tmp_path):
    """A step of two micro-batches of 3 conversations has the loss and the gradient norm of one batch of the same
    6, whose loss is the mean over all their target tokens: a micro-batch with fewer targets weighs less."""
    data, _, _ = chat_data
    args = [
        f"--data_dir={data}",
        "--vocab_size=40",
        "--n_layer=2",
        "--n_head=4",
        "--n_embd=32",
        "--block_size=32",
        "--total_batch_size=192",
        "--max_iters=1",
        "--log_interval=1",
        "--device=cpu",
    ]
    for batch_size in (3, 6):
        run_train(*args, f"--batch_size={batch_size}", f"--out_dir={tmp_path / str(batch_size)}")
    (two,), (one,) = ([r for r in read_metrics(tmp_path / str(b) / "metrics.jsonl") if "lr" in r] for b in (3, 6))
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    # the reference: the mean over every target token of those 6 conversations, with the run's initial weights
    cfg = resolve_config([*args, "--batch_size=6"])
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    x, y = ChatLoader([data / "train_000000.bin"], batch_size=6, block_size=32, seed=cfg.seed).next_batch()
    assert one["loss"] == pytest.approx(model(x, y)[1].item(), rel=1e-5)


def test_a_model_learns_the_answer_and_not_the_users_letters(chat_data, tmp_path):
    """Train on the conversations: the loss over assistant tokens falls near 0, which it could not if the users'
    random letters were targets; resume continues exactly."""
    data, _, _ = chat_data
    args = [
        f"--data_dir={data}",
        "--vocab_size=40",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=8",
        "--learning_rate=1e-2",
        "--min_lr=1e-3",
        "--warmup_iters=5",
        "--eval_iters=0",
        "--log_interval=5",
        "--device=cpu",
        "--total_batch_size=512",
        "--lr_decay_iters=60",
    ]
    straight = run_train(*args, f"--out_dir={tmp_path / 'a'}", max_iters=60, eval_interval=30)
    assert straight["history"][-1][1] < 0.05 and straight["val_history"][-1][1] < 0.05
    run_train(*args, f"--out_dir={tmp_path / 'b'}", max_iters=30, eval_interval=30)
    resumed = run_train(f"--out_dir={tmp_path / 'b'}", "--resume", "--max_iters=60")
    assert resumed["history"] == [h for h in straight["history"] if h[0] > 30]
