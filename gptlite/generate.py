"""Autoregressive generation: the KV cache, the sampling controls and the prefill + decode loop.

How `generate_tokens` runs:
1. Prefill: the prompts, left-padded to the longest, go through the model once, and every layer writes
   its keys and values into its own cache buffers, preallocated with static shapes (B, H, max_len, D)
   (separate tensors, so that writing one layer's never makes a compiled step copy them all). Several
   samples of one prompt share that prefill: the cache rows are copied, not recomputed.
2. Decode: each step feeds only the newest token of every row and writes one cache slot in place. A
   mask hides each row's left padding and positions count from each row's first real token, so a
   padded row computes what it would alone. With `compile=True` the decode step (and the prefill of a
   slid window, whose length is fixed) is `torch.compile`d with fixed shapes: CUDA graphs on CUDA,
   frozen prepacked weights and autotuned C++ matmuls on the CPU (`compiled_decode_step`).
3. Sampling (`sample_next`): repetition and frequency penalties, temperature (0 = greedy), top-k and
   top-p, drawing from an explicit `torch.Generator`, so a seed reproduces the text.

Context past `block_size` (the window policy):
- By default (both position types) a row whose window is full keeps its newest `SLIDE_KEEP` part,
  which is prefilled again at positions 0.. before decoding continues. This costs one prefill every
  block_size / 4 tokens instead of nanoGPT's full recompute at every step, and a row's window never
  depends on the other rows of its batch. A warning says so the first time a window slides.
- `extend_context=True` (sinusoidal and rotary positions) drops nothing: positions run past block_size,
  where the model was never trained, for as long as the generation asks. Learned positions have no
  vector past block_size, so they always slide.

Stop conditions: `max_new_tokens`, `stop_tokens` (e.g. the end-of-text id) in `generate_tokens`, and
stop strings in `generate_text`, which also decodes UTF-8 safely across BPE pieces for streaming.
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from gptlite.config import GPTConfig
    from gptlite.model import GPT

SLIDE_KEEP = 0.75  # fraction of block_size kept when a window slides
COMPILED_LEN_MULTIPLE = 64  # compile=True rounds the cache length up to a multiple of this (or block_size)
PAD = -1  # "no token": left padding of ragged prompts, and what a row yields after it has stopped

Prompts = torch.Tensor | Sequence[Sequence[int]]


class KVCache:
    """Keys and values of every layer for a fixed batch, preallocated for `max_len` slots and written in
    place, plus what the next forward call needs (set by `prepare`): the cache slots its tokens go to,
    their positions and the attention mask. A slot is visible once written, unless it holds padding."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (batch_size, config.n_head, max_len, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]  # (B, H, max_len, D) each
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.max_len = max_len
        self.visible = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (B, max_len)
        self.first = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) each row's first real slot
        self.padded = False  # whether any row has left padding
        self.end = 0  # slots written so far (the same for every row)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # (T,) slots of the next call's tokens
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, T) their positions
        self.mask: torch.Tensor | None = None  # (B, 1, T, S) True where a query may attend to a key
        self.span = 0  # S, the number of slots the next call attends over
        self.busy = False  # a compiled generation is using it (see _static_cache)

    def start(self, padding: torch.Tensor) -> None:
        """Forget the contents; the next prompts have `padding` (B,) pad tokens on their left."""
        self.first = padding.to(self.first.device)
        self.padded = bool(padding.any())
        self.visible.zero_()
        self.end = 0

    def prepare(self, T: int, full_span: bool = False) -> None:
        """Set up the next forward call, which writes T tokens per row at slots end..end+T-1. With
        `full_span` it attends over all max_len slots, so its shapes never change (for CUDA graphs)."""
        a, b = self.end, self.end + T
        assert b <= self.max_len, f"KV cache overflow: {b} > {self.max_len}"
        device = self.visible.device
        self.slots = torch.arange(a, b, device=device)  # (T,)
        self.span = self.max_len if full_span else b
        self.end = b
        if T == 1:  # decoding: every row's token is real, at position a - first
            self.pos = (a - self.first)[:, None]  # (B, 1)
            self.visible[:, a] = True
            # slots past a are not written yet, so they are not visible: the query sees exactly the visible ones
            no_mask = not self.padded and not full_span  # one query that sees every key written so far
            self.mask = None if no_mask else self.visible[:, None, None, : self.span]  # (B, 1, 1, S)
            return
        self.pos = (self.slots[None, :] - self.first[:, None]).clamp_min(0)  # (B, T); padding at 0
        self.visible[:, a:b] = self.slots[None, :] >= self.first[:, None]  # (B, T)
        keys = torch.arange(self.span, device=device)  # (S,)
        causal = keys[None, :] <= self.slots[:, None]  # (T, S)
        # a padding query sees itself, so no softmax row is empty (that would give NaN, not ignorable junk)
        mask = (self.visible[:, None, : self.span] & causal) | (keys[None, :] == self.slots[:, None])  # (B, T, S)
        self.mask = mask[:, None]  # (B, 1, T, S)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer's k, v (B, H, T, D) at the prepared slots; return its keys and values (B, H, S, D)."""
        self.k[layer].index_copy_(2, self.slots, k)
        self.v[layer].index_copy_(2, self.slots, v)
        return self.k[layer][:, :, : self.span], self.v[layer][:, :, : self.span]

    def repeat_rows(self, n: int) -> None:
        """Give every row n consecutive copies (n samples of each prompt share one prefill)."""
        if n > 1:
            self.k = [k.repeat_interleave(n, dim=0) for k in self.k]
            self.v = [v.repeat_interleave(n, dim=0) for v in self.v]
            self.visible, self.first = self.visible.repeat_interleave(n, dim=0), self.first.repeat_interleave(n, dim=0)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i takes over the contents of row rows[i] (beam search: each beam follows its parent), in place,
        so the buffers keep their addresses (CUDA graphs recorded against them stay valid)."""
        for buffer in self.k + self.v:
            buffer.copy_(buffer.index_select(0, rows))
        self.visible.copy_(self.visible.index_select(0, rows))
        self.first = self.first.index_select(0, rows)

    def same_shape(self, other: KVCache) -> bool:
        mine, theirs = self.k[0], other.k[0]
        return (len(self.k), mine.shape, mine.dtype, mine.device) == (len(other.k), theirs.shape, theirs.dtype, theirs.device)

    def copy_from(self, other: KVCache) -> None:
        """Take over other's contents (same shapes), keeping this cache's buffers where they are."""
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            mine.copy_(theirs)
        self.visible.copy_(other.visible)
        self.first, self.padded, self.end = other.first, other.padded, other.end


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits; checked when built. See `sample_next` and
    `apply_penalties` for what each control does."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty"):
            value = getattr(self, name)
            optional = name in ("top_k", "top_p") and value is None
            if not optional and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
                raise TypeError(f"{name}={value!r} must be a finite number" + (", or None" if name in ("top_k", "top_p") else ""))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and (self.top_k < 1 or self.top_k != int(self.top_k)):
            raise ValueError(f"top_k={self.top_k} must be an integer >= 1, or None for no limit")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1], or None for no limit")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from logits (B, V) -> (B,). temperature=0 is greedy (argmax); top_k keeps the
    k most likely tokens; top_p keeps the smallest set whose probability reaches p (Holtzman et al., 2019,
    "The Curious Case of Neural Text Degeneration"). top_k=None and top_p=1 change nothing."""
    Sampling(temperature, top_k, top_p)  # checks the values
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
) -> torch.Tensor:
    """Discourage repeats in logits (B, V). repetition_penalty r (Keskar et al., 2019, CTRL): a token that
    occurs in the prompt or the output so far has its logit divided by r if positive, multiplied by r
    if negative. frequency_penalty f (OpenAI's): subtract f times the token's count in the output so far.
    seen (B, V) bool and counts (B, V) float hold those occurrences."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if frequency_penalty != 0.0:
        logits = logits - frequency_penalty * counts
    return logits


def _prompt_rows(prompts: Prompts, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ids, checked: a (B, T) tensor with T >= 1, or a sequence of non-empty id lists."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.size(1) == 0:
            raise ValueError(f"prompt must have shape (B, T) with T >= 1, got {tuple(prompts.shape)}")
        rows = prompts.tolist()
    else:
        rows = [list(map(int, row)) for row in prompts]
        if not rows:
            raise ValueError("no prompts given; pass a (B, T) tensor or a list of token-id lists")
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {i} is empty; give at least one token (e.g. the end-of-text id)")
    for i, row in enumerate(rows):
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size}); check the tokenizer")
    return rows


def _prefill(model: GPT, cache: KVCache, rows: list[list[int]], step: Callable | None = None) -> torch.Tensor:
    """Run the rows (left-padded to the longest) through the model into an emptied cache; logits (B, V).
    A compiled `step` (see `compiled_decode_step`) attends over the whole cache, so its shapes are fixed."""
    T = max(len(r) for r in rows)
    device = cache.visible.device
    idx = torch.tensor([[0] * (T - len(r)) + r for r in rows], device=device)  # (B, T); pads are masked
    cache.start(torch.tensor([T - len(r) for r in rows], device=device))
    cache.prepare(T, full_span=step is not None)
    return (step or decode_step)(model, idx, cache)  # (B, V)


def decode_step(model: GPT, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step: token (B, 1), through the prepared cache, -> logits (B, V)."""
    return model.step(token, cache)


_compiled: dict[str, Callable] = {}  # device type -> decode_step through torch.compile
_frozen_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its weights' version
_compiled_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the shapes compiled for it
# inductor settings for the CPU decode step (see compiled_decode_step); the last two keep the autotuning quiet
CPU_COMPILE = {
    "freezing": True,
    "max_autotune_gemm": True,
    "cpp_wrapper": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
CUDA_COMPILE = {"coordinate_descent_tuning": True}  # inductor settings for the CUDA decode step
COMPILE_SETTINGS = {"cpu": CPU_COMPILE, "cuda": CUDA_COMPILE}


def compiled_decode_step(model: GPT) -> Callable:
    """`decode_step` through torch.compile with fixed shapes, compiled on first use for each shape.

    On CUDA, CUDA graphs (mode="reduce-overhead") replay the whole step, and its Triton kernels' launch
    settings are tuned by coordinate descent (`CUDA_COMPILE`, as gpt-fast does): that is what makes int8
    weights fast there, the int8-to-bfloat16 conversion fused into a matrix-vector kernel that is tuned for
    its shape (GPT-2-124M on an H100, batch 1: 390 -> 2,028 tokens/s). On the CPU, each shape compiles
    with the inductor settings in `CPU_COMPILE`: `freezing` makes the weights constants, prepacked once;
    `max_autotune_gemm` times MKL against inductor's own C++ GEMM kernels for every matmul shape and
    keeps the faster (its kernels win, 3-4x, for the few rows of a decode step); `cpp_wrapper` calls the
    kernels from C++ rather than Python. Measured on a 2-core CPU, float32, batch 1, against freezing
    alone: GPT-2-124M 36 -> 64 tokens/s; the 4x128 char model 1,130 -> 2,290 (with its slides compiled
    too, see `_decode_loop`, and `masked_attention`'s math). The price is a longer first call, most of it
    autotuning (GPT-2-124M: 27 s -> 58 s; char model: 6 s -> 34 s). Frozen weights are read once, when the
    step compiles, so changing them in place afterwards raises ValueError instead of decoding with stale
    weights.
    """
    weight = model.tok_emb.weight
    kind = weight.device.type
    if kind not in _compiled:
        mode = "reduce-overhead" if kind == "cuda" else None
        _compiled[kind] = torch.compile(decode_step, mode=mode, fullgraph=True, dynamic=False)
    step = _compiled[kind]
    settings = COMPILE_SETTINGS.get(kind)
    if settings is None:
        return step
    if kind == "cpu":  # only the CPU settings freeze the weights into the compiled step
        version = sum(p._version for p in model.parameters())
        if _frozen_versions.setdefault(model, version) != version:
            raise ValueError(
                "this model's weights changed in place after compile=True froze them for the CPU; generate with "
                "compile=False, or call gptlite.generate.reset_compiled() to compile again"
            )
    compiled_shapes = _compiled_shapes.setdefault(model, set())

    def tuned_step(model: GPT, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        shape = (tuple(token.shape), cache.max_len, weight.dtype)
        if shape in compiled_shapes:  # compiled already: skip the settings patch, which costs ~30 us a step
            return step(model, token, cache)
        with torch._inductor.config.patch(settings):  # read when a call compiles
            logits = step(model, token, cache)
        compiled_shapes.add(shape)
        return logits

    return tuned_step


def reset_compiled() -> None:
    """Forget every compiled decode step (this resets all of torch.compile's caches: torch._dynamo.reset)."""
    torch._dynamo.reset()
    _compiled.clear()
    _frozen_versions.clear()
    _compiled_shapes.clear()
    _static_caches.clear()


class SlabLinear(nn.Module):
    """An nn.Linear for eager CPU decoding of one row: a matrix-vector product, bound by streaming the weight
    from memory. The weight is cut into one contiguous slab of output rows per thread and run as a batched
    matmul, so that each thread streams its own slab from start to end. Layers wider than they are deep
    (q/k/v, the feed-forward input, the head: N > K) keep their slabs transposed, (K, N/P) each, and multiply
    the row into them; the others multiply each slab (N/P, K) by the row. On a 2-core AVX2 CPU this was faster
    than oneDNN on a prepacked weight (`PackedLinear`) at every GPT-2-124M shape: 12-27 GB/s against 9-22 (a
    plain sum over the same bytes: 16-26). Several rows (a prompt) go through F.linear."""

    def __init__(self, linear: nn.Linear, parts: int | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        weight = linear.weight.detach()
        N, K = weight.shape
        parts = parts or torch.get_num_threads()
        rows = -(-N // parts)  # output rows per slab; the last slab is padded with zeros
        if rows * parts != N:
            weight = torch.cat([weight, weight.new_zeros(rows * parts - N, K)])
        self.transposed = N > K
        slabs = weight.view(parts, rows, K)  # a view of the layer's own weight when nothing is padded
        self.slabs = slabs.transpose(1, 2).contiguous() if self.transposed else slabs  # (P, K, N/P) or (P, N/P, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K = x.size(-1)
        if x.numel() != K:
            return F.linear(x, self.weight, self.bias)
        row = x.reshape(1, 1, K).expand(len(self.slabs), 1, K)  # (P, 1, K)
        if self.transposed:
            y = torch.bmm(row, self.slabs)  # (P, 1, N/P)
        else:
            y = torch.bmm(self.slabs, row.transpose(1, 2))  # (P, N/P, 1)
        y = y.reshape(-1)[: self.weight.size(0)].view(*x.shape[:-1], -1)  # (..., N)
        return y if self.bias is None else y + self.bias


class PackedLinear(nn.Module):
    """An nn.Linear for eager CPU decoding of a batch: its float32 weight packed once into oneDNN's blocked
    layout, and the matmul run by oneDNN. At eight rows oneDNN on a prepacked weight streams the weights
    1.3-2.5x faster than `F.linear` (measured on a 2-core AVX2 CPU, GPT-2-124M shapes: 11-14 GB/s against 5-8)."""

    def __init__(self, linear: nn.Linear, rows: int):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)  # a copy, (N, K)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N)


PACK_MIN_WEIGHTS = 1 << 18  # the 4x128 char model's layers (49K weights) decode 1.3-1.5x faster as they are
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its weights' state, layout, view)


def packed_for_cpu(model: GPT, rows: int) -> GPT:
    """The model as eager decoding on the CPU runs it: a view that shares every module and tensor except the
    nn.Linear layers of at least PACK_MIN_WEIGHTS weights, which become `SlabLinear`s for one row and
    `PackedLinear`s for a batch; smaller layers are bound by per-call overhead, and are left as they are. The
    view is kept for the next call (the slabs and packed copies cost up to as much memory as the linear
    weights) and made again when the weights or the thread count change. Other devices and dtypes, and
    builds without oneDNN, get the model itself."""
    weight = model.tok_emb.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    layout = (1 if rows == 1 else 8, torch.get_num_threads())
    state = (model.training, *((p.data_ptr(), p._version) for p in model.parameters()))
    kept = _packed.get(model)
    if kept is not None and kept[:2] == (state, layout):
        return kept[2]

    def packs(module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and module.weight.numel() >= PACK_MIN_WEIGHTS

    def view(module: nn.Module) -> nn.Module:
        if packs(module):
            return SlabLinear(module) if rows == 1 else PackedLinear(module, layout[0])
        if not any(packs(m) for m in module.modules()):
            return module  # shared as it is
        clone = copy.copy(module)  # the same parameters and buffers; its own table of submodules
        clone._modules = {name: view(child) for name, child in module._modules.items()}
        return clone

    if not any(packs(m) for m in model.modules()):
        return model
    _packed[model] = (state, layout, view(model))
    return _packed[model][2]


def generate_tokens(
    model: GPT,
    prompts: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    *,
    seed: int | None = None,
    num_samples: int = 1,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    stop_tokens: Iterable[int] = (),
    extend_context: bool = False,
    compile: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (N,), up to max_new_tokens times.

    prompts: a (B, T) tensor, or B lists of token ids of any lengths. Each prompt gives `num_samples`
    consecutive rows (N = B * num_samples), sharing one prefill. A row that samples one of `stop_tokens`
    yields it, then PAD (-1); generation ends when every row has stopped. `seed` (or `generator`) makes
    sampling reproducible. See the module docstring for `extend_context` and `compile`. Arguments are
    checked when it is called, before the first token.
    """
    config = model.config
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty, frequency_penalty)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    if extend_context and not model.pos_emb.can_extend:
        raise ValueError(
            f"extend_context=True needs pos_emb='sinusoidal' or 'rope'; this model's {config.pos_emb} positions "
            f"stop at block_size={config.block_size}, so its window slides instead (leave extend_context=False)"
        )
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    rows = _prompt_rows(prompts, config.vocab_size)
    if not extend_context:
        rows = [r[-config.block_size :] for r in rows]  # a prompt longer than the window keeps its end
    rows = [r for r in rows for _ in range(num_samples)]
    if seed is not None:
        generator = torch.Generator(device=model.tok_emb.weight.device).manual_seed(seed)
    stop_ids = sorted(set(stop_tokens))
    return _decode(model, rows, num_samples, max_new_tokens, sampling, generator, stop_ids, extend_context, compile)


@torch.no_grad()
def _decode(
    model: GPT,
    rows: list[list[int]],
    num_samples: int,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    stop_ids: list[int],
    extend_context: bool,
    compile: bool,
) -> Iterator[torch.Tensor]:
    """The loop of `generate_tokens`, for checked arguments; rows holds each prompt num_samples times."""
    if max_new_tokens == 0:
        return
    config = model.config
    T = max(len(r) for r in rows)
    max_len = T + max_new_tokens - 1  # the last sampled token is never fed back
    if compile:  # a compiled step is specialised to the cache length: round it up, so that fewer lengths compile
        max_len = -(-max_len // COMPILED_LEN_MULTIPLE) * COMPILED_LEN_MULTIPLE
    if extend_context:
        model.pos_emb.extend(max_len)
    else:
        max_len = min(max_len, config.block_size)
    step = compiled_decode_step(model) if compile else decode_step
    if not compile:
        model = packed_for_cpu(model, len(rows))

    cache = model.new_cache(len(rows) // num_samples, max_len)
    logits = _prefill(model, cache, rows[::num_samples]).repeat_interleave(num_samples, dim=0)  # (N, V)
    cache.repeat_rows(num_samples)
    if compile:
        cache = _static_cache(model, cache)
    try:
        yield from _decode_loop(model, cache, rows, logits, max_new_tokens, sampling, generator, stop_ids, step, compile)
    finally:
        cache.busy = False


_static_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its compiled step's cache


def _static_cache(model: GPT, cache: KVCache) -> KVCache:
    """The cache the compiled step writes into. Its buffers keep their addresses from call to call (one
    per model, reused while the shapes match), so CUDA graphs recorded against them stay valid instead
    of being recorded again for every generation; a second generation running at the same time gets
    its own."""
    static = _static_caches.get(model)
    if static is not None and not static.busy and static.same_shape(cache):
        static.copy_from(cache)
    else:
        static = cache
        for buffer in static.k + static.v:
            torch._dynamo.mark_static_address(buffer)
        if model not in _static_caches or not _static_caches[model].busy:
            _static_caches[model] = static
    static.busy = True
    return static


def _decode_loop(
    model: GPT,
    cache: KVCache,
    rows: list[list[int]],
    logits: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    stop_ids: list[int],
    step: Callable,
    compile: bool,
) -> Iterator[torch.Tensor]:
    """Sample, then feed the sample back (or slide the window), max_new_tokens times."""
    config, device = model.config, cache.visible.device
    keep = max(1, int(config.block_size * SLIDE_KEEP))
    N, V = len(rows), config.vocab_size
    if sampling.penalized:
        seen = torch.zeros(N, V, dtype=torch.bool, device=device)  # (N, V) tokens in the prompt and output
        for i, r in enumerate(rows):
            seen[i, r] = True
        counts = torch.zeros(N, V, device=device)  # (N, V) occurrences in the output
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    fed: list[torch.Tensor] = []  # tokens fed since the last prefill, each (N,)
    warned = False
    for i in range(max_new_tokens):
        if sampling.penalized:
            logits = apply_penalties(logits, seen, counts, sampling.repetition_penalty, sampling.frequency_penalty)
        nxt = sample_next(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)  # (N,)
        if stop_ids:
            nxt = nxt.masked_fill(done, PAD)
            done |= torch.isin(nxt, stops)
        yield nxt
        if i == max_new_tokens - 1 or (stop_ids and bool(done.all())):
            return
        token = nxt.clamp_min(0)  # a stopped row feeds a dummy id; its output is never used
        if sampling.penalized:
            seen.scatter_(1, token[:, None], True)
            counts.scatter_add_(1, token[:, None], torch.ones_like(counts[:, :1]))
        if cache.end < cache.max_len:
            fed.append(token)
            cache.prepare(1, full_span=compile)
            logits = step(model, token[:, None], cache)  # (N, V)
            continue
        # the cache is full, which happens only when sliding: some row's window holds block_size tokens
        if not warned:
            warnings.warn(
                f"the context reached block_size={config.block_size}: a full window keeps its newest {keep} "
                "tokens, which are prefilled again at positions 0.. (see gptlite.generate)"
            )
            warned = True
        new = torch.stack([*fed, token], dim=1).tolist()  # (N, tokens since the last prefill)
        rows = [w if len(w) <= config.block_size else w[-keep:] for w in (r + n for r, n in zip(rows, new))]
        fed = []
        # when every row slid, the prefill has one shape, block_size * SLIDE_KEEP, so it compiles once
        logits = _prefill(model, cache, rows, step if compile and all(len(r) == keep for r in rows) else None)


@torch.no_grad()
def generate(
    model: GPT,
    prompts: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    **kwargs,
) -> torch.Tensor | list[list[int]]:
    """Prompts plus their new tokens; arguments as for `generate_tokens`, or, with `num_beams` (see
    gptlite.beam), the best continuations by beam search: `num_beams`, `length_penalty` (1.0), `early_stopping`
    (False, True or "never"), `num_return_sequences` (1, at most num_beams) and `stop_tokens`, `extend_context`,
    `compile`. Beam search is deterministic: temperature may be 0 or 1, and no top_k, top_p, penalties or
    seeds; num_beams=1 is greedy decoding.

    A (B, T) tensor gives a (B * n, T + L) tensor, n = num_samples or num_return_sequences, L <= max_new_tokens
    (fewer when every row stopped early; a stopped row is filled with PAD = -1). Lists of ids give lists of ids,
    without PAD.
    """
    if "num_beams" in kwargs:
        return _generate_beams(model, prompts, max_new_tokens, temperature, top_k, top_p, generator, **kwargs)
    new = list(generate_tokens(model, prompts, max_new_tokens, temperature, top_k, top_p, generator, **kwargs))
    n = kwargs.get("num_samples", 1)
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.repeat_interleave(n, dim=0)
        return torch.cat([prompts, torch.stack(new, dim=1)], dim=1) if new else prompts.clone()
    columns = torch.stack(new, dim=1).tolist() if new else [[] for _ in range(len(prompts) * n)]
    return [[*map(int, p), *(t for t in c if t != PAD)] for p, c in zip((p for p in prompts for _ in range(n)), columns)]


BEAM_OPTIONS = ("length_penalty", "early_stopping", "num_return_sequences", "stop_tokens", "extend_context", "compile")


def _generate_beams(model: GPT, prompts: Prompts, max_new_tokens: int, temperature: float, top_k: int | None,
                    top_p: float | None, generator: torch.Generator | None, num_beams: int, **kwargs):
    """`generate` with num_beams: the arguments checked, then gptlite.beam.beam_search (or greedy decoding)."""
    from gptlite.beam import beam_search

    problems = []
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        problems.append(f"num_beams={num_beams!r} must be an integer >= 1")
    if temperature not in (0, 1) or top_k is not None or top_p is not None:
        problems.append(f"beam search scores the model's own probabilities: temperature={temperature} must be 0 or 1 and "
                        f"top_k={top_k}, top_p={top_p} None (beam sampling is not supported)")
    others = sorted(set(kwargs) - set(BEAM_OPTIONS)) + (["generator"] if generator is not None else [])
    if others:
        problems.append(f"{', '.join(others)} cannot be used with num_beams (beam search is deterministic; "
                        "num_return_sequences gives several continuations)")
    n = kwargs.pop("num_return_sequences", 1)
    if not problems and not 1 <= n <= num_beams:
        problems.append(f"num_return_sequences={n} must be between 1 and num_beams={num_beams}")
    early_stopping = kwargs.pop("early_stopping", False)
    if early_stopping not in (True, False, "never"):
        problems.append(f"early_stopping={early_stopping!r} must be True, False or 'never'")
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    if num_beams == 1 or max_new_tokens == 0:  # one beam is greedy decoding
        kwargs.pop("length_penalty", None)
        return generate(model, prompts, max_new_tokens, temperature=0, **kwargs)
    rows = _prompt_rows(prompts, model.config.vocab_size)
    new = beam_search(model, rows, max_new_tokens, num_beams, early_stopping=early_stopping, num_return_sequences=n,
                      length_penalty=kwargs.get("length_penalty", 1.0), stop_tokens=list(kwargs.get("stop_tokens", ())),
                      extend_context=kwargs.get("extend_context", False), compile=kwargs.get("compile", False))
    full = [[*rows[i // n], *tokens] for i, tokens in enumerate(new)]
    if not isinstance(prompts, torch.Tensor):
        return full
    width = max(len(r) for r in full)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in full], device=prompts.device)


class TextStream:
    """One row's token ids in, text out: UTF-8 safe across BPE pieces, and cut exactly before the first
    stop string. Text that could still be the start of a stop string is held back until it cannot."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.pending = ""  # decoded text not yet released
        self.done = False

    def feed(self, ids: Iterable[int]) -> str:
        """Text released by these ids ("" once the stream is done)."""
        if self.done:
            return ""
        self.pending += self.decoder.feed(ids)
        return self._release(final=False)

    def close(self) -> str:
        """The text still held back; the stream is done."""
        if self.done:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending, self.done = self.pending[: min(hits)], "", True
            return out
        # no stop string has started before a released character: keep the longest tail that begins one
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.done = final
        return out


def generate_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    stop: Sequence[str] = (),
    stop_at_eot: bool = True,
    **kwargs,
) -> Iterator[list[str]]:
    """Yield, at each step, the new text of every row (each prompt gives `num_samples` rows): UTF-8 safe
    across BPE pieces, cut exactly before the first of the `stop` strings, and ended by the end-of-text
    token when `stop_at_eot` and the tokenizer has one. The last item is what was held back. Other
    arguments as for `generate_tokens` (checked when called); an empty prompt starts from the end-of-text
    token (else id 0)."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    start = [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
    ids = [tokenizer.encode(t) or start for t in texts]
    stop_tokens = set(kwargs.pop("stop_tokens", ()))
    if stop_at_eot and tokenizer.eot_id is not None:
        stop_tokens.add(tokenizer.eot_id)
    streams = [TextStream(tokenizer, stop) for _ in range(len(ids) * kwargs.get("num_samples", 1))]
    return _texts(generate_tokens(model, ids, max_new_tokens, stop_tokens=stop_tokens, **kwargs), streams, stop_tokens)


def _texts(tokens: Iterator[torch.Tensor], streams: list[TextStream], stop_tokens: set[int]) -> Iterator[list[str]]:
    """The loop of `generate_text`: every row's tokens through its TextStream."""
    for nxt in tokens:
        pieces = [
            "" if t == PAD else s.close() if t in stop_tokens else s.feed([t]) for s, t in zip(streams, nxt.tolist())
        ]
        yield pieces
        if all(s.done for s in streams):
            tokens.close()
            return
    yield [s.close() for s in streams]
