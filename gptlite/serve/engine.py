"""Continuous batching: one background thread decodes every running request together, one token per step.

A request (a `Job`: prompt ids, `Params`, and an `emit` callback) waits in a queue until a row of the shared
`RowCache` is free. At the next step it is prefilled on its own, its first token is sampled from the prefill,
and from then on it decodes with the other running rows, one token per step each, until it stops (a stop
token, a stop string, or max_tokens) or is cancelled; its row is freed before the next step. Running rows
are kept first (the last running row moves into a freed one), so a step over n requests costs n rows.

On the CPU, float32, the rows run through `packed_for_cpu`'s views of the model, made once: its slab layers for
a single row (so one request decodes as fast as sample.py's batch of one) and its oneDNN-packed layers for
several. Each row samples with its own temperature, top_p and `torch.Generator` (seeded when asked), and
never an id the tokenizer lacks (a padded vocabulary's extra ids). `emit` is called on the engine's thread
with a `Piece` for every token: the new text (UTF-8 safe, cut before a stop string) and, on the last piece,
why the request ended.

No request stops the engine: an exception while a request is admitted (its seed, its prefill) ends that request
with finish_reason "error", one in a decode step ends the requests that step ran, and the engine goes on with
the next step. Should the loop itself ever stop, `failure` says why, every queued and running request ends with
that error, later ones at once, and `stopped` is set, so that the server can say so and exit.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gptlite.cpu_decode import packed_for_cpu
from gptlite.generate import TextStream
from gptlite.kvcache import decode_step
from gptlite.sampling import mask_vocab, sample_next
from gptlite.serve.rows import RowCache

if TYPE_CHECKING:
    from gptlite.model import GPT
    from gptlite.tokenizer import Tokenizer

log = logging.getLogger("uvicorn.error")  # the server's log, so the engine's lines share its format and level
SEEDS = 2**64  # torch.Generator's seeds are 0..2**64-1; any integer seed is taken modulo this, as torch takes -1


@dataclass(frozen=True)
class Params:
    """How one completion is generated; checked by the caller (gptlite.serve.protocol)."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float | None = None
    stop: tuple[str, ...] = ()  # text is cut before the first of these, which ends the request
    stop_tokens: tuple[int, ...] = ()  # ids that end the request (end of text, end of turn)
    seed: int | None = None


@dataclass
class Piece:
    """What one step gave a job: its new text (may be empty), and on its last piece why it ended:
    "stop", "length", or "error" (with the message)."""

    text: str
    tokens: int  # tokens generated so far
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Job:
    """One completion to run: prompt ids, how to generate, and where its pieces go (called on the engine's thread)."""

    prompt: list[int]
    params: Params
    emit: Callable[[Piece], None]
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop generating; the engine frees the row before its next step and emits nothing more."""
        self.cancelled = True


@dataclass
class Row:
    """A running job's decoding state."""

    job: Job
    stream: TextStream
    generator: torch.Generator
    length: int = 0  # tokens in its cache row
    token: int = 0  # the newest sampled token, fed at the next step
    generated: int = 0
    finished: bool = field(default=False)


class Engine:
    """Runs jobs `max_batch` at a time on one thread (see the module docstring); `submit` from any thread."""

    def __init__(
        self, model: GPT, tokenizer: Tokenizer, max_batch: int = 16, max_len: int | None = None, compile: bool = False
    ):
        config = model.config
        weight = model.tok_emb.weight
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_len = min(max_len or config.block_size, config.block_size)  # a row's prompt + completion
        self.cache = RowCache(config, max_batch, self.max_len, weight.dtype, weight.device, always_mask=compile)
        self.vocab = min(tokenizer.vocab_size, config.vocab_size)  # ids past the tokenizer's are never sampled
        if compile:  # the plain modules, which inductor compiles
            self.one = self.many = model
            self.step = compiled_step()
        else:  # the eager CPU views: slab layers for one row, packed layers for several (other devices: the model)
            self.one = packed_for_cpu(model, 1)
            self.many = packed_for_cpu(model, max(2, max_batch))
            self.step = decode_step
        self.rows: list[Row] = []  # running, in cache rows 0..len-1
        self.waiting: deque[Job] = deque()
        self.wake = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        self.failure: str | None = None  # why the loop stopped for good, if it did
        self.stopped = threading.Event()  # set when the loop has ended: closed, or failed

    # -- the other threads' side

    def start(self) -> Engine:
        self.thread = threading.Thread(target=self.run, name="gptlite-engine", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()
        if self.thread is not None:
            self.thread.join()

    def submit(self, job: Job) -> None:
        """Queue a job; it starts at the next step with a free row (or, once the loop has failed, ends at once with
        the failure)."""
        assert 0 < len(job.prompt) and len(job.prompt) + job.params.max_tokens <= self.max_len, "unchecked job"
        with self.wake:
            if self.failure is None:
                self.waiting.append(job)
                self.wake.notify()
                return
        job.emit(Piece("", 0, "error", self.failure))

    @property
    def active(self) -> int:
        """Requests decoding now (rows in use)."""
        return len(self.rows)

    # -- the engine's thread

    def run(self) -> None:
        try:
            while self.turn():
                pass
        except BaseException as e:  # a fault of the loop itself, not of one request: nothing can run any more
            self.give_up(e)
        finally:
            self.stopped.set()

    def turn(self) -> bool:
        """One step: admit waiting jobs to free rows, decode every running row, free finished rows; False once
        closed."""
        with self.wake:
            while not (self.rows or self.waiting or self.closed):
                self.wake.wait()
            if self.closed:
                return False
        try:
            self.retire(lambda row: row.job.cancelled)
            while self.waiting and len(self.rows) < self.max_batch:
                job = self.waiting.popleft()  # a deque's ends are thread-safe: submit appends meanwhile
                if not job.cancelled:
                    self.admit(job)
            self.retire(lambda row: row.finished or row.job.cancelled)
            if self.rows:
                self.decode()
                self.retire(lambda row: row.finished or row.job.cancelled)
        except Exception as e:  # outside any one request's admission or step (admit and decode catch their own)
            self.fail(self.rows, e)
            self.rows = []  # every row is free again; a freed row's stale slots are never attended to
        return True

    def give_up(self, error: BaseException) -> None:
        """The loop has stopped for good: record why, and end every queued and running job with it."""
        frame = error.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        where = f" at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else ""
        with self.wake:
            self.failure = f"the server's engine stopped ({describe(error)}{where}); restart the server"
            jobs = [row.job for row in self.rows] + list(self.waiting)
            self.rows, self.waiting = [], deque()
        log.error("gptlite.serve: %s", self.failure)
        log.debug("the engine's traceback", exc_info=error)
        for job in jobs:
            if not job.cancelled:
                job.emit(Piece("", 0, "error", self.failure))

    def admit(self, job: Job) -> None:
        """Prefill the job into the next free row and emit its first token; a failure ends the job alone."""
        seed = job.params.seed if job.params.seed is not None else random.randrange(SEEDS)
        row = None
        try:
            generator = torch.Generator(device=self.cache.device).manual_seed(seed % SEEDS)
            row = Row(job, TextStream(self.tokenizer, job.params.stop), generator, length=len(job.prompt))
            self.rows.append(row)
            with torch.no_grad():
                self.cache.prepare(len(self.rows) - 1, [0], len(job.prompt))
                idx = torch.tensor([job.prompt], device=self.cache.device)  # (1, T)
                logits = self.step(self.one, idx, self.cache)  # (1, V)
                self.sample(logits, [row])
        except Exception as e:
            if row is None:  # it failed before it had a row
                job.emit(Piece("", 0, "error", describe(e)))
            else:
                self.fail([row], e)

    def decode(self) -> None:
        """One step of every running row: feed its newest token, sample the next."""
        rows = self.rows
        try:
            with torch.no_grad():
                self.cache.prepare(0, [row.length for row in rows], 1)
                tokens = torch.tensor([[row.token] for row in rows], device=self.cache.device)  # (n, 1)
                logits = self.step(self.one if len(rows) == 1 else self.many, tokens, self.cache)  # (n, V)
                for row in rows:
                    row.length += 1
                self.sample(logits, rows)
        except Exception as e:
            self.fail(rows, e)

    def sample(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Pick each row's next token from logits (n, V), and emit it."""
        logits = mask_vocab(logits, self.vocab)  # (n, V): never an id the tokenizer lacks
        greedy = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(rows):
            p = row.job.params
            token = (
                greedy[i]
                if p.temperature == 0
                else int(sample_next(logits[i : i + 1], p.temperature, None, p.top_p, row.generator))
            )
            row.token, row.generated = token, row.generated + 1
            self.emit(row, token)

    def emit(self, row: Row, token: int) -> None:
        """The token's text to the job; the row finishes at a stop token, a stop string or max_tokens."""
        p = row.job.params
        if token in p.stop_tokens:
            text, reason = row.stream.close(), "stop"
        else:
            text = row.stream.feed([token])
            reason = "stop" if row.stream.done else None
            if reason is None and row.generated >= p.max_tokens:
                text, reason = text + row.stream.close(), "length"
        row.finished = reason is not None
        if not row.job.cancelled:
            row.job.emit(Piece(text, row.generated, reason))

    def fail(self, rows: list[Row], error: Exception) -> None:
        """End these rows' jobs with the error's message; the engine goes on."""
        message = describe(error)
        for row in rows:
            if not row.finished and not row.job.cancelled:
                row.job.emit(Piece("", row.generated, "error", message))
            row.finished = True

    def retire(self, done: Callable[[Row], bool]) -> None:
        """Free the rows of finished or cancelled jobs, moving the last running row into each freed one."""
        i = 0
        while i < len(self.rows):
            if not done(self.rows[i]):
                i += 1
                continue
            last = self.rows.pop()
            if i < len(self.rows):  # the freed row was not the last: the last running row takes its place
                self.cache.move(len(self.rows), i, last.length)
                self.rows[i] = last


def describe(error: BaseException) -> str:
    """An exception as the message a request ends with."""
    return f"{type(error).__name__}: {error}"


def compiled_step() -> Callable:
    """gptlite.kvcache's `decode_step`, the one step sample.py runs too, through torch.compile with dynamic
    shapes (rows, tokens and slots vary from call to call), where sample.py compiles it for fixed shapes. Both
    compile one function, so in a process that runs both, dynamo's recompile limit per function (8 graphs by
    default) counts the graphs of the two together."""
    return torch.compile(decode_step, dynamic=True)
