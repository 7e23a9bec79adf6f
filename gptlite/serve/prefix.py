"""PrefixCache: the keys and values of token blocks the server computed recently, so that a prompt beginning with
them (a shared system prompt, a chat's earlier turns, the n copies of one prompt) skips their prefill.

Prompts are cut into blocks of `BLOCK` tokens. The blocks form a tree: a block's key is its own tokens, looked up
among the children of the block before it, so a block is found only after exactly the tokens that preceded it when
it was computed; matching compares token ids, never hashes, and a cached prefix holds exactly what a prefill of
the same tokens would write. Each block keeps every layer's keys and values for its tokens, copied out of the
engine's row after a prefill (the prompt's whole blocks) and when a request ends (its prompt and completion).

A model whose layers keep a state besides keys and values (a convolution's last inputs: GPTConfig.layer_types) has a
state that is valid only at the end of what a row was fed, never in the middle of a prefill. So a block keeps a
snapshot of the row's state where it ends exactly where a row's state was when stored (a prompt or a finished
request whose length is a whole number of blocks), and such a model reuses only runs of blocks that end at a block
with a snapshot: the exact boundaries, with no recomputation.

Memory is bounded by `budget` bytes: past it, the least recently used blocks are dropped. A lookup touches its
path from the deepest block to the root, and an insertion likewise, so a block is always used more recently than
any of its descendants and the least recently used block is a leaf: eviction never strands a subtree.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gptlite.serve.rows import RowCache

BLOCK = 32  # tokens per block: a prompt reuses its longest run of whole cached blocks


@dataclass(eq=False)  # compared and hashed by identity: a node of the tree
class Block:
    """BLOCK tokens' keys and values (2 * attention layers, KV, BLOCK, D), under the block that preceded them, and the
    other layers' state at its end where one was stored (RowCache.read_states)."""

    tokens: tuple[int, ...]
    kv: torch.Tensor | None
    parent: Block | None
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    state: list[torch.Tensor] | None = None


class PrefixCache:
    """Cached blocks of keys and values, found by the tokens before them; at most `budget` bytes of them."""

    def __init__(self, budget: int, stateful: bool = False):
        self.budget = budget
        self.stateful = stateful  # the model keeps states: reuse ends only at a block with a snapshot
        self.root = Block((), None, None)
        self.used: OrderedDict[Block, int] = OrderedDict()  # every cached block -> its bytes, least recent first
        self.bytes = 0
        self.hits = 0  # tokens restored from the cache so far

    def match(self, tokens: list[int], limit: int) -> list[Block]:
        """The longest run of cached blocks that begins `tokens` and covers at most `limit` of them; marked used."""
        node = self.root
        path = []
        for start in range(0, limit - BLOCK + 1, BLOCK):
            node = node.children.get(tuple(tokens[start : start + BLOCK]))
            if node is None:
                break
            path.append(node)
        if self.stateful:
            while path and path[-1].state is None:
                path.pop()
        self.touch(path)
        return path

    def restore(self, cache: RowCache, row: int, blocks: list[Block]) -> int:
        """Write the blocks' keys and values into slots 0.. of the cache's row; the number of tokens written."""
        if blocks:
            cache.write_span(row, 0, [block.kv for block in blocks], [t for block in blocks for t in block.tokens])
        if blocks and self.stateful:
            cache.write_states(row, blocks[-1].state)
        self.hits += len(blocks) * BLOCK
        return len(blocks) * BLOCK

    def store(self, cache: RowCache, row: int, tokens: list[int]) -> None:
        """Keep the whole blocks of `tokens`, whose keys and values are in slots 0..len(tokens)-1 of the cache's
        row (and whose state, if the model keeps one, is at its end), copying out those not cached yet; then drop the
        least recently used blocks past the budget."""
        node = self.root
        path = []
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            key = tuple(tokens[start : start + BLOCK])
            child = node.children.get(key)
            if child is None:
                kv = cache.read_span(row, start, start + BLOCK)  # (2 * n_layer, KV, BLOCK, D)
                size = kv.numel() * kv.element_size()
                if size > self.budget:
                    break
                child = Block(key, kv, node)
                node.children[key] = child
                self.used[child] = size
                self.bytes += size
            path.append(child)
            node = child
        ends_there = len(path) * BLOCK == len(tokens)  # the row's state is at the end of the last block
        if self.stateful and path and ends_there and path[-1].state is None:
            self.snapshot(path[-1], cache.read_states(row))
        self.touch(path)
        self.evict(keep=set(path))

    def snapshot(self, block: Block, state: list[torch.Tensor]) -> None:
        """Keep a row's state at the end of `block` with it (its bytes count against the budget)."""
        block.state = state
        size = sum(t.numel() * t.element_size() for t in state)
        self.used[block] += size
        self.bytes += size

    def touch(self, path: list[Block]) -> None:
        """Mark a root-to-block path used, deepest first, so every block is newer than its descendants."""
        for block in reversed(path):
            self.used.move_to_end(block)

    def evict(self, keep: set[Block]) -> None:
        """Drop least recently used blocks (leaves, see the module docstring) until the budget holds; never one in
        `keep` (the path just stored)."""
        for block in list(self.used):
            if self.bytes <= self.budget:
                return
            if block in keep or block not in self.used:  # (dropped already, with an older ancestor)
                continue
            self.drop(block)

    def drop(self, block: Block) -> None:
        """Forget a block and everything cached after it."""
        for child in list(block.children.values()):
            self.drop(child)
        assert block.parent is not None, "the root is never cached"
        del block.parent.children[block.tokens]
        self.bytes -= self.used.pop(block)
