"""Helpers of the serve tests: a tiny model whose tokenizer has a trivial chat template, and a server that runs
it in a thread on a free local port."""

from __future__ import annotations

import socket
import threading
import time

import torch
import uvicorn

from gptlite.serve.app import create_app
from gptlite.serve.engine import Engine
from gptlite.tokenizer import CharTokenizer
from gptlite.tokenizer.chat import render
from tests.conftest import tiny_model

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\u00e9"  # 97 characters, the tiny model's vocabulary
MODEL = "tiny"


class TemplateTokenizer(CharTokenizer):
    """A char tokenizer with a small chat template: "role: content\\n" per message, then "assistant: "."""

    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render(self.chat_template, messages, add_generation_prompt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An app served by uvicorn on a thread of this process, at `url`, until `stop`."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the test server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Served:
    """A tiny model, its template tokenizer, an engine and a running server."""

    def __init__(self, max_batch: int = 8, block_size: int = 128, **app_options):
        self.model = tiny_model(block_size=block_size)
        self.tokenizer = TemplateTokenizer(CHARS)
        self.engine = Engine(self.model, self.tokenizer, max_batch=max_batch).start()
        self.app = create_app(self.engine, self.tokenizer, MODEL, **app_options)
        self.running = Running(self.app)
        self.url = self.running.url

    def greedy(self, prompt: str, max_tokens: int) -> str:
        """The model's own greedy continuation, through GPT.generate."""
        ids = self.tokenizer.encode(prompt)
        out = self.model.generate(
            torch.tensor([ids], device=self.model.tok_emb.weight.device), max_tokens, temperature=0
        )
        return self.tokenizer.decode(out[0, len(ids) :].tolist())

    def close(self) -> None:
        self.running.stop()
        self.engine.close()


def slow_steps(monkeypatch, engine: Engine, seconds: float) -> None:
    """Make every engine step take at least `seconds` (so a test can act while a request decodes)."""
    step = engine.step

    def slow(*args):
        time.sleep(seconds)
        return step(*args)

    monkeypatch.setattr(engine, "step", slow)
