"""The server as harnesses use it: log-probabilities and echo on /v1/completions (against transformers'
log-softmax), token-id prompts, vLLM's tokenizer endpoints, a Gemma 3 directory's chat with its own template and
stop tokens, and EleutherAI's lm-eval `local-completions` client against lm-eval's own hf backend on the same weights
(with the client's tokenizer and with the server's; a tiny GPT-2 and a tiny Gemma 3 whose window the tasks' contexts
go past)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import transformers

from gptlite import GPT
from gptlite.evaluate.lm_harness import prefix_ids
from gptlite.serve.app import create_app
from gptlite.serve.engine import Engine
from gptlite.serve.protocol import token_text
from gptlite.tokenizer import load_tokenizer
from tests.evaluate.test_lm_harness import model_dir, tasks  # noqa: F401  (fixtures: a tiny GPT-2 folder, local task files)
from tests.helpers.gemma3 import BOS, END_OF_TURN, gemma3_dir
from tests.helpers.serving import Running

lm_eval = pytest.importorskip("lm_eval")  # the eval extra, which CI installs with the test extra
MODEL = "tiny-gpt2"
CONTEXT = 64


class Server:
    """The model folder's weights and tokenizer served on a free local port."""

    def __init__(self, folder):
        self.model = GPT.from_pretrained(str(folder)).eval()
        self.tokenizer = load_tokenizer(folder)
        self.engine = Engine(self.model, self.tokenizer, max_batch=4).start()
        self.running = Running(create_app(self.engine, self.tokenizer, MODEL))
        self.url = self.running.url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def close(self) -> None:
        try:
            self.running.stop()
        finally:
            self.engine.close()


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    s = Server(model_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


CONVERSATION = [  # within the tiny model's context of 64 tokens
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who's there?"},
    {"role": "assistant", "content": "Nay, stand."},
    {"role": "user", "content": "Speak!"},
]
STOP_AFTER = 5  # the tiny Gemma 3's greedy reply to CONVERSATION ends with <end_of_turn> after this many tokens


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3 directory (tests/helpers/gemma3.py) whose greedy reply to CONVERSATION ends by itself: its untied
    head's <end_of_turn> row points along the final hidden state at the reply's STOP_AFTER-th token."""
    folder = tmp_path_factory.mktemp("gemma3")
    model = gemma3_dir(folder, tie_word_embeddings=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = torch.tensor([list(tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"])])
    with torch.no_grad():
        reply = model.generate(prompt, max_new_tokens=STOP_AFTER, do_sample=False)
        hidden = model.model(reply).last_hidden_state[0, -1]  # after the norm: what the head reads
        model.lm_head.weight[END_OF_TURN] = 20 * hidden / hidden.norm() ** 2
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma_server(gemma):
    s = Server(gemma)
    yield s
    s.close()


def test_a_gemma3_directory_chats_with_its_own_template_and_stop_tokens(gemma, gemma_server):
    """The prompt is transformers' apply_chat_template (Gemma's turns, the assistant's role named `model`, <bos>
    first); the greedy reply is transformers' generate token for token and ends where generation_config.json's
    <end_of_turn> ends it (not at tokenizer_config.json's eos, <eos>)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(gemma)
    reference = transformers.AutoModelForCausalLM.from_pretrained(gemma).eval()
    prompt = list(tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"])
    assert tokenizer.decode(prompt).endswith("<end_of_turn>\n<start_of_turn>model\n") and prompt[0] == BOS
    rendered = gemma_server.post("/tokenize", {"model": MODEL, "messages": CONVERSATION}).json()["tokens"]
    assert rendered == prompt
    with torch.no_grad():
        room = CONTEXT - len(prompt)  # more than the reply needs
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=room, do_sample=False)[0, len(prompt) :]
    assert out.tolist()[-1] == END_OF_TURN and len(out) == STOP_AFTER + 1  # transformers stops there too
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": room, "temperature": 0, "logprobs": True}
    r = gemma_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert [bytes(item["bytes"]) for item in choice["logprobs"]["content"]] == [
        gemma_server.tokenizer.token_bytes([t]) for t in out.tolist()
    ]  # the stop token's logprob too, as for every stop
    assert choice["message"]["content"] == tokenizer.decode(out[:-1])
    assert r.json()["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": STOP_AFTER + 1,
        "total_tokens": len(prompt) + STOP_AFTER + 1,
    }


def log_softmax(reference, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token after each position of ids, (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_echo_and_logprobs_equal_transformers_log_softmax(server, reference):
    prompt = server.tokenizer.encode("ROMEO: But soft, what light")
    r = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 3, "echo": True},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = list(prompt)
    for _ in range(3):  # transformers' greedy continuation
        ids.append(int(log_softmax(reference, ids)[-1].argmax()))
    assert choice["text"] == server.tokenizer.decode(ids)
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # a prompt's first token
    want = log_softmax(reference, ids)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(want[t - 1, ids[t]].item(), abs=1e-4)
        top = want[t - 1].topk(3)
        names = [token_text(server.tokenizer.token_bytes([i])) for i in top.indices.tolist()]
        assert len(lp["top_logprobs"][t]) in (3, 4)  # the three most likely, and the chosen token if not among them
        for name, value in zip(names, top.values.tolist(), strict=True):
            assert lp["top_logprobs"][t][name] == pytest.approx(value, abs=1e-4)
    text = choice["text"]
    assert [text[o : o + len(tok)] for o, tok in zip(lp["text_offset"], lp["tokens"], strict=True)] == lp["tokens"]


def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, reference):
    prompts = [server.tokenizer.encode("To be, or not"), server.tokenizer.encode("to be")]
    r = server.post(
        "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 0, "logprobs": 0, "echo": True}
    )
    assert r.status_code == 200, r.text
    for prompt, choice in zip(prompts, r.json()["choices"], strict=True):
        assert choice["text"] == server.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
        want = log_softmax(reference, prompt)
        got = choice["logprobs"]["token_logprobs"]
        assert got[1:] == pytest.approx([want[t - 1, prompt[t]].item() for t in range(1, len(prompt))], abs=1e-4)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # only the token itself
    assert r.json()["usage"]["completion_tokens"] == 0


def test_chat_logprobs_in_openais_shape_equal_transformers_log_softmax(server, reference):
    messages = [{"role": "user", "content": "Who is there?"}]
    r = server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    ids = server.tokenizer.apply_chat_template(messages, True)
    start = len(ids)
    for _ in range(len(content)):
        ids.append(int(log_softmax(reference, ids)[-1].argmax()))
    want = log_softmax(reference, ids)
    for t, item in enumerate(content):
        token = ids[start + t]
        assert item["bytes"] == list(server.tokenizer.token_bytes([token]))
        assert item["logprob"] == pytest.approx(want[start + t - 1, token].item(), abs=1e-4)
        top = want[start + t - 1].topk(2)
        assert [x["logprob"] for x in item["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [x["bytes"] for x in item["top_logprobs"]] == [
            list(server.tokenizer.token_bytes([i])) for i in top.indices.tolist()
        ]


def events(r: httpx.Response) -> list[dict]:
    """A stream's chunks, in order."""
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_join_to_the_unstreamed_ones(server, echo):
    """A stream's chunks carry their tokens' logprobs; joined (text offsets counted on across the chunks, the echoed
    prompt first) they equal the response's without a stream, text included."""
    body = {"model": MODEL, "prompt": "JULIET: O Romeo", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = server.post("/v1/completions", {**body, "echo": echo}).json()["choices"][0]
    chunks = [e["choices"][0] for e in events(server.post("/v1/completions", {**body, "echo": echo, "stream": True}))]
    joined = {key: [] for key in whole["logprobs"]}
    for c in chunks:
        for key, values in (c["logprobs"] or {}).items():
            joined[key] += values
    assert joined == whole["logprobs"] and "".join(c["text"] for c in chunks) == whole["text"]
    assert len(joined["tokens"]) == 6 + (len(server.tokenizer.encode(body["prompt"])) if echo else 0)


def test_streamed_chat_logprobs_join_to_the_unstreamed_ones(server):
    messages = [{"role": "user", "content": "Who is there?"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    chunks = events(server.post("/v1/chat/completions", {**body, "stream": True}))
    joined = [
        item
        for e in chunks
        if e["choices"] and e["choices"][0]["logprobs"]
        for item in e["choices"][0]["logprobs"]["content"]
    ]
    assert joined == whole and len(joined) == 5


def test_logit_bias_forces_and_bans_tokens(server, reference):
    prompt = server.tokenizer.encode("KING: ")
    forced = server.tokenizer.encode(" crown")[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "seed": 3}
    r = server.post("/v1/completions", {**body, "logit_bias": {str(forced): 100}, "temperature": 1.0})
    assert r.json()["choices"][0]["text"] == server.tokenizer.decode([forced] * 5)
    greedy = int(log_softmax(reference, prompt)[-1].argmax())
    r = server.post("/v1/completions", {**body, "max_tokens": 1, "temperature": 0, "logit_bias": {str(greedy): -100}})
    second = int(log_softmax(reference, prompt)[-1].topk(2).indices[1])
    assert r.json()["choices"][0]["text"] == server.tokenizer.decode([second])


def test_presence_and_frequency_penalties_follow_openais_formula(server, reference):
    prompt = server.tokenizer.encode("To be, or not to be")
    presence, frequency = 0.7, 1.3
    ids, counts = list(prompt), {}
    for _ in range(12):  # greedy on logit - count * frequency - (count > 0) * presence, over generated tokens
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, -1].double()
        for token, count in counts.items():
            logits[token] -= count * frequency + presence
        token = int(logits.argmax())
        counts[token] = counts.get(token, 0) + 1
        ids.append(token)
    r = server.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "presence_penalty": presence,
            "frequency_penalty": frequency,
        },
    )
    assert r.json()["choices"][0]["text"] == server.tokenizer.decode(ids[len(prompt) :])
    plain = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert plain.json()["choices"][0]["text"] != r.json()["choices"][0]["text"]  # the penalties changed something


def test_the_tokenizer_endpoints_speak_vllms_shapes(server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == CONTEXT
    text = "Hello world<|endoftext|> again"
    r = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    eot = server.tokenizer.eot_id
    assert r["tokens"] == server.tokenizer.encode("Hello world") + [eot] + server.tokenizer.encode(" again")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == CONTEXT
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == server.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], True)


@pytest.mark.parametrize(
    "path, body, status, phrase",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": [1, 50257]}, 400, "token id 50257 is not in this model's vocabulary"),
        ("/v1/completions", {"prompt": [[5], []]}, 400, "empty list of token ids"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens=0 generates nothing"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "needs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
        ("/detokenize", {"tokens": [-1]}, 400, "token id -1"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "'abc' is not a token id"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "outside -100..100"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, 400, "2"),
        ("/tokenize", {}, 400, "give one of prompt"),
    ],
)
def test_bad_values_are_4xx_in_openais_shape_and_the_server_goes_on(server, path, body, status, phrase):
    r = server.post(path, {"model": MODEL, **body})
    assert r.status_code == status and phrase in r.json()["error"]["message"], r.text
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2})
    assert ok.status_code == 200


def lm_eval_results(lm, tasks):  # noqa: F811
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_rolling", "tiny_gen"], task_manager=manager)


@pytest.mark.slow  # lm-eval builds its tasks and runs both: seconds
@pytest.mark.parametrize("backend", ["huggingface", "remote"])
@pytest.mark.parametrize("folder, served", [("model_dir", "server"), ("gemma", "gemma_server")], ids=["gpt2", "gemma3"])
def test_lm_evals_local_completions_equal_its_hf_backend(request, folder, served, tasks, backend):  # noqa: F811
    """A tiny GPT-2, and a tiny Gemma 3 whose window of 8 positions the tasks' contexts (up to 63 tokens) go past."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    folder = request.getfixturevalue(folder)
    server = request.getfixturevalue(served)
    # the API client sends rolling windows of max_length - 1 tokens with their token of context, the hf backend
    # scores max_length + 1: 63 either way here, one less than the context, for the token the server generates
    # after an echoed prompt. Gemma's tokenizer puts <bos> before a text it encodes with its special tokens (GPT-2's
    # puts nothing): the client's own tokenizer does so with add_bos_token, as the hf backend does by default;
    # lm-eval's remote tokenizer (the server's /tokenize) never does, so there the hf backend is told not to either.
    bos = backend == "huggingface" and bool(prefix_ids(server.tokenizer))
    theirs = lm_eval_results(
        HFLM(pretrained=str(folder), device="cpu", batch_size=3, max_length=CONTEXT - 2, add_bos_token=bos), tasks
    )
    client = LocalCompletionsAPI(
        base_url=server.url + "/v1/completions",
        model=MODEL,
        tokenizer_backend=backend,
        tokenizer=str(folder) if backend == "huggingface" else None,
        add_bos_token=bos,
        tokenized_requests=True,
        max_length=CONTEXT,
        max_gen_toks=8,
        batch_size=3,
        max_retries=1,
    )
    ours = lm_eval_results(client, tasks)
    for name in ("tiny_mc", "tiny_rolling", "tiny_gen"):
        for a, b in zip(ours["samples"][name], theirs["samples"][name], strict=True):
            if name == "tiny_gen":
                assert a["resps"] == b["resps"], a["doc"]["question"]
            else:
                got, want = (
                    torch.tensor([[r if name == "tiny_rolling" else r[0] for r in x] for x in s["resps"]])
                    for s in (a, b)
                )
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        metrics = {k: v for k, v in theirs["results"][name].items() if isinstance(v, float)}
        assert {k: ours["results"][name][k] for k in metrics} == pytest.approx(metrics, rel=1e-5)
