"""Sampling controls: how the next token is chosen from a step's logits (temperature, top-k, top-p, penalties),
drawing from an explicit `torch.Generator` so that a seed reproduces the text; and `GenerationOptions`, every option
of generation in one typed place, which sampling, beam search and the server's engine share."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import torch

from gptlite.inference.cpu import native


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits; checked when built. See `sample_next` and
    `apply_penalties` for what each control does."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    vocab_limit: int | None = None  # ids from this one on are never sampled (see mask_vocab)

    def __post_init__(self) -> None:
        if self.vocab_limit is not None and (not isinstance(self.vocab_limit, int) or self.vocab_limit < 1):
            raise ValueError(f"vocab_limit={self.vocab_limit!r} must be an integer >= 1, or None for every id")
        for name in ("temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            optional = name in ("top_k", "top_p") and value is None
            if not optional and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            ):
                raise TypeError(
                    f"{name}={value!r} must be a finite number" + (", or None" if name in ("top_k", "top_p") else "")
                )
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
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


# the ways of generating, which the options below serve: gptlite.inference.generate's sampling,
# gptlite.inference.beam's beam search, and the server's engine (gptlite.serve.engine), which samples each request's
# row with the options of its own
SAMPLING = "sampling"
BEAMS = "beam search"
SERVING = "the server's engine"


def used_by(*ways: str, default=None):
    """A GenerationOptions field that the ways of generating listed take (SAMPLING, BEAMS, SERVING)."""
    return field(default=default, metadata={"used_by": ways})


@dataclass(frozen=True)
class GenerationOptions:
    """Every option of generation, one field each: GPT.generate's and gptlite.inference.generate's keyword arguments,
    what sample.py asks for, what beam search (gptlite.inference.beam) runs with and what the server's engine samples a
    request's row with (gptlite.serve.protocol builds them from an OpenAI request). A new option is a new field here.
    Sampling draws each token (`sampling` checks its controls); with num_beams set, beam search keeps the likeliest
    continuations instead (num_beams=1 is greedy decoding), and refuses the options it does not take (`unused_by`)."""

    temperature: float = used_by(SAMPLING, BEAMS, SERVING, default=1.0)  # 0 = greedy; beam search: 0 or 1
    top_k: int | None = used_by(SAMPLING, BEAMS, SERVING)  # beam search: None
    top_p: float | None = used_by(SAMPLING, BEAMS, SERVING)  # beam search: None
    repetition_penalty: float = used_by(SAMPLING, default=1.0)
    frequency_penalty: float = used_by(SAMPLING, SERVING, default=0.0)
    presence_penalty: float = used_by(SAMPLING, SERVING, default=0.0)
    seed: int | None = used_by(SAMPLING, SERVING)  # (or a torch.Generator, beside the options)
    num_samples: int = used_by(SAMPLING, default=1)  # rows per prompt, sharing its prefill
    stop_tokens: Iterable[int] = used_by(SAMPLING, BEAMS, SERVING, default=())  # ids that end a row
    extend_context: bool = used_by(
        SAMPLING, BEAMS, default=False
    )  # positions past block_size (gptlite.inference.generate)
    compile: bool = used_by(SAMPLING, BEAMS, default=False)  # torch.compile the decode step
    vocab_limit: int | None = used_by(SAMPLING, BEAMS)  # ids from this one on are never generated
    num_beams: int | None = used_by(BEAMS)  # None: sample; else beam search with this many beams
    length_penalty: float = used_by(BEAMS, default=1.0)  # a finished beam's score: log-probability / length ** this
    early_stopping: bool | str = used_by(BEAMS, default=False)  # False, True or "never" (gptlite.inference.beam)
    num_return_sequences: int = used_by(BEAMS, default=1)  # the best beams returned per prompt, at most num_beams

    @property
    def beams(self) -> bool:
        """Whether these options ask for beam search."""
        return self.num_beams is not None

    @property
    def sampling(self) -> Sampling:
        """The controls that choose each sampled token, checked."""
        return Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            vocab_limit=self.vocab_limit,
        )

    def greedy(self) -> GenerationOptions:
        """These options as greedy decoding, which beam search with one beam is: temperature 0, and the options that
        beam search alone takes back at their defaults."""
        beams_only = {f.name: f.default for f in fields(self) if f.metadata["used_by"] == (BEAMS,)}
        return replace(self, temperature=0, **beams_only)

    def unused_by(self, way: str) -> list[str]:
        """The options set to other than their defaults that `way` (SAMPLING, BEAMS or SERVING) does not take, by
        name."""
        return sorted(
            f.name for f in fields(self) if way not in f.metadata["used_by"] and getattr(self, f.name) != f.default
        )


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
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or so small that it is 0 in float32: greedy, its limit
        return greedy(logits)
    logits = logits.float()
    scaled = logits / temperature
    # a row that a tiny temperature sent past float's range (+inf - +inf is NaN in softmax) is divided shifted so
    # that its largest is 0 (softmax does not change), which sends the others to -inf; other rows stay as they are,
    # bit for bit (chosen per row without asking the device whether any overflowed)
    shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    logits = torch.where(torch.isposinf(scaled).any(dim=-1, keepdim=True), shifted, scaled)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False  # a top_p below float32's smallest (1e-300 is 0 there) would drop the first too
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit's id, logits (B, V) -> (B,) (a NaN counts as the largest, as torch.max's). Float32
    logits on the CPU go through gptlite's compiled kernel where it is loaded (gptlite.inference.cpu.native's `argmax`):
    PyTorch's max with indices read a vocabulary's logits several times slower than a plain pass over them, a part of
    every greedy decode step worth saving (figures: docs/generation.md). Elsewhere, torch.max's indices (on the CPU
    about a quarter faster than argmax)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and native.load():
        return native.argmax(logits)
    return logits.max(dim=-1).indices


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> torch.Tensor:
    """Discourage repeats in logits (B, V). repetition_penalty r (Keskar et al., 2019, CTRL): a token that
    occurs in the prompt or the output so far has its logit divided by r if positive, multiplied by r
    if negative. frequency_penalty f and presence_penalty p (OpenAI's): subtract f times the token's count in the
    output so far, and p once if it occurs there at all. seen (B, V) bool and counts (B, V) float hold those
    occurrences."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if frequency_penalty != 0.0:
        logits = logits - frequency_penalty * counts
    if presence_penalty != 0.0:
        logits = logits - presence_penalty * (counts > 0)
    return logits


def mask_vocab(logits: torch.Tensor, limit: int | None) -> torch.Tensor:
    """logits (B, V) with the ids from `limit` on at -inf, so they are never sampled: a model's vocabulary padded past
    its tokenizer's (GPT-2's 50,257 ids in a 50,304-wide head) has ids that decode to nothing. limit=None keeps all."""
    if limit is None or limit >= logits.size(-1):
        return logits
    return logits.index_fill(-1, torch.arange(limit, logits.size(-1), device=logits.device), float("-inf"))
