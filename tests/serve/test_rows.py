"""The server's rows through the CPU's one-call block step (gptlite.inference.cpu.blocks' NativeBlock, each row at its
own slot: RowCache.decode_buffers): requests of different lengths, joining and leaving the batch, decode the model's
own greedy tokens, float32 and int8, and so do requests that take their beginning from the prefix cache."""

from __future__ import annotations

import pytest
import torch

import gptlite.inference.cpu.decode
from gptlite.inference.cpu import native
from gptlite.inference.sampling import GenerationOptions
from gptlite.serve.engine import Engine, Params
from gptlite.serve.prefix import BLOCK
from gptlite.serve.rows import RowCache
from gptlite.tokenizer import CharTokenizer
from tests.conftest import VARIANTS, tiny_config, tiny_model
from tests.helpers.serving import CHARS
from tests.inference.cpu.test_native import BLOCK_MODELS
from tests.serve.test_engine import PROMPTS, Collect

GREEDY = GenerationOptions(temperature=0)
LENGTHS = [14, 5, 9, 12, 3, 17, 7, 10, 2]  # each of PROMPTS' completions a length of its own: rows leave in turn
GEMMA3 = "gemma 3: norms on both sides, unit offset, geglu, a window of 4"
MODELS = {
    "gpt2": VARIANTS["gpt2"],
    "llama": VARIANTS["llama"],
    "qwen3": VARIANTS["qwen3"],
    "gemma3": BLOCK_MODELS[GEMMA3],
}
SYSTEM = "You are a careful assistant; answer in one short line. " * 2  # 110 characters: three whole blocks


@pytest.fixture
def block_steps(monkeypatch) -> list[tuple[int, bool]]:
    """Every block of a tiny model through the compiled block step, float32 or int8 (its layers are smaller than
    those measured, which would keep PyTorch's kernels), and the (rows, each at its own slot) of each step it runs."""
    assert native.load(), native._state.get("why")
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    monkeypatch.setenv("GPTLITE_QUANT_KERNEL", "native")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    steps = []
    block_step = native.block_step

    def recorded(x, weights, cache, options, angles=None):
        steps.append((x.size(0), cache.slots is not None))
        return block_step(x, weights, cache, options, angles)

    monkeypatch.setattr(native, "block_step", recorded)
    return steps


def model_greedy(model, tokenizer, prompt: str, n: int) -> str:
    """The model's own greedy text: its whole PyTorch forward over the tokens so far at every step, without a cache
    or any kernel of gptlite's."""
    ids = tokenizer.encode(prompt)
    start = len(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))  # (1, T, V)
            ids.append(int(logits[0, -1, : tokenizer.vocab_size].argmax()))
    return tokenizer.decode(ids[start:])


def served(engine: Engine, tokenizer, prompts: list[str], lengths: list[int]) -> list[str]:
    """The texts the engine (started) decodes greedily for `prompts`, each up to its own length, all at once."""
    params = [Params(max_tokens=n, options=GREEDY) for n in lengths]
    return Collect(engine, tokenizer, prompts, params).wait()


@pytest.mark.filterwarnings("ignore:gptlite. int8 decodes this model slower than float32")  # a tiny model's
@pytest.mark.parametrize("mode", ["float32", "int8"])
@pytest.mark.parametrize("name", list(MODELS))
def test_rows_of_different_lengths_decode_the_models_greedy_tokens_through_the_block_step(block_steps, name, mode):
    """Nine requests of different lengths on four rows: they join as rows free up and leave at their own lengths, the
    steps of one row and of several running through the block step each row at its own slot, and each decodes the
    greedy text of the model's own forward (Gemma 3's: within its sliding window on its local layer)."""
    model = tiny_model(**MODELS[name]).cpu()
    if mode == "int8":
        model = model.quantize("int8")
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=4).start()
    try:
        texts = served(engine, tokenizer, PROMPTS, LENGTHS)
    finally:
        engine.close()
    assert texts == [model_greedy(model, tokenizer, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    rows = {rows for rows, own in block_steps if own}
    assert 1 in rows and 4 in rows  # one row alone at the end, and the whole batch


def test_requests_that_take_a_cached_prefix_decode_the_models_greedy_tokens_through_the_block_step(block_steps):
    """Requests one after another under one system prompt, then two together: the later ones take its blocks from
    the prefix cache, decode through the block step, and each gives the greedy text of the model's own forward."""
    model = tiny_model(block_size=192, **VARIANTS["qwen3"]).cpu()
    tokenizer = CharTokenizer(CHARS)
    prompts = [SYSTEM + "Hi", SYSTEM + "Hello there"]
    engine = Engine(model, tokenizer, max_batch=4, prefix_cache_mb=1).start()
    try:
        texts = [served(engine, tokenizer, [p], [12])[0] for p in prompts]
        texts += served(engine, tokenizer, [SYSTEM + "Hey", SYSTEM + "Hi!"], [10, 14])
    finally:
        engine.close()
    want = [model_greedy(model, tokenizer, p, 12) for p in prompts]
    want += [model_greedy(model, tokenizer, SYSTEM + "Hey", 10), model_greedy(model, tokenizer, SYSTEM + "Hi!", 14)]
    assert texts == want
    assert engine.prefix.hits == 3 * 3 * BLOCK  # the second, third and fourth: SYSTEM's three blocks each
    assert (2, True) in block_steps


def test_a_step_of_one_token_per_row_offers_each_rows_slot():
    """After a `prepare` of one token per row, the cache offers the one-call step its rows' buffers (views of its
    own, written in place), the last slot, the span and each row's slot; a prompt's `prepare` offers none."""
    config = tiny_config()
    cache = RowCache(config, 5, 40, torch.float32, "cpu")
    cache.prepare(1, [7, 30, 0], 1)
    keys, values, slot, span, visible, slots = cache.decode_buffers(1)
    assert keys.shape == (3, *cache.k[1].shape[1:]) and keys.is_contiguous() and visible is None
    assert keys.data_ptr() == cache.k[1][1].data_ptr() and values.data_ptr() == cache.v[1][1].data_ptr()
    assert (slot, span) == (30, 31) and slots.tolist() == [7, 30, 0]
    cache.prepare(0, [3, 0], 4)
    assert cache.decode_slot is None
