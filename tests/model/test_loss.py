"""The chunked head + cross-entropy (gptlite.model.loss) against the whole computation, F.cross_entropy(F.linear(h, W)):
the loss and both gradients, with ignored targets, under autocast, inside the model for every variant, compiled;
and that it never keeps the (tokens, vocab) logits for backward."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptlite.checkpoint import load_checkpoint
from gptlite.data.shards import write_shard
from gptlite.model.loss import chunk_tokens, linear_cross_entropy
from gptlite.train.lora import add_lora
from gptlite.train.metrics import read_metrics
from tests.conftest import DEVICE, randint, run_train, tiny_model

pytestmark = pytest.mark.device


def inputs(n: int = 300, c: int = 24, v: int = 500, dtype=torch.float32):
    torch.manual_seed(0)
    h = torch.randn(n, c, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.randn(v, c, device=DEVICE, dtype=dtype, requires_grad=True)
    t = randint(v, (n,))
    t[::7] = -1
    t[128:192] = -1  # a whole chunk of 64 without targets
    return h, w, t


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [64, 100, 1000])
@pytest.mark.parametrize("softcap", [0.0, 3.0])  # float32 uncapped: folded_gradients; capped: softmax_gradients
def test_loss_and_gradients_equal_the_whole_computation(reduction, chunk, softcap):
    h, w, t = inputs()
    logits = F.linear(h, w)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    want = F.cross_entropy(logits, t, ignore_index=-1, reduction=reduction)
    want_h, want_w = torch.autograd.grad(want * 3, (h, w))
    got = linear_cross_entropy(h, w, t, reduction, chunk=chunk, softcap=softcap)
    got_h, got_w = torch.autograd.grad(got * 3, (h, w))  # the incoming gradient scales the stored ones
    torch.testing.assert_close(got, want)
    # float32 sums in another order (a GPU's kernels, chunk by chunk) round differently: about 1e-5 of the largest
    # entries, which a sum over the tokens makes hundreds of times those of the mean
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trained", ["h", "weight"])
def test_a_gradient_for_one_input_only_equals_the_whole_computation(trained):
    """A frozen head (LoRA) or frozen hidden states: only the other gradient is computed, and it is the same."""
    h, w, t = inputs()
    frozen = w if trained == "h" else h
    frozen.requires_grad_(False)
    live = h if trained == "h" else w
    (want,) = torch.autograd.grad(F.cross_entropy(F.linear(h, w), t, ignore_index=-1), (live,))
    (got,) = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk=64), (live,))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_under_autocast_matches_the_whole_computation_in_bfloat16():
    """Autocast's matmuls in bfloat16 and the softmax in float32, as the whole computation does; gradients come back
    in the inputs' float32."""
    h, w, t = inputs()
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)
        got = linear_cross_entropy(h, w, t, chunk=64)
    want_h, want_w = torch.autograd.grad(want, (h, w))
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert got_h.dtype == got_w.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_h, want_h, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got_w, want_w, atol=2e-3, rtol=2e-2)


def test_without_targets_the_mean_is_nan_and_the_sum_zero_as_cross_entropy():
    h, w, t = inputs()
    t[:] = -1
    assert torch.isnan(F.cross_entropy(F.linear(h, w), t, ignore_index=-1))
    assert torch.isnan(linear_cross_entropy(h, w, t))
    assert linear_cross_entropy(h, w, t, "sum").item() == 0.0


def test_evaluation_keeps_no_gradients_and_bad_reduction_is_named():
    h, w, t = inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, chunk=64)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w), t, ignore_index=-1).detach())
    with pytest.raises(ValueError, match=r"reduction must be 'mean', 'sum' or 'none', got 'max'"):
        linear_cross_entropy(h, w, t, "max")


def test_per_token_losses_and_their_gradients_equal_the_whole_computation():
    h, w, t = inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    chunked = linear_cross_entropy(h, w, t, "none", chunk=64)  # (N,), several chunks
    weights = torch.rand_like(chunked)  # a gradient per token, as DPO's per-sequence sums give
    (chunked * weights).sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = None
    w.grad = None
    whole = F.cross_entropy(F.linear(h, w), t, ignore_index=-1, reduction="none")
    (whole * weights).sum().backward()
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], w.grad)


def test_chunks_hold_a_bounded_number_of_logits():
    assert chunk_tokens(50304) == 1334 and chunk_tokens(128256) == 523 and chunk_tokens(10**9) == 64
    assert chunk_tokens(50257, "cpu") == 125 and chunk_tokens(128256, "cpu") == 64 and chunk_tokens(65, "cpu") == 96791
    assert chunk_tokens(50257, "cpu", width=192) == 192 and chunk_tokens(128256, "cpu", width=576) == 576


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_evaluation_in_default_chunks_equals_the_whole_computation(reduction):
    """Without gradients the default chunk is the evaluation's (on a CPU, 104 tokens at 60,000 ids: three chunks
    of these 300 tokens, one of them partly ignored)."""
    h, w, t = inputs(v=60_000)
    with torch.no_grad():
        chunked = linear_cross_entropy(h, w, t, reduction)
        whole = F.cross_entropy(F.linear(h, w), t, ignore_index=-1, reduction=reduction)
    assert chunked.grad_fn is None
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_models_training_loss_equals_its_logits_loss(variant, reduction):
    """forward(..., return_logits=False): (None, the same loss), and every parameter's gradient the same, for each
    architecture (the tied and the untied head)."""
    idx, targets = randint(97, (2, 24)), randint(97, (2, 24))
    targets[0, :5] = -1
    results = []
    for return_logits in (True, False):
        model = tiny_model(**variant).train()
        logits, loss = model(idx, targets, reduction=reduction, return_logits=return_logits)
        assert (logits is None) == (not return_logits)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0])
    # a sum's gradients are the mean's times the targets counted, and so are their rounding errors (which differ
    # where a GPU's kernels sum in another order): compared at the mean's scale
    scale = 1.0 if reduction == "mean" else float((targets >= 0).sum())
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name] / scale, grad / scale, atol=1e-6, rtol=1e-5, msg=name)


def test_no_logits_are_kept_for_backward():
    """The whole computation keeps (B*T, V) float32 logits for backward; the chunked one keeps tensors of the inputs'
    sizes only."""
    largest = []
    for return_logits in (True, False):
        model = tiny_model(vocab_size=4096, n_embd=16, n_head=2).train()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t):
            model(randint(4096, (2, 32)), randint(4096, (2, 32)), return_logits=return_logits)[1].backward()
        largest.append(max(saved))
    assert largest[0] >= 64 * 4096 and largest[1] <= 4096 * 16, largest


def test_a_lora_head_falls_back_to_the_whole_computation():
    """A LoRA'd lm_head (untied models only) is not a plain linear: its logits are computed whole, the loss the same."""
    model = tiny_model(tie_embeddings=False).train()
    add_lora(model, rank=2, targets=("qkv", "lm_head"))
    idx = randint(97, (2, 16))
    torch.testing.assert_close(model(idx, idx, return_logits=False)[1], model(idx, idx)[1])
    assert model(idx, idx, return_logits=False)[0] is None


@pytest.mark.parametrize("autocast", [False, True])
def test_compiles_as_one_graph(autocast):
    """No graph break in training's forward, under bfloat16 autocast too (dynamo's capture, without code generation)."""
    torch._dynamo.reset()
    model = tiny_model().train()
    idx = randint(97, (2, 9))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
        loss = compiled(idx, idx, return_logits=False)[1]
        loss.backward()
        torch.testing.assert_close(loss, model(idx, idx)[1])


def test_train_steps_with_and_without_chunks_give_the_same_gradients(tmp_path):
    """One train.py step of two micro-batches with --chunked_loss on (the default) and off: the same loss, gradient
    norm and update."""
    data = tmp_path / "data"
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, 97, 2_000)
    write_shard(data / "train_000000.bin", ids[:1_500], 97)
    write_shard(data / "val_000000.bin", ids[1_500:], 97)
    args = [
        f"--data_dir={data}",
        "--vocab_size=97",
        "--n_layer=2",
        "--n_head=4",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=4",
        "--total_batch_size=256",
        "--max_iters=1",
        "--log_interval=1",
        f"--device={DEVICE}",
    ]
    for chunked in ("false", "true"):
        run_train(*args, f"--chunked_loss={chunked}", f"--out_dir={tmp_path / chunked}")
    (whole,), (chunks,) = (
        [r for r in read_metrics(tmp_path / c / "metrics.jsonl") if "lr" in r] for c in ("false", "true")
    )
    assert chunks["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert chunks["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    weights_whole, weights_chunks = (load_checkpoint(tmp_path / c)["model"] for c in ("false", "true"))
    for name, w in weights_whole.items():  # AdamW's first update, lr * g / (|g| + eps), is touchy where g is near eps
        torch.testing.assert_close(weights_chunks[name], w, atol=1e-6, rtol=1e-5)
