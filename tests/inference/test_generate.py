"""Generation against a full recompute, and the sampling controls against their definitions."""

import json
import sys
import warnings
import weakref

import pytest
import torch

from gptlite import GPT
from gptlite.inference.generate import PAD, SLIDE_KEEP, generate, generate_tokens, generate_with
from gptlite.inference.kvcache import new_cache
from gptlite.inference.sampling import BEAMS, SAMPLING, SERVING, GenerationOptions, apply_penalties, sample_next
from tests.conftest import DEVICE, randint, tensor, tiny_config, tiny_model

pytestmark = [pytest.mark.device, pytest.mark.filterwarnings("ignore:the context reached block_size")]
cpu_only = pytest.mark.skipif(
    DEVICE != "cpu", reason="the CPU's compiled-step machinery (frozen weights, compiled shapes)"
)


def greedy_by_full_recompute(model, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The reference: every step runs the whole window through model.forward, no cache. The window
    follows the documented policy: when it holds block_size tokens, it keeps the newest SLIDE_KEEP part."""
    block = model.config.block_size
    keep = int(block * SLIDE_KEEP)
    out = idx.clone()
    start = max(0, idx.size(1) - block)
    for _ in range(max_new_tokens):
        if out.size(1) - start > block:
            start = out.size(1) - keep
        logits, _ = model(out[:, start:])
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


@pytest.mark.parametrize("prompt_len,new", [(1, 10), (7, 20), (5, 70)])
def test_cached_greedy_equals_full_recompute(variant, prompt_len, new):
    """(5, 70) crosses block_size=32 twice, exercising the sliding window."""
    model = tiny_model(**variant)
    torch.manual_seed(1)
    idx = randint(97, (3, prompt_len))
    cached = model.generate(idx, new, temperature=0)
    assert cached.shape == (3, prompt_len + new)
    assert torch.equal(cached[:, :prompt_len], idx)
    assert torch.equal(cached, greedy_by_full_recompute(model, idx, new))


def test_prompt_longer_than_block_size(variant):
    model = tiny_model(**variant)
    idx = randint(97, (2, 45))
    out = generate(model, idx, 12, temperature=0)
    assert out.shape == (2, 57)
    assert torch.equal(out, greedy_by_full_recompute(model, idx, 12))


def test_ragged_batch_equals_each_prompt_alone(variant):
    """Left-padded rows of different lengths decode as each prompt would alone, through two slides of
    the window (the rows reach block_size=32 at different steps)."""
    model = tiny_model(**variant)
    torch.manual_seed(2)
    prompts = [randint(97, (n,)).tolist() for n in (3, 11, 1, 30)]
    batched = generate(model, prompts, 60, temperature=0)
    for prompt, row in zip(prompts, batched, strict=True):
        alone = greedy_by_full_recompute(model, tensor([prompt]), 60)[0].tolist()
        assert row == alone


def test_ragged_rows_match_their_unpadded_logits(variant):
    """Padding is invisible: a padded row's prefill logits equal the unpadded prompt's forward pass."""
    model = tiny_model(**variant)
    prompts = [[5, 6, 7, 8, 9], [1, 2]]
    cache = new_cache(model, 2)
    cache.start(torch.tensor([0, 3]))
    cache.prepare(5)
    logits = model.step(tensor([[5, 6, 7, 8, 9], [0, 0, 0, 1, 2]]), cache)
    for row, prompt in zip(logits, prompts, strict=True):
        torch.testing.assert_close(row, model(tensor([prompt]))[0][0, -1], atol=1e-5, rtol=1e-5)


def test_cache_chunked_prefill_equals_forward(variant):
    """Feeding a sequence in chunks through the cache gives the logits of one full forward pass."""
    model = tiny_model(**variant)
    idx = randint(97, (2, 20))
    full, _ = model(idx)
    cache = new_cache(model, 2)
    for a, b in [(0, 6), (6, 7), (7, 15), (15, 20)]:
        cache.prepare(b - a)
        logits = model.step(idx[:, a:b], cache)
        torch.testing.assert_close(logits, full[:, b - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos_emb", ["sinusoidal", "rope"])
def test_extend_context_runs_positions_past_block_size(pos_emb):
    """extend_context keeps every token: the same as a full recompute by a twin with a longer block_size
    (these positions have no weights, so the twin loads the same state_dict)."""
    model = tiny_model(pos_emb=pos_emb)
    with torch.no_grad():  # weights of a trained model's size, so that what the model sees changes its text
        for p in model.parameters():
            p.mul_(8)
    twin = GPT(tiny_config(pos_emb=pos_emb, block_size=128)).to(DEVICE).eval()
    twin.load_state_dict(model.state_dict())
    idx = randint(97, (2, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing slides, so nothing to say
        out = model.generate(idx, 50, temperature=0, extend_context=True)
    assert torch.equal(out, greedy_by_full_recompute(twin, idx, 50))
    slid = model.generate(idx, 50, temperature=0)
    assert torch.equal(out[:, :32], slid[:, :32]) and not torch.equal(out, slid)  # the sliding window forgets


def test_learned_positions_refuse_extend_context():
    with pytest.raises(
        ValueError, match="extend_context=True needs pos_emb='sinusoidal' or 'rope'.*stop at block_size=32"
    ):
        tiny_model(pos_emb="learned").generate(tensor([[0, 0, 0]]), 5, extend_context=True)


def test_sliding_window_is_announced_once():
    model = tiny_model()
    with pytest.warns(UserWarning, match="context reached block_size=32.*keeps its newest 24 tokens") as record:
        model.generate(tensor([[0] * 5]), 80, temperature=0)  # slides three times
    assert sum("block_size" in str(w.message) for w in record) == 1


def test_static_span_decode_equals_dynamic():
    """The fixed-shape decode the compiled path uses (attending over every slot under a mask) computes
    the same logits as attending over the written slots only."""
    model = tiny_model()
    idx = randint(97, (2, 12))
    logits = []
    for full_span in (False, True):
        cache = new_cache(model, 2, 16)
        cache.start(torch.tensor([0, 4]))
        cache.prepare(8)
        model.step(idx[:, :8], cache)
        steps = []
        for t in range(8, 12):
            cache.prepare(1, full_span=full_span)
            steps.append(model.step(idx[:, t : t + 1], cache))
        logits.append(torch.stack(steps))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.fixture
def compile_backend(monkeypatch):
    """compile=True as the test device runs it, with fresh compiled-step state. On the CPU through dynamo's
    graph capture (fullgraph: no breaks) without code generation, which keeps the suite fast (inductor's C++
    kernels are exercised by the benchmark); on CUDA for real: inductor's Triton kernels replayed as CUDA graphs."""
    module = sys.modules["gptlite.inference.kvcache"]
    torch._dynamo.reset()  # each test compiles for new models: start below dynamo's recompile limit (8 per function)
    compiled = {}
    if DEVICE == "cpu":
        compiled["cpu"] = torch.compile(module.decode_step, backend="eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(module, "_compiled", compiled)
    monkeypatch.setattr(module, "_frozen_versions", weakref.WeakKeyDictionary())
    monkeypatch.setattr(module, "_compiled_shapes", weakref.WeakKeyDictionary())
    monkeypatch.setattr(module, "_static_caches", weakref.WeakKeyDictionary())


def test_compiled_decode_step_traces_as_one_graph_and_matches_eager(compile_backend, variant):
    model = tiny_model(**variant)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert generate(model, prompts, 12, temperature=0, compile=True) == generate(model, prompts, 12, temperature=0)


def test_compiled_generation_across_slides_equals_full_recompute(compile_backend, monkeypatch):
    """Past block_size the slid windows' prefills go through the compiled step too (one fixed length),
    and the text stays that of the reference; on the CPU each new shape is compiled once with CPU_COMPILE."""
    module = sys.modules["gptlite.inference.kvcache"]
    model = tiny_model()  # block_size 32: windows slide every 8 tokens
    module.compiled_decode_step(model)  # makes the device's compiled step, which the next line wraps
    calls = []
    step = module._compiled[DEVICE.split(":")[0]]
    monkeypatch.setitem(
        module._compiled,
        DEVICE.split(":")[0],
        lambda m, token, cache: calls.append(token.shape) or step(m, token, cache),
    )
    idx = randint(97, (2, 5))
    out = model.generate(idx, 60, temperature=0, compile=True)
    assert torch.equal(out, greedy_by_full_recompute(model, idx, 60))
    keep = int(32 * SLIDE_KEEP)
    assert calls.count((2, keep)) >= 3  # the slides' prefills
    if DEVICE == "cpu":
        assert module._compiled_shapes[model] == {((2, 1), 32, torch.float32), ((2, keep), 32, torch.float32)}


@cpu_only
def test_compiled_generations_of_similar_lengths_share_one_compiled_shape(compile_backend):
    module = sys.modules["gptlite.inference.kvcache"]
    model = tiny_model(block_size=256, pos_emb="sinusoidal")
    for prompt_len, new in ((3, 10), (9, 40), (30, 30)):  # cache lengths 12, 48 and 59 all round up to 64
        idx = randint(97, (1, prompt_len))
        assert torch.equal(
            model.generate(idx, new, temperature=0, compile=True), model.generate(idx, new, temperature=0)
        )
    assert module._compiled_shapes[model] == {((1, 1), 64, torch.float32)}
    model.generate(torch.zeros(1, 30, dtype=torch.long), 60, temperature=0, compile=True, extend_context=True)
    assert ((1, 1), 128, torch.float32) in module._compiled_shapes[model]


def test_compiled_generations_reuse_one_static_cache_unless_running_together(compile_backend):
    """CUDA graphs stay valid only while the cache buffers they write keep their addresses."""
    module = sys.modules["gptlite.inference.kvcache"]
    model = tiny_model()
    idx = randint(97, (2, 5))
    expected = torch.stack(list(generate_tokens(model, idx, 10, temperature=0)), 1)
    for _ in range(2):
        assert torch.equal(torch.stack(list(generate_tokens(model, idx, 10, temperature=0, compile=True)), 1), expected)
    address = module._static_caches[model].k[0].data_ptr()
    a, b = (generate_tokens(model, idx, 10, temperature=0, compile=True) for _ in range(2))
    interleaved = [(next(a), next(b)) for _ in range(10)]  # b cannot share a's cache while a runs
    assert torch.equal(torch.stack([x for x, _ in interleaved], 1), expected)
    assert torch.equal(torch.stack([y for _, y in interleaved], 1), expected)
    a.close()
    b.close()
    list(generate_tokens(model, idx, 10, temperature=0, compile=True))
    assert module._static_caches[model].k[0].data_ptr() == address


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_frozen_weights_on_cpu_refuse_to_go_stale(compile_backend, dtype):
    model = tiny_model().to(dtype)
    idx = randint(97, (1, 4))
    model.generate(idx, 3, compile=True)
    model.generate(idx, 3, compile=True)  # unchanged weights: fine
    with torch.no_grad():
        model.blocks[0].ffn.fc.weight.mul_(2)
    assert model.generate(idx, 3, compile=False).shape == (1, 7)
    with pytest.raises(ValueError, match="weights changed in place after compile=True froze them"):
        model.generate(idx, 3, compile=True)
    module = sys.modules["gptlite.inference.kvcache"]
    step = module._compiled["cpu"]
    module.reset_compiled()  # forgets the frozen weights, so the next call compiles again
    module._compiled["cpu"] = step
    assert torch.equal(model.generate(idx, 3, temperature=0, compile=True), model.generate(idx, 3, temperature=0))


def test_samples_share_the_prompt_prefill():
    model = tiny_model()
    idx = randint(97, (2, 6))
    greedy = model.generate(idx, 10, temperature=0, num_samples=3)
    assert greedy.shape == (6, 16)
    assert torch.equal(greedy, model.generate(idx, 10, temperature=0).repeat_interleave(3, dim=0))
    sampled = model.generate(idx, 10, temperature=1.0, num_samples=3, seed=0)
    assert torch.equal(sampled[:, :6], idx.repeat_interleave(3, dim=0))
    assert len({tuple(row) for row in sampled[:3, 6:].tolist()}) == 3  # three different continuations


def test_top_k_1_equals_greedy():
    model = tiny_model()
    idx = randint(97, (2, 4))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    sampled = model.generate(idx, 15, temperature=1.0, top_k=1, generator=g)
    assert torch.equal(sampled, model.generate(idx, 15, temperature=0))


def test_same_seed_same_samples_and_different_seed_differs():
    model = tiny_model()
    idx = randint(97, (2, 4))
    runs = [
        model.generate(idx, 50, temperature=1.0, generator=torch.Generator(device=DEVICE).manual_seed(s))
        for s in (7, 7, 8)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert torch.equal(model.generate(idx, 50, temperature=1.0, seed=7), runs[0])  # seed= is the same generator


def test_generate_tokens_streams_one_token_per_row():
    model = tiny_model()
    idx = randint(97, (3, 4))
    tokens = list(generate_tokens(model, idx, 5, temperature=0))
    assert len(tokens) == 5 and all(t.shape == (3,) for t in tokens)
    assert torch.equal(torch.stack(tokens, 1), model.generate(idx, 5, temperature=0)[:, 4:])
    assert list(generate_tokens(model, idx, 0)) == []


def test_stop_tokens_end_each_row():
    model = tiny_model()
    idx = randint(97, (2, 4))
    free = model.generate(idx, 30, temperature=0)
    stop = free[0, 4 + 5].item()  # row 0's sixth new token
    out = model.generate(idx, 30, temperature=0, stop_tokens=[stop])
    row0 = free[0, 4:].tolist()
    cut = row0.index(stop) + 1  # the stop token is kept, then the row holds PAD
    assert out[0, 4 : 4 + cut].tolist() == row0[:cut]
    assert (out[0, 4 + cut :] == PAD).all()
    row1 = free[1, 4:].tolist()
    if stop not in row1:  # row 1 never stops, so it runs to max_new_tokens
        assert out.shape == (2, 34) and out[1, 4:].tolist() == row1
    # when every row has stopped, generation ends early; lists come back without PAD
    lists = generate(model, [idx[0].tolist()], 30, temperature=0, stop_tokens=[stop])
    assert lists == [idx[0].tolist() + row0[:cut]]


def test_untouched_distribution_with_top_p_1_and_no_top_k():
    """top_p=1 and top_k=None sample from softmax(logits / T) exactly: same draws as torch.multinomial."""
    logits = torch.randn(4, 50, device=DEVICE)
    draw = torch.Generator(device=DEVICE).manual_seed(3)
    expected = torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=draw).squeeze(-1)
    for kw in ({}, {"top_p": 1.0}, {"top_k": None, "top_p": None}, {"top_k": 50}):
        got = sample_next(logits, 0.7, generator=torch.Generator(device=DEVICE).manual_seed(3), **kw)
        assert torch.equal(got, expected), kw


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen_k, seen_p = set(), set()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for _ in range(400):
        seen_k.add(sample_next(logits, 1.0, top_k=2, generator=g).item())
        # top_p=0.8: 0.5 + 0.3 reaches 0.8, so exactly tokens 0 and 1 are kept
        seen_p.add(sample_next(logits, 1.0, top_p=0.8, generator=g).item())
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}
    # a tiny top_p always keeps the most likely token, one that is 0 in float32 too
    assert sample_next(logits, 1.0, top_p=1e-6, generator=g).item() == 0
    assert sample_next(logits, 1.0, top_p=1e-300, generator=g).item() == 0


def test_a_vanishing_temperature_is_greedy_not_nan():
    """logits / 1e-30 pass float32's range (+inf - +inf is NaN in softmax) and 1e-300 is 0 in float32: both were a
    RuntimeError from torch.multinomial; the shifted logits sample the argmax, with -inf entries kept out."""
    logits = torch.randn(3, 50, device=DEVICE) * 10
    logits[0, 20:] = float("-inf")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for temperature in (1e-30, 1e-40, 1e-300):
        assert torch.equal(sample_next(logits, temperature, generator=g), logits.argmax(dim=-1)), temperature


def test_penalties_match_their_formulas():
    logits = tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = tensor([[True, True, False, False]])
    counts = tensor([[0.0, 2.0, 1.0, 0.0]])
    assert torch.equal(apply_penalties(logits, seen, counts), logits)
    assert torch.equal(apply_penalties(logits, seen, counts, repetition_penalty=2.0), tensor([[1.0, -2.0, 0.5, 3.0]]))
    assert torch.equal(apply_penalties(logits, seen, counts, frequency_penalty=0.5), tensor([[2.0, -2.0, 0.0, 3.0]]))
    assert torch.equal(apply_penalties(logits, seen, counts, presence_penalty=0.5), tensor([[2.0, -1.5, 0.0, 3.0]]))


def test_penalties_in_generation_equal_a_full_recompute_that_applies_them():
    model = tiny_model()
    idx = randint(97, (2, 3))
    out = idx.clone()
    for _ in range(20):
        logits = model(out)[0][:, -1]
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, out, True)  # prompt and output
        counts = torch.zeros_like(logits).scatter_add(1, out[:, 3:], torch.ones_like(out[:, 3:], dtype=torch.float))
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.5, logits * 1.5), logits) - 0.3 * counts
        logits = logits - 0.2 * (counts > 0)  # the presence penalty
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    assert torch.equal(model.generate(idx, 20, temperature=0, **penalties), out)
    # a huge frequency penalty never repeats a token
    assert all(
        len(set(row)) == 40 for row in model.generate(idx, 40, temperature=0, frequency_penalty=1e4)[:, 3:].tolist()
    )


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"temperature": float("nan")}, TypeError, "temperature=nan must be a finite number"),
        ({"temperature": float("inf")}, TypeError, "temperature=inf must be a finite number"),
        ({"temperature": "0.5"}, TypeError, "temperature='0.5' must be a finite number"),
        ({"top_p": float("nan")}, TypeError, "top_p=nan must be a finite number, or None"),
        ({"top_k": 2.5}, ValueError, "top_k=2.5 must be an integer >= 1"),
        ({"repetition_penalty": float("nan")}, TypeError, "repetition_penalty=nan must be a finite number"),
        ({"frequency_penalty": None}, TypeError, "frequency_penalty=None must be a finite number"),
        ({"presence_penalty": float("nan")}, TypeError, "presence_penalty=nan must be a finite number"),
    ],
)
def test_non_finite_or_non_numeric_sampling_values_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        tiny_model().generate(tensor([[1, 2]]), 3, **kwargs)


def test_sampling_argument_errors():
    logits = torch.randn(1, 10, device=DEVICE)
    with pytest.raises(ValueError, match="temperature=-1"):
        sample_next(logits, -1)
    with pytest.raises(ValueError, match="top_k=0"):
        sample_next(logits, 1.0, top_k=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        sample_next(logits, 1.0, top_p=1.5)


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        (torch.zeros(1, 0, dtype=torch.long), {}, r"prompt must have shape \(B, T\) with T >= 1, got \(1, 0\)"),
        ([], {}, "no prompts given"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 97]], {}, r"prompt 0 has token id 97 outside the vocabulary \[0, 97\)"),
        ([[1]], {"max_new_tokens": -1}, "max_new_tokens=-1 must be an integer >= 0"),
        ([[1]], {"max_new_tokens": 2.5}, "max_new_tokens=2.5 must be an integer >= 0"),
        ([[1]], {"num_samples": 0}, "num_samples=0 must be >= 1"),
        ([[1]], {"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
        ([[1]], {"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
        ([[1]], {"seed": 1, "generator": torch.Generator()}, "give seed or generator, not both"),
        (
            [[1]],
            {"num_beams": 2, "length_penalty": 2.0},
            r"^length_penalty, num_beams configure beam search, and generate_tokens samples a token a step; leave "
            r"them out, or call generate\(\.\.\., num_beams=N\)$",
        ),
    ],
)
def test_generate_argument_errors(prompts, kwargs, message):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        next(generate_tokens(tiny_model(), prompts, **kwargs))


def test_the_generation_options_are_every_layers_keywords():
    """GenerationOptions is the one list of generation's options: GPT.generate, gptlite.inference.generate's keyword
    forms and their typed forms take the same fields, and give the same tokens; a name that is no field is a
    TypeError."""
    model = tiny_model()
    prompts = [[1, 2, 3], [4]]
    keywords = {"temperature": 0.8, "top_k": 20, "num_samples": 2, "seed": 3, "frequency_penalty": 0.5}
    keywords["presence_penalty"] = 0.25
    options = GenerationOptions(**keywords)
    expected = generate_with(model, prompts, 6, options)
    assert model.generate(prompts, 6, **keywords) == expected == generate(model, prompts, 6, **keywords)
    positional = model.generate(
        prompts, 6, 0.8, 20, num_samples=2, seed=3, frequency_penalty=0.5, presence_penalty=0.25
    )
    assert positional == expected
    beams = GenerationOptions(num_beams=3, num_return_sequences=2, length_penalty=0.5)
    assert model.generate(prompts, 6, num_beams=3, num_return_sequences=2, length_penalty=0.5) == generate_with(
        model, prompts, 6, beams
    )
    assert options.unused_by(BEAMS) == ["frequency_penalty", "num_samples", "presence_penalty", "seed"]
    assert beams.unused_by(SAMPLING) == ["length_penalty", "num_beams", "num_return_sequences"]
    # the server's engine: one row per request, its sampling but no beams (gptlite.serve.engine.Params refuses them)
    assert options.unused_by(SERVING) == ["num_samples"]
    assert beams.unused_by(SERVING) == ["length_penalty", "num_beams", "num_return_sequences"]
    assert beams.greedy() == GenerationOptions(temperature=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_n'"):
        model.generate(prompts, 6, top_n=5)


@cpu_only
def test_cpu_decoding_runs_large_linears_on_slabs_or_packed_weights(variant, monkeypatch, tmp_path):
    """Eager float32 decoding on the CPU runs large layers through the kernel measured fastest, here (as measured
    on the AMD AVX2 machine) SlabLinear for one row and PackedLinear (oneDNN on prepacked weights) for a batch:
    the same logits as the model's own layers, every other module and tensor shared, made again once the weights
    or the thread count change, and the model itself for other dtypes and for small layers."""
    import gptlite.inference.cpu.decode
    from gptlite.inference.cpu.decode import packed_for_cpu
    from gptlite.inference.cpu.linears import PackedLinear, SlabLinear

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # this test's own choices file
    monkeypatch.delenv("GPTLITE_CPU_LINEAR", raising=False)
    times = {
        1: {"slab": 1.0, "packed": 2.0, "linear": 3.0, "native": 4.0},
        8: {"packed": 1.0, "linear": 2.0, "native": 3.0},
    }
    monkeypatch.setattr(gptlite.inference.cpu.decode, "measure", lambda shape, rows: times[rows])
    model = tiny_model(**variant).eval()
    small = packed_for_cpu(model, 1)  # 32-wide layers: overhead-bound, left as they are
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(any(m is linear for m in small.modules()) for linear in linears)

    model = tiny_model(**variant).eval()  # another model: the view kept for this one holds the layers as they were
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def made_each_a(view, kind) -> bool:
        # every linear layer of the model became a kernel of `kind` in the view (whose paths differ where a one-call
        # step wraps a module: NativeAttention holds the attention as `attn`)
        made = [m for m in view.modules() if isinstance(m, kind)]
        return len(made) == len(linears) and not any(isinstance(m, torch.nn.Linear) for m in view.modules())

    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    view = packed_for_cpu(model, 1)
    assert view is not model and packed_for_cpu(model, 1) is view  # kept for the next call
    assert linears and made_each_a(view, SlabLinear)
    assert {id(m.weight) for m in view.modules() if isinstance(m, SlabLinear)} == {id(m.weight) for m in linears}
    assert view.pos_emb is model.pos_emb  # shared as it is
    norm = view.blocks[0].attn_norm  # a copy called directly, on the model's own parameters
    assert norm is not model.blocks[0].attn_norm and norm.weight is model.blocks[0].attn_norm.weight
    assert isinstance(norm, type(model.blocks[0].attn_norm)) and type(norm).__call__ is type(norm).forward
    assert isinstance(view.blocks[0].ffn.drop, torch.nn.Identity)  # dropout in eval mode, without the call
    assert {id(p) for p in view.parameters()} <= {id(p) for p in model.parameters()}  # the model's own
    idx, one = randint(97, (3, 9)), randint(97, (1, 1))  # a prompt (F.linear) and one decoded row (the slabs)
    batch = packed_for_cpu(model, 4)
    assert made_each_a(batch, PackedLinear)
    with torch.no_grad():
        for x in (idx, one):
            torch.testing.assert_close(view(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batch(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)
        model.lm_head.weight.mul_(2)  # tied to the embedding: a changed weight
        remade = packed_for_cpu(model, 1)
        assert remade is not view
        torch.testing.assert_close(remade(one)[0], model(one)[0], rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert packed_for_cpu(model, 1) is not remade  # one slab per thread: a new thread count, new slabs
    finally:
        torch.set_num_threads(threads)
    assert packed_for_cpu(model.to(torch.bfloat16), 1) is model


def test_the_cpu_view_calls_its_modules_directly_but_runs_every_hook(monkeypatch, tmp_path):
    """The view's own modules skip nn.Module's call, but a module with a hook, or a model under hooks registered for
    every module, keeps it: the hooks run, and registering or removing one makes the view again. The layers are
    forced onto F.linear, so that no block becomes a NativeBlock, whatever this CPU's measurement would choose."""
    import gptlite.inference.cpu.decode
    from gptlite.inference.cpu.decode import packed_for_cpu
    from gptlite.inference.cpu.linears import PlainLinear
    from gptlite.model.network import Block

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing read from, or kept in, the user's choices file
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "linear")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    model = tiny_model().eval()
    idx = randint(97, (2, 5))
    with torch.no_grad():
        want = model(idx)[0]
        direct = packed_for_cpu(model, 1)
        assert isinstance(direct.blocks[0].ffn.fc, PlainLinear)
        assert type(direct.blocks[0]).__call__ is Block.forward
        torch.testing.assert_close(direct(idx)[0], want)
        calls = []
        handle = model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(type(module)))
        hooked = packed_for_cpu(model, 1)
        assert hooked is not direct and type(hooked.blocks[1]).__call__ is Block.forward
        torch.testing.assert_close(hooked(idx)[0], want)
        assert calls == [Block]  # the view's copy of the block, with the model's hook
        handle.remove()
        assert type(packed_for_cpu(model, 1).blocks[0]).__call__ is Block.forward
        seen = set()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, a, o: seen.add(type(module)))
        try:
            everywhere = packed_for_cpu(model, 1)
            everywhere(idx)
        finally:
            handle.remove()
        assert Block in seen and type(everywhere).__call__ is torch.nn.Module.__call__


def test_each_cpu_kernel_computes_the_linear_and_is_measured(monkeypatch):
    """Every kernel the CPU path may choose equals nn.Linear at one row and at a batch, and `measure` times each
    one (the slabs at one row only)."""
    from gptlite.inference.cpu.decode import KERNELS, available_kernels, make_kernel, measure

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    for rows in (1, 8):
        for name in KERNELS:
            x = torch.randn(rows, 64)
            with torch.no_grad():
                torch.testing.assert_close(make_kernel(name, linear, rows)(x), linear(x), rtol=1e-5, atol=1e-5)
    assert available_kernels((96, 64), 1) == KERNELS  # CI's machine has a compiler: the compiled kernel is built
    assert set(measure((96, 64), 1)) == set(KERNELS) and set(measure((96, 64), 8)) == {"packed", "linear", "native"}
    assert set(measure((96, 40), 8)) == {"packed", "linear"}  # 40 inputs: not a width the compiled kernel takes
    assert all(0 < t < 1 for t in measure((96, 64), 1).values())


def test_the_kernel_choice_is_measured_once_per_machine_and_shape_and_kept(monkeypatch, tmp_path):
    import gptlite.inference.cpu.choices as choices
    import gptlite.inference.cpu.decode as cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPTLITE_CPU_LINEAR", raising=False)
    monkeypatch.setattr(choices, "cpu_times", lambda: None)  # the load unknown: every measurement is kept
    measured = []

    def fake_measure(shape, rows):
        measured.append((shape, rows))
        # 768x3072: the compiled kernel is the default, beaten by F.linear; 50x50 (not its width): slabs the default
        return (
            {"slab": 3.0, "packed": 2.0, "linear": 1.0, "native": 1.5}
            if shape[0] > 100
            else {"slab": 1.0, "packed": 0.95}
        )

    monkeypatch.setattr(cpu, "measure", fake_measure)
    assert cpu.choose_kernel((768, 3072), 1) == "linear"
    assert cpu.choose_kernel((50, 50), 1) == "slab"
    assert cpu.choose_kernel((768, 3072), 1) == "linear" and len(measured) == 2  # kept in this process
    table = json.loads(choices.choices_file().read_text())
    among = f"among {', '.join(cpu.available_kernels((768, 3072), 1))}"  # the candidates are part of the key
    assert table == {
        choices.machine_key(): {
            f"768x3072, 1 rows {among}": "linear",
            "50x50, 1 rows among slab, packed, linear": "slab",
        }
    }
    choices._choices.clear()  # a new process reads the file: nothing is measured again
    assert cpu.choose_kernel((768, 3072), 1) == "linear" and len(measured) == 2
    choices._choices.clear()
    choices.choices_file().write_text("[not, a table")  # damaged: measured again, and the file rewritten whole
    assert cpu.choose_kernel((768, 3072), 1) == "linear" and len(measured) == 3
    assert json.loads(choices.choices_file().read_text()) == {
        choices.machine_key(): {f"768x3072, 1 rows {among}": "linear"}
    }
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "slab")  # forced: slabs for one row, F.linear for a batch
    assert cpu.choose_kernel((768, 3072), 1) == "slab" and cpu.choose_kernel((768, 3072), 8) == "linear"
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match=r"GPTLITE_CPU_LINEAR='fast': choose one of slab, packed, linear, native, or"):
        cpu.choose_kernel((768, 3072), 1)
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "native")
    assert cpu.choose_kernel((768, 3072), 8) == "native"
    with pytest.raises(ValueError, match=r"GPTLITE_CPU_LINEAR=native: .* cannot run a 768x3000 layer here \(its input"):
        cpu.choose_kernel((768, 3000), 1)
    choices._choices.clear()


def test_a_choice_measured_while_other_work_ran_holds_for_this_process_only(monkeypatch, tmp_path):
    """While a measurement ran, other processes kept the CPU busy (the machine's busy time grew, this process's own
    did not): its choice serves this process, is not written to the choices file, and the next process measures
    again; measured on an otherwise idle machine, the choice is kept."""
    import gptlite.inference.cpu.choices as choices
    import gptlite.inference.cpu.decode as cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPTLITE_CPU_LINEAR", raising=False)
    monkeypatch.setattr(choices, "_choices", {})
    monkeypatch.setattr(choices, "_unkept", {})
    seconds = {"machine": 100.0, "own": 10.0}  # busy CPU time since boot: the whole machine's, this process's
    monkeypatch.setattr(choices, "cpu_times", lambda: (seconds["machine"], seconds["own"]))
    measured = []

    def measure(shape, rows, others: float):
        measured.append(shape)
        seconds["machine"] += 1.0 + others  # this process's second of measuring, and what the others took
        seconds["own"] += 1.0
        return {"slab": 3.0, "packed": 2.0, "linear": 1.0, "native": 4.0}

    monkeypatch.setattr(cpu, "measure", lambda shape, rows: measure(shape, rows, others=1e6))
    assert cpu.choose_kernel((768, 3072), 1) == "linear" and cpu.choose_kernel((768, 3072), 1) == "linear"
    assert len(measured) == 1 and not choices.choices_file().exists()  # this process's choice, not kept
    choices._choices.clear()
    choices._unkept.clear()  # the next process: measures again, on an idle machine, and keeps the choice
    monkeypatch.setattr(cpu, "measure", lambda shape, rows: measure(shape, rows, others=0.0))
    assert cpu.choose_kernel((768, 3072), 1) == "linear" and len(measured) == 2
    assert list(json.loads(choices.choices_file().read_text())[choices.machine_key()].values()) == ["linear"]
    assert choices.cores_busy_elsewhere(None, (1.0, 1.0), 1.0) is None  # no /proc/stat: kept, as before


@pytest.mark.parametrize("in_features, out_features, bias", [(32, 97, True), (33, 7, False), (16, 16, True)])
def test_slab_linear_equals_the_linear_for_any_slab_count(in_features, out_features, bias):
    """Wide layers (transposed slabs) and the others (row slabs), with the last slab padded where the slab
    count does not divide the output width: one row through the slabs, several through F.linear."""
    from gptlite.inference.cpu.linears import SlabLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    for parts in (1, 2, 3, 4):
        slab = SlabLinear(linear, parts)
        assert slab.transposed == (out_features > in_features)
        for shape in ((1, 1, in_features), (1, in_features), (2, 3, in_features)):
            x = torch.randn(shape)
            torch.testing.assert_close(slab(x), linear(x), rtol=1e-5, atol=1e-5)
