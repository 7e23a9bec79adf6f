"""Bits per byte over token windows: training's val loss and bpb (`evaluate_loader`), and any token streams'
(`evaluate_windows`).

bpb = (sum of the target tokens' cross-entropy, in nats) / (ln 2 x the UTF-8 bytes those tokens decode to). It does
not depend on the tokenizer, so a char model and a BPE model compare. Targets that stand for no text (the
end-of-text token, and padded ids) count in neither sum, as in nanochat. Each window of block_size tokens is scored
on its own, so its first tokens see little context: bpb (and val loss) over windows read higher than a full-context
evaluation would.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from gptlite.data.loader import Loader, evaluation_batches
from gptlite.model.network import Transformer
from gptlite.tokenizer import Tokenizer


def byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) the UTF-8 bytes of each id's text, built once: 0 for the end-of-text token and for ids past
    the tokenizer's vocabulary (a padded model vocabulary)."""
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    n = min(vocab_size, tokenizer.vocab_size)
    lengths[:n] = torch.tensor([len(tokenizer.token_bytes([i])) for i in range(n)])
    if tokenizer.eot_id is not None and tokenizer.eot_id < vocab_size:
        lengths[tokenizer.eot_id] = 0
    return lengths


def loss_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Sums over a batch, x and y (B, T): (cross-entropy of every target in nats, targets, cross-entropy of the
    targets that decode to bytes, those bytes); the last two are 0 without `lengths` (see byte_lengths). Targets of
    -1 (a conversation's non-assistant tokens, padding) count nowhere. The head and the cross-entropy run a chunk of
    tokens at a time (gptlite.model.loss), never all B x T x V logits at once."""
    _, ce = model(x, y, reduction="none", return_logits=False)  # (B, T), 0 where y is -1
    ce = ce.flatten()  # (B*T,)
    y = y.flatten()  # (B*T,)
    sums = torch.stack([ce.sum(), (y >= 0).sum().float()])
    if lengths is None:
        return torch.cat([sums, torch.zeros(2, device=ce.device)])
    nbytes = torch.where(y >= 0, lengths[y.clamp_min(0)], 0)  # (B*T,)
    text = torch.where(nbytes > 0, ce, torch.zeros_like(ce)).sum()
    return torch.cat([sums, torch.stack([text, nbytes.sum().float()])])


def loss_and_bpb(sums: torch.Tensor) -> tuple[float, float | None]:
    """(mean loss per target, bits per byte or None) from accumulated `loss_sums`."""
    loss, n, text, nbytes = sums.tolist()
    return loss / n, (text / (math.log(2) * nbytes) if nbytes else None)


@torch.no_grad()
def evaluate_loader(
    model: torch.nn.Module,
    loader: Loader,
    iters: int,
    device: str,
    autocast: contextlib.AbstractContextManager,
    lengths: torch.Tensor | None,
) -> tuple[float, float | None]:
    """Mean loss per target token and bits per byte (None without the tokens' byte `lengths`, see byte_lengths) of
    a loader's split, as training reports its val loss: over the first `iters` global batches (the same batches at
    every evaluation), or over every window of the split when iters=0 or the split is smaller
    (gptlite.data.loader.evaluation_batches). Under torchrun each rank scores its slice
    and the sums are all-reduced, so every rank gets the same figures."""
    import torch.distributed as dist

    model.eval()
    batches = evaluation_batches(loader, iters)
    sums = torch.zeros(4, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, T) each
        with autocast:
            sums += loss_sums(model, x, y, lengths)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return loss_and_bpb(sums)


@torch.no_grad()
def evaluate_windows(
    model: Transformer,
    streams: list[torch.Tensor],
    batch_size: int = 8,
    lengths: torch.Tensor | None = None,
    progress: bool = False,
) -> tuple[float, float | None, int]:
    """(loss, bpb, targets scored) over every non-overlapping window of block_size + 1 tokens of each 1-D token
    stream (a val shard, a text), its last and shorter window included; windows never cross streams."""
    from tqdm import tqdm

    T = model.config.block_size
    device = model.tok_emb.weight.device
    windows = [tokens[s : s + T + 1] for tokens in streams for s in range(0, len(tokens) - 1, T)]
    sums = torch.zeros(4, device=device)
    lengths = None if lengths is None else lengths.to(device)
    model.eval()
    for first in tqdm(range(0, len(windows), batch_size), desc="windows", disable=not progress, file=sys.stderr):
        batch = windows[first : first + batch_size]
        for size in {len(w) for w in batch}:  # a stream's last window may be shorter: a forward of its own
            x = torch.stack([w for w in batch if len(w) == size]).to(device)  # (B, size)
            sums += loss_sums(model, x[:, :-1], x[:, 1:], lengths)
    loss, bpb = loss_and_bpb(sums)
    return loss, bpb, int(sums[1].item())
