"""Structured outputs: tokens/s of JSON-schema requests against the same requests without a format, on a
GPT-2-124M-shaped model with random weights and GPT-2's tokenizer, through gptlite's engine in this process; and,
with --libraries, the grammar libraries gptlite chose among, side by side on the same schema and vocabulary.

    python benchmarks/bench_structured.py                             # 1 and 8 streams, 3 rounds, 128 tokens
    python benchmarks/bench_structured.py --streams 1 --rounds=5 --max_tokens=256 --json=structured.json
    python benchmarks/bench_structured.py --libraries=true            # also llguidance, xgrammar, outlines-core

Each round runs, for each number of streams n, n requests with the schema below (distinct prompts, temperature 1,
seeded, at most max_tokens each: a random model's output ends when its JSON is complete, or at max_tokens), all
submitted at once so that they decode together, and then the same n requests without a format, each asked for
exactly as many tokens as its constrained twin generated (the stop token off, so it generates them all): the same
prompts, the same number of tokens, only the grammar differs. The order of the two alternates from round to round.
Tokens/s = generated tokens / wall time from submitting to the last token (prefill included). Mask time is the
time spent in the rows' matchers (the mask for the next token, applied to its logits, and the token consumed) per
constrained token. The table gives min / median over the rounds. This is a script that prints a table, not a test.

--libraries: each library installed here (gptlite depends on llguidance alone; the others: `pip install --no-deps
xgrammar apache-tvm-ffi outlines-core`, --no-deps so that pip leaves torch alone) builds its view of GPT-2's
vocabulary from every id's bytes, compiles the schema, and walks it for a few seeds: random logits, masked, the
argmax taken, up to 200 tokens. It reports the build and compile times, the mean time of one mask (the library's
own call, into its bitmask), and how many walks ended with JSON that parses and validates against the schema
(`jsonschema`; a walk that reaches 200 tokens in a long string does not count).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench_serve import GPT2_SHAPE, WORDS  # noqa: E402  (the same model and prompts as the server's benchmark)

from gptlite import GPT, GPTConfig  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.files import write_json  # noqa: E402
from gptlite.inference.sampling import GenerationOptions  # noqa: E402
from gptlite.serve.engine import Engine, Job, Params  # noqa: E402
from gptlite.serve.grammar import Grammars, Matcher  # noqa: E402
from gptlite.tokenizer import get_tokenizer  # noqa: E402

SCHEMA = {  # a user record, as an app might ask for one
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
WALK_STEPS = 200  # tokens a library's random walk may take (--libraries)


@dataclass
class BenchOptions:
    streams: list[int] = option(default_factory=lambda: [1, 8], help="requests decoded together, per level")
    rounds: int = option(3, "times each level runs with and without the format (alternating)")
    max_tokens: int = option(128, "completion tokens per constrained request, at most")
    tokenizer: str = option("", "GPT-2's .tiktoken ranks file (default: ../shared/tokenizers/gpt2.tiktoken)")
    libraries: bool = option(
        False, "also compare the grammar libraries installed (llguidance, xgrammar, outlines-core)"
    )
    seeds: int = option(5, "random walks per library, with --libraries")
    json: str = option("", "also write the results here")


@dataclass
class Result:
    with_format: list[float] = field(default_factory=list)  # tokens/s per round
    without: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)  # per constrained token, per round
    tokens: list[int] = field(default_factory=list)  # generated by the n constrained requests, per round
    complete: list[int] = field(default_factory=list)  # constrained requests that ended with "stop", per round


class MatcherTime:
    """Seconds spent in the rows' matchers (Matcher.constrain and Matcher.consume), counted from now on."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("constrain", "consume"):
            setattr(Matcher, name, self.timed(getattr(Matcher, name)))

    def timed(self, method):
        def run(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def prompt(i: int) -> str:
    """A distinct prompt of a dozen words."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12))


def run_jobs(engine: Engine, jobs: list[tuple[list[int], Params]]) -> tuple[float, list[int], list[str]]:
    """(seconds from submitting to the last token, tokens generated, finish reasons) of jobs run together."""
    tokens = [0] * len(jobs)
    reasons = [""] * len(jobs)
    done = threading.Event()

    def emitter(i: int):
        def emit(piece) -> None:
            tokens[i] = piece.tokens
            if piece.finish_reason:
                reasons[i] = piece.finish_reason if piece.error is None else f"error: {piece.error}"
                if all(reasons):
                    done.set()

        return emit

    start = time.perf_counter()
    for i, (ids, params) in enumerate(jobs):
        engine.submit(Job(ids, params, emitter(i)))
    done.wait()
    errors = [r for r in reasons if r.startswith("error")]
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return time.perf_counter() - start, tokens, reasons


def measure(options: BenchOptions, engine: Engine, fmt, eot: int, timer: MatcherTime) -> dict[int, Result]:
    prompts = [engine.tokenizer.encode(prompt(i)) for i in range(max(options.streams))]
    jobs = {}  # n -> (the constrained requests, the same without a format)
    for n in options.streams:
        constrained = [
            (
                prompts[i],
                Params(
                    options.max_tokens,
                    GenerationOptions(temperature=1.0, stop_tokens=(eot,), seed=i),
                    response_format=fmt,
                ),
            )
            for i in range(n)
        ]
        counts = run_jobs(engine, constrained)[1]  # what each generates (the same in every round), and a warm-up
        jobs[n] = (
            constrained,
            [(prompts[i], Params(counts[i], GenerationOptions(temperature=1.0, seed=i))) for i in range(n)],
        )
    results = {n: Result() for n in options.streams}
    for r in range(options.rounds):
        for n in options.streams:
            res = results[n]
            constrained, plain = jobs[n]
            for formatted in (True, False) if r % 2 == 0 else (False, True):
                before = timer.seconds
                seconds, tokens, reasons = run_jobs(engine, constrained if formatted else plain)
                if not formatted:
                    res.without.append(sum(tokens) / seconds)
                    continue
                res.with_format.append(sum(tokens) / seconds)
                res.mask_us.append(1e6 * (timer.seconds - before) / sum(tokens))
                res.tokens.append(sum(tokens))
                res.complete.append(reasons.count("stop"))
    return results


def mm(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}} / {statistics.median(values):{fmt}}"


def table(options: BenchOptions, results: dict[int, Result], compile_ms: dict[str, float]) -> str:
    lines = [
        "| streams | with format tokens/s | without tokens/s | ratio | mask µs/token | tokens per round "
        "| ended 'stop' |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, res in results.items():
        ratio = statistics.median(res.with_format) / statistics.median(res.without)
        lines.append(
            f"| {n} | {mm(res.with_format, '.1f')} | {mm(res.without, '.1f')} | {ratio:.2f}x | "
            f"{mm(res.mask_us, '.0f')} | {statistics.median(res.tokens):.0f} | "
            f"{sum(res.complete)} of {n * options.rounds} |"
        )
    lines.append(
        f"\nmin / median of {options.rounds} rounds; ratio = median with / median without; at most "
        f"{options.max_tokens} tokens per constrained request, temperature 1. llguidance's view of GPT-2's "
        f"vocabulary built in {compile_ms['tokenizer']:.0f} ms; the schema compiled in {compile_ms['schema']:.1f} ms "
        f"(then cached: {compile_ms['cached']:.3f} ms)."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# --libraries: the grammar libraries side by side


class Library:
    """One grammar library's view of a vocabulary, given every id's bytes: `build` it, `compile` a schema, and walk
    a matcher: `fill` its bitmask for the next token, `consume` a token, `done`."""

    name = ""
    module = ""

    def __init__(self, tokenizer, token_bytes: list[bytes]):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.eos = tokenizer.eot_id
        self.words = (len(token_bytes) + 31) // 32
        self.bits = np.zeros(self.words, dtype=np.int32)


class LLGuidance(Library):
    name = "llguidance 1.9 (gptlite's)"
    module = "llguidance"

    def build(self) -> None:  # as the server builds it, from the tokenizer (llguidance tokenizes forced text with it)
        self.tok = Grammars(self.tokenizer, len(self.token_bytes), (self.eos,)).ll_tokenizer()

    def compile(self, schema: dict):
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return llguidance.LLMatcher(self.tok, grammar, log_level=0)

    def start(self, compiled) -> None:
        self.m = compiled.deep_copy()

    def fill(self) -> None:
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)

    def consume(self, token: int) -> None:
        assert self.m.consume_token(token), self.m.get_error()

    def done(self) -> bool:
        return self.m.is_stopped()


class XGrammar(Library):
    name = "xgrammar 0.2"
    module = "xgrammar"

    def build(self) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo(self.token_bytes, vocab_size=len(self.token_bytes), stop_token_ids=[self.eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = torch.zeros(1, self.words, dtype=torch.int32)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def start(self, compiled) -> None:
        import xgrammar

        self.m = xgrammar.GrammarMatcher(compiled)

    def fill(self) -> None:
        self.m.fill_next_token_bitmask(self.mask, 0)
        self.bits[:] = self.mask[0].numpy()

    def consume(self, token: int) -> None:
        assert self.m.accept_token(token)

    def done(self) -> bool:
        return self.m.is_terminated()


class OutlinesCore(Library):
    name = "outlines-core 0.2"
    module = "outlines_core"

    def build(self) -> None:
        import outlines_core

        tokens = {}
        for i, data in enumerate(self.token_bytes):
            if i != self.eos and data:
                tokens.setdefault(data, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos, tokens)

    def compile(self, schema: dict):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        return outlines_core.Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), self.vocabulary)

    def start(self, compiled) -> None:
        import outlines_core

        self.m = outlines_core.Guide(compiled)

    def fill(self) -> None:
        self.m.write_mask_into(self.bits.ctypes.data, self.bits.size, self.bits.itemsize)

    def consume(self, token: int) -> None:
        self.m.advance(token)

    def done(self) -> bool:
        return self.m.is_finished()


def compare_libraries(options: BenchOptions, tokenizer, width: int) -> list[dict]:
    """Each installed library's build and compile times, mean mask time and valid walks (see the docstring)."""
    token_bytes = [tokenizer.token_bytes([i]) for i in range(tokenizer.vocab_size)] + [b""] * (
        width - tokenizer.vocab_size
    )
    eos = tokenizer.eot_id
    validate = None
    if importlib.util.find_spec("jsonschema") is not None:
        import jsonschema

        validate = jsonschema.Draft202012Validator(SCHEMA).is_valid
    rows = []
    for kind in (LLGuidance, XGrammar, OutlinesCore):
        if importlib.util.find_spec(kind.module) is None:
            print(f"{kind.module} is not installed: left out")
            continue
        lib = kind(tokenizer, token_bytes)
        start = time.perf_counter()
        lib.build()
        built = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lib.compile(SCHEMA)
        compiled_s = time.perf_counter() - start
        masks = []
        valid = 0
        for seed in range(options.seeds):
            lib.start(compiled)
            generator = torch.Generator().manual_seed(seed)
            out = []
            for _ in range(WALK_STEPS):
                start = time.perf_counter()
                lib.fill()
                masks.append(time.perf_counter() - start)
                allowed = np.unpackbits(lib.bits.view(np.uint8), bitorder="little")[:width].view(np.bool_)
                logits = torch.randn(width, generator=generator).masked_fill(~torch.from_numpy(allowed), -torch.inf)
                token = int(logits.argmax())
                if token == eos:
                    break
                out.append(token)
                lib.consume(token)
                if lib.done():
                    break
            try:
                valid += validate is None or validate(json.loads(tokenizer.decode(out)))
            except ValueError:  # not JSON: a string cut at WALK_STEPS
                pass
        rows.append(
            {
                "library": lib.name,
                "vocabulary_ms": 1e3 * built,
                "compile_ms": 1e3 * compiled_s,
                "mask_us": 1e6 * statistics.mean(masks),
                "mask_median_us": 1e6 * statistics.median(masks),
                "valid": valid,
                "walks": options.seeds,
            }
        )
    return rows


def library_table(rows: list[dict]) -> str:
    lines = [
        "| library | vocabulary built (ms) | schema compiled (ms) | mask, mean (µs) | mask, median (µs) "
        "| valid walks |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['library']} | {r['vocabulary_ms']:.0f} | {r['compile_ms']:.1f} | {r['mask_us']:.0f} | "
            f"{r['mask_median_us']:.1f} | {r['valid']} of {r['walks']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        options = parse(BenchOptions, sys.argv[1:] if argv is None else argv, "bench_structured.py", __doc__)
        print(machine_line(), flush=True)
        ranks = options.tokenizer or str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken")
        tokenizer = get_tokenizer(ranks)
        torch.manual_seed(0)
        model = GPT(GPTConfig(**GPT2_SHAPE)).eval()
        eot = tokenizer.eot_id
        grammars = Grammars(tokenizer, model.config.vocab_size, (eot,))
        start = time.perf_counter()
        grammars.ll_tokenizer()
        compile_ms = {"tokenizer": 1e3 * (time.perf_counter() - start)}
        start = time.perf_counter()
        fmt = grammars.compile("json_schema", SCHEMA)
        compile_ms["schema"] = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile("json_schema", SCHEMA)
        compile_ms["cached"] = 1e3 * (time.perf_counter() - start)
        timer = MatcherTime()
        engine = Engine(model, tokenizer, max_batch=max(options.streams)).start()
        try:
            results = measure(options, engine, fmt, eot, timer)
        finally:
            engine.close()
        print(table(options, results, compile_ms))
        libraries = []
        if options.libraries:
            libraries = compare_libraries(options, tokenizer, model.config.vocab_size)
            print()
            print(library_table(libraries))
        if options.json:
            data = {str(n): asdict(r) for n, r in results.items()}
            write_json(Path(options.json), {"results": data, "compile_ms": compile_ms, "libraries": libraries})
        return 0

    return run_command("bench_structured.py", body, "nothing was measured")


if __name__ == "__main__":
    sys.exit(main())
