"""Structured outputs: `response_format` on both routes, through llguidance's grammar, with a tiktoken, a Hugging Face
and a char tokenizer. A random-weight model's outputs validate against their JSON schema (`jsonschema`) for several
seeds at temperature 1 and end with "stop"; a constrained row leaves its unconstrained neighbours' greedy text as it
was; log-probabilities stay the model's own; bad formats are 400s and the server goes on."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
import torch

from gptlite.inference.sampling import GenerationOptions
from gptlite.serve.app import create_app
from gptlite.serve.engine import Engine, Job, Params
from gptlite.serve.grammar import Grammars
from gptlite.tokenizer import get_tokenizer
from tests.conftest import shared_file, tiny_model
from tests.helpers.serving import CHARS, Running, TemplateTokenizer
from tests.tokenizer.test_chat import QWEN_LIKE
from tests.tokenizer.test_chat import model_dir as chat_model_dir

MODEL = "tiny"
SCHEMA = {  # a nested object, an array, enums, a bounded integer, short strings, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Who are you?"}]


def tokenizer_of(kind: str, tmp_path_factory):
    """GPT-2's tiktoken ranks, a Hugging Face tokenizer.json with ChatML markers and a chat template, or the serve
    tests' char tokenizer with its template."""
    if kind == "tiktoken":
        return get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    if kind == "huggingface":
        return get_tokenizer(str(chat_model_dir(tmp_path_factory.mktemp("hf"), QWEN_LIKE, "jinja")))
    return TemplateTokenizer(CHARS)


class Server:
    """A tiny random model for the tokenizer (its vocabulary padded past the tokenizer's, as GPT-2's is), served."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model = tiny_model(vocab_size=tokenizer.vocab_size + 7, block_size=256)
        self.engine = Engine(self.model, tokenizer, max_batch=8).start()
        self.app = create_app(self.engine, tokenizer, MODEL)
        self.running = Running(self.app)
        self.url = self.running.url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": MODEL, **body}, timeout=120)

    def close(self) -> None:
        try:
            self.running.stop()
        finally:
            self.engine.close()


@pytest.fixture(scope="module", params=["tiktoken", "huggingface", "char"])
def server(request, tmp_path_factory):
    s = Server(tokenizer_of(request.param, tmp_path_factory))
    yield s
    s.close()


def choices(server, chat: bool, body: dict) -> list[dict]:
    """The choices of a request to the chat route (messages) or the completions route (a prompt)."""
    path, prompt = ("/v1/chat/completions", {"messages": MESSAGES}) if chat else ("/v1/completions", {"prompt": "Hi"})
    r = server.post(path, {**prompt, **body})
    assert r.status_code == 200, r.text
    out = r.json()["choices"]
    return [{"text": c["message"]["content"] if chat else c["text"], **c} for c in out]


def test_json_schema_outputs_validate_for_several_seeds(server):
    check_json_schema_outputs(server, chat=False)


@pytest.mark.parametrize("server", ["huggingface", "char"], indirect=True)  # the tokenizers with a chat template
def test_json_schema_chat_outputs_validate_for_several_seeds(server):
    check_json_schema_outputs(server, chat=True)


def check_json_schema_outputs(server, chat: bool) -> None:
    body = {"response_format": JSON_SCHEMA, "max_tokens": 200, "temperature": 1.0, "n": 4, "seed": 7}
    for choice in choices(server, chat, body):
        assert choice["finish_reason"] == "stop", choice["text"]
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_json_object_outputs_parse_as_objects(server):
    # the quote and the closing brace favoured, so that a random model's strings and objects end soon (its numbers
    # and the strings of the other tokens with a quote in them could go on past max_tokens)
    favoured = {str(server.tokenizer.encode(c)[0]): 15 for c in '"}'}
    body = {"response_format": {"type": "json_object"}, "max_tokens": 100, "n": 3, "seed": 1}
    for choice in choices(server, False, {**body, "logit_bias": favoured}):
        assert choice["finish_reason"] == "stop", choice["text"]
        assert isinstance(json.loads(choice["text"]), dict)


def test_a_streamed_json_schema_output_joins_to_valid_json(server):
    body = {"prompt": "Hi", "response_format": JSON_SCHEMA, "max_tokens": 200, "seed": 3, "stream": True}
    r = server.post("/v1/completions", body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_type_text_and_too_few_tokens_change_nothing_else(server):
    plain = choices(server, False, {"max_tokens": 8, "temperature": 0})
    assert choices(server, False, {"max_tokens": 8, "temperature": 0, "response_format": {"type": "text"}}) == plain
    (short,) = choices(server, False, {"response_format": JSON_SCHEMA, "max_tokens": 3, "seed": 1})
    assert short["finish_reason"] == "length" and short["text"].startswith("{")


def test_log_probabilities_stay_the_models_own(server):
    """The format forces the first token: its log-probability is the one the model gives it after the prompt (echo
    scores it), and the alternatives listed are the model's most likely tokens, as without a format."""
    prompt = server.tokenizer.encode("Hi")
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 3}
    plain = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    forced = server.post("/v1/completions", {**body, "response_format": JSON_SCHEMA}).json()["choices"][0]
    assert forced["text"].startswith("{")
    token = server.tokenizer.encode(forced["text"])
    echo = {"prompt": prompt + token, "max_tokens": 0, "echo": True, "logprobs": 0}
    scored = server.post("/v1/completions", echo).json()["choices"][0]["logprobs"]
    assert forced["logprobs"]["token_logprobs"] == pytest.approx(scored["token_logprobs"][-1:], abs=1e-4)
    alternatives = forced["logprobs"]["top_logprobs"][0]
    assert {k: alternatives[k] for k in plain["top_logprobs"][0]} == pytest.approx(plain["top_logprobs"][0], abs=1e-5)


HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
HF_SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]  # tests.tokenizer.test_chat's model_dir's


def test_inside_a_string_every_text_token_is_allowed_and_no_special_or_padded_one(server):
    tokenizer = server.tokenizer
    ids = {
        "tiktoken": {tokenizer.eot_id},
        "huggingface": {tokenizer.special_id(text) for text in HF_SPECIALS},
        "char": set(),
    }[tokenizer.kind]
    assert tokenizer.special_token_ids() == ids
    matcher = server.app.state.server.grammars.compile("json_schema", {"type": "string"}).matcher()
    matcher.consume(tokenizer.encode('"')[0])
    width = server.model.config.vocab_size
    allowed = set(torch.isfinite(matcher.constrain(torch.zeros(1, width)))[0].nonzero().flatten().tolist())
    assert not allowed & ids and max(allowed) < tokenizer.vocab_size < width  # the padded ids never
    # in a string most tokens are text (not control characters, nor the bytes that cannot begin a character)
    assert len(allowed) > 0.5 * tokenizer.vocab_size


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BAD_FORMATS = {  # name: (response_format, a phrase of the message)
    "an invalid schema": (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        "Invalid type",
    ),
    "an unsatisfiable schema": (
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
        "minimum (5) is greater than maximum (1)",
    ),
    "a bad pattern": ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}}, "regex"),
    "an unknown type": ({"type": "xml"}, "'text', 'json_object' or 'json_schema'"),
    "not an object": ("json", "valid dictionary"),
    "no schema": ({"type": "json_schema"}, 'needs "json_schema"'),
    "a schema that is not an object": ({"type": "json_schema", "json_schema": {"schema": True}}, "valid dictionary"),
    # what the grammar engine cannot take, refused before it sees it (gptlite.serve.schema): each was a 500, a panic
    # or (the chain of $refs) a crash of the whole server
    "a schema that is only itself": (schema_format({"$ref": "#"}), "refers to itself with no JSON in between (# -> #)"),
    "$defs in a loop": (
        schema_format({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        "refers to itself with no JSON in between (#/$defs/a -> #/$defs/b -> #/$defs/a)",
    ),
    "an anyOf of only itself": (  # llguidance's "NoExtensionBias" at the first token, said in words
        schema_format({"anyOf": [{"$ref": "#"}]}),
        "the schema refers to itself with no JSON in between (a $ref or an anyOf that loops back to itself)",
    ),
    "an object that requires itself": (  # once llguidance's "Too many items (limit 50000; ff_tokens)" midway
        schema_format({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
        "the schema requires itself inside itself (# -> #/properties/next -> #): every output would nest without end",
    ),
    "an array that requires itself": (
        schema_format(
            {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"}
        ),
        "the schema requires itself inside itself (#/$defs/a -> #/$defs/a/items -> #/$defs/a)",
    ),
    "a chain of 1,000 $refs": (
        schema_format(
            {
                "$defs": {
                    f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(1000)
                }
                | {"d1000": {"type": "integer"}},
                "$ref": "#/$defs/d0",
            }
        ),
        "the schema nests more than 64 subschemas deep at #/$defs/d31/properties/x",
    ),
    "nested counted repetitions": (
        schema_format({"type": "string", "pattern": "^(a{1,1000}){1000}$"}),
        "the pattern at #/pattern (^(a{1,1000}){1000}$) nests repetitions whose counts multiply to 1,000,000, over "
        "this server's limit of 500",
    ),
    "a 1.3 MB schema": (
        schema_format(
            {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(20)]} for i in range(5000)}}
        ),
        "characters of JSON, over this server's limit of 262,144; send a smaller schema",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FORMATS))
def test_a_bad_response_format_is_a_400_and_the_server_goes_on(server, name):
    response_format, phrase = BAD_FORMATS[name]
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "response_format": response_format})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"].startswith("response_format")
    assert phrase in error["message"], error["message"]
    (ok,) = choices(server, False, {"response_format": JSON_SCHEMA, "max_tokens": 200, "seed": 5})
    assert ok["finish_reason"] == "stop"


def greedy(model, tokenizer, prompt: list[int], n: int) -> str:
    out = model.generate(torch.tensor([prompt]), n, temperature=0)
    return tokenizer.decode(out[0, len(prompt) :].tolist())


class Collect:
    """Jobs submitted to an engine not yet started (so the first step admits them all into one batch), and what
    each was sent."""

    def __init__(self, engine: Engine, jobs: list[tuple[list[int], Params]]):
        self.pieces = [[] for _ in jobs]
        self.left = len(jobs)
        self.done = threading.Event()
        for i, (prompt, params) in enumerate(jobs):
            engine.submit(Job(prompt, params, self.emitter(i)))
        engine.start()

    def emitter(self, i: int):
        def emit(piece) -> None:
            self.pieces[i].append(piece)
            if piece.finish_reason:
                self.left -= 1
                if self.left == 0:
                    self.done.set()

        return emit

    def wait(self) -> list[tuple[str, str, str | None]]:
        """Each job's (text, finish_reason, error)."""
        assert self.done.wait(120), "the engine did not finish"
        return [("".join(p.text for p in ps), ps[-1].finish_reason, ps[-1].error) for ps in self.pieces]


def test_a_constrained_row_leaves_its_neighbours_greedy_text_unchanged():
    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    model = tiny_model(vocab_size=50304, block_size=128)
    engine = Engine(model, tokenizer, max_batch=4)
    fmt = Grammars(tokenizer, 50304, (tokenizer.eot_id,)).compile("json_schema", SCHEMA)
    prompts = [tokenizer.encode(p) for p in ["ROMEO:", "Hello, world", "To be or not", "x"]]
    stops = (tokenizer.eot_id,)
    plain = Params(max_tokens=20, options=GenerationOptions(temperature=0, stop_tokens=stops))
    formatted = Params(
        max_tokens=100, options=GenerationOptions(temperature=1.0, stop_tokens=stops, seed=0), response_format=fmt
    )
    try:
        out = Collect(engine, [(prompts[0], plain), (prompts[1], formatted), (prompts[2], plain), (prompts[3], plain)])
        results = out.wait()
    finally:
        engine.close()
    for i in (0, 2, 3):
        assert results[i] == (greedy(model, tokenizer, prompts[i], 20), "length", None)
    text, reason, _ = results[1]
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def breaks_at(fmt, n: int, monkeypatch) -> None:
    """Rows of this Format get a matcher that fails at their n-th token."""
    make = fmt.matcher

    def matcher():
        m = make()
        consume, taken = m.consume, []

        def consume_or_break(token: int) -> None:
            taken.append(token)
            if len(taken) == n:
                raise ValueError("response_format: the matcher broke")
            consume(token)

        m.consume = consume_or_break
        return m

    monkeypatch.setattr(fmt, "matcher", matcher)


def test_a_failing_matcher_ends_its_request_alone(monkeypatch):
    tokenizer = TemplateTokenizer(CHARS)
    model = tiny_model(block_size=256)
    engine = Engine(model, tokenizer, max_batch=4)
    grammars = Grammars(tokenizer, model.config.vocab_size, ())
    good, bad = grammars.compile("json_schema", SCHEMA), grammars.compile("json_object")
    breaks_at(bad, 2, monkeypatch)  # its first token is "{", which cannot end it
    prompt = tokenizer.encode("Hi")
    jobs = [
        (prompt, Params(max_tokens=200, options=GenerationOptions(seed=1), response_format=bad)),
        (prompt, Params(max_tokens=200, options=GenerationOptions(seed=1), response_format=good)),
        (prompt, Params(max_tokens=10, options=GenerationOptions(temperature=0))),
    ]
    try:
        results = Collect(engine, jobs).wait()
    finally:
        engine.close()
    assert results[0][1:] == ("error", "ValueError: response_format: the matcher broke")
    assert results[1][1] == "stop"
    jsonschema.validate(json.loads(results[1][0]), SCHEMA)
    assert results[2] == (greedy(model, tokenizer, prompt, 10), "length", None)


def test_a_grammar_that_fails_midway_is_a_400_naming_response_format(server, monkeypatch):
    """The grammar engine failing after the output began (as a pattern's lexer that grows past its limit does) is
    the request's fault, said as a 400, not a 500; its neighbours and the next request are served."""
    from gptlite.serve.grammar import GrammarError

    fmt = server.app.state.server.grammars.compile("json_schema", SCHEMA)
    make = fmt.matcher

    def matcher():
        m = make()
        consume = m.consume

        def consume_then_fail(token: int) -> None:
            consume(token)
            raise GrammarError("response_format: a pattern or a length in the schema is too complex; simplify it")

        m.consume = consume_then_fail
        return m

    monkeypatch.setattr(fmt, "matcher", matcher)
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "response_format": JSON_SCHEMA})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert error["message"] == "response_format: a pattern or a length in the schema is too complex; simplify it"
    monkeypatch.undo()
    (ok,) = choices(server, False, {"response_format": JSON_SCHEMA, "max_tokens": 200, "seed": 5})
    assert ok["finish_reason"] == "stop"


def test_a_panic_of_the_grammar_engine_never_reaches_the_request(caplog):
    """llguidance catches its Rust panics and reports them as its error text: the request is told the engine failed
    on its schema, and the server's log keeps the panic."""
    from gptlite.serve.grammar import plain

    with caplog.at_level("WARNING", logger="uvicorn.error"):
        text, explained = plain("panic: assertion failed: bytes.len() <= ExprRef::MAX_BYTE_CONCAT\n<backtrace>...")
    assert "panic" not in text and "assertion" not in text and explained
    assert text.startswith("the grammar engine failed on this schema (an internal error, in the server's log)")
    assert "llguidance failed: panic: assertion failed: bytes.len()" in caplog.text
    assert plain("Unknown format: panic") == ("Unknown format: panic", False)
    assert plain("lexer error: too many expressions constructed")[0].startswith("a pattern or a length in the schema")


def test_the_schema_check_passes_recursion_that_writes_json():
    """Recursion through properties or items (a tree), left recursion with another branch, recursion a finite
    output can stop (an optional property, an array that may be empty, a schema of no type), a pattern with one
    large count or nested small ones: all compile, and the engine follows them."""
    from gptlite.serve.schema import check_schema

    tree = {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}}
    schemas = [
        tree | {"$ref": "#/$defs/n"},
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"type": "object", "additionalProperties": {"$ref": "#"}},
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a linked list: its recursion optional
        {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: a number follows it too
        {"type": "array", "items": {"$ref": "#"}, "minItems": 0},
        {"type": "string", "pattern": "^[a-z]{1,100000}$"},
        {"type": "string", "pattern": "^((25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})\\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})$"},
        {"type": "string", "pattern": "^((a{1,7}){7}){7}$"},
        {"type": "string", "pattern": "(("},  # Python cannot parse it: llguidance says what is wrong
    ]
    for schema in schemas:
        check_schema(schema)
    grammars = Grammars(TemplateTokenizer(CHARS), 97, ())
    for schema in schemas[:-1]:
        grammars.compile("json_schema", schema).matcher().first_mask()


def test_grammars_refuse_a_bad_schema_in_one_line():
    grammars = Grammars(TemplateTokenizer(CHARS), 97, ())
    with pytest.raises(ValueError, match="^Invalid type: foo$"):
        grammars.compile("json_schema", {"type": "foo"})
    with pytest.raises(ValueError, match="^regex parse error: \\( \\^ error: unclosed group$"):
        grammars.compile("json_schema", {"type": "string", "pattern": "("})
    with pytest.raises(ValueError, match="tokenizer cannot spell the schema's text .character 'ü' is not in"):
        grammars.compile("json_schema", {"enum": ["grün"]})
    assert grammars.compile("text") is None
    assert grammars.compile("json_schema", SCHEMA) is grammars.compile("json_schema", json.loads(json.dumps(SCHEMA)))
