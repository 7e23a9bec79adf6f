"""Who may use gptlite.serve: an API key sent as OpenAI's clients send it (Authorization: Bearer), host names
beyond loopback ones, CORS for named origins; and the command's options that set them, with the warning for an
address beyond this machine without a key. (A loopback server's defaults are tested in test_serve.py.)"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from gptlite.serve.__main__ import KEY_VARIABLE, ServeOptions, main, policy, warnings
from gptlite.serve.guard import Policy
from tests.helpers.serving import MODEL, Served, free_port

KEY = "sekret-key"
APP = "https://app.example"


@pytest.fixture(scope="module")
def guarded():
    s = Served(max_batch=2, policy=Policy(api_key=KEY, allowed_hosts=("proxy.example",), cors_origins=(APP,)))
    yield s
    s.close()


def test_v1_needs_the_key_as_openai_clients_send_it(guarded):
    r = httpx.get(guarded.url + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": "the request sent no API key; send the server's key (its --api_key or GPTLITE_API_KEY) as "
            "Authorization: Bearer KEY",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    with pytest.raises(openai.AuthenticationError, match="sent an API key that is not this server's"):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for authorization in (f"Basic {KEY}", KEY, f"Bearer {KEY}x"):
        r = httpx.post(guarded.url + "/v1/completions", json={}, headers={"Authorization": authorization})
        assert r.status_code == 401  # refused before its body is read
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"
    page = httpx.get(guarded.url + "/")  # static, and asks for the key itself
    assert page.status_code == 200 and "Authorization" in page.text


def test_named_hosts_and_origins_pass_and_no_others(guarded):
    key = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(guarded.url + "/v1/models", headers={**key, "Host": "proxy.example"}).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", headers={**key, "Host": "localhost"}).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", headers={**key, "Host": "evil.example"}).status_code == 400
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(guarded.url + "/v1/completions", headers={**asks, "Origin": APP})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(guarded.url + "/v1/completions", headers={**asks, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(guarded.url + "/v1/models", headers={**key, "Origin": APP})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP


def test_the_options_set_the_policy(monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    loopback = ServeOptions(out_dir="run")
    assert policy(loopback) == Policy() and warnings(loopback, policy(loopback)) == []
    wide = ServeOptions(out_dir="run", host="0.0.0.0", max_body_mb=1, read_timeout=5)
    assert policy(wide) == Policy(allowed_hosts=None, max_body_mb=1, read_timeout=5)  # any name: ours are unknown
    named = ServeOptions(out_dir="run", host="0.0.0.0", allowed_hosts=["a.example"], cors_origins=["*"])
    assert policy(named).allowed_hosts == ("a.example",) and policy(named).cors_origins == ("*",)
    assert policy(ServeOptions(out_dir="run", api_key="given")).api_key == "given"
    monkeypatch.setenv(KEY_VARIABLE, "from-the-environment")
    assert policy(wide).api_key == "from-the-environment" and warnings(wide, policy(wide)) == []
    assert policy(ServeOptions(out_dir="run", api_key="given")).api_key == "given"


def test_listening_beyond_loopback_without_a_key_warns(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    port = free_port()
    assert main([f"--model={tmp_path / 'no_run'}", "--host=0.0.0.0", f"--port={port}"]) == 2  # no model to load
    warning, refusal = capsys.readouterr().err.strip().splitlines()
    assert warning == (
        f"gptlite.serve: warning: listening on 0.0.0.0:{port} with no API key: anyone who can reach this port can "
        "use the model and its machine's time; set --api_key or GPTLITE_API_KEY, or listen on 127.0.0.1"
    )
    assert refusal.startswith("gptlite.serve: error: ")


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"allowed_hosts": ["http://a.example"]}, "allowed_hosts: 'http://a.example' must be a host name alone"),
        ({"allowed_hosts": ["a.example:8000"]}, "allowed_hosts: 'a.example:8000' must be a host name alone"),
        ({"cors_origins": ["app.example"]}, "cors_origins: 'app.example' must be an origin such as https://"),
        ({"max_body_mb": 0}, "max_body_mb=0 must be > 0"),
        ({"read_timeout": -1}, "read_timeout=-1 must be > 0"),
        ({"shutdown_timeout": -1}, "shutdown_timeout=-1 must be >= 0"),
    ],
)
def test_bad_access_options_are_refused(options, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        ServeOptions(out_dir="run", **options)
