"""The optimizers of training: AdamW's and Muon's parameter groups (`configure_optimizers`), the learning-rate
schedule (`lr_at`), and Muon, the optimizer for the matrices inside the transformer blocks, orthogonalised per
logical matrix.

Muon (Keller Jordan, 2024, https://kellerjordan.github.io/posts/muon/) is SGD with Nesterov momentum whose
update of each weight matrix is replaced by the nearest semi-orthogonal matrix, found by a few steps of a
Newton-Schulz iteration. It is meant for hidden-layer matrices only; the embedding (tied to the head), positions
and every vector stay with AdamW.

Two refinements from the speedrun records, off by default: the Polar Express coefficients in Newton-Schulz
(Amsel et al., 2025; muon_ns="polar_express") and NorMuon's per-neuron normalisation of the orthogonalised update
(Li et al., 2025; normuon=true).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gptlite.model.network import SwiGLU, Transformer

if TYPE_CHECKING:
    from gptlite.config import TrainConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: its steep slope at 0 lifts small singular values
NS_STEPS = 5
# Polar Express (Amsel, Persson, Musco & Gower, 2025, "The Polar Express: Optimal Matrix Sign Methods and Their
# Application to the Muon Algorithm"): one quintic per step, each the best for the interval of singular values the
# previous steps leave, so that five steps land closer to 1 than five of the fixed quintic. These are the five of
# modded-nanogpt and nanochat, computed for a safety factor of 1.02 (the input is divided by 1.02 times its norm).
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02


def ns_schedule(method: str, steps: int = NS_STEPS) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """(the (a, b, c) of every step, the safety factor the input's norm is multiplied by) of a Newton-Schulz method:
    quintic, Keller Jordan's fixed coefficients `steps` times; polar_express, its five steps."""
    if method == "polar_express":
        return POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_SAFETY
    return (NS_COEFFICIENTS,) * steps, 1.0


def newton_schulz(
    g: Tensor, dtype: torch.dtype = torch.bfloat16, steps: int = NS_STEPS, eps: float = 1e-7, method: str = "quintic"
) -> Tensor:
    """g (rows, cols), or a batch of them (n, rows, cols) -> roughly each one's orthogonal factor U V^T, where
    g = U S V^T: iterations of X <- a X + (b A + c A^2) X with A = X X^T, in `dtype`, which push the singular values
    of X towards 1 (with the fixed quintic most end between 0.7 and 1.2, not at 1: the coefficients trade accuracy
    for fewer steps, which does not hurt training). `method` picks the coefficients (ns_schedule): "quintic", `steps`
    times, which for one matrix is torch.optim.Muon's arithmetic op for op; or "polar_express", its own five.
    Returns g's shape in dtype."""
    coefficients, safety = ns_schedule(method, steps)
    mm = torch.addmm if g.dim() == 2 else torch.baddbmm  # C + A B, for one matrix or a batch
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    if tall:  # iterate on the wide orientation, so that A = X X^T is the smaller square
        x = x.mT  # (..., cols, rows)
    norm = x.norm(dim=(-2, -1), keepdim=True)  # Frobenius norm >= spectral: singular values <= 1
    x = x / (norm * safety).clamp(min=eps)
    for a, b, c in coefficients:
        A = x @ x.mT  # (..., r, r), r = min(rows, cols)
        x = mm(x, mm(A, A, A, beta=b, alpha=c), x, beta=a)  # a X + (b A + c A A) X
    return x.mT if tall else x  # (..., rows, cols)


Split = int | tuple[int, ...]  # a parameter's logical matrices: that many of equal rows, or their row counts


def row_sizes(rows: int, split: Split) -> list[int]:
    return [rows // split] * split if isinstance(split, int) else list(split)


def orthogonalise(
    updates: list[Tensor],
    split: Split = 1,
    dtype: torch.dtype = torch.bfloat16,
    scaled: bool = False,
    method: str = "quintic",
) -> list[Tensor]:
    """Updates (rows, cols), each `split` logical matrices stacked along dim 0 -> each logical matrix's
    newton_schulz in dtype with `method`'s coefficients (times its lr_scale if `scaled`), stacked again. Matrices
    of one shape go through one batched iteration: a few bmm calls instead of a few mm calls per matrix, which
    matters on the CPU, where small matmuls are mostly overhead. A DTensor (a parameter sharded by FSDP2) is gathered
    whole on every rank first and this rank's shard of the result returned: simple, not fast (every rank repeats it)."""
    whole = [u.full_tensor() if hasattr(u, "full_tensor") else u for u in updates]  # (rows, cols) each
    n = len(row_sizes(whole[0].size(0), split)) if whole else 0  # logical matrices per update
    chunks = [m for u in whole for m in u.split(row_sizes(u.size(0), split))]
    shapes: dict[torch.Size, list[int]] = {}
    for i, m in enumerate(chunks):
        shapes.setdefault(m.shape, []).append(i)
    done = list(chunks)
    for same in shapes.values():
        batch = (
            newton_schulz(chunks[same[0]], dtype, method=method)[None]
            if len(same) == 1
            else newton_schulz(torch.stack([chunks[i] for i in same]), dtype, method=method)
        )  # (n, rows, cols)
        for i, m in zip(same, batch, strict=True):
            done[i] = m * lr_scale(m.shape) if scaled else m
    results = [torch.cat(done[k * n : (k + 1) * n]) for k in range(len(updates))]  # (rows, cols) each
    for k, u in enumerate(updates):
        if hasattr(u, "full_tensor"):
            from torch.distributed.tensor import distribute_tensor

            results[k] = distribute_tensor(results[k], u.device_mesh, u.placements, src_data_rank=None)  # no traffic
    return results


def lr_scale(shape: torch.Size, split: int = 1) -> float:
    """Keller Jordan's sqrt(max(1, rows / cols)) for one logical matrix of a (split * rows, cols) parameter.

    An orthogonal (rows, cols) update has RMS sqrt(1 / max(rows, cols)); this factor gives every matrix the
    per-element update of a square one of width cols, so that muon_lr means the same for q, k, v and the output
    projections (factor 1) as for a feed-forward input (F, C) with F > C (sqrt(F / C)). It is torch.optim.Muon's
    default (adjust_lr_fn="original"), and the rule under which muon_lr = 0.02 to 0.05 is known to work
    (Keller Jordan's Muon, modded-nanogpt).
    Moonshot's 0.2 * sqrt(max(rows, cols)) ("Muon is Scalable for LLM Training", 2025) instead matches AdamW's
    update RMS so that one learning rate serves both; gptlite has its own muon_lr, so it keeps the simpler rule."""
    rows, cols = shape[0] // split, shape[1]
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum and decoupled weight decay, for 2-D parameters W (rows, cols):

        B <- momentum B + (1 - momentum) G          the momentum buffer (an average, as torch.optim.Muon's)
        U <- (1 - momentum) G + momentum B          Nesterov
        O <- orthogonalise(U, split)                (Newton-Schulz with ns_method's coefficients)
        O <- normalise_neurons(O)                   only with normuon: NorMuon's per-neuron step sizes
        W <- (1 - lr weight_decay) W - lr lr_scale(W) O

    A group's `split` (default 1) says how many logical matrices each of its parameters stacks along dim 0;
    each is orthogonalised and its learning rate scaled on its own, as if the model held separate Linear layers.
    That is why this is not torch.optim.Muon: it orthogonalises a 2-D parameter whole, so for gptlite's fused
    qkv (3C, C) it would orthogonalise q, k and v together, leaving each one's part of the update far from
    orthogonal (singular values from 0.01 to 0.8 in tests/train/test_optim.py), and scale the learning rate by
    sqrt(3); likewise for SwiGLU's fused (2F, C) input. On one unsplit matrix this class computes exactly what
    torch.optim.Muon does (tests/train/test_optim.py).

    `ns_dtype` is the Newton-Schulz iteration's precision: bfloat16 as Keller Jordan's and torch's, fast on
    GPUs; training takes float32 off CUDA, since a CPU without bf16 instructions multiplies bfloat16 matrices
    many times more slowly (figures: docs/training.md). `ns_method` and `normuon` are the refinements of the
    module's docstring; `normuon_beta2` is the decay of NorMuon's per-neuron second moment."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype = torch.bfloat16,
        ns_method: str = "quintic",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
    ):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "split": 1})
        self.ns_dtype = ns_dtype  # not a group value: checkpoints hold plain values only
        self.ns_method = ns_method
        self.normuon = normuon
        self.normuon_beta2 = normuon_beta2
        for group in self.param_groups:
            split = group["split"]
            for p in group["params"]:
                if p.dim() != 2 or (p.size(0) % split if isinstance(split, int) else sum(split) != p.size(0)):
                    raise ValueError(
                        f"Muon takes 2-D parameters whose rows split into {group['split']} equal "
                        f"matrices, got shape {tuple(p.shape)}; give other parameters to AdamW"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, split = group["lr"], group["momentum"], group["split"]
            params = [p for p in group["params"] if p.grad is not None]
            nesterov = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                nesterov.append(p.grad.lerp(buf, momentum))
            uneven = not isinstance(split, int)  # matrices of different rows (GQA's q, k, v): each scaled apart
            updates = orthogonalise(nesterov, split, self.ns_dtype, uneven, self.ns_method)  # (rows, cols) each
            if self.normuon:
                updates = [
                    normalise_neurons(u, self._second_moment(p), self.normuon_beta2, split)
                    for p, u in zip(params, updates, strict=True)
                ]
            for p, update in zip(params, updates, strict=True):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * (1.0 if uneven else lr_scale(p.shape, split)))
        return loss

    def _second_moment(self, p: Tensor) -> Tensor:
        """NorMuon's running mean of each row's mean squared update, (rows, 1) in float32, kept in p's state."""
        state = self.state[p]
        if "neuron_second_moment" not in state:
            state["neuron_second_moment"] = torch.zeros(p.size(0), 1, dtype=torch.float32, device=p.device)
        return state["neuron_second_moment"]


def normalise_neurons(update: Tensor, second_moment: Tensor, beta2: float, split: Split = 1) -> Tensor:
    """NorMuon's per-neuron normalisation (Li et al., 2025, "NorMuon: Making Muon more efficient and scalable",
    algorithm 1): an orthogonalised update O (rows, cols) leaves some output neurons (rows) with much larger steps
    than others; each row is divided by the square root of v, the running mean (decay beta2) of that row's mean
    square, updated here in place ((rows, 1), float32). Each logical matrix of `split` is then scaled back to the
    Frobenius norm it had, so that Muon's learning rate keeps its meaning (as modded-nanogpt's NorMuon does; the
    paper rescales to AdamW's update size instead). Returns O's shape and dtype."""
    full = update.float()  # (rows, cols)
    mean_square = full.square().mean(dim=1, keepdim=True)  # (rows, 1)
    second_moment.lerp_(mean_square, 1 - beta2)
    normalised = full * second_moment.clamp_min(1e-10).rsqrt()  # (rows, cols)
    sizes = row_sizes(update.size(0), split)
    parts = []
    for before, after in zip(full.split(sizes), normalised.split(sizes), strict=True):
        parts.append(after * (before.norm() / after.norm().clamp_min(1e-10)))
    return torch.cat(parts).to(update.dtype)  # (rows, cols)


def block_matrices(model: Transformer) -> dict[Tensor, int]:
    """Every 2-D weight inside model.blocks -> how many logical matrices it stacks along dim 0: attention's qkv
    holds q, k and v (3), Gated DeltaNet's in_proj q, k, v, z, b and a; SwiGLU's fc holds W1 and W3 (2); the output
    projections and GELU's fc are one matrix."""
    splits = {}
    for block in model.blocks:
        splits.update({p: 1 for p in block.parameters() if p.dim() == 2})
        # attention's rows q, then k, then v (fewer k, v rows with GQA); Gated DeltaNet's q, k, v, z, b, a
        weight, sizes = block.attn.stacked_rows()
        splits[weight] = len(sizes) if len(set(sizes)) == 1 else tuple(sizes)
        if isinstance(block.ffn, SwiGLU):
            splits[block.ffn.fc.weight] = 2  # (2F, C): rows W1 (the gate), then W3
    return splits


def configure_optimizers(model: Transformer, cfg: TrainConfig, device_type: str) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay on matrices (linear weights and the tied embedding/head, as nanoGPT) and none on
    vectors (norm weights, biases); the fused implementation, on the CPU too (one kernel for every tensor instead of
    a loop over them: the step of a small model is mostly that loop's overhead).

    With optimizer="muon", a second optimizer, Muon, takes the 2-D weights inside the blocks, q, k, v and SwiGLU's
    W1 and W3 each orthogonalised on its own (a group per `split`), with muon_weight_decay; AdamW keeps the token
    embedding (tied to the head), learned positions and the vectors. Every group's `lr_ratio` is its peak learning
    rate over learning_rate: the schedule (`lr_at`) scales all of them alike. Only trainable parameters are given
    to an optimizer: with LoRA, the adapters."""
    params = [p for p in model.parameters() if p.requires_grad]
    splits = block_matrices(model) if cfg.optimizer == "muon" else {}  # parameter -> logical matrices in it
    splits = {p: split for p, split in splits.items() if p.requires_grad}
    rest = [p for p in params if p not in splits]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_ratio": 1.0},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_ratio": 1.0},
    ]
    fused = device_type in ("cuda", "cpu")
    optimizers = [torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)]
    if splits:
        ratio = cfg.muon_lr / cfg.learning_rate if cfg.learning_rate else 0.0  # learning_rate=0 moves nothing
        in_order = sorted(set(splits.values()), key=lambda s: (isinstance(s, tuple), s))
        groups = [
            {"params": [p for p, s in splits.items() if s == split], "split": split, "lr_ratio": ratio}
            for split in in_order
        ]
        ns_dtype = torch.bfloat16 if device_type == "cuda" else torch.float32  # see Muon
        muon = Muon(
            groups,
            lr=cfg.muon_lr,
            momentum=cfg.muon_momentum,
            weight_decay=cfg.muon_weight_decay,
            ns_dtype=ns_dtype,
            ns_method=cfg.muon_ns,
            normuon=cfg.normuon,
            normuon_beta2=cfg.normuon_beta2,
        )
        optimizers.append(muon)
    return optimizers


def run_progress(step: int, cfg: TrainConfig, minutes: float = 0.0) -> float:
    """How far the run is, in [0, 1]: `minutes` of max_minutes with lr_schedule="time", else step of max_iters."""
    if cfg.lr_schedule == "time":
        return min(1.0, minutes / cfg.max_minutes)
    return min(1.0, step / cfg.max_iters)


def seq_len_at(step: int, cfg: TrainConfig, minutes: float = 0.0) -> int:
    """The training windows' length at optimizer step `step`: block_size, or with seq_len_start a sequence-length
    warm-up (as in Li, Zhang & He, 2022, "The Stability-Efficiency Dilemma", and modded-nanogpt's growing attention
    windows): seq_len_start, doubled at each of log2(block_size / seq_len_start) equal shares of the first
    seq_len_warmup of the run (run_progress), then block_size. Short windows early cost less attention, and the
    first steps learn what a short context shows anyway."""
    T = cfg.model.block_size
    if not cfg.seq_len_start:
        return T
    share = run_progress(step, cfg, minutes) / cfg.seq_len_warmup
    if share >= 1:
        return T
    doublings = round(math.log2(T / cfg.seq_len_start))
    return cfg.seq_len_start * 2 ** int(share * doublings)


class WeightAverage:
    """An exponential moving average of a model's trainable parameters (Polyak & Juditsky, 1992; in the speedrun
    records as an EMA of the weights), in float32: after each optimizer step, average <- average + (1 - d) (weights
    - average) with d = min(decay, (1 + updates) / (10 + updates)), the warm-up of TensorFlow's
    ExponentialMovingAverage, so that the first steps' random weights fade fast. The average smooths the last
    steps' noise; train.py evaluates and saves it at the end of a run (--ema_decay)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.average = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.average, [p.detach().float() for p in self.params], 1 - decay)
        self.updates += 1

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Put the average into the model's parameters (in their dtype)."""
        for p, average in zip(self.params, self.average, strict=True):
            p.copy_(average)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "average": {n: a.cpu() for n, a in zip(self.names, self.average, strict=True)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        for name, average in zip(self.names, self.average, strict=True):
            average.copy_(state["average"][name])


def lr_at(step: int, cfg: TrainConfig, minutes: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (counted from 0): a linear warmup to learning_rate over
    warmup_iters steps, then a cosine decay to min_lr, reached at lr_decay_iters (lr_schedule="steps"), or when
    `minutes` of wall-clock time reach max_minutes (lr_schedule="time", for a fixed time budget); then min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    min_lr = min(cfg.min_lr, cfg.learning_rate)  # learning_rate=0: nothing moves
    if cfg.lr_schedule == "time":
        progress = minutes / cfg.max_minutes
    else:
        decay_iters = cfg.lr_decay_iters or cfg.max_iters
        progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    progress = min(progress, 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - min_lr)
