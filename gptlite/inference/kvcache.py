"""The KV caches and the steps that run a model through a cache: `kv_buffers` (the buffers' shape, computed once),
sample.py's `KVCache`, prefill of (ragged) prompts, the decode step, the compiled decode step (`compile=True`), and
`start_decoding`, the set-up generation and beam search share.
Every cache is an `AttentionCache`, what the model reads from any cache: that interface stands below both
(gptlite.model.attention_cache), so that the model imports nothing of generation; it is importable from here too.

`KVCache` holds every layer's keys and values for a fixed batch in buffers preallocated with static shapes
(B, KV, max_len, D), and every other layer's state (`state_buffers`: a convolution's last inputs) in buffers of its
own. Prompts are left-padded to the longest; a mask hides each row's padding from attention, `real` keeps it out of
the other layers' states, and positions count from each row's first real token, so a padded row computes what it
would alone. Each decode step writes one slot in place. The server's per-row cache (gptlite.serve.rows.RowCache) plays
the same role for continuous batching: it is an `AttentionCache` too, takes its buffers from `kv_buffers` and
`state_buffers`, and runs through the same `decode_step`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gptlite.inference.cpu.decode import packed_for_cpu
from gptlite.inference.quantize import choose_ways
from gptlite.model.attention_cache import AttentionCache  # importable from here too, as before
from gptlite.model.network import layer_states

if TYPE_CHECKING:
    from gptlite.config import GPTConfig
    from gptlite.model.network import Transformer


def kv_buffers(
    config: GPTConfig, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's key and value buffers, zeros of (batch_size, KV, max_len, D) each: the one place a cache's
    shape comes from. Only n_kv_head heads are kept (grouped-query attention's saving), and every layer has
    tensors of its own, so that writing one layer's never makes a compiled step copy them all. A layer that does not
    attend (config.layer_types) gets buffers of no slots: its state is in `state_buffers`."""
    attends = config.attention_layer_ids
    shapes = [
        (batch_size, config.kv_heads, max_len if i in attends else 0, config.head_width)  # (B, KV, max_len, D)
        for i in range(config.n_layer)
    ]
    keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    return keys, values


def state_buffers(
    config: GPTConfig, batch_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[dict[str, torch.Tensor]]:
    """Every layer's state besides keys and values, zeros of (batch_size, *shape) for each tensor its `state_spec`
    names (gptlite.model.network.layer_states; empty for attention layers): per row, never per slot, since a state
    holds what a row has been fed so far."""
    return [
        {
            name: torch.zeros((batch_size, *spec.shape), dtype=spec.dtype or dtype, device=device)
            for name, spec in specs.items()
        }
        for specs in layer_states(config)
    ]


def state_tensors(states: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Every layer's state tensors, in layer order, then name order: what a row's snapshot lists."""
    return [tensor for layer in states for tensor in layer.values()]


class KVCache:
    """Keys and values of every layer for a fixed batch, preallocated for `max_len` slots and written in
    place, plus what the next forward call needs (set by `prepare`): the cache slots its tokens go to,
    their positions and the attention mask. A slot is visible once written, unless it holds padding."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.k, self.v = kv_buffers(config, batch_size, max_len, dtype, device)  # (B, KV, max_len, D) each
        self.states = state_buffers(config, batch_size, dtype, device)  # per layer: name -> (B, *shape)
        self.tokens = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)  # (B, max_len) (bigram_vocab)
        self.max_len = max_len
        self.visible = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (B, max_len)
        self.first = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) each row's first real slot
        self.padded = False  # whether any row has left padding
        self.end = 0  # slots written so far (the same for every row)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # (T,) slots of the next call's tokens
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, T) their positions
        self.mask: torch.Tensor | None = None  # (B, 1, T, S) True where a query may attend to a key
        self.real: torch.Tensor | None = None  # (B, T) False where a token is left padding; None: none is
        self.span = 0  # S, the number of slots the next call attends over
        self.decode_slot: int | None = None  # the one slot a decode step (not of full span) writes: decode_buffers
        self.busy = False  # a compiled generation is using it (see static_cache)

    def start(self, padding: torch.Tensor) -> None:
        """Forget the contents; the next prompts have `padding` (B,) pad tokens on their left."""
        self.first = padding.to(self.first.device)
        self.padded = bool(padding.any())
        self.visible.zero_()
        for tensor in state_tensors(self.states):
            tensor.zero_()
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
        self.decode_slot = a if T == 1 and not full_span else None
        self.real = None
        if T == 1:  # decoding: every row's token is real, at position a - first
            self.pos = (a - self.first)[:, None]  # (B, 1)
            self.visible[:, a] = True
            # slots past a are not written yet, so they are not visible: the query sees exactly the visible ones
            no_mask = not self.padded and not full_span  # one query that sees every key written so far
            self.mask = None if no_mask else self.visible[:, None, None, : self.span]  # (B, 1, 1, S)
            return
        self.pos = (self.slots[None, :] - self.first[:, None]).clamp_min(0)  # (B, T); padding at 0
        self.visible[:, a:b] = self.slots[None, :] >= self.first[:, None]  # (B, T)
        if self.padded:
            self.real = self.visible[:, a:b]  # (B, T)
        keys = torch.arange(self.span, device=device)  # (S,)
        causal = keys[None, :] <= self.slots[:, None]  # (T, S)
        # a padding query sees itself, so no softmax row is empty (that would give NaN, not ignorable junk)
        mask = (self.visible[:, None, : self.span] & causal) | (keys[None, :] == self.slots[:, None])  # (B, T, S)
        self.mask = mask[:, None]  # (B, 1, T, S)

    @property
    def key_pos(self) -> torch.Tensor:
        """The positions of the keys the next call attends over (B, S) (a sliding window's bound; padding's are
        negative, and masked)."""
        return torch.arange(self.span, device=self.first.device)[None, :] - self.first[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer's k, v (B, H, T, D) at the prepared slots; return its keys and values (B, H, S, D)."""
        self.k[layer].index_copy_(2, self.slots, k)
        self.v[layer].index_copy_(2, self.slots, v)
        return self.k[layer][:, :, : self.span], self.v[layer][:, :, : self.span]

    def read_state(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's state (name -> (B, *shape)): every row's, as the last call left it (zeros after `start`)."""
        return self.states[layer]

    def write_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """Store layer's state after this call, in place (the buffers keep their addresses, as the keys' do)."""
        for name, tensor in state.items():
            self.states[layer][name].copy_(tensor)

    def decode_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None]:
        """What a decode step of one token per row (after a `prepare` that set `decode_slot`) reads and writes in
        layer `layer`, for a step that writes the token's keys and values itself instead of calling `update` (the
        CPU's one-call steps, gptlite.inference.cpu.blocks): its keys and values (B, KV, max_len, D), the slot the
        token's go to, the span of slots it attends over, and which of them each row sees (B, max_len), None where it
        sees every slot written."""
        visible = self.visible if self.padded else None  # (B, max_len)
        return self.k[layer], self.v[layer], self.decode_slot, self.span, visible

    def previous_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Write idx (B, T) at the prepared slots; each token's previous one (B, T), -1 at position 0 (a row's first
        real token; its left padding is at position 0 too, and masked)."""
        self.tokens.index_copy_(1, self.slots, idx)
        before = self.tokens.index_select(1, (self.slots - 1).clamp_min(0))  # (B, T)
        return torch.where(self.pos == 0, -1, before)

    def repeat_rows(self, n: int) -> None:
        """Give every row n consecutive copies (n samples of each prompt share one prefill)."""
        if n > 1:
            self.k = [k.repeat_interleave(n, dim=0) for k in self.k]
            self.v = [v.repeat_interleave(n, dim=0) for v in self.v]
            self.states = [{name: t.repeat_interleave(n, dim=0) for name, t in layer.items()} for layer in self.states]
            self.tokens = self.tokens.repeat_interleave(n, dim=0)
            self.visible = self.visible.repeat_interleave(n, dim=0)
            self.first = self.first.repeat_interleave(n, dim=0)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i takes over the contents of row rows[i] (beam search: each beam follows its parent), in place,
        so the buffers keep their addresses (CUDA graphs recorded against them stay valid)."""
        for buffer in [*self.k, *self.v, *state_tensors(self.states), self.tokens]:
            buffer.copy_(buffer.index_select(0, rows))
        self.visible.copy_(self.visible.index_select(0, rows))
        self.first = self.first.index_select(0, rows)

    def same_shape(self, other: KVCache) -> bool:
        mine = [(t.shape, t.dtype, t.device) for t in [*self.k, *state_tensors(self.states)]]
        theirs = [(t.shape, t.dtype, t.device) for t in [*other.k, *state_tensors(other.states)]]
        return mine == theirs

    def copy_from(self, other: KVCache) -> None:
        """Take over other's contents (same shapes), keeping this cache's buffers where they are."""
        mine = [*self.k, *self.v, *state_tensors(self.states), self.tokens]
        theirs = [*other.k, *other.v, *state_tensors(other.states), other.tokens]
        for buffer, source in zip(mine, theirs, strict=True):
            buffer.copy_(source)
        self.visible.copy_(other.visible)
        self.first = other.first
        self.padded = other.padded
        self.end = other.end


def new_cache(model: Transformer, batch_size: int, max_len: int | None = None) -> KVCache:
    """An empty KV cache for batch_size rows of up to max_len (default block_size) positions, in the weights' dtype
    and on their device."""
    weight = model.tok_emb.weight
    return KVCache(model.config, batch_size, max_len or model.config.block_size, weight.dtype, weight.device)


def prefill(model: Transformer, cache: KVCache, rows: list[list[int]], step: Callable | None = None) -> torch.Tensor:
    """Run the rows (left-padded to the longest) through the model into an emptied cache; logits (B, V).
    A compiled `step` (see `compiled_decode_step`) attends over the whole cache, so its shapes are fixed."""
    T = max(len(r) for r in rows)
    device = cache.visible.device
    idx = torch.tensor([[0] * (T - len(r)) + r for r in rows], device=device)  # (B, T); pads are masked
    cache.start(torch.tensor([T - len(r) for r in rows], device=device))
    cache.prepare(T, full_span=step is not None)
    return (step or decode_step)(model, idx, cache)  # (B, V)


def decode_step(
    model: Transformer, token: torch.Tensor, cache: AttentionCache, last: torch.Tensor | None = None
) -> torch.Tensor:
    """One step through a prepared cache: token (B, T), one token per row when decoding or the prompts when
    prefilling, -> logits (B, V) of the last (or of token last[b] of each row b, for prompts padded on the right).
    The one step every cache runs: sample.py's KVCache here, the server's RowCache in gptlite.serve.engine (which
    compiles it with dynamic shapes)."""
    return model.step(token, cache, last)


_compiled: dict[str, Callable] = {}  # device type -> decode_step through torch.compile
_frozen_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its weights' version
_compiled_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the shapes compiled for it
_static_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its compiled step's cache
_compile_failed: dict[str, str] = {}  # device type -> why its compiler failed (the step then runs uncompiled)
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


def compiled_decode_step(model: Transformer) -> Callable:
    """`decode_step` through torch.compile with fixed shapes, compiled on first use for each shape.

    On CUDA, CUDA graphs (mode="reduce-overhead") replay the whole step, and its Triton kernels' launch
    settings are tuned by coordinate descent (`CUDA_COMPILE`, as gpt-fast does): that is what makes int8
    weights fast there, the int8-to-bfloat16 conversion fused into a matrix-vector kernel that is tuned for
    its shape. On the CPU, each shape compiles with the inductor settings in `CPU_COMPILE`: `freezing` makes
    the weights constants, prepacked once; `max_autotune_gemm` times MKL against inductor's own C++ GEMM
    kernels for every matmul shape and keeps the faster (its kernels win for the few rows of a decode step);
    `cpp_wrapper` calls the kernels from C++ rather than Python. Together they make the compiled CPU step
    much faster than freezing alone (with the slid windows' prefills compiled too, see
    gptlite.inference.generate's `_decode_loop`, and `masked_attention`'s math). The price is a much longer first call,
    most of it autotuning. Frozen weights are read once, when the step compiles, so changing them in place
    afterwards raises ValueError instead of decoding with stale weights. The figures, and the commands that
    measure them, are in docs/generation.md and docs/benchmarks.md.
    """
    weight = model.tok_emb.weight
    kind = weight.device.type
    choose_ways(model)  # a quantized model's kernels, chosen before the compile: no file is read inside it
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
                "compile=False, or call gptlite.inference.kvcache.reset_compiled() to compile again"
            )
    compiled_shapes = _compiled_shapes.setdefault(model, set())

    def tuned_step(model: Transformer, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        shape = (tuple(token.shape), cache.max_len, weight.dtype)
        if shape in compiled_shapes:  # compiled already: skip the settings patch, a cost on every step otherwise
            return step(model, token, cache)
        if kind in _compile_failed:
            return decode_step(model, token, cache)
        try:
            with torch._inductor.config.patch(settings):  # read when a call compiles
                logits = step(model, token, cache)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # inductor's own build failed (its C++ compiler, $CXX, missing or broken, a full or read-only temporary
            # folder): compiling is a speed-up, so the step runs uncompiled, as compile=False runs it
            return uncompiled_step(kind, e, model, token, cache)
        compiled_shapes.add(shape)
        return logits

    return tuned_step


def uncompiled_step(
    kind: str, error: Exception, model: Transformer, token: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """decode_step, for every step on this device type from now on, after torch.compile failed on it; says why in
    one line, once. Nothing was written into the cache: a compile fails before the step runs."""
    inner = getattr(error, "inner_exception", None) or error.__cause__ or error  # what the backend raised
    cause = str(inner).strip().splitlines()
    _compile_failed[kind] = f"{type(inner).__name__}: {cause[0]}" if cause else type(inner).__name__
    warnings.warn(
        f"gptlite: compile=True: torch.compile failed on this {kind} ({_compile_failed[kind][:300]}); decoding "
        "uncompiled instead. Check the C++ compiler torch uses ($CXX, else g++) and its temporary folder, or leave "
        "--compile out",
        stacklevel=2,
    )
    return decode_step(model, token, cache)


def reset_compiled() -> None:
    """Forget every compiled decode step (this resets all of torch.compile's caches: torch._dynamo.reset)."""
    torch._dynamo.reset()
    _compiled.clear()
    _frozen_versions.clear()
    _compiled_shapes.clear()
    _static_caches.clear()
    _compile_failed.clear()


def static_cache(model: Transformer, cache: KVCache) -> KVCache:
    """The cache the compiled step writes into. Its buffers keep their addresses from call to call (one
    per model, reused while the shapes match), so CUDA graphs recorded against them stay valid instead
    of being recorded again for every generation; a second generation running at the same time gets
    its own."""
    static = _static_caches.get(model)
    if static is not None and not static.busy and static.same_shape(cache):
        static.copy_from(cache)
    else:
        static = cache
        for buffer in [*static.k, *static.v, *state_tensors(static.states), static.tokens]:
            torch._dynamo.mark_static_address(buffer)
        if model not in _static_caches or not _static_caches[model].busy:
            _static_caches[model] = static
    static.busy = True
    return static


def start_decoding(
    model: Transformer, prompts: list[list[int]], copies: int, max_len: int, compile: bool
) -> tuple[Transformer, Callable, KVCache, torch.Tensor]:
    """The set-up of a decoding loop: the prompts prefilled once into a new cache of max_len slots, each prompt's rows
    then copied `copies` times (samples of one prompt, or beam search's beams), through the compiled step
    (`compile`) or eagerly through the CPU's view of the model (gptlite.inference.cpu.decode.packed_for_cpu; the
    model itself elsewhere) -> (the model as decoding runs it, the decode step, the cache, the first logits
    (len(prompts) * copies, V))."""
    step = compiled_decode_step(model) if compile else decode_step
    if not compile:
        model = packed_for_cpu(model, len(prompts) * copies)
    cache = new_cache(model, len(prompts), max_len)
    logits = prefill(model, cache, prompts).repeat_interleave(copies, dim=0)  # (B * copies, V)
    cache.repeat_rows(copies)
    if compile:
        cache = static_cache(model, cache)
    return model, step, cache, logits
