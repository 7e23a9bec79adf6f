"""Structured outputs: a request's `response_format` compiled into a grammar over the tokenizer's tokens, and each
row's matcher, which says which tokens may come next and when the output is complete.

The grammar library is llguidance (the one llama.cpp and vLLM use). It takes any tokenizer given the bytes of every
id, so tiktoken, Hugging Face and gptlite's own char and byte tokenizers all go through the same table, built once
per server. It compiles a JSON schema without a pass over the vocabulary (it walks the token trie as the output
grows), so a request with a new schema starts at once, and a row's mask for the next token comes from the same walk.
docs/serve.md has the measurements behind the choice.

A `Grammars` (one per server) compiles a response_format into a `Format`, cached by the format's JSON text; each
row that asks for it gets its own `Matcher`, a copy of the Format's matcher at the start of the grammar.

Every failure of the grammar engine is a `GrammarError`, with a plain message: a schema is checked before llguidance
sees it (gptlite.serve.schema), the first token's mask is computed when the format is compiled (where llguidance
reports a schema it cannot follow), llguidance's terse messages are said in words, and a panic of its native code
never reaches a request's error, only the server's log.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from gptlite.serve.schema import check_schema

if TYPE_CHECKING:
    from gptlite.tokenizer import Tokenizer

CACHED_FORMATS = 256  # compiled formats kept, the least recently used dropped first
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (`{"a":1}`): no run of spaces a model could ramble in
END_TEXT = b"<|gptlite:end|>"  # the end-of-output token the grammar needs, for a tokenizer that has none
log = logging.getLogger("uvicorn.error")  # the server's log
PLAIN = {  # a phrase of llguidance's message -> what it means for the schema, and the fix
    "NoExtensionBias": (
        "the schema refers to itself with no JSON in between (a $ref or an anyOf that loops back to itself), so no "
        "output can follow it; give the loop a type, or put the recursion inside properties or items"
    ),
    "too many expressions constructed": (
        "a pattern or a length in the schema is too complex for the grammar engine (nested repetitions such as "
        "(a{1,100}){100}); simplify it"
    ),
    "schema too large": "the schema is too large for the grammar engine; send a smaller schema",
}


class GrammarError(ValueError):
    """The grammar engine cannot follow a response_format: the request's fault (a 400), with a plain message;
    `explained` says whether the message already says the fix (llguidance's own messages say only the problem)."""

    def __init__(self, message: str, explained: bool = True):
        super().__init__(message)
        self.explained = explained


class Grammars:
    """A server's grammar machinery: llguidance's view of the tokenizer, and the formats compiled for it.

    `width` is the width of the logits the engine samples from (the model's vocabulary, maybe padded past the
    tokenizer's: those ids are never allowed); `stops` are the ids that end a completion (end of text, end of
    turn), which the grammar allows where the output may end."""

    def __init__(self, tokenizer: Tokenizer, width: int, stops: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.width = width
        self.stops = tuple(i for i in stops if i < width)
        self.lock = threading.Lock()  # requests compile on worker threads
        self.built: llguidance.LLTokenizer | None = None
        self.formats: OrderedDict[str, Format] = OrderedDict()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer: every id's bytes (ids past the tokenizer's, empty: never allowed), its special
        tokens marked as such (never spelled by text), the stop ids as the grammar's end; built on first use."""
        with self.lock:
            if self.built is None:
                table = TokenTable(self)
                self.built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), eos_token=table.eos)
            return self.built

    def compile(self, kind: str, schema: dict[str, Any] | None = None) -> Format | None:
        """The Format of a response_format's type ("text": None, "json_object", "json_schema" with its schema);
        GrammarError naming the problem for a schema that gptlite.serve.schema or llguidance refuses."""
        if kind == "text":
            return None
        if kind == "json_object":
            schema = {"type": "object"}
        key = json.dumps(schema)  # the properties' order is the output's order: no sort_keys
        with self.lock:
            if key in self.formats:
                self.formats.move_to_end(key)
                return self.formats[key]
        try:
            check_schema(schema)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        try:  # llguidance tokenizes the text a grammar forces (keys, enums) with the tokenizer, which must spell it
            self.tokenizer.encode(json.dumps(schema, ensure_ascii=False))
        except ValueError as e:  # a char tokenizer's unknown character
            raise GrammarError(f"this model's tokenizer cannot spell the schema's text ({e})", False) from None
        tokenizer = self.ll_tokenizer()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:  # e.g. a number JSON cannot hold ("Value is not JSON serializable: 1e400")
            raise GrammarError(*plain(str(e))) from None
        start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if start.is_error():
            raise GrammarError(*plain(start.get_error()))
        compiled = Format(start, tokenizer.vocab_size)
        compiled.matcher().first_mask()  # where llguidance finds what it cannot follow (a schema that is only itself)
        with self.lock:
            self.formats[key] = compiled
            while len(self.formats) > CACHED_FORMATS:
                self.formats.popitem(last=False)
        return compiled


class TokenTable:
    """What llguidance's TokenizerWrapper reads of a tokenizer: `tokens` (every id's bytes), `special_token_ids`,
    `eos_token_id`, and encoding as a call on bytes; `eos`, the ids that end the grammar."""

    def __init__(self, grammars: Grammars):
        tokenizer = grammars.tokenizer
        width = grammars.width
        known = min(tokenizer.vocab_size, width)
        self.tokens = [tokenizer.token_bytes([i]) for i in range(known)] + [b""] * (width - known)
        self.eos = list(grammars.stops)
        if not self.eos:  # one past the logits, never sampled: the output ends when the grammar is complete
            self.eos = [len(self.tokens)]
            self.tokens.append(END_TEXT)
        self.special_token_ids = sorted({i for i in tokenizer.special_token_ids() if i < width} | set(self.eos))
        self.eos_token_id = self.eos[0]
        self.bos_token_id = None
        self.encode = tokenizer.encode

    def __call__(self, data: bytes | str) -> list[int]:
        return self.encode(data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)


class Format:
    """A compiled response_format: llguidance's matcher at the start of its grammar, which each row copies."""

    def __init__(self, start: llguidance.LLMatcher, size: int):
        self.start = start
        self.size = size  # ids in llguidance's tokenizer: the logits' width (and the end added where none was)

    def matcher(self) -> Matcher:
        return Matcher(self.start.deep_copy(), self.size)


class Matcher:
    """One row's place in its grammar: the tokens it allows next, the token the row took, and whether the output
    is complete. Each method raises ValueError with llguidance's message should the matcher fail."""

    def __init__(self, matcher: llguidance.LLMatcher, size: int):
        self.matcher = matcher
        self.bits = np.zeros((size + 31) // 32, dtype=np.int32)  # one bit per id of llguidance's tokenizer

    def first_mask(self) -> None:
        """Compute the tokens allowed first: GrammarError where the grammar engine cannot."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            raise GrammarError(*plain(self.matcher.get_error()))

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) with every token the grammar does not allow next at -inf: a new tensor."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        self.check()
        banned = np.unpackbits(~self.bits.view(np.uint8), bitorder="little")[: logits.size(-1)].view(np.bool_)
        if banned.all():
            raise GrammarError(
                "response_format: the schema allows no token of this model's vocabulary here; send a schema whose "
                "text this model's tokenizer can spell"
            )
        return logits.masked_fill(torch.from_numpy(banned).to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        """Advance past the token the row took."""
        self.matcher.consume_token(token)
        self.check()

    @property
    def done(self) -> bool:
        """Whether the output is complete: the grammar takes no more text."""
        return self.matcher.is_stopped()

    def check(self) -> None:
        if self.matcher.is_error():
            text, explained = plain(self.matcher.get_error())
            fix = "" if explained else "; send a JSON schema this server can follow"
            raise GrammarError(f"response_format: {text}{fix}")


def plain(message: str) -> tuple[str, bool]:
    """llguidance's message on one line, without the parser state or backtrace it may append, said in words where it
    is terse (PLAIN), and whether it says the fix; a panic of its native code is logged, and the request told only
    that the engine failed."""
    line = " ".join(re.split("<state>|<backtrace>", message)[0].split())
    if re.search(r"(^|\W)panic(:|ked)", line):  # how Rust, and llguidance catching it, words a panic
        log.warning("gptlite.serve: llguidance failed: %s", line)
        return (
            "the grammar engine failed on this schema (an internal error, in the server's log); send a smaller or "
            "simpler schema",
            True,
        )
    for phrase, meaning in PLAIN.items():
        if phrase in line:
            return meaning, True
    return line or "the grammar engine failed without a message", False
