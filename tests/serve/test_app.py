"""gptlite.serve through the official `openai` client (and raw HTTP for bodies it would not send), against a tiny
model served on a free local port: greedy text, streaming, stop strings, n and seeds, concurrency, every bad
input's 4xx in OpenAI's error shape, a failing model's 500, disconnects, a full queue, and chat templates; then
what a hostile client tries (huge and stalled bodies, stalled headers, abandoned requests, malformed HTTP, other
hosts and sites), and the command itself."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from gptlite.inference.sampling import GenerationOptions
from gptlite.serve.__main__ import ServeOptions
from gptlite.serve.guard import Policy
from tests.helpers.serving import MODEL, Served, slow_steps

READ_TIMEOUT = 2.0  # the module server's, for headers and bodies: the stalled-client tests wait it out


@pytest.fixture(scope="module")
def served():
    s = Served(max_batch=8, policy=Policy(read_timeout=READ_TIMEOUT))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_one_model(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "gptlite" and card.context == 128


def test_completion_is_the_models_greedy_text(served, client):
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0)
    (choice,) = r.choices
    assert choice.text == served.greedy("ROMEO:", 30)
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 30, 36)


def test_the_one_model_answers_to_any_name_and_each_response_names_it(served, client):
    """A server holds one model: a request that names another (the README's "char" sent to the run in
    out/quickstart) gets its answer, and the response's model field says which model gave it."""
    r = client.completions.create(model="gpt-9", prompt="ROMEO:", max_tokens=5, temperature=0)
    assert r.model == MODEL and r.choices[0].text == served.greedy("ROMEO:", 5)
    chunks = list(client.completions.create(model="char", prompt="ROMEO:", max_tokens=5, temperature=0, stream=True))
    assert {c.model for c in chunks} == {MODEL}


def test_stream_chunks_join_to_the_whole_text(client):
    args = dict(model=MODEL, prompt="Hello", max_tokens=40, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.prompt_tokens == 5


def test_stop_strings_cut_the_text(served, client):
    greedy = served.greedy("ROMEO:", 30)
    stop = greedy[10:12]
    r = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=[stop, "\u00e9\u00e9"]
    )
    assert r.choices[0].text == greedy[: greedy.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_n_choices_and_seeds_reproduce(client):
    args = dict(model=MODEL, prompt=["To be", "or not"], max_tokens=12, temperature=1.0, n=3, seed=7)
    first, again = client.completions.create(**args), client.completions.create(**args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == list(range(6)) and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 6 * 12 and first.usage.prompt_tokens == 5 + 6
    other = client.completions.create(**{**args, "seed": 8})
    assert [c.text for c in other.choices] != texts


def test_a_requests_sampling_reaches_the_engine_as_generation_options(served, monkeypatch):
    """The server's engine decodes each row with generation's own options
    (gptlite.inference.sampling.GenerationOptions): what a request's sampling fields give, the seed moved on per choice,
    top_p 1 as no limit, and the tokenizer's end ids; OpenAI's own fields (stop strings, logit_bias) travel beside them
    in Params."""
    submitted = []
    submit = served.engine.submit

    def record(job):
        submitted.append(job.params)
        submit(job)

    monkeypatch.setattr(served.engine, "submit", record)
    body = {**GOOD, "n": 2, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": "zz", "logit_bias": {"3": 1.5}}
    body |= {"presence_penalty": 0.5, "frequency_penalty": -0.25}
    assert post(served, "/v1/completions", json=body).status_code == 200
    ends = tuple(served.tokenizer.end_ids())
    sampling = dict(temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=-0.25, stop_tokens=ends)
    assert [p.options for p in submitted] == [
        GenerationOptions(**sampling, seed=5),
        GenerationOptions(**sampling, seed=6),
    ]
    assert {(p.max_tokens, p.stop, p.logit_bias) for p in submitted} == {(3, ("zz",), ((3, 1.5),))}
    submitted.clear()
    assert post(served, "/v1/completions", json=GOOD).status_code == 200  # OpenAI's defaults: top_p 1, no seed
    assert [p.options for p in submitted] == [GenerationOptions(stop_tokens=ends)]


def test_seeds_anywhere_in_torchs_range_sample(client):
    """2**64 - 1 with n=2 asks for seed 2**64 for the second choice, taken modulo 2**64 as torch takes -1."""
    top = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, n=2, seed=2**64 - 1)
    low = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, seed=-(2**63))
    zero = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, seed=0)
    assert [c.finish_reason for c in top.choices + low.choices] == ["length"] * 3
    assert top.choices[1].text == zero.choices[0].text


def test_fit_max_tokens_lowers_max_tokens_to_what_the_context_leaves(client):
    """gptlite's own field, which the chat page sends; without it the same request is a 400 (BAD_INPUTS)."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, extra_body={"fit_max_tokens": True})
    assert r.usage.completion_tokens == 128 - 2 and r.choices[0].finish_reason == "length"


def test_eight_concurrent_streams_all_finish_with_their_greedy_text(served, client):
    prompts = ["ROMEO:", "a", "The quick brown", "To be or not to be", "x", "Hello, world", "JULIET: O", "12345"]

    def run(prompt: str) -> str:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(run, prompts))
    assert texts == [served.greedy(p, 40) for p in prompts]


def post(served, path: str, **kwargs) -> httpx.Response:
    return httpx.post(served.url + path, **{"timeout": 30, **kwargs})


GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
JSON = {"Content-Type": "application/json"}
BAD_INPUTS = {  # name: (path, body (a dict is sent as JSON), status, the error's param, a phrase of its message)
    "malformed JSON": ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt", "Field required"),
    "missing model": ("/v1/completions", {"prompt": "Hi"}, 400, "model", "Field required"),
    "max_tokens a string": ("/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    "temperature a string": ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    "max_tokens 0": ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 generates nothing"),
    "temperature 3": ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    "prompt past the context": ("/v1/completions", {**GOOD, "prompt": "x" * 200}, 400, "prompt", "context is 128"),
    "max_tokens past the context": ("/v1/completions", {**GOOD, "max_tokens": 200}, 400, "max_tokens", "at most 126"),
    "n too large": ("/v1/completions", {**GOOD, "n": 9}, 400, "n", "at most 8"),
    "too many stops": ("/v1/completions", {**GOOD, "stop": list("abcde")}, 400, "stop", "at most 4"),
    "stop strings too long": ("/v1/completions", {**GOOD, "stop": ["q" * 250_000] * 4}, 400, "stop", "at most 256"),
    "a seed past torch's range": ("/v1/completions", {**GOOD, "seed": 2**64}, 400, "seed", "18446744073709551615"),
    "a seed below torch's range": ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, 400, "seed", "greater than"),
    "an integer of 5,000 digits": (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
        None,
        "an integer of 5000 digits",
    ),
    "100,000 nested brackets": ("/v1/completions", b"[" * 100_000, 400, None, "nests deeper than 32 levels"),
    "nesting past the bound": (
        "/v1/completions",
        {**GOOD, "user": json.loads("[" * 32 + "1" + "]" * 32)},  # 33 levels with the body's own
        400,
        None,
        "nests",
    ),
    "NaN": (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "Hi", "temperature": NaN}',
        400,
        None,
        "not a JSON number",
    ),
    "logprobs": ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    "chat without messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    "a message's role": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
        400,
        "messages.0.role",
        "Input should be",
    ),
    "a character the tokenizer lacks": (
        "/v1/completions",
        {**GOOD, "prompt": "\u2603"},
        400,
        "prompt",
        "not in this char",
    ),
    "a message the tokenizer cannot encode": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "\u2603"}]},
        400,
        "messages",
        "not in this char",
    ),
    "unknown path": ("/v1/embeddings", {}, 404, None, "Not Found"),
    "a logit_bias key of a superscript digit": (  # str.isdigit takes it, int() does not: was a 500
        "/v1/completions",
        {**GOOD, "logit_bias": {"\u00b2": 1}},
        400,
        "logit_bias",
        "logit_bias: '\u00b2' is not a token id of this model (0 to 96)",
    ),
    "a logit_bias key of another script's digit": (  # int() took it as 3: now refused as OpenAI's ids are ASCII
        "/v1/completions",
        {**GOOD, "logit_bias": {"\u0663": 1}},
        400,
        "logit_bias",
        "is not a token id of this model",
    ),
    "an empty prompt on a tokenizer without end-of-text": (
        "/v1/completions",
        {**GOOD, "prompt": ""},
        400,
        "prompt",
        "this model's char tokenizer has no end-of-text token to start a document with; give at least one character",
    ),
    "an empty prompt echoed and scored": (
        "/v1/completions",
        {**GOOD, "prompt": "", "echo": True, "logprobs": 1},
        400,
        "prompt",
        "no end-of-text token",
    ),
    "token ids past the vocabulary": (
        "/v1/completions",
        {**GOOD, "prompt": [5, 97]},
        400,
        "prompt",
        "prompt[1]: token id 97 is not in this model's vocabulary of 97 ids (0 to 96); send ids below 97",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_its_4xx_and_the_server_goes_on(served, client, name):
    path, body, status, param, phrase = BAD_INPUTS[name]
    r = post(served, path, content=body, headers=JSON) if isinstance(body, bytes) else post(served, path, json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and phrase in error["message"]
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"


def model_logprobs(served, ids: list[int]) -> torch.Tensor:
    """The model's log-probabilities of the token after `ids` (V,), from a plain forward."""
    with torch.no_grad():
        logits, _ = served.model(torch.tensor([ids], device=served.model.tok_emb.weight.device))
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("prompt", ["h", [5]])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_a_one_token_prompt(served, prompt, stream):
    """A one-token prompt has no token to score but its first (None, as OpenAI lists it); its completion's token has
    the model's own log-probability. Was a 500 (IndexError: an empty list of ids made a float tensor)."""
    body = {**GOOD, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "stream": stream}
    r = post(served, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        tokens = [t for lp in logprobs for t in lp["tokens"]]
        values = [v for lp in logprobs for v in lp["token_logprobs"]]
    else:
        choice = r.json()["choices"][0]
        text, tokens, values = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
    ids = served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    first = served.tokenizer.decode(ids)
    expected = model_logprobs(served, ids)
    chosen = int(expected.argmax())
    assert text == first + served.tokenizer.decode([chosen]) and tokens == [first, served.tokenizer.decode([chosen])]
    assert values[0] is None and values[1] == pytest.approx(expected[chosen].item(), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_generates_nothing(served, stream):
    """echo with max_tokens 0 is the prompt alone: no token generated, completion_tokens 0 (it generated one)."""
    body = {**GOOD, "prompt": "hi there", "max_tokens": 0, "echo": True, "stream": stream}
    body |= {"stream_options": {"include_usage": True}} if stream else {}
    r = post(served, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        reason = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        use = events[-1]["usage"]
    else:
        (choice,) = r.json()["choices"]
        text, reason, use = choice["text"], choice["finish_reason"], r.json()["usage"]
    assert (text, reason) == ("hi there", "length")
    assert (use["prompt_tokens"], use["completion_tokens"]) == (8, 0)
    scored = post(served, "/v1/completions", json={**body, "stream": False, "logprobs": 0}).json()["choices"][0]
    assert scored["text"] == "hi there" and scored["logprobs"]["tokens"] == list("hi there")


@pytest.mark.parametrize("sampling", [{"top_p": 1e-300}, {"temperature": 1e-300}, {"temperature": 1e-45}])
def test_a_vanishing_top_p_or_temperature_samples_the_most_likely_token(served, sampling):
    """top_p 1e-300 is 0 in float32, and dropped even the most likely token; temperature 1e-300 sent the logits past
    float's range (NaN): each was a 500. Both are greedy in the limit, and now sample the greedy text."""
    r = post(served, "/v1/completions", json={**GOOD, "prompt": "ROMEO:", "max_tokens": 10, "seed": 1, **sampling})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == served.greedy("ROMEO:", 10)


def test_the_openai_client_raises_on_a_4xx(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)


def test_an_error_inside_the_model_is_a_500_and_the_server_goes_on(served, client, monkeypatch):
    step, calls = served.engine.step, []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the model broke")
        return step(*args)

    monkeypatch.setattr(served.engine, "step", fails_once)
    with pytest.raises(openai.InternalServerError, match="the model broke"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=5).choices[0].finish_reason == "length"
    assert wait_for(lambda: served.engine.active == 0)  # the row is freed just after its last piece is sent


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_disconnected_stream_frees_its_row(served, monkeypatch):
    slow_steps(monkeypatch, served.engine, 0.02)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 120, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)][0].startswith("data: ")
        assert served.engine.active == 1
    assert wait_for(lambda: served.engine.active == 0, 1.0)  # long before its 120 tokens (2.4 s) were done
    assert served.app.state.server.in_flight == 0


def test_past_max_batch_plus_max_waiting_a_request_gets_a_429(served, client, monkeypatch):
    slow_steps(monkeypatch, served.engine, 0.02)
    monkeypatch.setattr(served.app.state.server, "limit", 1)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        with pytest.raises(openai.RateLimitError, match="the server is full"):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    monkeypatch.setattr(served.app.state.server, "wait_when_full", True)
    with ThreadPoolExecutor(2) as pool:  # waiting instead: both finish, one after the other
        texts = list(pool.map(lambda _: client.completions.create(**GOOD).choices[0].text, range(2)))
    assert len(texts) == 2


def raw(served, data: bytes) -> socket.socket:
    """A connection to the server that has sent `data` (and may send more)."""
    conn = socket.create_connection(("127.0.0.1", served.running.port), timeout=10)
    conn.sendall(data)
    return conn


def response(conn: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one response a connection gets, read to the server's close."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def headers(path: str, length: int, extra: str = "") -> bytes:
    """A JSON POST's headers, announcing `length` bytes of body; `extra`: more header lines, each ending in CRLF."""
    lines = f"Host: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n{extra}"
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode()


def assert_openai_error(body: dict, phrase: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and phrase in error["message"], error


def test_a_huge_body_is_refused_before_it_is_read(served, client):
    """Declared: 413 before a byte of it is sent. Sent in chunks with no length: 413 once it passes the limit."""
    status, body = response(raw(served, headers("/v1/completions", 80_000_000)))
    assert status == 413
    assert_openai_error(body, "the request body is 76.3 MB, over this server's limit of 4 MB (its --max_body_mb)")
    chunks = (b"x" * 2**16 for _ in range(65))  # the last chunk crosses 4 MB
    r = post(served, "/v1/completions", content=chunks, headers=JSON)
    assert r.status_code == 413 and "is over this server's limit of 4 MB" in r.json()["error"]["message"]
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_a_client_still_sending_a_huge_body_reads_its_413(served, client, path):
    """A client that goes on sending a 10 MB body after the server has answered its Content-Length with a 413 (as
    an HTTP client does: it reads the response once its body is sent) can send it and then read the 413, where the
    server's close with the client's bytes unread once reset the connection under it (a broken pipe, "connection
    reset")."""
    conn = raw(served, headers(path, 10_000_000) + b"x" * 2**16)
    time.sleep(0.3)  # the server has answered (and once closed: this sendall then failed with a broken pipe)
    conn.sendall(b"x" * 4_000_000)
    status, body = response(conn)
    assert status == 413
    assert_openai_error(body, "the request body is 9.5 MB, over this server's limit of 4 MB (its --max_body_mb)")
    r = post(served, path, content=b'{"prompt": "' + b"x" * 10_000_000 + b'"}', headers=JSON)  # an HTTP client's
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"


def test_a_small_request_is_not_held_up_by_a_huge_prompt(served, client, monkeypatch):
    """Prompts are tokenized on a worker thread: while a huge prompt's tokenizing is held, a small request goes
    through, then the huge one gets its 400."""
    encode, entered, release = served.tokenizer.encode, threading.Event(), threading.Event()

    def held(text: str) -> list[int]:
        if len(text) > 1000:
            entered.set()
            assert release.wait(10)
        return encode(text)

    monkeypatch.setattr(served.tokenizer, "encode", held)
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(post, served, "/v1/completions", json={**GOOD, "prompt": "x" * 3_000_000})
        assert entered.wait(10)
        small = client.completions.create(**GOOD)  # would wait forever, were the event loop tokenizing
        release.set()
        r = huge.result()
    assert small.choices[0].finish_reason == "length"
    assert r.status_code == 400 and "the prompt has 3000000 tokens" in r.json()["error"]["message"]


def test_an_abandoned_request_frees_its_place_at_once(served, client, monkeypatch):
    """A non-streamed request whose client gives up is cancelled: its row and its place are free again at once,
    so the next request is served, not told the server is full."""
    slow_steps(monkeypatch, served.engine, 0.02)
    monkeypatch.setattr(served.app.state.server, "limit", 1)
    with pytest.raises(httpx.TimeoutException):
        post(served, "/v1/completions", json={**GOOD, "max_tokens": 120}, timeout=0.3)  # 120 steps: 2.4 s
    assert wait_for(lambda: served.app.state.server.in_flight == 0 and served.engine.active == 0, 2.0)
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"
    assert wait_for(lambda: "went away during POST /v1/completions; its request was dropped" in served.log.text)


def test_stalled_clients_are_let_go_after_the_read_timeout(served, client):
    """A body that stops short gets a 408; headers that stop short have their connection closed; a client that
    leaves mid-body is one line in the log. Meanwhile others are served."""
    stalled_body = raw(served, headers("/v1/completions", 100) + b'{"model":')
    stalled_headers = raw(served, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    raw(served, headers("/v1/completions", 100) + b'{"model":').close()
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"
    status, body = response(stalled_body)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert_openai_error(body, f"the request body did not arrive within {READ_TIMEOUT:g} s")
    assert stalled_headers.recv(1) == b""  # closed, after READ_TIMEOUT
    assert "went away during POST /v1/completions; its request was dropped" in served.log.text
    assert "sent no whole request headers within 2 s; closed its connection" in served.log.text


def test_malformed_http_gets_a_400_in_openais_shape(served, client):
    big = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    for data in (big, b"NOT HTTP AT ALL\r\n\r\n"):
        status, body = response(raw(served, data))
        assert status == 400
        assert_openai_error(body, "the request is not valid HTTP/1.1, or its headers pass 16 KiB")
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"


def test_other_hosts_and_sites_are_refused(served, client):
    """DNS rebinding (a page whose own name resolves to 127.0.0.1) and a cross-site text/plain POST, which browsers
    send without asking; and no CORS unless configured."""
    r = post(served, "/v1/completions", json=GOOD, headers={"Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    assert_openai_error(r.json(), "the Host header 'evil.example' is not a name of this server")
    assert httpx.get(served.url + "/", headers={"Host": "evil.example:80"}).status_code == 400
    for host in (f"localhost:{served.running.port}", "127.0.0.1", "app.localhost", "[::1]:80"):
        assert post(served, "/v1/completions", json=GOOD, headers={"Host": host}).status_code == 200
    r = post(served, "/v1/completions", content=json.dumps(GOOD), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert_openai_error(r.json(), "the request's Content-Type is 'text/plain'; send the body as JSON")
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(served.url + "/v1/completions", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert client.completions.create(**GOOD).choices[0].finish_reason == "length"


class Fatal(BaseException):
    """What no step of the engine catches: a fault of its loop itself."""


def test_when_the_engine_stops_every_route_says_so_and_the_command_exits_1(monkeypatch, capsys):
    """A request in flight and every later one, on any route, get a 503 that says why; `serve`, the command's
    loop, then shuts uvicorn down and returns 1 instead of serving a server that never completes."""
    import uvicorn

    from gptlite.serve.__main__ import serve
    from gptlite.serve.connection import uvicorn_config
    from tests.helpers.serving import free_port

    s = Served(max_batch=2)
    try:

        def broken() -> bool:
            raise Fatal("the loop broke")

        monkeypatch.setattr(s.engine, "turn", broken)  # from the next step on; the one waiting now runs
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="the server's engine stopped \\(Fatal: the loop broke"):
            client.completions.create(**{**GOOD, "max_tokens": 20})
        for path in ("/", "/v1/models"):
            r = httpx.get(s.url + path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        with pytest.raises(openai.InternalServerError, match="restart the server"):
            client.completions.create(**GOOD)
        config = uvicorn_config(s.app, "127.0.0.1", free_port(), 30, 5, log_config=None)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(serve, uvicorn.Server(config), s.engine).result(timeout=10) == 1
        assert capsys.readouterr().err.startswith("gptlite.serve: error: the server's engine stopped (Fatal: ")
    finally:
        s.close()


def test_chat_renders_the_template_and_streams(served, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    prompt = served.tokenizer.render(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(served.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert r.choices[0].message.content == served.greedy(prompt, 20) and r.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    default = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)  # the rest of the context
    assert (
        default.usage.completion_tokens == 128 - r.usage.prompt_tokens and default.choices[0].finish_reason == "length"
    )


def test_chat_renders_a_model_directorys_template_as_transformers_does(tmp_path):
    """A Hugging Face tokenizer with its template: the prompt is transformers' apply_chat_template, and a reply ends
    at the template's end-of-turn token."""
    import transformers

    from gptlite.serve.app import create_app
    from gptlite.serve.engine import Engine
    from gptlite.tokenizer import get_tokenizer
    from tests.conftest import tiny_model
    from tests.helpers.serving import Running
    from tests.tokenizer.test_chat import CONVERSATION, QWEN_LIKE, model_dir

    folder = model_dir(tmp_path, QWEN_LIKE, "jinja")
    tokenizer = get_tokenizer(str(folder))
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=128)
    engine = Engine(model, tokenizer, max_batch=2).start()
    running = Running(create_app(engine, tokenizer, MODEL))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        messages = CONVERSATION[:4]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert r.usage.prompt_tokens == len(expected) == len(tokenizer.apply_chat_template(messages, True))
        assert tokenizer.end_of_turn_id == tokenizer.token_id("<|im_end|>")
    finally:
        running.stop()
        engine.close()


def test_chat_without_a_template_is_a_400_that_says_so(served, client, monkeypatch):
    monkeypatch.setattr(served.tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert client.models.list().data[0].chat is False


class GPT2Served:
    """A tiny model served with GPT-2's tiktoken tokenizer, which has no chat template, and `vocab_size` ids."""

    def __init__(self, vocab_size: int = 50257, tokenizer=None):
        from gptlite.serve.app import create_app
        from gptlite.serve.engine import Engine
        from gptlite.tokenizer import get_tokenizer
        from tests.conftest import shared_file, tiny_model
        from tests.helpers.serving import Running

        self.tokenizer = tokenizer or get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
        self.model = tiny_model(vocab_size=vocab_size, block_size=64)
        self.engine = Engine(self.model, self.tokenizer, max_batch=2).start()
        self.running = Running(create_app(self.engine, self.tokenizer, MODEL))
        self.url = self.running.url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": MODEL, **body}, timeout=60)

    def close(self) -> None:
        try:
            self.running.stop()
        finally:
            self.engine.close()


MESSAGES = [{"role": "user", "content": "Hi"}]


def test_messages_on_a_base_model_without_a_template_are_a_400_and_leave_its_tokenizer_alone():
    """/tokenize with messages once gave the tokenizer ChatML (apply_chat_template's default), adding <|im_start|>
    and <|im_end|> as ids 50257 and 50258, past a GPT-2 base's vocabulary: the chat route then rendered them and the
    model's embedding failed (a 500, IndexError). Both routes refuse messages for a tokenizer without a template."""
    s = GPT2Served()
    try:
        for path in ("/tokenize", "/v1/chat/completions", "/tokenize", "/v1/chat/completions"):
            r = s.post(path, {"messages": MESSAGES, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template", r.text
            assert_openai_error(r.json(), f"the model '{MODEL}' has no chat template, so it cannot render messages")
        assert s.tokenizer.vocab_size == 50257 and s.tokenizer.added == {} and s.tokenizer.chat_template is None
        r = s.post("/tokenize", {"prompt": "<|im_start|>user"})
        assert r.status_code == 200 and max(r.json()["tokens"]) < 50257
    finally:
        s.close()


def test_ids_a_tokenizer_has_past_the_models_vocabulary_are_a_400():
    """A tokenizer whose chat markers were added past the vocabulary of the model it serves (ChatML given to GPT-2's
    tokenizer, a model of 50257 ids): every route that would feed the model such an id says which, and the
    vocabulary, instead of an IndexError from the embedding."""
    from gptlite.tokenizer import get_tokenizer
    from tests.conftest import shared_file

    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    tokenizer.use_default_template()  # ChatML: <|im_start|> 50257, <|im_end|> 50258
    s = GPT2Served(50257, tokenizer)
    try:
        past = "the chat template gave token id 50257 '<|im_start|>' (at 0), which is past this model's vocabulary "
        past += "of 50257 ids (0 to 50256): the tokenizer has ids the model was not trained with"
        for path in ("/v1/chat/completions", "/tokenize"):
            r = s.post(path, {"messages": MESSAGES})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert_openai_error(r.json(), past)
        r = s.post("/v1/completions", {"prompt": [50258]})
        assert r.status_code == 400
        assert_openai_error(r.json(), "prompt[0]: token id 50258 is not in this model's vocabulary of 50257 ids")
        assert s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        s.close()


def test_text_whose_ids_pass_the_models_vocabulary_is_a_400():
    """A model with fewer ids than its tokenizer (50000 of GPT-2's 50257): a text prompt with a token past them."""
    s = GPT2Served(50000)
    try:
        text = s.tokenizer.decode([50100])
        assert s.tokenizer.encode(text) == [50100]
        r = s.post("/v1/completions", {"prompt": "Hi" + text})
        assert r.status_code == 400
        assert_openai_error(r.json(), "prompt: the text became token id 50100")
        assert_openai_error(r.json(), "which is past this model's vocabulary of 50000 ids (0 to 49999)")
    finally:
        s.close()


def test_an_empty_prompt_starts_a_document_with_the_end_of_text_token():
    """OpenAI's API: "if a prompt is not specified the model will generate as if from the beginning of a new
    document", which begins with <|endoftext|> (as every document gptlite prepares does): the completion is the
    model's greedy text after that token alone, which usage counts, echo shows and logprobs list."""
    s = GPT2Served()
    try:
        eot = s.tokenizer.eot_id
        r = s.post("/v1/completions", {"prompt": "", "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        out = s.model.generate(torch.tensor([[eot]]), 5, temperature=0)
        assert choice["text"] == "<|endoftext|>" + s.tokenizer.decode(out[0, 1:].tolist())
        assert choice["logprobs"]["tokens"][0] == "<|endoftext|>" and choice["logprobs"]["token_logprobs"][0] is None
        assert r.json()["usage"]["prompt_tokens"] == 1
        same = s.post("/v1/completions", {"prompt": [eot], "max_tokens": 5, "temperature": 0, "echo": True})
        assert same.json()["choices"][0]["text"] == choice["text"]
    finally:
        s.close()


def llama_folder(tmp_path, eos: str):
    """A Llama-like tokenizer (SentencePiece style: its pieces begin with "▁"), its special tokens <unk>, <s>, </s>
    and <|im_end|>, saved by transformers with `eos` as its eos_token."""
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.conftest import shared_file

    tok = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    specials = ["<unk>", "<s>", "</s>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([shared_file("data/tinyshakespeare.txt").read_text()[:50_000], "<|>"], trainer)
    saved = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=eos, unk_token="<unk>", additional_special_tokens=specials[3:]
    )
    saved.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("eos", ["</s>", "<|im_end|>"])
def test_a_model_directorys_tokenizer_is_named_and_read_as_its_own_files_say(tmp_path, eos):
    """A Hugging Face directory made elsewhere: /tokenizer_info names its eos, bos and unk as its own
    tokenizer_config.json does (AutoTokenizer's), never gptlite's <|endoftext|>, which this vocabulary lacks, nor
    the end of a turn in place of its eos; and every route reads text one way, as transformers does: a special
    token the tokenizer has is that token, the name of one it lacks is plain text (/tokenize, completions' echo and
    usage agree)."""
    import transformers

    from gptlite.serve.app import create_app
    from gptlite.serve.engine import Engine
    from gptlite.tokenizer import get_tokenizer
    from tests.conftest import tiny_model
    from tests.helpers.serving import Running

    folder = llama_folder(tmp_path, eos)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer = get_tokenizer(str(folder))
    engine = Engine(tiny_model(vocab_size=tokenizer.vocab_size, block_size=64), tokenizer, max_batch=2).start()
    running = Running(create_app(engine, tokenizer, MODEL))
    try:
        for text in ("hi<|endoftext|>", "hi</s> there", "To be<|im_end|>"):
            expected = theirs(text, add_special_tokens=False)["input_ids"]
            tokens = httpx.post(running.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
            body = {"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}
            echoed = httpx.post(running.url + "/v1/completions", json=body).json()
            assert tokens == expected and echoed["usage"]["prompt_tokens"] == len(expected), text
            assert echoed["choices"][0]["text"] == text
        assert len(expected) > 2 and expected[-1] == theirs.convert_tokens_to_ids("<|im_end|>")
        info = httpx.get(running.url + "/tokenizer_info").json()
        assert (info["eos_token"], info["bos_token"], info["unk_token"]) == (eos, "<s>", "<unk>")
        assert (theirs.eos_token, theirs.bos_token, theirs.unk_token, theirs.pad_token) == (eos, "<s>", "<unk>", None)
        assert info["pad_token"] is None
    finally:
        running.stop()
        engine.close()


def test_every_route_reads_a_special_tokens_text_as_that_token():
    """GPT-2's tiktoken tokenizer has <|endoftext|>: /tokenize, a completion's prompt (its usage and echo) and a
    chat's messages all read the text <|endoftext|> as that token; ChatML's markers, which it lacks, are text."""
    from gptlite.tokenizer import get_tokenizer
    from tests.conftest import shared_file

    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no markers to add
    s = GPT2Served(50257, tokenizer)
    try:
        eot = s.tokenizer.eot_id
        text = "Hello<|endoftext|> again <|im_end|>"
        expected = [*s.tokenizer.encode("Hello"), eot, *s.tokenizer.encode(" again <|im_end|>")]
        assert s.post("/tokenize", {"prompt": text}).json()["tokens"] == expected
        echoed = s.post("/v1/completions", {"prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0}).json()
        assert echoed["usage"]["prompt_tokens"] == len(expected)
        assert echoed["choices"][0]["logprobs"]["tokens"][: len(expected)] == [
            s.tokenizer.decode([i]) for i in expected
        ]
        rendered = s.post("/tokenize", {"messages": [{"role": "user", "content": text}]}).json()["tokens"]
        assert rendered == expected + s.tokenizer.encode("\n")
        chat = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == len(expected) + 1
    finally:
        s.close()


def test_the_page_is_served(served):
    r = httpx.get(served.url + "/")
    assert r.status_code == 200 and "/v1/chat/completions" in r.text and "http" not in r.text.replace("http-equiv", "")


def test_options_are_checked(capsys):
    from gptlite.serve.__main__ import main

    assert main(["--port=0"]) == 2
    assert capsys.readouterr().err == (
        "gptlite.serve: error: give the model to read: --model=X, where X is a gptlite run folder, a Hugging Face "
        "directory or a hub name such as gpt2\n"
    )
    with pytest.raises(ValueError, match="max_batch=0 must be >= 1"):
        ServeOptions(model="run", max_batch=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch._dynamo's imports
def test_a_broken_cpu_compiler_serves_uncompiled_with_a_warning(monkeypatch, capsys):
    from gptlite.inference.kvcache import decode_step
    from gptlite.serve.__main__ import build
    from tests.conftest import tiny_model
    from tests.helpers.serving import CHARS, TemplateTokenizer

    monkeypatch.setenv("CXX", "/bin/true")
    monkeypatch.setattr(
        "gptlite.checkpoint.inference.load_model", lambda **kw: (tiny_model(), TemplateTokenizer(CHARS))
    )
    engine, _ = build(ServeOptions(model="tiny", device="cpu", compile=True))
    try:
        assert engine.step is decode_step
    finally:
        engine.close()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gptlite.serve: warning: torch.compile is unavailable (the C++ compiler '/bin/true' exited 0 on a one-line "
        "program but wrote no library; set CXX to a working C++ compiler); serving uncompiled"
    )


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_the_command_serves_with_a_key_and_a_stalled_upload_does_not_hold_sigterm(tmp_path):
    """python -m gptlite.serve --out_dir=RUN, its key from GPTLITE_API_KEY: a wrong key gets a 401, the right one a
    completion through the openai client; --allowed_hosts lets a proxy's name through and no other. Then SIGTERM
    ends it at once although a client holds an upload half-sent (the read and shutdown timeouts are 30 s), and
    its log holds no traceback."""
    import os
    import signal
    import subprocess
    import sys

    from gptlite.checkpoint import save_checkpoint
    from gptlite.config import build_config, config_to_dict
    from tests.conftest import ROOT, tiny_model
    from tests.helpers.serving import CHARS, TemplateTokenizer, free_port

    cfg = build_config({"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(tmp_path / "ckpt.pt", {"config": config_to_dict(cfg), "model": tiny_model().state_dict()})
    TemplateTokenizer(CHARS).save(tmp_path / "tokenizer.json")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gptlite.serve", f"--out_dir={tmp_path}", f"--port={port}", "--device=cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPTLITE_API_KEY": "sekret"}
    server = subprocess.Popen(
        [*cmd, "--allowed_hosts=proxy.example"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                (card,) = client.models.list().data
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        assert card.id == tmp_path.name and card.chat is True  # the saved tokenizer.json keeps its chat template
        with pytest.raises(openai.AuthenticationError, match="sent an API key that is not this server's"):
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).models.list()
        key = {"Authorization": "Bearer sekret"}
        assert httpx.get(url + "/v1/models", headers={**key, "Host": "proxy.example"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={**key, "Host": "evil.example"}).status_code == 400
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(headers("/v1/completions", 100, extra="Authorization: Bearer sekret\r\n") + b'{"model":')
        r = client.completions.create(model=card.id, prompt="ROMEO:", max_tokens=10, temperature=0)
        assert r.usage.completion_tokens == 10
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            log, _ = server.communicate(timeout=15)  # SIGTERM would wait out the 30 s timeouts, had it to
        finally:
            server.kill()
    assert server.returncode == 128 + signal.SIGTERM and "gptlite.serve: interrupted (SIGTERM)" in log
    assert "went away during POST /v1/completions; its request was dropped" in log and "Traceback" not in log
    stalled.close()


def test_the_command_refuses_bad_options_in_one_line(capsys):
    from gptlite.serve.__main__ import main

    assert main(["--out_dir=run", "--max_batch=0", "--when_full=later"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "when_full='later' must be one of reject, wait" in err
    assert main(["--help"]) == 0 and "--max_batch=16" in capsys.readouterr().out
