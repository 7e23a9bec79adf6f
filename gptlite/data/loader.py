"""The memory-mapped, resumable batch loaders over token shards (their file format is in gptlite.data.shards): windows
of a token stream for pretraining (`ShardLoader`), whole conversations for fine-tuning on chats (`ChatLoader`), pairs of
a chosen and a rejected answer for preference tuning (`PairLoader`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gptlite.data.shards import (  # noqa: F401  (the shard format's names, importable from here as before)
    ANSWER,
    FORMATS,
    HEADER_BYTES,
    HEADER_INTS,
    MANIFEST,
    PROGRESS,
    START,
    TARGET,
    UINT16_VOCAB,
    check_vocab,
    file_sha256,
    find_shards,
    read_roles,
    read_shard,
    roles_path,
    verify_manifest,
    write_shard,
)

if TYPE_CHECKING:
    from gptlite.config import TrainConfig


class ShardLoader:
    """Yields (x, y) batches of (batch_size, block_size) int64 windows from a list of shards.

    Every epoch visits the shards in a seeded order; within a shard, windows of block_size + 1 tokens
    start at a seeded offset and are visited in a seeded random order. A global batch is
    world_size * batch_size windows, of which rank r takes the r-th slice, so ranks never read the
    same window. The position (epoch, shard, index) is all the state: `state()` / `restore()`.
    """

    kind = "text"  # what its rows hold (gptlite.train.objective.objective_for maps it to its objective)
    past_block = 0  # windows of text always hold targets (ChatLoader counts its items that do not)

    def __init__(
        self,
        files: list[Path],
        batch_size: int,
        block_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ):
        self.files = list(files)
        self.shards = [read_shard(p) for p in self.files]
        self.batch_size, self.block_size = batch_size, block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        windows = sum(max(0, (len(s) - 1) // block_size) for s in self.shards)
        self.size = windows  # the windows of the split: every_window's
        need = batch_size * world_size
        if windows < need:
            tokens = sum(len(s) for s in self.shards)
            fewer = f"--batch_size={windows // world_size} or less, " if windows >= world_size else ""
            raise ValueError(
                f"{tokens} tokens in {len(self.files)} shard(s) ({self.files[0]}...) make {windows} windows of "
                f"block_size+1={block_size + 1} tokens, fewer than one batch of {need}; "
                f"use more data, {fewer}or a smaller --block_size"
            )
        self.epoch = 0
        self.shard = 0
        self.index = 0
        self._plan_epoch()

    def _plan_epoch(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        self.order = rng.permutation(len(self.shards)) if self.shuffle else np.arange(len(self.shards))
        self._plan_shard()

    def _plan_shard(self) -> None:
        """Window start offsets of the current shard, in visiting order."""
        tokens = self.shards[self.order[self.shard]]
        T = self.block_size
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.shard])
            offset = int(rng.integers(T)) if len(tokens) - 1 >= 2 * T else 0
            n = max(0, (len(tokens) - 1 - offset) // T)
            self.starts = offset + T * rng.permutation(n)
        else:
            self.starts = T * np.arange(max(0, (len(tokens) - 1) // T))

    def _next_window(self) -> tuple[int, int]:
        """The next (shard id, start) in the global order, advancing the position."""
        while self.index >= len(self.starts):
            self.shard, self.index = self.shard + 1, 0
            if self.shard == len(self.shards):
                self.epoch, self.shard = self.epoch + 1, 0
                self._plan_epoch()
            else:
                self._plan_shard()
        window = int(self.order[self.shard]), int(self.starts[self.index])
        self.index += 1
        return window

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), each (batch_size, block_size) int64; y is x shifted by one token."""
        windows = [self._next_window() for _ in range(self.batch_size * self.world_size)]
        return self._gather(windows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def every_window(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every window of every shard exactly once, in file order, this rank's share (global batches of
        world_size * batch_size windows, rank r taking the r-th slice; the last batch may be short or empty).
        For a full evaluation; it does not move the position."""
        T = self.block_size
        windows = [(s, i) for s, tokens in enumerate(self.shards) for i in range(0, len(tokens) - T, T)]
        step = self.batch_size * self.world_size
        for first in range(0, len(windows), step):
            mine = windows[first + self.rank * self.batch_size : first + (self.rank + 1) * self.batch_size]
            if mine:
                yield self._gather(mine)

    def _gather(self, windows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        buf = np.stack([self.shards[s][i : i + T + 1] for s, i in windows]).astype(np.int64)  # (B, T+1)
        buf = torch.from_numpy(buf)
        return buf[:, :-1], buf[:, 1:]  # (B, T) each

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state(self) -> dict[str, int]:
        """The exact position, to store in a checkpoint."""
        return {"epoch": self.epoch, "shard": self.shard, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()` (on a loader built with the same files and seed)."""
        self.epoch, self.shard = int(state["epoch"]), int(state["shard"])
        self._plan_epoch()
        self.index = int(state["index"])


class ChatLoader:
    """Yields (x, y) batches of whole conversations, one per row, from shards with roles files (data/prepare.py
    --chat): x the conversation's tokens but the last, y the next tokens where they are targets (an assistant's
    tokens and end-of-turn) and -1 elsewhere, both right-padded (x with 0, y with -1) to the batch's longest row
    rounded up to PAD_MULTIPLE (at most block_size). A row never holds two conversations, so none attends across
    a conversation boundary, and no attention mask is needed: the causal one hides the padding that follows.

    Every epoch visits the conversations in a seeded order; a global batch is world_size * batch_size of them, of
    which rank r takes the r-th slice. The position (epoch, index) is all the state: `state()` / `restore()`."""

    PAD_MULTIPLE = 32  # rows are padded to a multiple of this: few distinct shapes, little padding
    kind = "conversations"

    def __init__(
        self, files: list[Path], batch_size: int, block_size: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        self.files = list(files)
        self.tokens = [read_shard(p) for p in self.files]
        self.roles = [read_roles(roles_path(p), len(t)) for p, t in zip(self.files, self.tokens, strict=True)]
        self.batch_size, self.block_size = batch_size, block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.conversations = self._items()
        self.size = len(self.conversations)  # the items of the split: every_window's
        need = batch_size * world_size
        if self.size < need:
            items = "preference pairs" if self.kind == "pairs" else "conversations"
            fewer = f" or --batch_size={self.size // world_size} or less" if self.size >= world_size else ""
            raise ValueError(
                f"{self.size} {items} in {len(self.files)} shard(s) ({self.files[0]}...)"
                f" are fewer than one batch of {need}; use more data{fewer}"
            )
        self.targets = int(sum(int((r & TARGET).astype(bool).sum()) for r in self.roles))
        self.past_block = self._check_block()
        self.epoch, self.index = 0, 0
        self.order = self._order()

    def _check_block(self) -> int:
        """How many items have no target within block_size (a row holds block_size + 1 tokens at most): they train
        nothing. All of them is a one-line error, before anything is written: the data was prepared for longer
        rows than --block_size gives."""
        firsts = []  # each item's first target, counted from its first token
        for shard, start, *_, end in self.conversations:
            targets = np.flatnonzero(self.roles[shard][start:end] & TARGET)
            firsts.append(int(targets[0]) if len(targets) else end - start)
        past = sum(first > self.block_size for first in firsts)
        if past == len(firsts):
            what = "preference pairs' answers" if self.kind == "pairs" else "conversations' assistant turns"
            raise ValueError(
                f"block_size={self.block_size} cuts every one of the {len(firsts):,} {what} in "
                f"{self.files[0].parent} away (the shortest prompt before one is {min(firsts):,} tokens), so nothing "
                f"would train: give --block_size={max(firsts):,} or more, or prepare the data again with "
                f"--block_size={self.block_size}"
            )
        return past

    def _items(self) -> np.ndarray:
        """(N, 3) int64: each conversation's shard, start and end."""
        return np.array(
            [(s, a, b) for s, roles in enumerate(self.roles) for a, b in spans(roles)], dtype=np.int64
        ).reshape(-1, 3)

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.conversations))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), each (batch_size, L) int64 with L <= block_size."""
        picks = []
        for _ in range(self.batch_size * self.world_size):
            if self.index == len(self.order):
                self.epoch, self.index = self.epoch + 1, 0
                self.order = self._order()
            picks.append(int(self.order[self.index]))
            self.index += 1
        return self._gather(picks[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def every_window(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every conversation once, in file order, this rank's share of each global batch (the last may be short or
        empty); it does not move the position."""
        step = self.batch_size * self.world_size
        for first in range(0, len(self.conversations), step):
            mine = list(
                range(
                    first + self.rank * self.batch_size,
                    min(first + (self.rank + 1) * self.batch_size, len(self.conversations)),
                )
            )
            if mine:
                yield self._gather(mine)

    def _gather(self, picks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for shard, start, end in self.conversations[picks]:
            end = min(end, start + self.block_size + 1)  # prepare cut or dropped longer ones; never more than a window
            tokens = self.tokens[shard][start:end].astype(np.int64)
            targets = np.where(self.roles[shard][start + 1 : end] & TARGET, tokens[1:], -1)
            rows.append((tokens[:-1], targets))
        return self._pad(rows)

    def _pad(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) rows of different lengths -> (R, L) tensors, right-padded (x with 0, y with -1)."""
        width = min(self.block_size, -(-max(len(x) for x, _ in rows) // self.PAD_MULTIPLE) * self.PAD_MULTIPLE)
        x = torch.zeros(len(rows), width, dtype=torch.long)  # (B, L)
        y = torch.full((len(rows), width), -1, dtype=torch.long)  # (B, L)
        for i, (tokens, targets) in enumerate(rows):
            x[i, : len(tokens)] = torch.from_numpy(tokens)
            y[i, : len(targets)] = torch.from_numpy(targets)
        return x, y

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state(self) -> dict[str, int]:
        """The exact position, to store in a checkpoint."""
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()` (on a loader built with the same files and seed)."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.order = self._order()


class PairLoader(ChatLoader):
    """Yields (x, y) batches of preference pairs (data/prepare.py --preference) for DPO (gptlite.train.preference):
    2 * batch_size rows, the batch's chosen answers each after its prompt, then its rejected answers in the same
    order, y the next tokens on the answer's tokens and -1 elsewhere, padded as ChatLoader pads (so the two rows of a
    pair are compared over the same prompt). A pair's tokens lie one after the other in the shard: the prompt (its
    first token START), the chosen answer, the rejected answer (each answer's first token ANSWER). Order, ranks and
    state are ChatLoader's, with pairs for conversations."""

    kind = "pairs"

    def _items(self) -> np.ndarray:
        """(N, 5) int64: each pair's shard, start, chosen answer's start, rejected answer's start, end."""
        pairs = []
        for s, roles in enumerate(self.roles):
            for a, b in spans(roles):
                answers = a + np.flatnonzero(roles[a:b] & ANSWER)
                if len(answers) != 2 or answers[0] == a:
                    raise ValueError(
                        f"{roles_path(self.files[s])}: the pair at token {a} has {len(answers)} answer(s) marked after "
                        "its prompt, not 2; prepare the data again with data/prepare.py --preference"
                    )
                pairs.append((s, a, int(answers[0]), int(answers[1]), b))
        return np.array(pairs, dtype=np.int64).reshape(-1, 5)

    def _gather(self, picks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = []
        rejected = []
        for shard, start, first, second, end in self.conversations[picks]:
            tokens = self.tokens[shard]
            roles = self.roles[shard]
            for rows, (a, b) in ((chosen, (first, second)), (rejected, (second, end))):
                seq = np.concatenate([tokens[start:first], tokens[a:b]]).astype(np.int64)[: self.block_size + 1]
                target = np.concatenate([roles[start:first], roles[a:b]])[: self.block_size + 1] & TARGET
                rows.append((seq[:-1], np.where(target[1:], seq[1:], -1)))
        return self._pad(chosen + rejected)  # (2B, L) each


def spans(roles: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every conversation in a shard's roles: from one START byte to the next, or the end."""
    starts = np.flatnonzero(roles & START)
    ends = np.append(starts[1:], len(roles))
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True) if b - a >= 2]


def is_preference_data(files: list[Path]) -> bool:
    """Whether shards hold preference pairs: their folder's manifest.json says data/prepare.py --preference."""
    try:
        return bool(files) and bool(json.loads((files[0].parent / "manifest.json").read_text()).get("preference"))
    except (OSError, ValueError, AttributeError):
        return False


def is_chat_data(files: list[Path]) -> bool:
    """Whether shards come with roles files (a chat preparation). Roles files beside some shards only, or none
    in a folder whose manifest.json says --chat, are an error: training on every token would be silently wrong."""
    with_roles = [roles_path(p).is_file() for p in files]
    try:
        chat = bool(files) and bool(json.loads((files[0].parent / "manifest.json").read_text()).get("chat"))
    except (OSError, ValueError, AttributeError):  # no manifest (shards from elsewhere), or not one of ours
        chat = False
    if (chat or any(with_roles)) and not all(with_roles):
        missing = roles_path(files[with_roles.index(False)])
        raise FileNotFoundError(
            f"{missing} is missing: {files[0].parent} holds conversations (data/prepare.py --chat) "
            "whose roles files mark what to train on; prepare the data again"
        )
    return bool(files) and all(with_roles)


Loader = ShardLoader | ChatLoader | PairLoader  # what training and its evaluation read batches from


def make_loaders(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> tuple[Loader, Loader]:
    """Train and val loaders over cfg.data_dir's shards (see make_loader); every problem of the data is found before
    the first step. The train split must hold a batch for every rank; the val split is scored as it is, however
    small (see make_val_loader)."""
    train = make_loader(cfg, "train", cfg.seed, rank, world_size)
    return train, make_val_loader(cfg, rank, world_size)


def make_val_loader(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> Loader:
    """The loader of cfg.data_dir's val split, taking batch_size items at a time, which needs only an item for
    every rank: a split smaller than the batches an evaluation takes is scored whole, each window, conversation or
    pair once, the last batch short (see evaluation_batches), as `python -m gptlite.evaluate` scores it."""
    loader = make_loader(dataclasses.replace(cfg, batch_size=1), "val", cfg.seed + 1, rank, world_size)
    loader.batch_size = cfg.batch_size
    return loader


def evaluation_batches(loader: Loader, iters: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches an evaluation scores, from the split's start: the first `iters` global batches, the same at every
    evaluation, or every window, conversation or pair once (the last batch short) when iters=0 or the split holds
    fewer items than those batches would take."""
    loader.restore({"epoch": 0, "shard": 0, "index": 0})
    if iters == 0 or loader.size < iters * loader.batch_size * loader.world_size:
        return loader.every_window()
    return (loader.next_batch() for _ in range(iters))


def make_loader(cfg: TrainConfig, split: str, seed: int, rank: int = 0, world_size: int = 1) -> Loader:
    """A loader over one split of cfg.data_dir's shards, after checking that no shard is empty, every token id is
    below vocab_size and the split holds at least one global batch. Rank r reads the r-th slice of every global
    batch, so ranks never read the same window. Shards with roles files (data/prepare.py --chat) give whole
    conversations whose assistant tokens alone are targets, and a preparation of preference pairs (--preference)
    gives pairs (PairLoader)."""
    if cfg.init_from:
        fix = f"prepare the data with {cfg.init_from}'s tokenizer, whose ids the pretrained model knows"
    elif cfg.resume:  # the run's own vocab_size, which a resume cannot change (gptlite.train.run_config)
        fix = (
            f"on --resume vocab_size={cfg.model.vocab_size} is the run's own (its checkpoint's, or run.json's, in "
            f"{cfg.out_dir}): resume on the data it trained on, or train on this data in another --out_dir"
        )
    else:
        fix = ""
    files = find_shards(cfg.data_dir, split)
    for path in files:
        if len(read_shard(path)) == 0:
            raise ValueError(f"shard {path} holds no tokens; delete it or prepare the data again")
    check_vocab(files, cfg.model.vocab_size, fix=fix)
    loader = ChatLoader if is_chat_data(files) else ShardLoader
    if is_preference_data(files):
        loader = PairLoader
    try:
        return loader(files, cfg.batch_size, cfg.model.block_size, seed=seed, rank=rank, world_size=world_size)
    except ValueError as e:
        raise ValueError(f"{split} split: {e}") from None


def data_identity(files: list[Path], kind: str) -> dict[str, str]:
    """What a run trains on, for its checkpoints: the train split's kind (text, conversations or pairs) and a
    fingerprint of its shards (their names and sizes, and the manifest data/prepare.py wrote beside them), so that
    a resume can tell another data folder from the run's own, wherever it lies now."""
    sha = hashlib.sha256()
    for path in files:
        sha.update(f"{path.name} {path.stat().st_size}\n".encode())
    manifest = files[0].parent / "manifest.json" if files else None
    if manifest is not None and manifest.is_file():
        sha.update(manifest.read_bytes())
    return {"kind": kind, "data": sha.hexdigest()[:16]}
