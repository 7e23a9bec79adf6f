"""The CPU decode view (gptlite.inference.cpu.decode.packed_for_cpu) wraps a plain model from outside: building it
leaves the model's modules, their classes and tensors as they were, every tensor the view computes with is the model's
own, and it decodes the model's own greedy tokens."""

import pytest
import torch

import gptlite.inference.cpu.decode
from gptlite.inference.cpu import native
from gptlite.inference.cpu.blocks import NativeAttention, NativeBlock
from gptlite.inference.cpu.decode import packed_for_cpu
from gptlite.inference.cpu.linears import NativeLinear
from tests.conftest import tiny_model

MODELS = {
    "gpt2": {"pos_emb": "learned", "norm": "layernorm", "ffn": "gelu", "bias": True},
    "llama-like, gqa": {"norm": "rmsnorm", "ffn": "swiglu", "n_kv_head": 2, "pos_emb": "sinusoidal"},
    "llama: rope, gqa": {"norm": "rmsnorm", "ffn": "swiglu", "pos_emb": "rope", "n_kv_head": 2},
    "qwen3: rope, gqa, q/k norms": {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "pos_emb": "rope",
        "n_kv_head": 2,
        "qk_norm": True,
    },
    "olmo 2: norms after the branch, q/k norms over all heads": {
        "norm": "rmsnorm",
        "pos_emb": "rope",
        "qk_norm": True,
        "qk_norm_scope": "all",
        "norm_position": "post",
    },
    "gemma 3: norms on both sides, a window": {
        "norm": "rmsnorm",
        "ffn": "geglu",
        "pos_emb": "rope",
        "qk_norm": True,
        "norm_position": "both",
        "norm_unit_offset": True,
        "sliding_window": 4,
        "window_layers": "0",
        "rope_local_theta": 100.0,
    },
}


def snapshot(model: torch.nn.Module) -> dict[str, tuple]:
    """Each module's class, and each parameter's and buffer's tensor object, address and version, by name."""
    modules = {f"module {name}": (type(module),) for name, module in model.named_modules()}
    tensors = {
        f"tensor {name}": (tensor, tensor.data_ptr(), tensor._version)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    return {**modules, **tensors}


def greedy_by_forward(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation through the model's plain forward over the whole context at every step -> (B, T + steps)."""
    idx = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits = model(idx)[0][:, -1]  # (B, V)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("overrides", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("kernel", ["native", "slab"])
def test_the_view_leaves_the_model_untouched_and_decodes_its_tokens(monkeypatch, overrides, kernel):
    """Building the view (every layer on the compiled kernel, or on slabs) changes no module's class and no tensor
    of the model; each parameter and buffer of the view is one of the model's tensors (shared, not copied); and the
    model's generate, which decodes through the view, gives the greedy tokens of the model's own forward."""
    assert native.load(), "CI's machine has a C++ compiler"
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", kernel)
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    model = tiny_model(**overrides)
    before = snapshot(model)
    view = packed_for_cpu(model, 1)
    assert view is not model
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (first, *rest) in before.items():
        now, *rest_now = after[name]
        assert now is first and rest_now == rest, name
    own = {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    assert all(id(tensor) in own for tensor in [*view.parameters(), *view.buffers()])
    one_call = [type(block) for block in view.blocks]
    if kernel == "native":  # each matrix on the compiled kernel: each block's step in one call
        assert all(issubclass(kind, NativeBlock) for kind in one_call)
        assert isinstance(view.blocks[0].block.ffn.fc, NativeLinear)
    else:  # slabs: the block's own step, its attention in one call
        assert all(isinstance(block.attn, NativeAttention) for block in view.blocks)
    prompts = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15]])
    for rows in (prompts[:1], prompts):
        want = greedy_by_forward(model, rows, 12)
        assert torch.equal(model.generate(rows, 12, temperature=0), want)
    assert snapshot(model).keys() == before.keys()


def test_where_the_kernels_are_not_loaded_the_view_keeps_the_models_own_steps(monkeypatch):
    """Without the compiled kernels (here: load() says no), no one-call step is made, and the view decodes as the
    model does."""
    monkeypatch.setattr(native, "load", lambda: False)
    monkeypatch.setenv("GPTLITE_CPU_LINEAR", "linear")
    monkeypatch.setattr(gptlite.inference.cpu.decode, "PACK_MIN_WEIGHTS", 0)
    model = tiny_model(**MODELS["gpt2"])
    view = packed_for_cpu(model, 1)
    assert [type(block).__name__ for block in view.blocks] == ["Block", "Block"]
    assert [type(block.attn).__name__ for block in view.blocks] == ["CausalSelfAttention", "CausalSelfAttention"]
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(model.generate(prompt, 12, temperature=0), greedy_by_forward(model, prompt, 12))
