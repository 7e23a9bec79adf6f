"""The output head and its cross-entropy in chunks of tokens, so that the (tokens, vocab) logits are never all in
memory at once.

A language model's loss multiplies N hidden states (N, C) by the head (V, C) and takes a cross-entropy over V
classes. Done whole, the float32 logits, their log-softmax and their gradient each take N x V x 4 bytes: for a
batch of 8 x 1024 tokens and Llama 3's 128,256 tokens that is 4.2 GB apiece, more than the rest of a small
model's training step. Here each chunk of tokens makes its logits, its loss and at once its gradients with
respect to the hidden states and the head (softmax minus the one-hot target), and then lets the logits go; the
backward pass only scales the stored gradients by the incoming one. The idea is llm.c's fused classifier and
Liger-Kernel's fused linear cross-entropy (Hsu et al., 2024, https://arxiv.org/abs/2410.10989); the arithmetic
is the same as F.cross_entropy(F.linear(h, weight), targets), done chunk by chunk. With a soft cap the logits are
softcap * tanh(z / softcap) of z = h @ weight.T (GPTConfig.logit_softcap), and the chain rule multiplies the
softmax's gradient by 1 - tanh(z / softcap)^2.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 256 * 2**20  # float32 logits per chunk: 1,334 tokens at GPT-2's 50,304, 523 at Llama 3's 128,256
# On a CPU each pass over a chunk's logits runs at the memory's speed unless the chunk stays in the cache: a chunk
# about the size of a last-level cache, 125 tokens at GPT-2's 50,257, measured faster than 1,334 at widths 24-72
# and as fast at 192 (docs/benchmarks.md, AMD EPYC with 32 MiB of L3). But every chunk also reads the (V, C) head
# and adds to its gradient, which fewer tokens a chunk repeat more often: a CPU chunk has at least as many tokens
# as the head is wide.
CPU_CHUNK_BYTES = 24 * 2**20


def chunk_tokens(vocab_size: int, device_type: str = "cuda", width: int = 0) -> int:
    """Tokens per chunk on a device of `device_type` for a head of `vocab_size` x `width`: as many as keep one
    chunk's float32 logits within CHUNK_BYTES, or on a CPU within CPU_CHUNK_BYTES but at least `width` (and always
    at least 64)."""
    if device_type == "cpu":
        return max(64, CPU_CHUNK_BYTES // (4 * vocab_size), width)
    return max(64, CHUNK_BYTES // (4 * vocab_size))


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """h (N, C) hidden states, weight (V, C) the head, targets (N,) with -1 ignored -> the cross-entropy of
    h @ weight.T against targets: its mean over the targets that are not -1 (NaN if there are none, as
    F.cross_entropy), with reduction="sum" its sum, or with reduction="none" each token's (N,), 0 where the
    target is -1 (what DPO sums per sequence, gptlite.train.preference). The matmuls run in autocast's dtype when
    autocast is on, the softmax in float32, as the whole computation does under autocast. `chunk` tokens at a time
    (default: chunk_tokens(V, the device's type, C)); `softcap` > 0 caps the logits first (see the module's
    docstring)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # else evaluation: the loss only
    chunk = chunk or chunk_tokens(weight.size(0), h.device.type, weight.size(1))
    if reduction == "none" and not grads:  # nothing to recompute in a backward
        parts = [
            token_cross_entropy(h[i : i + chunk], weight, targets[i : i + chunk], softcap)
            for i in range(0, h.size(0), chunk)
        ]
        return torch.cat(parts)  # (N,)
    if reduction == "none":
        # One loss per token has a gradient per token, which the fused forward below cannot precompute for an
        # incoming gradient it does not know yet: each chunk is recomputed in backward instead (activation
        # checkpointing), so still only one chunk's logits are ever in memory.
        parts = [
            checkpoint(
                token_cross_entropy, h[i : i + chunk], weight, targets[i : i + chunk], softcap, use_reentrant=False
            )
            for i in range(0, h.size(0), chunk)
        ]
        return torch.cat(parts)  # (N,)
    return LinearCrossEntropy.apply(h, weight, targets, reduction == "mean", chunk, grads, softcap)


def token_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """h (n, C), weight (V, C), targets (n,) -> each token's cross-entropy (n,) in float32, 0 where the target is
    -1: one chunk of linear_cross_entropy(reduction="none")."""
    logits = F.linear(h, weight).float()  # (n, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction="none")


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(h, weight) would multiply in: autocast's where it is on, else the inputs' own."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when gradients are wanted, the loss's gradients with respect to h and weight;
    backward multiplies them by the incoming gradient (a scalar's). Holds one chunk's logits at a time plus the
    gradients, (N, C) and (V, C): the size of the inputs. A chunk's gradients come from `softmax_gradients`, or in
    float32 without a cap from `folded_gradients`, the same arithmetic in two fewer passes over the logits."""

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        mean: bool,
        chunk: int,
        grads: bool,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        dtype = compute_dtype(h, weight)
        want_h = grads and ctx.needs_input_grad[0]
        want_w = grads and ctx.needs_input_grad[1]
        if dtype == torch.float32 and not softcap:
            gradients = folded_gradients
        else:
            gradients = functools.partial(softmax_gradients, softcap=softcap)
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            count = (targets >= 0).sum()
            scale = 1.0 / count.float() if mean else torch.ones((), device=h.device)  # NaN mean when no targets
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(hc) if want_h else None  # (N, C)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None  # (V, C)
            for start in range(0, h.size(0), chunk):
                rows = slice(start, start + chunk)
                tgt = targets[rows]
                keep = (tgt >= 0).unsqueeze(1)  # (n, 1)
                safe = tgt.clamp_min(0).unsqueeze(1)  # (n, 1): an ignored row reads class 0, then counts 0
                if not (want_h or want_w):  # evaluation: the loss only, 0 on ignored rows
                    total += token_cross_entropy(hc[rows], wc, tgt, softcap).sum()
                    continue
                logits = (hc[rows] @ wc.mT).float()  # (n, V)
                weights = keep * scale  # (n, 1): each row's share of the loss, 0 on ignored rows
                loss, chunk_grad_h = gradients(logits, hc[rows], wc, safe, weights, want_h, grad_w)
                total += (loss * keep).sum()
                if grad_h is not None:
                    grad_h[rows] = chunk_grad_h
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (
            None if grad_h is None else (grad_h * grad_out).to(h_dtype),
            None if grad_w is None else (grad_w * grad_out).to(w_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def softmax_gradients(
    logits: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    safe: torch.Tensor,
    weights: torch.Tensor,
    want_h: bool,
    grad_w: torch.Tensor | None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: logits (n, V) float32 of h (n, C) and the head weight (V, C) in the compute dtype, targets safe
    (n, 1), rows' weights (n, 1) -> (each row's loss (n, 1), the rows' gradient (n, C) or None unless want_h),
    adding the head's gradient into grad_w (V, C) float32 where it is not None. The gradient with respect to the
    logits is written out, (softmax - one-hot) x weights (x the cap's 1 - tanh^2), in the logits' memory, then cast
    to the compute dtype for both products: what a lower precision needs, since the target's entry, p - 1, is small
    for a confident prediction and would be lost in a difference taken after a bfloat16 product."""
    squash = None  # softcap: tanh(z / softcap), whose derivative the gradient needs
    if softcap:
        squash = torch.tanh(logits / softcap)  # (n, V)
        logits = squash * softcap
    lse = logits.logsumexp(dim=1, keepdim=True)  # (n, 1)
    loss = lse - logits.gather(1, safe)  # (n, 1)
    probs = logits.sub_(lse).exp_()  # (n, V) softmax, in the logits' memory
    grad = probs.scatter_add_(1, safe, -torch.ones_like(safe, dtype=probs.dtype))  # softmax - one-hot
    if squash is not None:  # d(softcap tanh(z / softcap)) / dz = 1 - tanh^2
        grad = grad.mul_(1 - squash.square())
    grad = grad.mul_(weights).to(weight.dtype)  # (n, V); 0 on ignored rows
    if grad_w is not None and weight.dtype == torch.float32:
        grad_w.addmm_(grad.mT, h)  # (V, C), in place
    elif grad_w is not None:
        grad_w += (grad.mT @ h).float()  # (V, C); each chunk's sum rounded once to dtype
    return loss, (grad @ weight if want_h else None)


def folded_gradients(
    logits: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    safe: torch.Tensor,
    weights: torch.Tensor,
    want_h: bool,
    grad_w: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax_gradients in float32 without a cap, with two fewer passes over the (n, V) logits, each of which runs at
    the memory's speed on a CPU. With E = exp(z - max z) and s its row sums, the logits' gradient is
    diag(r) E - diag(w) one-hot for r = w / s: the rows' scales go onto the (n, C) products and onto h, and the one-hot
    part is a gather and an index_add of (n, C) rows, so E itself is never rescaled or written again."""
    top = logits.amax(dim=1, keepdim=True)  # (n, 1)
    target = logits.gather(1, safe)  # (n, 1), before the logits' memory becomes E
    e = logits.sub_(top).exp_()  # (n, V)
    sums = e.sum(dim=1, keepdim=True)  # (n, 1)
    loss = sums.log() + top - target  # (n, 1): logsumexp - the target's logit
    r = weights / sums  # (n, 1)
    if grad_w is not None:
        grad_w.addmm_(e.mT, r * h)  # (V, C): E^T diag(r) h
        grad_w.index_add_(0, safe.squeeze(1), -(weights * h))  # - one-hot^T diag(w) h
    if not want_h:
        return loss, None
    return loss, r * (e @ weight) - weights * weight[safe.squeeze(1)]  # (n, C)
