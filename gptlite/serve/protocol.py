"""OpenAI's API shapes: the request bodies of /v1/completions and /v1/chat/completions, checked, and the
responses, chunks and errors the official `openai` client reads.

Bodies are checked strictly (a string where a number belongs is an error, as OpenAI's API has it); fields
this server does not implement are refused when they ask for something (`suffix`, tools...) and ignored when they
ask for nothing, so a client's defaults pass. Parsing is bounded too: an integer of more
digits than any field can use, nesting deeper than any field has, NaN and Infinity are each a 400 before a
field is read, so no body makes the parser itself fail.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gptlite.inference.sampling import GenerationOptions

UNSUPPORTED = (  # asked of /v1/completions and /v1/chat/completions (the chat route refuses logprobs itself)
    "suffix",
    "best_of",
    "tools",
    "functions",
    "tool_choice",
)
UNSUPPORTED_IN_CHAT = ("echo",)  # /v1/completions has it
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_STOP_CHARS = 256  # characters per stop string: each is checked at every token
MAX_INT_DIGITS = 20  # digits of an integer in a body: 2**64 - 1 has 20
# nesting of a body's arrays and objects: a response_format's JSON schema goes deepest (OpenAI's take objects nested 10
# deep, two levels each, below response_format.json_schema.schema)
MAX_DEPTH = 32
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class APIError(Exception):
    """An error a request gets back, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers  # e.g. Connection: close, where the body was left unread

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """The `json_schema` of a response_format, as OpenAI, vLLM and llama.cpp take it: the schema, and a name, a
    description and `strict`, which change nothing here (every output follows the schema)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel's method of that name
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """What a completion's text must be: anything ("text"), a JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def has_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return self


class GenerationRequest(BaseModel):
    """The fields both endpoints share: those that sample become a gptlite.inference.sampling.GenerationOptions
    (`generation_options`); the others (stop strings, logprobs, logit_bias, response_format...) are OpenAI's own,
    which the engine's Params carries beside them."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> -100..100
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    response_format: ResponseFormat | None = None  # compiled by gptlite.serve.grammar
    # gptlite's own, which the chat page sends: max_tokens is a ceiling, lowered to what the context leaves after
    # the prompt, instead of OpenAI's 400
    fit_max_tokens: bool = False

    def generation_options(self, stop_tokens: tuple[int, ...], choice: int = 0) -> GenerationOptions:
        """What the engine samples the request's choice `choice` (of n) with: its sampling fields as generation's own
        options (top_p 1 is no limit), the seed moved on by `choice` so that each choice samples its own text and a
        seed still reproduces them all, ending at stop_tokens (the tokenizer's end of text and of turn). A sampling
        option the server takes is a field above, checked as OpenAI's API checks it, and one line here."""
        return GenerationOptions(
            temperature=self.temperature,
            top_p=self.top_p if self.top_p < 1 else None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed is None else self.seed + choice,
            stop_tokens=stop_tokens,
        )

    def logprob_count(self) -> int | None:
        """How many alternatives each generated token's log-probability comes with (None: none asked for)."""
        return None

    def biases(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (id, bias) pairs, each id in the vocabulary and each bias in -100..100 (a 400 else)."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab:  # "²" and "٣" are digits to isdigit
                raise APIError(
                    400, f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})", "logit_bias"
                )
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias: {bias} for token {key} is outside -100..100", "logit_bias")
            out.append((int(key), float(bias)))
        return tuple(out)

    def stops(self) -> tuple[str, ...]:
        """The stop strings, at most MAX_STOP of at most MAX_STOP_CHARS characters each (a 400 past them)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop has {len(stops)} strings; give at most {MAX_STOP}", "stop")
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise APIError(
                    400,
                    f"a stop string has {len(s)} characters; give at most {MAX_STOP_CHARS} per string",
                    "stop",
                )
        return tuple(s for s in stops if s)


class CompletionRequest(GenerationRequest):
    """A prompt is text, token ids, or a list of either (one choice per prompt, times n)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, each text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def newer_name(self) -> ChatRequest:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens  # sets it in model_fields_set too
        return self


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: text, or messages rendered with the chat template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # gptlite never puts BOS before text: accepted, changes nothing


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, or a 400 APIError naming the first problem and its field."""
    try:
        data = json.loads(raw, parse_int=bounded_int, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:  # json's parser recurses into nested arrays and objects
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels; send a flatter body") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if depth(data) > MAX_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels; send a flatter body")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        given = "" if first["type"] == "missing" else f", got {json.dumps(first.get('input'))[:80]}"
        raise APIError(400, f"{param}: {first['msg']}{given}", param) from None
    for name in UNSUPPORTED:
        if (request.model_extra or {}).get(name) not in (None, False, 0, [], {}):
            raise APIError(400, f"{name} is not supported by this server; leave it out", name)
    return request


def bounded_int(text: str) -> int:
    """An integer of the body, refused past MAX_INT_DIGITS digits (before Python's own limit on int() of a long
    string turns it into an error of another kind)."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise APIError(
            400, f"the request body has an integer of {digits} digits; numbers here have at most {MAX_INT_DIGITS}"
        )
    return int(text)


def no_constant(name: str) -> float:
    """NaN, Infinity and -Infinity, which Python's json takes and JSON does not."""
    raise APIError(400, f"the request body has {name}, which is not a JSON number; send a finite number")


def depth(data: Any) -> int:
    """How deep a parsed body's arrays and objects nest (a flat object is 1), found without recursion."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, level = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            break
        todo.extend((child, level + 1) for child in children)
    return deepest


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    rid: str, model: str, texts: list[str], reasons: list[str], use: dict, logprobs: list[dict | None] | None = None
) -> dict:
    logprobs = logprobs or [None] * len(texts)
    choices = [
        {"index": i, "text": t, "logprobs": lp, "finish_reason": r}
        for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs, strict=True))
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def token_text(data: bytes) -> str:
    """A token as the logprobs lists name it: its text, or, for a piece of a character, its bytes as OpenAI
    writes them ("bytes:\\xe2\\x80")."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class LogprobsWriter:
    """A completion choice's `logprobs` as OpenAI's and vLLM's legacy API shape it, written as its tokens come:
    `tokens`, `token_logprobs`, `top_logprobs` (token text -> log-probability per position; None where a prompt
    begins) and `text_offset` (the character where each token starts in the choice's whole text, counted on
    across a stream's chunks). `entries` are the engine's TokenLogprob."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters of the text before the next token

    def add(self, entries: list) -> dict:
        """The `logprobs` of these entries, the choice's next tokens."""
        tokens = []
        values = []
        tops = []
        offsets = []
        for entry in entries:
            data = self.token_bytes(entry.token)
            offsets.append(self.chars)
            self.chars += len(self.decoder.decode(data))
            tokens.append(token_text(data))
            values.append(entry.logprob)
            if entry.logprob is None:
                tops.append(None)
                continue
            top = {token_text(self.token_bytes(i)): value for i, value in entry.top}
            top.setdefault(tokens[-1], entry.logprob)  # the chosen token is always there, as vLLM has it
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def logprobs_body(entries: list, token_bytes: Callable[[int], bytes]) -> dict:
    """A whole completion choice's `logprobs` (see LogprobsWriter)."""
    return LogprobsWriter(token_bytes).add(entries)


def chat_logprobs_body(entries: list, token_bytes: Callable[[int], bytes]) -> dict:
    """A chat choice's `logprobs` as OpenAI's chat API shapes it: `content`, a list of {token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]} per generated token."""

    def item(token: int, logprob: float) -> dict:
        data = token_bytes(token)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

    content = [
        {**item(entry.token, entry.logprob), "top_logprobs": [item(i, value) for i, value in entry.top]}
        for entry in entries
    ]
    return {"content": content, "refusal": None}


def chat_completion(
    rid: str, model: str, texts: list[str], reasons: list[str], use: dict, logprobs: list[dict | None] | None = None
) -> dict:
    logprobs = logprobs or [None] * len(texts)
    choices = [
        {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp, "finish_reason": r}
        for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs, strict=True))
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    index: int | None,
    text: str | None,
    reason: str | None,
    first: bool = False,
    use: dict | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk of a choice (index None: the closing usage chunk, which has no choices), with the
    `logprobs` of its tokens when asked for."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {
            "index": index,
            "delta": delta if text is not None else {},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [] if index is None else [choice],
    }
    if use is not None:
        body["usage"] = use
    return body


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
