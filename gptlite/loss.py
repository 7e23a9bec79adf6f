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

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 256 * 2**20  # float32 logits per chunk: 1,334 tokens at GPT-2's 50,304, 523 at Llama 3's 128,256


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as keep one chunk's float32 logits within CHUNK_BYTES (at least 64)."""
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
    target is -1 (what DPO sums per sequence, gptlite.preference). The matmuls run in autocast's dtype when
    autocast is on, the softmax in float32, as the whole computation does under autocast. `chunk` tokens at a time
    (default: chunk_tokens(V)); `softcap` > 0 caps the logits first (see the module's docstring)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    chunk = chunk or chunk_tokens(weight.size(0))
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
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # else evaluation: the loss only
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
    gradients, (N, C) and (V, C): the size of the inputs."""

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
                logits = (hc[rows] @ wc.mT).float()  # (n, V)
                squash = None  # softcap: tanh(z / softcap), whose derivative the gradient needs
                if softcap:
                    squash = torch.tanh(logits / softcap)  # (n, V)
                    logits = squash * softcap
                lse = logits.logsumexp(dim=1, keepdim=True)  # (n, 1)
                total += ((lse - logits.gather(1, safe)) * keep).sum()
                if grad_h is None and grad_w is None:
                    continue
                probs = logits.sub_(lse).exp_()  # (n, V) softmax, in the logits' memory
                grad = probs.scatter_add_(1, safe, -torch.ones_like(safe, dtype=probs.dtype))  # softmax - one-hot
                if squash is not None:  # d(softcap tanh(z / softcap)) / dz = 1 - tanh^2
                    grad = grad.mul_(1 - squash.square())
                grad = grad.mul_(keep * scale).to(dtype)  # (n, V); 0 on ignored rows
                if grad_h is not None:
                    grad_h[rows] = grad @ wc  # (n, C)
                if grad_w is not None and dtype == torch.float32:
                    grad_w.addmm_(grad.mT, hc[rows])  # (V, C), in place
                elif grad_w is not None:
                    grad_w += (grad.mT @ hc[rows]).float()  # (V, C); each chunk's sum rounded once to dtype
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
