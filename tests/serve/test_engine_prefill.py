"""The engine's prefill of arrivals together and its prefix cache: prompts of different lengths prefilled in padded
batches, prompts that begin with cached blocks, and the n copies of one prompt each decode exactly what they
would alone; the cache's blocks are matched by their tokens and dropped least recently used first."""

from __future__ import annotations

import pytest
import torch

from gptlite.inference.sampling import GenerationOptions
from gptlite.serve.engine import Engine, Params, padded_runs
from gptlite.serve.prefix import BLOCK, PrefixCache
from gptlite.serve.rows import RowCache
from gptlite.tokenizer import CharTokenizer
from tests.conftest import VARIANTS, tiny_config, tiny_model
from tests.helpers.serving import CHARS
from tests.serve.test_engine import Collect, greedy

pytestmark = pytest.mark.device  # the engine runs where the model is

SYSTEM = "You are a careful assistant; answer in one short line. " * 2  # 110 characters: three whole blocks
CONTEXT = 192
GREEDY = GenerationOptions(temperature=0)


def recording(engine: Engine) -> list[tuple[int, int]]:
    """The (rows, tokens) of every step the engine runs from now on."""
    shapes = []
    step = engine.step

    def record(model, idx, cache, last=None):
        shapes.append(tuple(idx.shape))
        return step(model, idx, cache, last)

    engine.step = record
    return shapes


@pytest.mark.parametrize("name", ["learned", "rope", "gqa-untied"])
def test_arrivals_prefilled_together_decode_their_greedy_text(name):
    """Seven prompts of 1 to 40 tokens arrive together: they are prefilled in padded batches of similar lengths
    (fewer prefills than prompts, one of them padded), and each decodes the text it would alone."""
    model = tiny_model(block_size=CONTEXT, **VARIANTS[name])
    tokenizer = CharTokenizer(CHARS)
    prompts = ["a", "xy", "ROMEO:", "JULIET:", "The quick brown fox", "The quick brown dogs", "To be or not " * 3]
    engine = Engine(model, tokenizer, max_batch=8)
    collect = Collect(engine, tokenizer, prompts, Params(max_tokens=12, options=GREEDY))  # all queued before a step
    shapes = recording(engine)
    engine.start()
    try:
        texts = collect.wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 12) for p in prompts]
    prefills = shapes[: shapes.index((len(prompts), 1))]  # the steps before the first decode of all seven
    assert sum(rows for rows, _ in prefills) == len(prompts) and len(prefills) < len(prompts)
    assert (2, 7) in prefills  # "ROMEO:" (6 tokens) padded to "JULIET:" (7)


def test_padded_runs_keep_the_padding_small_and_every_row_within_its_slots():
    assert padded_runs([1, 2, 6, 7, 19, 20, 39], [0] * 7, 64) == [
        range(0, 1),
        range(1, 2),
        range(2, 4),
        range(4, 6),
        range(6, 7),
    ]
    assert padded_runs([10, 10, 10], [0, 0, 0], 64) == [range(0, 3)]
    assert padded_runs([10, 10, 10], [0, 50, 0], 55) == [range(0, 1), range(1, 2), range(2, 3)]  # 50 + 10 > 55


def test_prefix_cached_requests_decode_what_uncached_ones_do():
    """Requests one after another under one system prompt: the later ones take its whole blocks from the cache,
    and each decodes the greedy text it decodes without a cache."""
    model = tiny_model(block_size=CONTEXT, pos_emb="rope")
    tokenizer = CharTokenizer(CHARS)
    prompts = [SYSTEM + "Hi", SYSTEM + "Hello there", SYSTEM + "Hi"]
    engine = Engine(model, tokenizer, max_batch=4, prefix_cache_mb=1).start()
    try:
        texts = [Collect(engine, tokenizer, [p], Params(max_tokens=16, options=GREEDY)).wait()[0] for p in prompts]
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 16) for p in prompts]
    assert engine.prefix.hits == 2 * 3 * BLOCK  # the second and third: SYSTEM's three blocks each


@pytest.mark.parametrize("name", ["learned", "qwen3"])
def test_a_chats_next_turn_reuses_the_previous_turns_completion(name):
    """The next turn's prompt is the previous prompt and its completion and more: it reuses every whole block of
    them (the completion's blocks were kept when its request ended), and decodes what it would uncached."""
    model = tiny_model(block_size=CONTEXT, **VARIANTS[name])
    tokenizer = CharTokenizer(CHARS)
    first = SYSTEM + "Q: tell me"
    engine = Engine(model, tokenizer, max_batch=2, prefix_cache_mb=1).start()
    try:
        (reply,) = Collect(engine, tokenizer, [first], Params(max_tokens=40, options=GREEDY)).wait()
        second = first + reply + "\nQ: more"
        (again,) = Collect(engine, tokenizer, [second], Params(max_tokens=16, options=GREEDY)).wait()
    finally:
        engine.close()
    assert again == greedy(model, tokenizer, second, 16)
    fed = len(first) + len(reply) - 1  # the last token of the reply was sampled, never fed
    assert engine.prefix.hits == fed // BLOCK * BLOCK


def test_the_n_copies_of_a_prompt_share_one_prefill_and_sample_as_they_would_alone():
    model = tiny_model(block_size=CONTEXT)
    tokenizer = CharTokenizer(CHARS)
    seeds = [1, 2, 1, 3]
    params = [Params(max_tokens=12, options=GenerationOptions(temperature=1.0, seed=s)) for s in seeds]
    engine = Engine(model, tokenizer, max_batch=4)
    collect = Collect(engine, tokenizer, ["ROMEO:"] * 4, params)
    shapes = recording(engine)
    engine.start()
    try:
        together = collect.wait()
        alone = [Collect(engine, tokenizer, ["ROMEO:"], [p]).wait()[0] for p in params]
    finally:
        engine.close()
    assert together == alone and together[0] == together[2] and together[0] != together[1]
    assert shapes[:2] == [(1, 6), (4, 1)]  # one prefill of the six tokens for all four, then they decode


def kv_rows(config, rows: int, length: int) -> RowCache:
    """A RowCache whose slots hold distinct values (row r, slot s: r * 1000 + s in every layer and channel)."""
    cache = RowCache(config, rows, length, torch.float32, "cpu")
    for buffer in cache.k + cache.v:
        buffer.copy_(torch.arange(rows)[:, None, None, None] * 1000 + torch.arange(length)[None, None, :, None])
    return cache


def test_blocks_are_found_by_every_token_before_them():
    """A block is reused only after exactly the tokens that preceded it; restoring writes what was stored."""
    config = tiny_config(block_size=4 * BLOCK)
    source = kv_rows(config, 2, 4 * BLOCK)
    prefix = PrefixCache(budget=2**20)
    tokens = list(range(3 * BLOCK))
    prefix.store(source, 1, tokens)
    assert len(prefix.match(tokens, len(tokens))) == 3
    assert len(prefix.match(tokens, len(tokens) - 1)) == 2  # at least one token is left to run
    assert len(prefix.match(tokens[:BLOCK] + [7] + tokens[BLOCK + 1 :], 3 * BLOCK)) == 1
    assert prefix.match([9] + tokens[1:], 3 * BLOCK) == []
    target = RowCache(config, 1, 4 * BLOCK, torch.float32, "cpu")
    assert prefix.restore(target, 0, prefix.match(tokens, 2 * BLOCK)) == 2 * BLOCK
    for mine, theirs in zip(target.k + target.v, source.k + source.v, strict=True):
        assert torch.equal(mine[0, :, : 2 * BLOCK], theirs[1, :, : 2 * BLOCK])
        assert not mine[0, :, 2 * BLOCK :].any()


def test_the_least_recently_used_blocks_go_first_and_the_budget_holds():
    config = tiny_config(block_size=4 * BLOCK)
    source = kv_rows(config, 1, 4 * BLOCK)
    block_bytes = source.read_span(0, 0, BLOCK).numel() * 4
    prefix = PrefixCache(budget=4 * block_bytes)
    a, b, c = ([i] * (2 * BLOCK) for i in (1, 2, 3))  # three prompts of two blocks each
    prefix.store(source, 0, a)
    prefix.store(source, 0, b)
    assert prefix.bytes == 4 * block_bytes
    prefix.match(a, 2 * BLOCK)  # a is now more recent than b
    prefix.store(source, 0, c)  # past the budget: b's blocks go, deepest first
    assert prefix.bytes <= prefix.budget
    assert len(prefix.match(a, 2 * BLOCK)) == 2 and len(prefix.match(c, 2 * BLOCK)) == 2
    assert prefix.match(b, 2 * BLOCK) == []
    small = PrefixCache(budget=block_bytes - 1)  # too small for one block: keeps none
    small.store(source, 0, a)
    assert small.bytes == 0 and small.match(a, 2 * BLOCK) == []


CONV = dict(n_layer=3, layer_types="conv,full_attention,conv", pos_emb="rope", norm="rmsnorm")  # LFM2's layout


def test_rows_with_a_conv_state_join_leave_and_move_and_each_decodes_its_greedy_text():
    """A model with conv layers (a state per row besides keys and values) on three rows: seven prompts arrive together
    and are prefilled in right-padded batches, requests of different lengths leave and the last rows move into the
    freed ones, queued ones join; each decodes the text it would alone."""
    model = tiny_model(block_size=CONTEXT, **CONV)
    tokenizer = CharTokenizer(CHARS)
    prompts = ["ROMEO:", "JULIET:", "a", "xy", "The quick brown fox", "The quick brown dogs", "To be or not " * 3]
    lengths = [9, 4, 12, 3, 7, 10, 5]
    params = [Params(max_tokens=n, options=GREEDY) for n in lengths]
    engine = Engine(model, tokenizer, max_batch=3)
    collect = Collect(engine, tokenizer, prompts, params)
    shapes = recording(engine)
    engine.start()
    try:
        texts = collect.wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert (2, 7) in shapes  # "ROMEO:" (6 tokens) padded on the right to "JULIET:" (7)


def test_a_stateful_model_reuses_prefixes_only_where_a_snapshot_of_its_state_ends_them():
    """A conv model's state is valid only at the end of what a row was fed: a prompt of exactly two blocks leaves a
    snapshot at its end, which a later prompt beginning with it reuses; a prompt ending mid-block leaves none, so a
    prompt that shares its first blocks only recomputes them. Each decodes its uncached greedy text."""
    model = tiny_model(block_size=CONTEXT, **CONV)
    tokenizer = CharTokenizer(CHARS)
    two_blocks = SYSTEM[: 2 * BLOCK]
    other = "Whether tis nobler in the mind to suffer " * 3  # three whole blocks and more, shared by the last two
    prompts = [two_blocks, two_blocks + " and more", other + "Hi", other + "Hello"]
    params = Params(max_tokens=8, options=GREEDY)
    engine = Engine(model, tokenizer, max_batch=2, prefix_cache_mb=1).start()
    try:
        texts = []
        hits = []
        for prompt in prompts:
            texts.append(Collect(engine, tokenizer, [prompt], params).wait()[0])
            hits.append(engine.prefix.hits)
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 8) for p in prompts]
    # the second reuses the first's two blocks; other + "Hi" and its 8 tokens end mid-block: no snapshot, no reuse
    assert hits == [0, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK]
