"""The continuous-batching engine without HTTP: greedy text equal to GPT.generate's for requests that join and
leave a running batch, rows freed and compacted mid-flight, stop tokens, the tokenizer's vocabulary, compile."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from gptlite.inference.generate import generate_with
from gptlite.inference.kvcache import AttentionCache, KVCache, kv_buffers
from gptlite.inference.sampling import GenerationOptions
from gptlite.serve.engine import Engine, Job, Params
from gptlite.serve.rows import RowCache
from gptlite.tokenizer import CharTokenizer
from tests.conftest import DEVICE, VARIANTS, tiny_config, tiny_model
from tests.helpers.serving import CHARS

pytestmark = pytest.mark.device  # the engine runs where the model is

GREEDY = GenerationOptions(temperature=0)
PROMPTS = ["ROMEO:", "a", "The quick brown", "To be or not to", "x", "Hello, world", "JULIET: O", "12345", "zz"]


class Collect:
    """Jobs' pieces, gathered; `wait` until every job has finished."""

    def __init__(self, engine: Engine, tokenizer, prompts: list[str], params: Params | list[Params], on_piece=None):
        self.pieces: list[list] = [[] for _ in prompts]
        self.left = len(prompts)
        self.done = threading.Event()
        self.on_piece = on_piece
        each = params if isinstance(params, list) else [params] * len(prompts)
        self.jobs = [Job(tokenizer.encode(p), each[i], self.emitter(i)) for i, p in enumerate(prompts)]
        for job in self.jobs:
            engine.submit(job)

    def emitter(self, i: int):
        def emit(piece) -> None:
            self.pieces[i].append(piece)
            if self.on_piece:
                self.on_piece(i, piece)
            if piece.finish_reason:
                self.left -= 1
                if self.left == 0:
                    self.done.set()

        return emit

    def wait(self, seconds: float = 60) -> list[str]:
        assert self.done.wait(seconds), "the engine did not finish"
        return ["".join(p.text for p in pieces) for pieces in self.pieces]

    def run(self, engine: Engine) -> list[str]:
        """Start the engine (the jobs are queued already), wait for every job, and close it; the texts."""
        engine.start()
        try:
            return self.wait()
        finally:
            engine.close()


def greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt)
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    return tokenizer.decode(model.generate(idx, n, temperature=0)[0, len(ids) :].tolist())


@pytest.mark.parametrize("name", ["learned", "rope", "gpt2", "llama"])
def test_requests_joining_a_running_batch_decode_their_greedy_text(name):
    """Nine requests on four rows: they queue, join the batch as rows free up, and each decodes what it would alone."""
    model, tokenizer = tiny_model(**VARIANTS[name]), CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=4).start()
    try:
        texts = Collect(engine, tokenizer, PROMPTS, Params(max_tokens=15, options=GREEDY)).wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 15) for p in PROMPTS]
    assert engine.active == 0


def test_a_cancelled_row_is_freed_and_the_others_go_on_unchanged():
    """Cancelling the first of three running rows moves the last into its place; every survivor's text is intact."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=3).start()
    prompts = ["ROMEO:", "Hello", "x"]

    def cancel_first(i, piece):
        if i == 0 and piece.tokens == 3:
            collect.jobs[0].cancel()

    try:
        collect = Collect(engine, tokenizer, prompts, Params(max_tokens=20, options=GREEDY), cancel_first)
        collect.left -= 1  # the cancelled job never finishes
        texts = collect.wait()
    finally:
        engine.close()
    assert len(collect.pieces[0]) == 3 and collect.pieces[0][-1].finish_reason is None
    assert texts[1:] == [greedy(model, tokenizer, p, 20) for p in prompts[1:]]


def test_a_stop_token_ends_the_request_without_its_text():
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    whole = greedy(model, tokenizer, "ROMEO:", 10)
    engine = Engine(model, tokenizer, max_batch=2).start()
    try:
        collect = Collect(
            engine,
            tokenizer,
            ["ROMEO:"],
            Params(10, GenerationOptions(temperature=0, stop_tokens=tuple(tokenizer.encode(whole[4])))),
        )
        (text,) = collect.wait()
    finally:
        engine.close()
    assert text == whole[: whole.index(whole[4])] and collect.pieces[0][-1].finish_reason == "stop"


def test_rows_decode_with_generations_own_options_as_generate_does():
    """A row samples with a gptlite.inference.sampling.GenerationOptions, the options generate takes: greedy with
    presence and frequency penalties, it gives generate's tokens; an option the engine does not apply is refused in
    Params."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    prompts = ["ROMEO:", "a", "Hello"]
    options = GenerationOptions(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    engine = Engine(model, tokenizer, max_batch=2).start()
    try:
        texts = Collect(engine, tokenizer, prompts, Params(max_tokens=16, options=options)).wait()
    finally:
        engine.close()
    ids = [tokenizer.encode(p) for p in prompts]
    out = generate_with(model, ids, 16, replace(options, vocab_limit=tokenizer.vocab_size))
    assert texts == [tokenizer.decode(row[len(prompt) :]) for row, prompt in zip(out, ids, strict=True)]
    assert texts != [greedy(model, tokenizer, p, 16) for p in prompts]  # the penalties changed the text
    with pytest.raises(ValueError, match="the server's engine does not apply num_samples, repetition_penalty "):
        Params(max_tokens=5, options=GenerationOptions(repetition_penalty=1.2, num_samples=2))


def test_ids_past_the_tokenizers_vocabulary_are_never_sampled():
    """A model whose vocabulary is padded past its tokenizer's (97 ids, 60 characters): every sample decodes."""
    model, tokenizer = tiny_model(), CharTokenizer(CHARS[:60])
    engine = Engine(model, tokenizer, max_batch=4).start()
    try:
        collect = Collect(
            engine, tokenizer, ["ABC"] * 4, Params(max_tokens=25, options=GenerationOptions(temperature=2.0, seed=1))
        )
        texts = collect.wait()
    finally:
        engine.close()
    assert all(pieces[-1].finish_reason == "length" for pieces in collect.pieces)
    assert all(len(t) == 25 and set(t) <= set(CHARS[:60]) for t in texts)


def test_both_caches_are_attention_caches_with_buffers_from_one_function():
    """sample.py's KVCache and the server's RowCache play one role for the model: both are the AttentionCache
    its hints name, and both take their buffers, n_kv_head heads each, from kv_buffers."""
    config = tiny_config(n_kv_head=2)  # 4 query heads of width 8, 2 key/value heads
    keys, values = kv_buffers(config, 3, 16, torch.float32, "cpu")
    assert len(keys) == len(values) == config.n_layer
    assert all(b.shape == (3, 2, 16, 8) for b in keys + values)
    caches = (
        KVCache(config, 3, 16, torch.float32, torch.device("cpu")),
        RowCache(config, rows=3, max_len=16, dtype=torch.float32, device="cpu"),
    )
    for cache in caches:
        assert isinstance(cache, AttentionCache)
        assert [b.shape for b in cache.k + cache.v] == [b.shape for b in keys + values]
    assert not isinstance(SimpleNamespace(update=None, mask=None), AttentionCache)  # no positions


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_steps_decode_the_same_greedy_text():
    """Three graphs compile (prefill, one row, several rows; dynamic sizes past 1), then serve every request."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    prompts = [p for p in PROMPTS if len(p) > 1][:5]  # a one-token prompt would compile a graph of its own
    engine = Engine(model, tokenizer, max_batch=4, compile=True).start()
    try:
        # three compiles come first: on a 2-core CPU they took 45-50 s alone, and past 60 s in the whole suite
        texts = Collect(engine, tokenizer, prompts, Params(max_tokens=10, options=GREEDY)).wait(600)
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 10) for p in prompts]


@pytest.mark.parametrize("mode, way", [("int8", ""), ("int8", "bfloat16"), ("int4", "float32"), ("int4", "bfloat16")])
def test_a_quantized_model_decodes_its_own_greedy_text_in_every_row(mode, way, monkeypatch):
    """Continuous batching on quantized weights: each row of a batch decodes what the model does alone, with the
    kernels' float32 or bfloat16 activations (GPTLITE_QUANT_KERNEL; "": what the layers choose themselves)."""
    if way:
        monkeypatch.setenv("GPTLITE_QUANT_KERNEL", way)
    if mode == "int4" and DEVICE != "cpu":
        pytest.skip("int4's kernel is a CPU one")  # the GPU's run of the suite; CI's CPU runs every case
    model = tiny_model().quantize(mode)
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=3).start()
    try:
        texts = Collect(engine, tokenizer, PROMPTS[:4], Params(max_tokens=12, options=GREEDY)).wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 12) for p in PROMPTS[:4]]


@pytest.mark.parametrize("fastest_alone", ["bfloat16", "int8_dot"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_models_rows_decode_what_it_does_alone_whichever_way_each_row_count_measured(
    mode, fastest_alone, monkeypatch, tmp_path
):
    """Every quantized layer measured, one row's fastest way made up as bfloat16 activations
    (tests.inference.test_quantize.MADE_UP_TIMES) or int8 ones (INT8_DOT_TIMES) and a batch's as float32 ones: the ways
    compete only at the model's activation dtype, and a batch multiplies what one row chose to (int8 activations
    there), so a request decodes the same greedy text in a batch of four as alone."""
    from tests.inference.test_quantize import INT8_DOT_TIMES, MADE_UP_TIMES, made_up_measurements

    if DEVICE != "cpu":
        pytest.skip("the CPU's kernel choices")
    made_up_measurements(monkeypatch, tmp_path, INT8_DOT_TIMES if fastest_alone == "int8_dot" else MADE_UP_TIMES)
    model = tiny_model().quantize(mode)
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=4).start()
    try:
        texts = Collect(engine, tokenizer, PROMPTS[:4], Params(max_tokens=12, options=GREEDY)).wait()
    finally:
        engine.close()
    assert texts == [greedy(model, tokenizer, p, 12) for p in PROMPTS[:4]]
    layers = [m for m in model.modules() if hasattr(m, "way")]
    assert layers and all(m.way(1) != "bfloat16" for m in layers)  # chosen when the engine was made
    assert fastest_alone != "int8_dot" or all(m.way(1) == m.way(8) == "int8_dot" for m in layers)


def test_odd_seeds_never_stop_the_engine():
    """Seeds past torch's range are taken modulo 2**64, as torch takes -1: none stops the engine, and a seed and
    itself plus 2**64 sample alike."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=4).start()
    seeds = [2**64, 0, -(2**63) - 1, 2**64 - 1, 5, 5 + 2**64]
    try:
        collect = Collect(
            engine,
            tokenizer,
            ["Hi"] * len(seeds),
            [Params(max_tokens=8, options=GenerationOptions(seed=s)) for s in seeds],
        )
        texts = collect.wait()
    finally:
        engine.close()
    assert all(pieces[-1].finish_reason == "length" for pieces in collect.pieces)
    assert texts[0] == texts[1] and texts[4] == texts[5] and texts[4] != texts[0]
    assert engine.failure is None


def test_a_request_that_fails_to_start_ends_alone_and_the_next_one_runs(monkeypatch):
    """An error while a request is admitted (here making its stop strings' stream) ends that request with the
    error; the request beside it decodes."""
    import gptlite.serve.engine as engine_module

    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    real = engine_module.TextStream

    def stream(tokenizer, stop):
        if "boom" in stop:
            raise RuntimeError("no stream for you")
        return real(tokenizer, stop)

    monkeypatch.setattr(engine_module, "TextStream", stream)
    engine = Engine(model, tokenizer, max_batch=2)
    params = [Params(max_tokens=5, stop=("boom",)), Params(max_tokens=5, options=GREEDY)]
    collect = Collect(engine, tokenizer, ["Hi", "Ho"], params)
    texts = collect.run(engine)
    (piece,) = collect.pieces[0]
    assert piece.finish_reason == "error" and piece.error == "RuntimeError: no stream for you"
    assert texts[1] == greedy(model, tokenizer, "Ho", 5) and engine.failure is None


def test_a_fault_between_steps_ends_the_running_requests_and_the_engine_goes_on(monkeypatch):
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=2)
    retire, calls = engine.retire, []

    def fails_once(done):
        calls.append(1)
        if len(calls) == 4:  # the second step's first
            raise RuntimeError("the bookkeeping broke")
        return retire(done)

    monkeypatch.setattr(engine, "retire", fails_once)
    broken = Collect(engine, tokenizer, ["Hi", "Ho"], Params(max_tokens=20, options=GREEDY))
    engine.start()
    try:
        broken.wait()
        after = Collect(engine, tokenizer, ["ROMEO:"], Params(max_tokens=10, options=GREEDY)).wait()
    finally:
        engine.close()
    assert [pieces[-1].error for pieces in broken.pieces] == ["RuntimeError: the bookkeeping broke"] * 2
    assert after == [greedy(model, tokenizer, "ROMEO:", 10)] and engine.active == 0 and engine.failure is None


class Fatal(BaseException):
    """What no step catches: a fault of the loop itself."""


def test_when_the_loop_stops_every_request_ends_with_why_at_once(monkeypatch):
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=1)
    turn = engine.turn

    def dies_on_the_third_step():
        if len(running.pieces[0]) == 2:
            raise Fatal("the loop broke")
        return turn()

    monkeypatch.setattr(engine, "turn", dies_on_the_third_step)
    running = Collect(engine, tokenizer, ["Hi"], Params(max_tokens=20, options=GREEDY))
    queued = Collect(engine, tokenizer, ["Ho"], Params(max_tokens=20, options=GREEDY))
    engine.start()
    running.wait(), queued.wait()
    assert engine.stopped.wait(5) and "the server's engine stopped (Fatal: the loop broke at " in engine.failure
    assert running.pieces[0][-1].error == queued.pieces[0][-1].error == engine.failure
    later = Collect(engine, tokenizer, ["Hi"], Params(max_tokens=5))  # answered at once, on this thread
    assert later.done.is_set() and later.pieces[0][-1].error == engine.failure
    engine.close()


def test_a_steps_pieces_are_emitted_once_every_row_has_its_token():
    """When a row's piece reaches its job, every row of that step has already sampled its token (so a server can hand
    the step's pieces over at once)."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=3)
    seen = []  # at each piece: (its job, pieces so far, every running row's generated count)

    def on_piece(i, piece):
        seen.append((i, piece.tokens, [row.generated for row in engine.rows]))

    collect = Collect(engine, tokenizer, ["Hi", "Ho", "Hu"], Params(max_tokens=6, options=GREEDY), on_piece)
    texts = collect.run(engine)
    assert texts == [greedy(model, tokenizer, p, 6) for p in ["Hi", "Ho", "Hu"]]
    decoded = [(tokens, generated) for _, tokens, generated in seen if len(generated) == 3]
    assert decoded and all(generated == [tokens] * 3 for tokens, generated in decoded)


def test_a_row_that_fails_mid_step_leaves_the_pieces_before_it_emitted(monkeypatch):
    """An error while one row's piece is made ends the step's requests; the rows before it in that step still get
    their piece first, so no request that finished in that step is left without its last piece."""
    model = tiny_model()
    tokenizer = CharTokenizer(CHARS)
    engine = Engine(model, tokenizer, max_batch=2)
    piece = engine.piece

    def fails_on_the_second_row(row, token, logprobs):
        if row is engine.rows[1] and row.generated == 3:
            raise RuntimeError("no piece for you")
        return piece(row, token, logprobs)

    monkeypatch.setattr(engine, "piece", fails_on_the_second_row)
    params = [Params(max_tokens=3, options=GREEDY), Params(max_tokens=10, options=GREEDY)]
    collect = Collect(engine, tokenizer, ["Hi", "Ho"], params)
    texts = collect.run(engine)
    assert collect.pieces[0][-1].finish_reason == "length" and texts[0] == greedy(model, tokenizer, "Hi", 3)
    assert collect.pieces[1][-1].error == "RuntimeError: no piece for you" and engine.failure is None
