"""The decode loop and streaming: `generate_tokens` (each step's tokens), `generate` (the whole output, or beam
search's) and `generate_text` (each step's text), with the window policy past `block_size`. Each takes its options as
keyword arguments, GPT.generate's, or as one gptlite.inference.sampling.GenerationOptions (`generate_tokens_with`,
`generate_with`, `generate_text_with`).

What the loop runs lives in modules of its own: the KV cache, prefill and the decode step, compiled or not, in
gptlite.inference.kvcache; the sampling controls in gptlite.inference.sampling; the CPU fast path of eager decoding in
gptlite.inference.cpu.decode; beam search in gptlite.inference.beam.

How `generate_tokens` runs:
1. Prefill: the prompts, left-padded to the longest, go through the model once into a KV cache preallocated
   with static shapes (`prefill`). Several samples of one prompt share that prefill: the cache rows are
   copied, not recomputed.
2. Decode: each step feeds only the newest token of every row and writes one cache slot in place; a padded
   row computes what it would alone. With `compile=True` the decode step (and the prefill of a slid window,
   whose length is fixed) is `torch.compile`d with fixed shapes (`compiled_decode_step`), for a cache length
   rounded up to a multiple of COMPILED_LEN_MULTIPLE, so that fewer lengths compile.
3. Sampling (`sample_next`): repetition, frequency and presence penalties, temperature (0 = greedy), top-k and
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

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gptlite.inference.beam import beam_search
from gptlite.inference.kvcache import KVCache, prefill, start_decoding
from gptlite.inference.sampling import (
    BEAMS,
    SAMPLING,
    GenerationOptions,
    Sampling,
    apply_penalties,
    mask_vocab,
    sample_next,
)
from gptlite.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from gptlite.model.network import Transformer

SLIDE_KEEP = 0.75  # fraction of block_size kept when a window slides
COMPILED_LEN_MULTIPLE = 64  # compile=True rounds the cache length up to a multiple of this (or block_size)
PAD = -1  # "no token": left padding of ragged prompts, and what a row yields after it has stopped

Prompts = torch.Tensor | Sequence[Sequence[int]]


def check_prompts(prompts: Prompts, vocab_size: int) -> list[list[int]]:
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
            raise ValueError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size}); check the tokenizer"
            )
    return rows


def generate_tokens(
    model: Transformer,
    prompts: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    **options,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (N,), up to max_new_tokens times: `generate_tokens_with` for the options
    given as keyword arguments (the fields of gptlite.inference.sampling.GenerationOptions: seed, num_samples,
    penalties, stop_tokens, extend_context, compile, vocab_limit)."""
    options = GenerationOptions(temperature=temperature, top_k=top_k, top_p=top_p, **options)
    return generate_tokens_with(model, prompts, max_new_tokens, options, generator)


def generate_tokens_with(
    model: Transformer,
    prompts: Prompts,
    max_new_tokens: int,
    options: GenerationOptions,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (N,), up to max_new_tokens times, sampled as `options` say.

    prompts: a (B, T) tensor, or B lists of token ids of any lengths. Each prompt gives `num_samples`
    consecutive rows (N = B * num_samples), sharing one prefill. A row that samples one of `stop_tokens`
    yields it, then PAD (-1); generation ends when every row has stopped. `seed` (or `generator`) makes
    sampling reproducible. Ids from `vocab_limit` on (the tokenizer's vocab_size, when the model's is padded past
    it) are never sampled. See the module docstring for `extend_context` and `compile`. Arguments are checked
    when it is called, before the first token.
    """
    config = model.config
    sampling = options.sampling
    beams_only = options.unused_by(SAMPLING)
    if beams_only:
        raise ValueError(
            f"{', '.join(beams_only)} configure beam search, and generate_tokens samples a token a step; "
            "leave them out, or call generate(..., num_beams=N)"
        )
    num_samples = options.num_samples
    extend_context = options.extend_context
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    if extend_context and not model.pos_emb.can_extend:
        raise ValueError(
            f"extend_context=True needs pos_emb='sinusoidal' or 'rope'; this model's {config.pos_emb} positions "
            f"stop at block_size={config.block_size}, so its window slides instead (leave extend_context=False)"
        )
    if options.seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    rows = check_prompts(prompts, config.vocab_size)
    if not extend_context:
        rows = [r[-config.block_size :] for r in rows]  # a prompt longer than the window keeps its end
    rows = [r for r in rows for _ in range(num_samples)]
    if options.seed is not None:
        generator = torch.Generator(device=model.tok_emb.weight.device).manual_seed(options.seed)
    stop_ids = sorted(set(options.stop_tokens))
    return _decode(
        model, rows, num_samples, max_new_tokens, sampling, generator, stop_ids, extend_context, options.compile
    )


@torch.no_grad()
def _decode(
    model: Transformer,
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
    model, step, cache, logits = start_decoding(model, rows[::num_samples], num_samples, max_len, compile)  # (N, V)
    try:
        yield from _decode_loop(
            model, cache, rows, logits, max_new_tokens, sampling, generator, stop_ids, step, compile
        )
    finally:
        cache.busy = False


def _decode_loop(
    model: Transformer,
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
        logits = mask_vocab(logits, sampling.vocab_limit)
        if sampling.penalized:
            logits = apply_penalties(
                logits,
                seen,
                counts,
                sampling.repetition_penalty,
                sampling.frequency_penalty,
                sampling.presence_penalty,
            )
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
                "tokens, which are prefilled again at positions 0.. (see gptlite.inference.generate)",
                stacklevel=2,
            )
            warned = True
        new = torch.stack([*fed, token], dim=1).tolist()  # (N, tokens since the last prefill)
        rows = [
            w if len(w) <= config.block_size else w[-keep:] for w in (r + n for r, n in zip(rows, new, strict=True))
        ]
        fed = []
        # when every row slid, the prefill has one shape, block_size * SLIDE_KEEP, so it compiles once
        logits = prefill(model, cache, rows, step if compile and all(len(r) == keep for r in rows) else None)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    **options,
) -> torch.Tensor | list[list[int]]:
    """`generate_with` for the options given as keyword arguments (the fields of
    gptlite.inference.sampling.GenerationOptions), as GPT.generate takes them."""
    options = GenerationOptions(temperature=temperature, top_k=top_k, top_p=top_p, **options)
    return generate_with(model, prompts, max_new_tokens, options, generator)


@torch.no_grad()
def generate_with(
    model: Transformer,
    prompts: Prompts,
    max_new_tokens: int,
    options: GenerationOptions,
    generator: torch.Generator | None = None,
) -> torch.Tensor | list[list[int]]:
    """Prompts plus their new tokens, sampled as for `generate_tokens_with`, or, with `num_beams` (see
    gptlite.inference.beam), the best continuations by beam search: `num_beams`, `length_penalty` (1.0),
    `early_stopping` (False, True or "never"), `num_return_sequences` (1, at most num_beams) and `stop_tokens`,
    `extend_context`, `compile`. Beam search is deterministic: temperature may be 0 or 1, and no top_k, top_p, penalties
    or seeds; num_beams=1 is greedy decoding.

    A (B, T) tensor gives a (B * n, T + L) tensor, n = num_samples or num_return_sequences, L <= max_new_tokens
    (fewer when every row stopped early; a stopped row is filled with PAD = -1). Lists of ids give lists of ids,
    without PAD.
    """
    if options.beams:
        return _generate_beams(model, prompts, max_new_tokens, options, generator)
    new = list(generate_tokens_with(model, prompts, max_new_tokens, options, generator))
    n = options.num_samples
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.repeat_interleave(n, dim=0)
        return torch.cat([prompts, torch.stack(new, dim=1)], dim=1) if new else prompts.clone()
    columns = torch.stack(new, dim=1).tolist() if new else [[] for _ in range(len(prompts) * n)]
    return [
        [*map(int, p), *(t for t in c if t != PAD)]
        for p, c in zip((p for p in prompts for _ in range(n)), columns, strict=True)
    ]


def _generate_beams(
    model: Transformer,
    prompts: Prompts,
    max_new_tokens: int,
    options: GenerationOptions,
    generator: torch.Generator | None,
):
    """`generate_with` with num_beams: the options checked, then gptlite.inference.beam.beam_search (or greedy
    decoding)."""
    num_beams = options.num_beams
    temperature = options.temperature
    problems = []
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        problems.append(f"num_beams={num_beams!r} must be an integer >= 1")
    sampled = [f"temperature={temperature} must be 0 or 1"] if temperature not in (0, 1) else []
    sampled += [
        f"{name}={value} must be None"
        for name, value in (("top_k", options.top_k), ("top_p", options.top_p))
        if value is not None
    ]
    if sampled:
        problems.append(
            f"beam search scores the model's own probabilities, so {' and '.join(sampled)} there (beam "
            "sampling is not supported)"
        )
    others = options.unused_by(BEAMS) + (["generator"] if generator is not None else [])
    if others:
        problems.append(
            f"{', '.join(others)} cannot be used with num_beams (beam search is deterministic; "
            "num_return_sequences gives several continuations)"
        )
    n = options.num_return_sequences
    if not isinstance(n, int) or isinstance(n, bool):
        problems.append(f"num_return_sequences={n!r} must be an integer")
    elif not problems and not 1 <= n <= num_beams:
        problems.append(f"num_return_sequences={n} must be between 1 and num_beams={num_beams}")
    if options.early_stopping not in (True, False, "never"):
        problems.append(f"early_stopping={options.early_stopping!r} must be True, False or 'never'")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    if num_beams == 1 or max_new_tokens == 0:  # one beam is greedy decoding
        return generate_with(model, prompts, max_new_tokens, options.greedy())
    rows = check_prompts(prompts, model.config.vocab_size)
    new = beam_search(model, rows, max_new_tokens, options)
    full = [[*rows[i // n], *tokens] for i, tokens in enumerate(new)]
    if not isinstance(prompts, torch.Tensor):
        return full
    width = max(len(r) for r in full)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in full], device=prompts.device)


class TextStream:
    """One row's token ids in, text out: UTF-8 safe across BPE pieces, and cut exactly before the first
    stop string. Text that could still be the start of a stop string is held back until it cannot.

    Each stop string is matched as the text arrives, one character at a time, by Knuth-Morris-Pratt: what it
    keeps is how many of the stop string's first characters the text ends with, so checking costs time linear in
    the text produced, however long the stop strings are (Knuth, Morris and Pratt, "Fast pattern matching in
    strings", 1977)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.borders = [borders(s) for s in self.stop]
        self.matched = [0] * len(self.stop)  # per stop string: how many of its first characters the text ends with
        self.pending = ""  # decoded text not yet released
        self.done = False

    def feed(self, ids: Iterable[int]) -> str:
        """Text released by these ids ("" once the stream is done)."""
        if self.done:
            return ""
        return self._release(self.decoder.feed(ids), final=False)

    def close(self) -> str:
        """The text still held back; the stream is done."""
        if self.done:
            return ""
        return self._release(self.decoder.flush(), final=True)

    def _release(self, text: str, final: bool) -> str:
        cut = self._match(text)
        self.pending += text
        if cut is not None:  # a stop string begins at `cut`: the text ends before it
            out = self.pending[:cut]
            self.pending = ""
            self.done = True
            return out
        # no stop string has started before a released character: keep the longest tail that begins one
        hold = 0 if final else max(self.matched, default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.done = final
        return out

    def _match(self, text: str) -> int | None:
        """Advance every stop string's match over text's characters; where in pending + text the stop string
        completed first begins (of several completed by one character, the longest), or None."""
        for i, char in enumerate(text):
            longest = 0  # of the stop strings completed by this character (the longest begins first)
            for j, stop in enumerate(self.stop):
                k = self.matched[j]
                while k and stop[k] != char:
                    k = self.borders[j][k - 1]
                k += stop[k] == char
                if k == len(stop):
                    longest = max(longest, k)
                    k = self.borders[j][k - 1]
                self.matched[j] = k
            if longest:
                return len(self.pending) + i + 1 - longest
        return None


def borders(s: str) -> list[int]:
    """Knuth-Morris-Pratt's failure function: for each prefix s[:i + 1], the length of its longest proper prefix
    that is also its suffix."""
    out = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        k += s[i] == s[k]
        out[i] = k
    return out


def generate_text(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    stop: Sequence[str] = (),
    stop_at_eot: bool = True,
    generator: torch.Generator | None = None,
    **options,
) -> Iterator[list[str]]:
    """`generate_text_with` for the options given as keyword arguments (the fields of
    gptlite.inference.sampling.GenerationOptions), vocab_limit the tokenizer's vocab_size unless given."""
    options = GenerationOptions(**{"vocab_limit": tokenizer.vocab_size, **options})
    return generate_text_with(
        model, tokenizer, prompts, max_new_tokens, options, stop=stop, stop_at_eot=stop_at_eot, generator=generator
    )


def generate_text_with(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    options: GenerationOptions,
    *,
    stop: Sequence[str] = (),
    stop_at_eot: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[list[str]]:
    """Yield, at each step, the new text of every row (each prompt gives `num_samples` rows): UTF-8 safe
    across BPE pieces, cut exactly before the first of the `stop` strings, and ended by the end-of-text
    token when `stop_at_eot` and the tokenizer has one. The last item is what was held back. The options as for
    `generate_tokens_with` (checked when called); an empty prompt starts from the end-of-text token (else id 0)."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    start = [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
    ids = [tokenizer.encode(t) or start for t in texts]
    stop_tokens = set(options.stop_tokens)
    if stop_at_eot and tokenizer.eot_id is not None:
        stop_tokens.add(tokenizer.eot_id)
    streams = [TextStream(tokenizer, stop) for _ in range(len(ids) * options.num_samples)]
    options = dataclasses.replace(options, stop_tokens=stop_tokens)
    return _texts(generate_tokens_with(model, ids, max_new_tokens, options, generator), streams, stop_tokens)


def _texts(tokens: Iterator[torch.Tensor], streams: list[TextStream], stop_tokens: set[int]) -> Iterator[list[str]]:
    """The loop of `generate_text`: every row's tokens through its TextStream."""
    for nxt in tokens:
        pieces = [
            "" if t == PAD else s.close() if t in stop_tokens else s.feed([t])
            for s, t in zip(streams, nxt.tolist(), strict=True)
        ]
        yield pieces
        if all(s.done for s in streams):
            tokens.close()
            return
    yield [s.close() for s in streams]
