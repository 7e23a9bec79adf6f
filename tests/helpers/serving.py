"""Helpers of the serve tests: a tiny model whose tokenizer has a trivial chat template, and a server that runs
it in a thread on a free local port, whose log must hold no traceback when it stops."""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch
import uvicorn

from gptlite import GPT
from gptlite.serve.app import create_app
from gptlite.serve.connection import uvicorn_config
from gptlite.serve.engine import Engine
from gptlite.serve.guard import Policy
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


class ServerLog(logging.Handler):
    """The server's log lines (uvicorn's loggers, which gptlite.serve shares), tracebacks included, as text."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        self.previous_hook = threading.excepthook
        logging.getLogger("uvicorn").addHandler(self)
        threading.excepthook = self.thread_died

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def thread_died(self, args) -> None:  # an exception that ended a thread (the engine's, say)
        self.lines.append(f"Traceback: thread {args.thread.name} died of {args.exc_type.__name__}: {args.exc_value}")
        self.previous_hook(args)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def close(self) -> None:
        logging.getLogger("uvicorn").removeHandler(self)
        threading.excepthook = self.previous_hook
        super().close()


class Running:
    """An app served by uvicorn on a thread of this process, at `url`, until `stop`, which checks that the
    server's log holds no traceback."""

    def __init__(self, app, read_timeout: float = Policy.read_timeout, shutdown_timeout: float = 10.0):
        self.log = ServerLog()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(
            app, "127.0.0.1", self.port, read_timeout, shutdown_timeout, log_level="info", log_config=None
        )  # log_config=None: uvicorn's loggers keep ServerLog, where its own set-up would replace their handlers
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the test server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.log.close()
        assert "Traceback" not in self.log.text, f"the server's log holds a traceback:\n{self.log.text}"


class Served:
    """A tiny model (or `model`, of the same vocabulary), its template tokenizer, an engine and a running server (its
    headers and bodies read within the policy's read_timeout)."""

    def __init__(
        self,
        max_batch: int = 8,
        block_size: int = 128,
        policy: Policy | None = None,
        model: GPT | None = None,
        **app_options,
    ):
        self.model = tiny_model(block_size=block_size) if model is None else model  # the tokenizer's 97 ids
        self.tokenizer = TemplateTokenizer(CHARS)
        self.engine = Engine(self.model, self.tokenizer, max_batch=max_batch).start()
        self.policy = policy or Policy()
        self.app = create_app(self.engine, self.tokenizer, MODEL, policy=self.policy, **app_options)
        self.running = Running(self.app, read_timeout=self.policy.read_timeout)
        self.url = self.running.url
        self.log = self.running.log

    def greedy(self, prompt: str, max_tokens: int) -> str:
        """The model's own greedy continuation, through GPT.generate."""
        ids = self.tokenizer.encode(prompt)
        out = self.model.generate(
            torch.tensor([ids], device=self.model.tok_emb.weight.device), max_tokens, temperature=0
        )
        return self.tokenizer.decode(out[0, len(ids) :].tolist())

    def close(self) -> None:
        try:
            self.running.stop()
        finally:
            self.engine.close()


def slow_steps(monkeypatch, engine: Engine, seconds: float) -> None:
    """Make every engine step take at least `seconds` (so a test can act while a request decodes)."""
    step = engine.step

    def slow(*args):
        time.sleep(seconds)
        return step(*args)

    monkeypatch.setattr(engine, "step", slow)
