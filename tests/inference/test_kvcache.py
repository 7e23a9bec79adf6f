"""The KV cache's decode step through torch.compile when the compiler fails: the step runs uncompiled, says so once,
and decodes what compile=False decodes. The decoding set-up generation and beam search share (`start_decoding`)."""

import sys
import weakref

import pytest
import torch

from gptlite.inference.generate import generate
from gptlite.inference.kvcache import decode_step, start_decoding
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
