"""The HTTP side: a FastAPI app that speaks OpenAI's API over an `Engine`, and serves the chat page.

    GET  /                      the chat page (gptlite/serve/chat.html)
    GET  /v1/models             the one model served, with `chat` (whether it has a chat template) and `context`
    POST /v1/completions        prompt (text or token ids) -> text, with logprobs and echo as OpenAI's legacy API
    POST /v1/chat/completions   messages, rendered with the tokenizer's chat template -> the assistant's reply
    GET  /tokenizer_info        the tokenizer's special tokens, chat template and context (vLLM's shape)
    POST /tokenize              prompt or messages -> tokens, count
    POST /detokenize            tokens -> prompt

Before a route runs, `gptlite.serve.guard` checks the request's host, key and size (its `Policy`); a JSON route
reads its body with `read_json` and tokenizes its prompts on a worker thread, never on the event loop, where a
`response_format` is compiled too (`gptlite.serve.grammar`; the engine keeps each row's tokens to its grammar).

Admission: at most max_batch + max_waiting completions are in flight (running or queued for a row); past that
a request gets a 429, or with `wait_when_full` waits for room, holding no cache row while it waits. A request
whose client goes away, streamed or not, is cancelled, which frees its place at once and its row before the
engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable
from importlib import resources
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from gptlite.serve.engine import Job, Params, Piece
from gptlite.serve.grammar import Format, GrammarError, Grammars
from gptlite.serve.guard import Guard, Policy, read_json
from gptlite.serve.protocol import (
    UNSUPPORTED_IN_CHAT,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    LogprobsWriter,
    TokenizeRequest,
    chat_completion,
    chat_logprobs_body,
    chunk,
    completion,
    logprobs_body,
    new_id,
    sse,
    usage,
)

if TYPE_CHECKING:
    from gptlite.serve.engine import Engine
    from gptlite.tokenizer import Tokenizer

WAIT_POLL = 0.02  # seconds between looks for room, with wait_when_full
log = logging.getLogger("uvicorn.error")  # the server's log
T = TypeVar("T")


class Mailbox:
    """Pieces handed from the engine's thread to one event loop in batches. The loop's thread shares the cores and
    the GIL with the engine's, and every time it wakes it holds the engine up, so it wakes as seldom as it can: a
    decode step emits a piece for every running row, one after another; the first one posted wakes the loop
    (call_soon_threadsafe), and those posted before that wake-up has run ride on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, list[tuple[int, Piece]]]] = []  # posted, not yet delivered

    def post(self, queue: asyncio.Queue, items: list[tuple[int, Piece]]) -> None:
        """On the engine's thread: queue.put_nowait(item) for each item, on the loop, soon. RuntimeError once the loop
        has closed."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop has closed")
        with self.lock:
            self.pending.append((queue, items))
            if len(self.pending) > 1:
                return  # the first one's wake-up has not run yet: it delivers these too
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:  # the loop closed since the look above: nothing will be delivered
            with self.lock:
                self.pending.clear()
            raise

    def deliver(self) -> None:
        """On the loop: every piece posted so far, in the order posted."""
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, items in pending:
            for item in items:
                queue.put_nowait(item)


class Generation:
    """One request's jobs, their pieces handed from the engine's thread to the event loop as (job index, Piece).
    With `hold` (a response sent whole, not streamed) a job's pieces are held on the engine's side and handed over
    together with its last one: the loop wakes once a completion, not once a token."""

    def __init__(self, jobs: list[tuple[list[int], Params]], mailbox: Mailbox, hold: bool):
        self.mailbox = mailbox
        self.hold = hold
        self.queue: asyncio.Queue[tuple[int, Piece]] = asyncio.Queue()
        self.jobs = [Job(prompt, params, self.emitter(i)) for i, (prompt, params) in enumerate(jobs)]
        self.open = len(self.jobs)
        self.tokens = [0] * len(self.jobs)  # tokens each job has generated

    def emitter(self, index: int):
        held: list[tuple[int, Piece]] = []  # this job's pieces not handed over yet (with `hold`)

        def emit(piece: Piece) -> None:  # on the engine's thread
            held.append((index, piece))
            if self.hold and piece.finish_reason is None:
                return
            items = held.copy()
            held.clear()
            try:
                self.mailbox.post(self.queue, items)
            except RuntimeError:  # the event loop has closed: nobody is listening
                self.jobs[index].cancel()

        return emit

    async def next(self) -> tuple[int, Piece]:
        index, piece = await self.queue.get()
        self.tokens[index] = piece.tokens
        self.open -= piece.finish_reason is not None
        return index, piece

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


class Server:
    """The app's state: the engine, the tokenizer, the model's name, and how many completions are in flight."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, max_waiting: int, wait_when_full: bool):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limit = engine.max_batch + max_waiting
        self.wait_when_full = wait_when_full
        self.in_flight = 0
        self.grammars = Grammars(tokenizer, engine.model.config.vocab_size, self.stop_tokens())
        self.mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}  # one per event loop that serves requests

    def mailbox(self) -> Mailbox:
        """The running event loop's mailbox (a test's client may run the app on a loop of its own)."""
        loop = asyncio.get_running_loop()
        if loop not in self.mailboxes:
            self.mailboxes = {old: box for old, box in self.mailboxes.items() if not old.is_closed()}
            self.mailboxes[loop] = Mailbox(loop)
        return self.mailboxes[loop]

    def check(self, body: GenerationRequest, prompts: int) -> None:
        """What can be checked before tokenizing: n x prompts against the batch, the stops. The request's model name
        is not checked: the server has one model, which answers to any name (docs/serve.md), and every response names
        it."""
        if prompts * body.n > self.engine.max_batch:
            raise APIError(
                400,
                f"n={body.n} x {prompts} prompt(s) asks for {prompts * body.n} completions "
                f"at once; this server runs at most {self.engine.max_batch} (its --max_batch)",
                "n",
            )
        body.stops()

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, read as /tokenize reads text (`tokenize`). An empty prompt is the start of a document, the
        end-of-text token, as OpenAI's API defines it ("if a prompt is not specified the model will generate as if
        from the beginning of a new document") and as every document gptlite prepares begins: usage counts that
        token, echo shows it and logprobs list it. A tokenizer without one (char, byte) has nothing to start from: a
        400."""
        ids = self.tokenize(text)
        if ids:
            return ids
        if self.tokenizer.eot_id is None:
            raise APIError(
                400,
                f"prompt is empty, and this model's {self.tokenizer.kind} tokenizer has no end-of-text token to "
                "start a document with; give at least one character",
                "prompt",
            )
        return [self.tokenizer.eot_id]

    def check_ids(self, ids: list[int], param: str, source: str = "") -> list[int]:
        """Token ids a request sent, or that its text became (`source` says how), each one the model can read and
        the tokenizer has: a 400 naming the first that is not, and the vocabulary."""
        vocab = self.engine.vocab
        if not ids or (0 <= min(ids) and max(ids) < vocab):
            return ids
        i, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
        held = f"this model's vocabulary of {vocab} ids (0 to {vocab - 1})"
        if not source:
            raise APIError(400, f"{param}[{i}]: token id {token} is not in {held}; send ids below {vocab}", param)
        text = self.tokenizer.decode([token]) if token < self.tokenizer.vocab_size else ""
        raise APIError(
            400,
            f"{param}: {source} token id {token} {text!r} (at {i}), which is past {held}: the tokenizer has ids the "
            "model was not trained with; serve the model with the tokenizer it was trained with",
            param,
        )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's ids: text encoded, token ids checked (an empty list of ids is an error)."""
        if isinstance(prompt, str):
            return self.check_ids(self.encode(prompt), "prompt", "the text became")
        if not prompt:
            raise APIError(400, "prompt holds an empty list of token ids; give at least one", "prompt")
        return self.check_ids(prompt, "prompt")

    def tokenize(self, text: str) -> list[int]:
        """Text's ids, the one way every route reads text (a prompt, /tokenize's, a chat's messages once rendered):
        each special token the tokenizer has is that token where the text spells it, as transformers reads a prompt
        and as vLLM's /tokenize does; the name of one it lacks is plain text (Tokenizer.encode_with_specials)."""
        try:
            return self.tokenizer.encode_with_specials(text)
        except ValueError as e:  # e.g. a character a char tokenizer never saw
            raise APIError(400, str(e), "prompt") from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The messages' ids through the tokenizer's chat template, ending where the assistant's reply begins; a 400
        for a tokenizer without a template (the tokenizer's apply_chat_template would give it ChatML, adding markers
        past the vocabulary the model was trained with) and for any id the model cannot read."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(
                400,
                f"the model '{self.model_name}' has no chat template, so it cannot render messages; send a plain "
                "prompt (to /v1/completions, or as /tokenize's prompt)",
                "messages",
                "no_chat_template",
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, specials=self.tokenizer.specials_in_text()
            )
        except ValueError as e:  # a template's own rules (e.g. roles that must alternate), or an unknown character
            raise APIError(400, str(e), "messages") from None
        return self.check_ids(ids, "messages", "the chat template gave")

    def stop_tokens(self) -> tuple[int, ...]:
        """Ids that end a completion: end of text, and the end of a turn where the tokenizer has one."""
        return tuple(self.tokenizer.end_ids())

    def response_format(self, body: GenerationRequest) -> Format | None:
        """The request's response_format, compiled (None for none, or "text"); a 400 for a schema that the grammar
        library refuses."""
        wanted = body.response_format
        if wanted is None:
            return None
        try:
            return self.grammars.compile(wanted.type, wanted.json_schema.schema_ if wanted.json_schema else None)
        except GrammarError as e:
            fix = "" if e.explained else "; send a JSON schema this server can follow"
            raise APIError(400, f"response_format.json_schema.schema: {e}{fix}", "response_format") from None

    def jobs(
        self, body: GenerationRequest, prompts: list[list[int]], param: str, response_format: Format | None = None
    ) -> list[tuple[list[int], Params]]:
        """Each prompt n times with its Params, checked against the context (the rest by `check`)."""
        context = self.engine.max_len
        stops = body.stops()
        out = []
        for prompt in prompts:
            if len(prompt) >= context:
                raise APIError(
                    400,
                    f"the prompt has {len(prompt)} tokens, but this model's context is {context} tokens "
                    "with at least one left to generate; shorten the prompt",
                    param,
                    "context_length_exceeded",
                )
            room = context - len(prompt)
            asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
            default = type(body).model_fields["max_tokens"].default  # completions 16; chat: the rest of the context
            max_tokens = asked if asked is not None else min(default or room, room)
            if body.fit_max_tokens:
                max_tokens = min(max_tokens, room)
            elif max_tokens > room:
                raise APIError(
                    400,
                    f"the prompt's {len(prompt)} tokens plus max_tokens={max_tokens} exceed this model's "
                    f"context of {context} tokens; ask for at most {room}",
                    "max_tokens",
                    "context_length_exceeded",
                )
            logprobs = body.logprob_count()
            echo = getattr(body, "echo", False)
            if max_tokens == 0 and not echo:
                raise APIError(
                    400, "max_tokens=0 generates nothing; ask for at least 1 (or echo the prompt)", "max_tokens"
                )
            biases = body.biases(self.engine.vocab)
            out += [
                (
                    prompt,
                    Params(
                        max_tokens,
                        body.generation_options(self.stop_tokens(), j),
                        stops,
                        logprobs,
                        echo,
                        biases,
                        response_format,
                    ),
                )
                for j in range(body.n)
            ]
        return out

    async def admit(self, k: int) -> None:
        """Take room for k completions, or raise a 429 (or wait, with wait_when_full)."""
        while self.in_flight + k > self.limit:
            if not self.wait_when_full:
                raise APIError(
                    429,
                    f"the server is full ({self.in_flight} completions running or queued, at most "
                    f"{self.limit}); retry shortly",
                    None,
                    "server_full",
                    "rate_limit_error",
                )
            await asyncio.sleep(WAIT_POLL)
        self.in_flight += k

    def failed(self, piece: Piece) -> APIError:
        """A piece's error as the request's: a 400 where its response_format's grammar failed, a 503 once the engine
        has stopped for good, else a 500."""
        if piece.invalid:
            return APIError(400, piece.error or "", "response_format")
        status = 503 if self.engine.failure is not None else 500
        return APIError(status, piece.error or "", None, None, "server_error")

    async def respond(
        self, request: Request, body: GenerationRequest, prompts: list[list[int]], chat: bool, param: str
    ):
        """Run the request's jobs; a JSON response, or a stream of server-sent events. A client that goes away
        before its response begins cancels it (a stream's own watch takes over once it has begun). A response_format
        compiles on a worker thread: a large schema takes a while."""
        response_format = await asyncio.to_thread(self.response_format, body)
        jobs = self.jobs(body, prompts, param, response_format)
        return await cancel_on_disconnect(request, self.run(jobs, body, chat, sum(len(p) for p in prompts)))

    async def run(self, jobs: list[tuple[list[int], Params]], body: GenerationRequest, chat: bool, prompt_tokens: int):
        await self.admit(len(jobs))
        gen = Generation(jobs, self.mailbox(), hold=not body.stream)
        streaming = False
        try:
            for job in gen.jobs:
                self.engine.submit(job)
            first = await gen.next()
            if first[1].error:
                raise self.failed(first[1])
            if body.stream:
                streaming = True  # the stream owns the jobs from here
                return StreamingResponse(
                    self.stream(gen, first, body, chat, prompt_tokens),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            return JSONResponse(await self.collect(gen, first, body, chat, prompt_tokens))
        finally:
            if not streaming:
                gen.cancel()
                self.in_flight -= len(gen.jobs)

    async def collect(
        self, gen: Generation, first: tuple[int, Piece], body: GenerationRequest, chat: bool, prompt_tokens: int
    ) -> dict:
        n = len(gen.jobs)
        texts, reasons = [""] * n, [""] * n
        entries = [[] for _ in range(n)]  # each choice's TokenLogprob: its prompt's (with echo), then its tokens'
        index, piece = first
        while True:
            if piece.error:
                raise self.failed(piece)
            texts[index] += piece.text
            reasons[index] = piece.finish_reason or reasons[index]
            entries[index] += (piece.prompt_logprobs or []) + piece.logprobs
            if not gen.open:
                break
            index, piece = await gen.next()
        rid, use = new_id("chatcmpl" if chat else "cmpl"), usage(prompt_tokens, sum(gen.tokens))
        params = gen.jobs[0].params
        token_bytes = lambda i: self.tokenizer.token_bytes([i])  # noqa: E731
        if chat:
            logprobs = None
            if params.logprobs is not None:
                logprobs = [chat_logprobs_body(choice, token_bytes) for choice in entries]
            return chat_completion(rid, self.model_name, texts, reasons, use, logprobs)
        if params.echo:
            texts = [self.tokenizer.decode(job.prompt) + text for job, text in zip(gen.jobs, texts, strict=True)]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [logprobs_body(choice, token_bytes) for choice in entries]
        return completion(rid, self.model_name, texts, reasons, use, logprobs)

    async def stream(
        self, gen: Generation, first: tuple[int, Piece], body: GenerationRequest, chat: bool, prompt_tokens: int
    ):
        """Server-sent events: each choice's pieces as chunks (with their tokens' log-probabilities when asked for;
        with echo, a choice's first chunk begins with its prompt and the prompt's), the usage chunk if asked, then
        [DONE]."""
        rid, started = new_id("chatcmpl" if chat else "cmpl"), set()
        params = gen.jobs[0].params
        token_bytes = lambda i: self.tokenizer.token_bytes([i])  # noqa: E731
        writers = [LogprobsWriter(token_bytes) for _ in gen.jobs]  # each choice's, counting its text's characters
        try:
            index, piece = first
            while True:
                if piece.error:
                    yield sse(self.failed(piece).body())
                    return
                if chat and index not in started:
                    started.add(index)
                    yield sse(chunk(rid, self.model_name, chat, index, "", None, first=True))
                text = piece.text
                if params.echo and index not in started:  # (completions only) the prompt comes first
                    started.add(index)
                    text = self.tokenizer.decode(gen.jobs[index].prompt) + text
                entries = (piece.prompt_logprobs or []) + piece.logprobs
                logprobs = None
                if params.logprobs is not None and entries:
                    logprobs = chat_logprobs_body(entries, token_bytes) if chat else writers[index].add(entries)
                if text or piece.finish_reason or logprobs is not None:
                    yield sse(chunk(rid, self.model_name, chat, index, text, piece.finish_reason, logprobs=logprobs))
                if not gen.open:
                    break
                index, piece = await gen.next()
            if body.stream_options and body.stream_options.include_usage:
                yield sse(
                    chunk(rid, self.model_name, chat, None, None, None, use=usage(prompt_tokens, sum(gen.tokens)))
                )
            yield sse("[DONE]")
        finally:  # finished, or the client went away: either way the rows are freed
            gen.cancel()
            self.in_flight -= len(gen.jobs)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or, should the client go away first, `work` cancelled and ClientDisconnect raised. The
    request's body must have been read: from then on the connection's next message is its end."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancels the request (its shutdown's time is up)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its cleanup frees the request's places
    raise ClientDisconnect()


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    max_waiting: int | None = None,
    wait_when_full: bool = False,
    policy: Policy | None = None,
) -> FastAPI:
    """The app serving `engine` (started and closed by the caller) as `model_name`; max_waiting defaults to
    max_batch. `policy` says who may use it and how much a request may send (gptlite.serve.guard; default: a
    loopback server's, no key)."""
    policy = policy or Policy()
    server = Server(
        engine, tokenizer, model_name, engine.max_batch if max_waiting is None else max_waiting, wait_when_full
    )
    app = FastAPI(
        title="gptlite", docs_url=None, redoc_url=None, openapi_url=None
    )  # no pages that load scripts from a CDN
    app.state.server = server
    app.add_middleware(Guard, policy=policy, failure=lambda: engine.failure)
    if policy.cors_origins:  # added last, so outermost: it answers browsers' preflight requests itself
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(policy.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    page = resources.files("gptlite.serve").joinpath("chat.html").read_text(encoding="utf-8")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(
            APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
            status_code=e.status_code,
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s went away during %s %s; its request was dropped", client, request.method, request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; never sent, as nobody is there

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", kind="server_error").body(), status_code=500)

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "gptlite",
            "chat": getattr(tokenizer, "chat_template", None) is not None,
            "context": engine.max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, CompletionRequest, policy)
        given = body.prompts()
        if not given:
            raise APIError(400, "prompt is an empty list; give text, token ids, or a list of either", "prompt")
        server.check(body, len(given))
        prompts = await asyncio.to_thread(lambda: [server.prompt_ids(p) for p in given])
        return await server.respond(request, body, prompts, chat=False, param="prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, ChatRequest, policy)
        for name in UNSUPPORTED_IN_CHAT:
            if (body.model_extra or {}).get(name) not in (None, False, 0):
                raise APIError(400, f"{name} is not supported by this server's chat route; leave it out", name)
        server.check(body, 1)
        prompt = await asyncio.to_thread(server.render, [m.as_dict() for m in body.messages])
        return await server.respond(request, body, [prompt], chat=True, param="messages")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        names = tokenizer.special_names()  # a Hugging Face directory's own; gptlite's for a run it wrote
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": names["eos_token"],
            "bos_token": names["bos_token"],
            "pad_token": names["pad_token"],
            "unk_token": names["unk_token"],
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": engine.max_len,
            "vocab_size": engine.vocab,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request, TokenizeRequest, policy)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give one of prompt (text) or messages", "prompt")
        if body.messages is not None:
            messages = [m.as_dict() for m in body.messages]
            render = lambda: server.render(messages, body.add_generation_prompt)  # noqa: E731
            tokens = await asyncio.to_thread(render)
        else:
            tokens = await asyncio.to_thread(server.tokenize, body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request, DetokenizeRequest, policy)
        tokens = server.check_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, tokens)}

    return app
