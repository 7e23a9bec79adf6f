"""Continuous batching: one background thread decodes every running request together, one token per step.

A request (a `Job`: prompt ids, `Params`, and an `emit` callback) waits in a queue until a row of the shared
`RowCache` is free. At the next step the requests that arrived are prefilled together, its first token is
sampled from the prefill, and from then on it decodes with the other running rows, one token per step each,
until it stops (a stop token, a stop string, or max_tokens) or is cancelled; its row is freed before the next
step. Running rows are kept first (the last running row moves into a freed one), so a step over n requests
costs n rows.

Prefilling arrivals together: a prompt first takes whatever `PrefixCache` holds of its beginning (blocks of keys
and values computed recently: a shared system prompt, a chat's earlier turns; `prefix_cache_mb` bounds it);
prompts that several arrivals share (the n choices of one request) are prefilled once and the row copied; the
rest run as batches of similar lengths, each padded on the right to its longest, reading every row's logits at
its own last token. A padded slot holds junk until the row's next token overwrites it, and no query ever
attends past its own slot, so a row computes what it would alone.

On the CPU, float32, the rows run through `packed_for_cpu`'s views of the model, made once: its slab layers for a
single row (so one request decodes as fast as sample.py's batch of one) and its oneDNN-packed layers for several.
Where gptlite's compiled kernels take a block (gptlite.inference.cpu.blocks), a decode step of one row or a few runs
the block in one call, as sample.py's does, each row at its own slot (RowCache.decode_buffers). Each
row samples with its own `GenerationOptions` (gptlite.inference.sampling's, the options generation takes: temperature,
top_k, top_p, presence and frequency penalties, seed, stop ids; those the engine applies are marked SERVING there) and
its own `torch.Generator` (seeded when asked), and never an id the tokenizer lacks (a padded vocabulary's extra ids); a
row with a response_format, only the tokens its grammar allows next (its `Matcher`, gptlite.serve.grammar), and it
ends once the grammar is complete; rows without one skip all of that. `emit` is called on the engine's thread with a
`Piece` for every token (a step's pieces one after another, once every row has its token): the new text (UTF-8 safe,
cut before a stop string) and, on the last piece, why the request ended. A job that asks for log-probabilities gets
each token's (and its most likely alternatives') under the model's own distribution; with `echo`, the prompt's too,
from a forward of the whole prompt before its prefill (a job with max_tokens 0 gets only those, and no token at all
without logprobs; one with max_tokens 1 takes its token from that forward and needs neither prefill nor row).

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

from gptlite.inference.cpu.decode import packed_for_cpu
from gptlite.inference.generate import TextStream
from gptlite.inference.kvcache import decode_step
from gptlite.inference.quantize import choose_ways
from gptlite.inference.sampling import SERVING, GenerationOptions, greedy, mask_vocab, sample_next
from gptlite.serve.grammar import GrammarError
from gptlite.serve.prefix import BLOCK as PREFIX_BLOCK
from gptlite.serve.prefix import PrefixCache
from gptlite.serve.rows import RowCache

if TYPE_CHECKING:
    from gptlite.model.network import Transformer
    from gptlite.serve.grammar import Format, Matcher
    from gptlite.tokenizer import Tokenizer

log = logging.getLogger("uvicorn.error")  # the server's log, so the engine's lines share its format and level
SEEDS = 2**64  # torch.Generator's seeds are 0..2**64-1; any integer seed is taken modulo this, as torch takes -1
PAD_SLACK = 1.25  # a batch of prefills may compute this many padded tokens per real one (see `padded_runs`)


@dataclass(frozen=True)
class Params:
    """How one completion is generated: its sampling as generation's own options (`options`), and beside them what
    only an OpenAI request asks for (stop strings, logprobs, echo, logit_bias, response_format). Checked by the caller
    (gptlite.serve.protocol), but for options that the engine does not apply, which it refuses here."""

    max_tokens: int
    options: GenerationOptions = GenerationOptions()  # temperature (0 = greedy), top_p, penalties, seed, stop ids
    stop: tuple[str, ...] = ()  # text is cut before the first of these, which ends the request
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives (None: none)
    echo: bool = False  # with `logprobs`, the prompt's tokens' log-probabilities too, on the first piece
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, added to its logit) before sampling
    response_format: Format | None = None  # the grammar its text must follow (gptlite.serve.grammar); None: any

    def __post_init__(self) -> None:
        unused = self.options.unused_by(SERVING)
        if unused:
            raise ValueError(
                f"the server's engine does not apply {', '.join(unused)} (gptlite.inference.sampling marks the options "
                "it applies SERVING); leave them at their defaults"
            )

    @property
    def adjusts(self) -> bool:
        return bool(self.logit_bias) or self.options.presence_penalty != 0 or self.options.frequency_penalty != 0


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's distribution (before temperature and top_p, as vLLM reports
    it), and the most likely tokens there with theirs; the first token of a prompt has neither (None, ())."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


@dataclass
class Piece:
    """What one step gave a job: its new text (may be empty), and on its last piece why it ended:
    "stop", "length", or "error" (with the message)."""

    text: str
    tokens: int  # tokens generated so far
    finish_reason: str | None = None
    error: str | None = None
    invalid: bool = False  # the error is the request's own (its response_format's grammar failed): a 400, not a 500
    logprobs: list[TokenLogprob] = field(default_factory=list)  # this piece's token's, with Params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, on the first piece, with Params.echo


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


@dataclass(eq=False)  # a row is itself: compared and hashed by identity
class Row:
    """A running job's decoding state."""

    job: Job
    stream: TextStream
    generator: torch.Generator
    length: int = 0  # tokens in its cache row
    token: int = 0  # the newest sampled token, fed at the next step
    generated: int = 0
    finished: bool = field(default=False)
    failed: bool = False  # ended by an error: its cache row may hold half-written keys and values
    tokens: list[int] = field(default_factory=list)  # the tokens generated so far
    counts: dict[int, int] = field(default_factory=dict)  # how often each token was generated (for penalties)
    matcher: Matcher | None = field(init=False)  # its place in its response_format's grammar (None: no format)

    def __post_init__(self) -> None:
        fmt = self.job.params.response_format
        self.matcher = fmt.matcher() if fmt is not None else None


class Engine:
    """Runs jobs `max_batch` at a time on one thread (see the module docstring); `submit` from any thread."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        max_batch: int = 16,
        max_len: int | None = None,
        compile: bool = False,
        prefix_cache_mb: float = 0.0,
    ):
        config = model.config
        weight = model.tok_emb.weight
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_len = min(max_len or config.block_size, config.block_size)  # a row's prompt + completion
        self.cache = RowCache(config, max_batch, self.max_len, weight.dtype, weight.device, always_mask=compile)
        self.vocab = min(tokenizer.vocab_size, config.vocab_size)  # ids past the tokenizer's are never sampled
        budget = int(prefix_cache_mb * 2**20)
        self.prefix = PrefixCache(budget, stateful=self.cache.stateful) if prefix_cache_mb > 0 else None
        choose_ways(model)  # a quantized model's kernels, chosen once, before a compile: no file read inside it
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
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the admitted job's, until its first piece
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
            self.admit_waiting()
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

    def admit_waiting(self) -> None:
        """Take waiting jobs into the free rows: a job that scores its prompt on its own (`admit`), the others
        prefilled together (`prefill`)."""
        batch = []
        while self.waiting and len(self.rows) + len(batch) < self.max_batch:
            job = self.waiting.popleft()  # a deque's ends are thread-safe: submit appends meanwhile
            if job.cancelled:
                continue
            if (job.params.echo and job.params.logprobs is not None) or job.params.max_tokens == 0:
                self.admit(job)
            else:
                batch.append(job)
        if batch:
            self.prefill(batch)

    def new_row(self, job: Job) -> Row:
        """The decoding state of a job about to be prefilled, its generator seeded."""
        seed = job.params.options.seed if job.params.options.seed is not None else random.randrange(SEEDS)
        generator = torch.Generator(device=self.cache.device).manual_seed(seed % SEEDS)
        return Row(job, TextStream(self.tokenizer, job.params.stop), generator, length=len(job.prompt))

    def prefill(self, jobs: list[Job]) -> None:
        """Prefill jobs into the next free rows together, and emit their first tokens (see the module docstring);
        a failure ends the jobs it touched, alone."""
        rows = []
        for job in jobs:
            try:
                rows.append(self.new_row(job))
            except Exception as e:
                job.emit(Piece("", 0, "error", describe(e)))
        leaders: dict[tuple[int, ...], Row] = {}  # a prompt -> the row that prefills it
        followers = []  # rows whose prompt a leader prefills: (row, its leader)
        for row in rows:
            leader = leaders.setdefault(tuple(row.job.prompt), row)
            if leader is not row:
                followers.append((row, leader))
        logits = self.prefill_rows(list(leaders.values()))  # leader -> its logits (1, V)
        for row, leader in followers:
            self.rows.append(row)
            if leader not in logits:
                self.fail([row], RuntimeError("the prefill of this prompt failed"))
                continue
            self.cache.move(self.rows.index(leader), len(self.rows) - 1, len(row.job.prompt))
            self.sample(logits[leader], [row])

    def prefill_rows(self, rows: list[Row]) -> dict[Row, torch.Tensor]:
        """Prefill rows with distinct prompts into the next free cache rows, and emit their first tokens; each
        prefilled row's last logits (1, V)."""
        cached = [self.prefix.match(row.job.prompt, len(row.job.prompt) - 1) if self.prefix else [] for row in rows]
        left = [len(row.job.prompt) - len(blocks) * PREFIX_BLOCK for row, blocks in zip(rows, cached, strict=True)]
        order = sorted(range(len(rows)), key=left.__getitem__)  # shortest first: similar lengths share a batch
        first = len(self.rows)
        reused = []  # tokens each row (in `order`) takes from the prefix cache
        for index, i in enumerate(order, start=first):
            self.rows.append(rows[i])
            reused.append(self.prefix.restore(self.cache, index, cached[i]) if cached[i] else 0)
        ordered = [rows[i] for i in order]
        prompts = [row.job.prompt[done:] for row, done in zip(ordered, reused, strict=True)]  # what is left to run
        logits = {}
        for run in padded_runs([len(p) for p in prompts], reused, self.max_len):
            run_rows = [ordered[i] for i in run]
            try:
                with torch.no_grad():
                    T = max(len(prompts[i]) for i in run)
                    real = [len(prompts[i]) for i in run]  # the rest of each row is right padding
                    self.cache.prepare(first + run.start, [reused[i] for i in run], T, real)
                    padded = [prompts[i] + [0] * (T - len(prompts[i])) for i in run]
                    idx = torch.tensor(padded, device=self.cache.device)  # (n, T)
                    last = torch.tensor([len(prompts[i]) - 1 for i in run], device=self.cache.device)  # (n,)
                    model = self.one if len(run) == 1 else self.many
                    run_logits = self.step(model, idx, self.cache, last)  # (n, V)
                if self.prefix is not None:
                    for i in run:
                        self.prefix.store(self.cache, first + i, ordered[i].job.prompt)
                self.sample(run_logits, run_rows)
                logits.update((row, run_logits[j : j + 1]) for j, row in enumerate(run_rows))
            except Exception as e:
                self.fail(run_rows, e)
        return logits

    def admit(self, job: Job) -> None:
        """Score the job's prompt, then prefill it into the next free row and emit its first token; a failure ends
        the job alone."""
        row = None
        last = None  # the prompt's last logits, when a scoring forward gave them
        try:
            if job.params.echo and job.params.logprobs is not None:
                self.prompt_logprobs, last = self.score_prompt(job.prompt, job.params.logprobs)
            if job.params.max_tokens == 0:  # the prompt's log-probabilities are all it asked for
                job.emit(Piece("", 0, "length", prompt_logprobs=self.take_prompt_logprobs()))
                return
            row = self.new_row(job)
            if last is not None and job.params.max_tokens == 1:  # (lm-eval's log-likelihoods) no prefill, no row
                self.sample(last, [row])
                return
            self.rows.append(row)
            with torch.no_grad():
                self.cache.prepare(len(self.rows) - 1, [0], len(job.prompt))
                idx = torch.tensor([job.prompt], device=self.cache.device)  # (1, T)
                logits = self.step(self.one, idx, self.cache)  # (1, V)
                self.sample(logits, [row])
        except Exception as e:
            self.prompt_logprobs = None
            if row is None:  # it failed before it had a row
                job.emit(Piece("", 0, "error", describe(e)))
            else:
                self.fail([row], e)

    def score_prompt(self, prompt: list[int], top: int) -> tuple[list[TokenLogprob], torch.Tensor]:
        """Every prompt token's log-probability given the ones before it, and the last position's logits (1, V),
        from one forward of the whole prompt."""
        with torch.no_grad():
            logits, _ = self.model(torch.tensor([prompt], device=self.cache.device))  # (1, T, V)
            logprobs = torch.log_softmax(mask_vocab(logits[0, :-1].float(), self.vocab), dim=-1)  # (T - 1, V)
        return [TokenLogprob(prompt[0], None, ())] + token_logprobs(logprobs, prompt[1:], top), logits[:, -1]

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        scored = self.prompt_logprobs
        self.prompt_logprobs = None
        return scored

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
        scored = any(row.job.params.logprobs is not None for row in rows)
        logprobs = torch.log_softmax(logits.float(), dim=-1) if scored else None  # (n, V): the model's own
        if any(row.job.params.adjusts for row in rows):
            logits = logits.clone()
            for i, row in enumerate(rows):
                adjust(logits[i], row)
        picks = greedy(logits).tolist()  # (n,): each row's first largest
        pieces = []  # (job, its piece), emitted once every row has its token
        try:
            for i, row in enumerate(rows):
                piece = self.pick(row, logits[i : i + 1], picks[i], None if logprobs is None else logprobs[i : i + 1])
                if piece is not None:
                    pieces.append((row.job, piece))
        finally:  # together, after the step's work (a server hands them over in one go); also when a row failed
            for job, piece in pieces:
                if not job.cancelled:
                    job.emit(piece)

    def pick(self, row: Row, own: torch.Tensor, best: int, logprobs: torch.Tensor | None) -> Piece | None:
        """Row's next token from its logits (1, V) (`best` is their argmax), and the piece it gives (None where the
        row failed instead: its grammar)."""
        p = row.job.params
        options = p.options
        if row.matcher is not None:  # a response_format: only the tokens its grammar allows next
            try:
                own = row.matcher.constrain(own)
            except ValueError as e:  # the matcher failed (a GrammarError): its request ends, alone
                self.take_prompt_logprobs()  # (an echoed prompt's, which no later row may take)
                self.fail([row], e)
                return None
            best = int(own.argmax())
        token = (
            best
            if options.temperature == 0
            else int(sample_next(own, options.temperature, options.top_k, options.top_p, row.generator))
        )
        row.token = token
        row.tokens.append(token)
        row.generated += 1
        row.counts[token] = row.counts.get(token, 0) + 1
        entries = token_logprobs(logprobs, [token], p.logprobs) if p.logprobs is not None else []
        return self.piece(row, token, entries)

    def piece(self, row: Row, token: int, logprobs: list[TokenLogprob]) -> Piece | None:
        """The token's text (and log-probabilities) for the job; the row finishes at a stop token, a stop string, a
        complete response_format or max_tokens. A prompt's log-probabilities, when asked for, go with its first
        token. None where the row failed instead (its grammar), which has ended its job."""
        p = row.job.params
        if row.matcher is not None:
            try:
                row.matcher.consume(token)
            except ValueError as e:  # the matcher failed (a GrammarError): its request ends, alone
                self.take_prompt_logprobs()  # (an echoed prompt's, which no later row may take)
                self.fail([row], e)
                return None
        if token in p.options.stop_tokens:
            text, reason = row.stream.close(), "stop"
        else:
            text = row.stream.feed([token])
            reason = "stop" if row.stream.done else None
            if reason is None and row.matcher is not None and row.matcher.done:  # the format is complete
                text = text + row.stream.close()
                reason = "stop"
            if reason is None and row.generated >= p.max_tokens:
                text, reason = text + row.stream.close(), "length"
        row.finished = reason is not None
        prompt = self.take_prompt_logprobs() if row.generated == 1 else None
        return Piece(text, row.generated, reason, logprobs=logprobs, prompt_logprobs=prompt)

    def fail(self, rows: list[Row], error: Exception) -> None:
        """End these rows' jobs with the error's message; the engine goes on. A grammar's failure is the request's
        own (its schema), said in the grammar's plain words."""
        invalid = isinstance(error, GrammarError)
        message = str(error) if invalid else describe(error)
        for row in rows:
            if not row.finished and not row.job.cancelled:
                row.job.emit(Piece("", row.generated, "error", message, invalid))
            row.finished = True
            row.failed = True

    def retire(self, done: Callable[[Row], bool]) -> None:
        """Free the rows of finished or cancelled jobs, moving the last running row into each freed one."""
        i = 0
        while i < len(self.rows):
            if not done(self.rows[i]):
                i += 1
                continue
            self.remember(i, self.rows[i])
            last = self.rows.pop()
            if i < len(self.rows):  # the freed row was not the last: the last running row takes its place
                self.cache.move(len(self.rows), i, last.length)
                self.rows[i] = last

    def remember(self, index: int, row: Row) -> None:
        """Keep the whole blocks of a leaving row's prompt and completion in the prefix cache (a chat's next turn
        begins with them), unless an error may have left its cache row half-written."""
        if self.prefix is not None and not row.failed:
            self.prefix.store(self.cache, index, (row.job.prompt + row.tokens)[: row.length])


def padded_runs(lengths: list[int], reused: list[int], max_len: int) -> list[range]:
    """Cut prompts sorted by length (ascending), whose rows already hold reused[i] tokens, into runs each prefilled
    as one batch padded on the right to its longest: a run grows while its padded size stays within PAD_SLACK
    times its real tokens and every row's padded slots fit in max_len."""
    runs = []
    start = 0
    real = 0
    for i, n in enumerate(lengths):
        padded = (i - start + 1) * n  # sorted: row i is the run's longest
        if i > start and (padded > PAD_SLACK * (real + n) or max(reused[start : i + 1]) + n > max_len):
            runs.append(range(start, i))
            start = i
            real = 0
        real += n
    runs.append(range(start, len(lengths)))
    return runs


def adjust(logits: torch.Tensor, row: Row) -> None:
    """A row's logits (V,) with OpenAI's logit_bias added and its presence and frequency penalties taken from the
    tokens it has generated (logit - count * frequency_penalty - presence_penalty, as OpenAI defines them)."""
    p = row.job.params
    options = p.options
    for token, bias in p.logit_bias:
        logits[token] += bias
    if row.counts and (options.presence_penalty or options.frequency_penalty):
        ids = torch.tensor(list(row.counts), device=logits.device)
        counts = torch.tensor(list(row.counts.values()), device=logits.device, dtype=logits.dtype)
        logits[ids] -= counts * options.frequency_penalty + options.presence_penalty


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probability of tokens[i] in row i of `logprobs` (len(tokens), V), and the row's `top` most likely
    tokens with theirs."""
    rows = torch.arange(len(tokens), device=logprobs.device)
    # long, said: a one-token prompt scores no token, and torch.tensor([]) would be float
    ids = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)
    chosen = logprobs[rows, ids].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprob(token, value, tuple(zip(row_ids, row_values, strict=True)))
        for token, value, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)
    ]


def describe(error: BaseException) -> str:
    """An exception as the message a request ends with."""
    return f"{type(error).__name__}: {error}"


def compiled_step() -> Callable:
    """gptlite.inference.kvcache's `decode_step`, the one step sample.py runs too, through torch.compile with dynamic
    shapes (rows, tokens and slots vary from call to call), where sample.py compiles it for fixed shapes. Both
    compile one function, so in a process that runs both, dynamo's recompile limit per function (8 graphs by
    default) counts the graphs of the two together."""
    return torch.compile(decode_step, dynamic=True)
