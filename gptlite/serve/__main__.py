"""Serve a model over OpenAI's API, with continuous batching and a chat page at /.

    python -m gptlite.serve --model=RUN                # a training run's newest checkpoint
    python -m gptlite.serve --model=gpt2 [--port=8000]  # GPT-2's weights, or a Hugging Face directory
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "RUN", "prompt": "ROMEO:", "max_tokens": 50}'

--model names a training run's folder, a Hugging Face directory or a hub name (gpt2[-medium|-large|-xl]); --out_dir
and --init_from, its old spellings, still work. The model's name in /v1/models and every response is its folder's
name, or the hub name (see --model_name); a request may name any model, the one model answers it. Up to --max_batch
requests decode together; --max_waiting more wait for a row, and past that a request gets a 429 (or waits, with
--when_full=wait). It needs the serve extra: pip install -e ".[serve]".

Who may use it: with --api_key (or the GPTLITE_API_KEY environment variable, which other users cannot read in
the process list) every /v1/ request must send `Authorization: Bearer KEY`, as OpenAI's clients do. On a
loopback address only loopback host names are answered (--allowed_hosts adds names, as behind a proxy), and no
web page of another origin may call the API unless --cors_origins names it.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from gptlite.cli import MODEL_KINDS, ModelOptions, model_to_read, parse, reworded, run_command
from gptlite.config import option
from gptlite.extras import need_extra
from gptlite.files import error
from gptlite.serve.policy import Policy, is_loopback

KEY_VARIABLE = "GPTLITE_API_KEY"  # the key's environment variable, used when --api_key is not given


@dataclass
class ServeOptions(ModelOptions):
    model: str = reworded(
        ModelOptions, "model", f"the model to serve: {MODEL_KINDS} (a run: its newest checkpoint and tokenizer.json)"
    )
    dtype: str = reworded(ModelOptions, "dtype", "the weights' precision; auto = bfloat16 on CUDA, float32 elsewhere")
    compile: bool = reworded(
        ModelOptions,
        "compile",
        "torch.compile the prefill and decode steps, dynamic shapes (the first requests "
        "compile three graphs); for GPUs: on a CPU the default eager path, sample.py's "
        "slab and packed layers, decodes faster (docs/serve.md)",
    )
    model_name: str = option("", "the model's name in /v1/models and responses (default: --model's folder name)")
    host: str = option("127.0.0.1", "the address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "the port to listen on")
    max_batch: int = option(16, "requests decoded together; each holds one row of the KV cache")
    max_waiting: int = option(-1, "requests that may wait for a row (-1: max_batch); past them, --when_full says")
    when_full: str = option(
        "reject",
        "what a request gets when max_batch + max_waiting are in flight: reject (a 429) or wait",
        choices=("reject", "wait"),
    )
    max_len: int = option(
        0, "tokens per request, prompt and completion (0: the model's block_size); the cache holds max_batch x max_len"
    )
    prefix_cache_mb: float = option(
        256.0,
        "memory for the keys and values of recent prompts and completions, in MB: a prompt that begins with them (a "
        "shared system prompt, a chat's earlier turns) skips their prefill; least recently used dropped first; 0: off",
    )
    api_key: str = option(
        "", f"the key clients must send as Authorization: Bearer KEY (default: ${KEY_VARIABLE}; unset: no key)"
    )
    allowed_hosts: list[str] = option(
        help="host names answered besides loopback ones (behind a proxy, say); on a loopback --host only "
        "loopback names are answered, on another address any name unless this lists them",
        default_factory=list,
    )
    cors_origins: list[str] = option(
        help="origins whose web pages may call the API (https://app.example.com, or *); default: none",
        default_factory=list,
    )
    max_body_mb: float = option(Policy.max_body_mb, "the largest request body, in MB (a 413 past it)")
    read_timeout: float = option(
        Policy.read_timeout,
        "seconds a client has to send a request's headers, and then its body (past them: a 408 for a body; a "
        "connection whose headers stall is closed)",
    )
    shutdown_timeout: float = option(
        30.0, "seconds running requests get to finish after SIGTERM or Ctrl-C, before they are cancelled"
    )
    log_level: str = option("info", "uvicorn's log level", choices=("critical", "error", "warning", "info", "debug"))

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port < 65536:
            problems.append(f"port={self.port} must be in 0..65535")
        if self.max_batch < 1:
            problems.append(f"max_batch={self.max_batch} must be >= 1")
        if self.max_waiting < -1:
            problems.append(f"max_waiting={self.max_waiting} must be >= 0, or -1 for max_batch")
        if self.prefix_cache_mb < 0:
            problems.append(f"prefix_cache_mb={self.prefix_cache_mb} must be >= 0 (0 turns the prefix cache off)")
        if self.max_len < 0:
            problems.append(f"max_len={self.max_len} must be >= 1, or 0 for the model's block_size")
        for name in ("max_body_mb", "read_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if not self.shutdown_timeout >= 0:
            problems.append(f"shutdown_timeout={self.shutdown_timeout} must be >= 0")
        for host in self.allowed_hosts:
            if "/" in host or (":" in host and not host.startswith("[")):
                problems.append(f"allowed_hosts: {host!r} must be a host name alone, without scheme, port or path")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                problems.append(f"cors_origins: {origin!r} must be an origin such as https://app.example.com, or *")
        if problems:
            raise ValueError("; ".join(problems))


def build(options: ServeOptions):
    """The engine (started) and the app for these options (options.model: the one model name, model_to_read's)."""
    from gptlite.checkpoint import open_model
    from gptlite.serve.app import create_app
    from gptlite.serve.engine import Engine

    # the kernels' first build at start-up, not in the first request; an unavailable torch.compile is a warning, as
    # every request would otherwise end in the compiler's error
    model, tokenizer = open_model(options, "gptlite.serve", uncompiled="serving uncompiled")
    engine = Engine(
        model, tokenizer, options.max_batch, options.max_len or None, options.compile, options.prefix_cache_mb
    ).start()
    name = options.model_name or Path(options.model).resolve().name or options.model
    waiting = options.max_batch if options.max_waiting == -1 else options.max_waiting
    return engine, create_app(engine, tokenizer, name, waiting, options.when_full == "wait", policy(options))


def policy(options: ServeOptions) -> Policy:
    """The app's rules for its clients from the options (and the key's environment variable)."""
    return Policy(
        api_key=options.api_key or os.environ.get(KEY_VARIABLE, ""),
        allowed_hosts=tuple(options.allowed_hosts) if is_loopback(options.host) or options.allowed_hosts else None,
        cors_origins=tuple(options.cors_origins),
        max_body_mb=options.max_body_mb,
        read_timeout=options.read_timeout,
    )


def warnings(options: ServeOptions, policy: Policy) -> list[str]:
    """What an address beyond this machine without a key exposes."""
    if is_loopback(options.host) or policy.api_key:
        return []
    return [
        f"listening on {options.host}:{options.port} with no API key: anyone who can reach this port can use the "
        f"model and its machine's time; set --api_key or {KEY_VARIABLE}, or listen on 127.0.0.1"
    ]


def check_address(host: str, port: int) -> None:
    """Bind host:port once before the model loads, as uvicorn will: a port in use or an address that is not this
    machine's is one line at once, not a log after the loading."""
    import socket

    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise error(
            e.errno, f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host"
        ) from None


def serve(server, engine) -> int:
    """Run uvicorn until a signal ends it, or until the engine stops for good: then uvicorn shuts down and the
    exit code is 1, so whatever runs the server sees it fail instead of a server that answers and never
    completes."""

    def watch() -> None:
        engine.stopped.wait()
        if engine.failure is not None:
            server.should_exit = True

    threading.Thread(target=watch, name="gptlite-engine-watch", daemon=True).start()
    try:
        server.run()  # after a graceful shutdown on SIGINT/SIGTERM it raises the signal again, for run_command
    finally:
        engine.close()
    if engine.failure is not None:
        print(f"gptlite.serve: error: {engine.failure}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        options = parse(ServeOptions, argv, "python -m gptlite.serve", __doc__)
        need_extra("serve", "python -m gptlite.serve")  # its --help works without them
        import uvicorn

        from gptlite.serve.connection import uvicorn_config

        options.model = model_to_read(options, "gptlite.serve")
        check_address(options.host, options.port)
        for line in warnings(options, policy(options)):
            print(f"gptlite.serve: warning: {line}", file=sys.stderr)
        engine, app = build(options)
        config = uvicorn_config(
            app, options.host, options.port, options.read_timeout, options.shutdown_timeout, options.log_level
        )
        return serve(uvicorn.Server(config), engine)

    return run_command("gptlite.serve", body, "the server stopped")


if __name__ == "__main__":
    sys.exit(main())
