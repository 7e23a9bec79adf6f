"""A conversation with a model, turn by turn, held in one KV cache: each turn renders the whole conversation with
the tokenizer's chat template, prefills only what the cache does not hold yet (the earlier turns stay where they
are), and streams the reply until the template's end-of-turn token."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from gptlite.inference.generate import TextStream
from gptlite.inference.kvcache import decode_step, new_cache
from gptlite.inference.sampling import Sampling, mask_vocab, sample_next

if TYPE_CHECKING:
    from gptlite.model.network import Transformer
    from gptlite.tokenizer import Tokenizer


class Conversation:
    """The messages so far and the tokens the cache holds; `reply(text)` adds a user turn and streams the
    assistant's, which joins the messages."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        sampling: Sampling,
        max_new_tokens: int = 500,
        system: str = "",
        generator: torch.Generator | None = None,
    ):
        tokenizer.use_default_template()
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer's chat markers need ids up to {tokenizer.vocab_size - 1} but the model knows "
                f"{model.config.vocab_size}: it was not trained on conversations (data/prepare.py --chat)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.generator = generator
        self.max_new_tokens = max_new_tokens
        self.messages = [{"role": "system", "content": system}] if system else []
        self.stops = set(tokenizer.end_ids())
        self.cache = new_cache(model, 1)
        self.fed: list[int] = []  # the tokens whose keys and values the cache holds
        self.reused = 0  # prompt tokens the last turn found in the cache

    @torch.no_grad()
    def reply(self, text: str) -> Iterator[str]:
        """Add the user's `text`, then yield the assistant's reply piece by piece."""
        self.messages.append({"role": "user", "content": text})
        ids = self.fit(self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True))
        logits = self.prefill(ids)
        stream, reply = TextStream(self.tokenizer), []
        for _ in range(self.max_new_tokens):
            logits = mask_vocab(logits, self.tokenizer.vocab_size)
            token = int(
                sample_next(
                    logits, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, self.generator
                )[0]
            )
            if token in self.stops or self.cache.end >= self.cache.max_len:
                break
            reply.append(token)
            yield stream.feed([token])
            self.cache.prepare(1)
            logits = decode_step(self.model, torch.tensor([[token]], device=self.cache.visible.device), self.cache)
            self.fed.append(token)
        yield stream.close()
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply)})

    def fit(self, ids: list[int]) -> list[int]:
        """The prompt, with the oldest turns (after a system message) left out until it and a reply fit the model's
        context."""
        limit = self.model.config.block_size - min(self.max_new_tokens, self.model.config.block_size // 2)
        while len(ids) > limit and len(self.messages) > 1 + (self.messages[0]["role"] == "system"):
            del self.messages[1 if self.messages[0]["role"] == "system" else 0]
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if len(ids) > limit:
            warnings.warn(
                f"this turn takes {len(ids)} tokens, more than the {limit} the model's context (block_size="
                f"{self.model.config.block_size}) leaves beside a reply: its first {len(ids) - limit} are left out",
                stacklevel=2,
            )
        return ids[-limit:]

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run what the cache does not hold of `ids` through the model; the last position's logits (1, V). Where the
        prompt does not extend what the cache holds (a turn left out, a reply the template re-tokenized), the
        cache starts over."""
        device = self.cache.visible.device
        if ids[: len(self.fed)] != self.fed or len(ids) == len(self.fed):
            self.cache.start(torch.zeros(1, dtype=torch.long, device=device))
            self.fed = []
        self.reused, new = len(self.fed), ids[len(self.fed) :]
        self.cache.prepare(len(new))
        logits = self.model.step(torch.tensor([new], device=device), self.cache)
        self.fed = list(ids)
        return logits
