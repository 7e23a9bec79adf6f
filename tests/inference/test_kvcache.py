"""The KV cache's decode step through torch.compile when the compiler fails: the step runs uncompiled, says so once,
and decodes what compile=False decodes. The decoding set-up generation and beam search share (`start_decoding`). A
conv layer's state (GPTConfig.layer_types) through the cache: left padding, copied and reordered rows."""

import sys
import weakref

import pytest
import torch

from gptlite.inference.generate import generate
from gptlite.inference.kvcache import decode_step, new_cache, start_decoding
from tests.conftest import tiny_model


@pytest.fixture
def failing_compiler(monkeypatch):
    """compile=True on the CPU with a backend that fails as inductor does when its C++ compiler ($CXX) writes no
    library: dynamo raises BackendCompilerFailed at the first call of each shape."""
    module = sys.modules["gptlite.inference.kvcache"]
    torch._dynamo.reset()

    def backend(graph, example_inputs):
        raise OSError("main.so: cannot open shared object file: No such file or directory")

    compiled = {"cpu": torch.compile(module.decode_step, backend=backend, fullgraph=True, dynamic=False)}
    monkeypatch.setattr(module, "_compiled", compiled)
    monkeypatch.setattr(module, "_frozen_versions", weakref.WeakKeyDictionary())
    monkeypatch.setattr(module, "_compiled_shapes", weakref.WeakKeyDictionary())
    monkeypatch.setattr(module, "_static_caches", weakref.WeakKeyDictionary())
    monkeypatch.setattr(module, "_compile_failed", {})


def test_a_failing_compiler_decodes_uncompiled_and_says_so_once(failing_compiler):
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    failed = r"torch.compile failed on this cpu \(OSError: .*cannot open shared object file.*\); decoding uncompiled"
    with pytest.warns(UserWarning, match=failed) as seen:
        compiled = generate(model, prompts, 12, temperature=0, compile=True)
    assert sum("torch.compile failed" in str(w.message) for w in seen) == 1
    assert compiled == generate(model, prompts, 12, temperature=0)


def test_start_decoding_prefills_each_prompt_once_and_copies_its_rows():
    """Two prompts of different lengths, three copies each: the first logits are each prompt's last logits from the
    model's own forward, repeated per copy, and every copy's cache row decodes the next token as its prompt would."""
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with torch.no_grad():
        view, step, cache, logits = start_decoding(model, prompts, 3, 12, compile=False)
        assert step is decode_step and logits.shape == (6, model.config.vocab_size)
        for i, prompt in enumerate(prompts):
            want = model(torch.tensor([prompt]))[0][0, -1]  # (V,)
            for copy in range(3):
                torch.testing.assert_close(logits[3 * i + copy], want, rtol=1e-5, atol=1e-5)
        token = logits.argmax(-1, keepdim=True)  # (6, 1)
        cache.prepare(1)
        after = step(view, token, cache)  # (6, V)
        for i, prompt in enumerate(prompts):
            want = model(torch.tensor([[*prompt, int(token[3 * i])]]))[0][0, -1]
            for copy in range(3):
                torch.testing.assert_close(after[3 * i + copy], want, rtol=1e-5, atol=1e-5)


CONV = dict(n_layer=3, layer_types="conv,full_attention,conv", pos_emb="rope", norm="rmsnorm")  # LFM2's layout


def conv_model(**layout):
    """A tiny model with conv layers (or `layout`'s), its weights large enough that every token changes the greedy
    choice."""
    model = tiny_model(**(layout or CONV))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.3)
    return model


def recomputed(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, each from the model's forward over everything so far (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_a_conv_layers_state_decodes_what_the_whole_forward_gives_and_padding_never_enters_it():
    """Greedy decoding through the cache (a conv layer's last inputs as its state) equals recomputing the whole
    sequence at every step; in a left-padded batch each row decodes what it decodes alone; the state is zeros where
    the cache starts and one (C, conv_kernel - 1) tensor per row."""
    model = conv_model()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    batch = generate(model, prompts, 10, temperature=0)
    assert batch == [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    assert batch == [recomputed(model, p, 10) for p in prompts]
    cache = new_cache(model, 2, 16)
    assert cache.states[0]["conv"].shape == (2, 32, 2) and cache.states[1] == {}
    assert cache.k[0].shape[2] == 0 and cache.k[1].shape[2] == 16  # keys only for the attention layer


def test_a_conv_layers_state_follows_its_rows_when_they_are_copied_and_reordered():
    """start_decoding's copies of each prompt, then beam search's reorder: every row's next logits are those of its
    own sequence's forward."""
    model = conv_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with torch.no_grad():
        view, step, cache, logits = start_decoding(model, prompts, 2, 12, compile=False)
        parents = [2, 3, 0, 1]  # the two prompts' rows trade places
        cache.reorder(torch.tensor(parents))
        token = torch.tensor([[10], [11], [12], [13]])
        cache.prepare(1)
        after = step(view, token, cache)  # (4, V)
        for row in range(4):
            sequence = [*prompts[parents[row] // 2], int(token[row])]
            want = model(torch.tensor([sequence]))[0][0, -1]
            torch.testing.assert_close(after[row], want, rtol=1e-4, atol=1e-4)


# Granite 4-H's layout: Mamba-2 layers among attention without positions, chunks shorter than the prompts
MAMBA = dict(
    n_layer=3,
    layer_types="mamba,full_attention,mamba",
    pos_emb="rope",
    nope_layers="0,1,2",
    norm="rmsnorm",
    mamba_heads=4,
    mamba_head_dim=16,
    mamba_state=8,
    mamba_groups=2,
    mamba_chunk_size=4,
)


def test_a_mamba_layers_state_decodes_what_the_whole_forward_gives_and_padding_never_enters_it():
    """Greedy decoding through the cache (the convolution's last inputs and the scan's state) equals recomputing the
    whole sequence at every step; in a left-padded batch each row decodes what it decodes alone."""
    model = conv_model(**MAMBA)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8]]
    batch = generate(model, prompts, 10, temperature=0)
    assert batch == [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    assert batch == [recomputed(model, p, 10) for p in prompts]
    cache = new_cache(model, 2, 16)
    assert cache.states[0]["conv"].shape == (2, 64 + 2 * 2 * 8, 3)  # (B, x + B + C channels, mamba_conv_kernel - 1)
    assert cache.states[0]["ssm"].shape == (2, 4, 16, 8) and cache.states[0]["ssm"].dtype == torch.float32
