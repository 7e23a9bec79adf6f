"""Serve a model over OpenAI's API, with continuous batching and a chat page at /.

    python -m gptlite.serve --out_dir=RUN                  # a training run's newest checkpoint
    python -m gptlite.serve --init_from=gpt2 [--port=8000]  # GPT-2's weights, or a Hugging Face directory
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "RUN", "prompt": "ROMEO:", "max_tokens": 50}'

The model's name in requests is the run directory's or init_from's name (see --model_name). Up to --max_batch
requests decode together; --max_waiting more wait for a row, and past that a request gets a 429 (or waits,
with --when_full=wait).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from gptlite.cli import parse, run_command
from gptlite.config import DTYPE_CHOICES, QUANTIZE_CHOICES, option
from gptlite.device import pick_device, pick_dtype
from gptlite.files import error


@dataclass
class ServeOptions:
    out_dir: str = option("", "a training run's directory (its newest checkpoint and tokenizer.json)")
    init_from: str = option(
        "",
        "pretrained weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face "
        "directory (GPT-2, Llama, Mistral, Qwen2, Qwen3)",
    )
    tokenizer: str = option(
        "",
        "a tokenizer.json, .tiktoken ranks file or tiktoken name (default: the run's "
        "tokenizer.json; GPT-2's BPE with --init_from)",
    )
    model_name: str = option("", "the model's name in requests and /v1/models (default: out_dir's or init_from's name)")
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
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = option(
        "auto",
        "the weights' precision; auto = bfloat16 on CUDA, float32 elsewhere",
        choices=DTYPE_CHOICES,
    )
    compile: bool = option(
        False,
        "torch.compile the prefill and decode steps, dynamic shapes (the first requests "
        "compile three graphs); for GPUs: on a CPU the default eager path, sample.py's "
        "slab and packed layers, decodes faster (docs/serve.md)",
    )
    quantize: str = option("", "int8: weight-only int8 weights", choices=QUANTIZE_CHOICES)
    log_level: str = option("info", "uvicorn's log level", choices=("critical", "error", "warning", "info", "debug"))

    def __post_init__(self) -> None:
        problems = []
        if bool(self.out_dir) == bool(self.init_from):
            problems.append(
                "give one of --out_dir=RUN (a training run) or --init_from=NAME_OR_DIR (pretrained weights)"
            )
        if not 0 <= self.port < 65536:
            problems.append(f"port={self.port} must be in 0..65535")
        if self.max_batch < 1:
            problems.append(f"max_batch={self.max_batch} must be >= 1")
        if self.max_waiting < -1:
            problems.append(f"max_waiting={self.max_waiting} must be >= 0, or -1 for max_batch")
        if self.max_len < 0:
            problems.append(f"max_len={self.max_len} must be >= 1, or 0 for the model's block_size")
        if problems:
            raise ValueError("; ".join(problems))


def build(options: ServeOptions):
    """The engine (started) and the app for these options."""
    import torch

    from gptlite.checkpoint import load_model
    from gptlite.serve.app import create_app
    from gptlite.serve.engine import Engine

    device = pick_device(options.device)
    dtype = pick_dtype(options.dtype, device)
    model, tokenizer = load_model(options.out_dir, options.init_from, options.tokenizer)
    model = model.to(device, getattr(torch, dtype)).eval()
    if options.quantize:
        model.quantize(options.quantize)
    engine = Engine(model, tokenizer, options.max_batch, options.max_len or None, options.compile).start()
    name = options.model_name or Path(options.out_dir or options.init_from).resolve().name or options.init_from
    waiting = options.max_batch if options.max_waiting == -1 else options.max_waiting
    return engine, create_app(engine, tokenizer, name, waiting, options.when_full == "wait")


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        import uvicorn

        options = parse(ServeOptions, argv, "python -m gptlite.serve", __doc__)
        check_address(options.host, options.port)
        engine, app = build(options)
        server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level))
        try:
            server.run()  # after a graceful shutdown on SIGINT/SIGTERM it raises the signal again, for run_command
        finally:
            engine.close()
        return 0

    return run_command("gptlite.serve", body, "the server stopped")


if __name__ == "__main__":
    sys.exit(main())
