"""What hostile or careless clients cost everyone else on `python -m gptlite.serve`: long stop strings, a huge body,
abandoned non-streamed requests. Each attack runs beside small requests, whose time it reports.

    python benchmarks/bench_serve_attacks.py [--tree=DIR]   # DIR: another gptlite checkout to serve (before/after)

The server is a tiny random model (2 layers, 4 heads, 32 wide, block 256, a character tokenizer) in a temporary
run folder, started from this checkout or from --tree. A small request is {"prompt": "x", "max_tokens": 4}. Prints
one line per attack; asserts nothing.
"""

from __future__ import annotations

import json
import os
import socket
import string
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.checkpoint import save_checkpoint  # noqa: E402
from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import build_config, config_to_dict, option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402
from gptlite.gpt import GPT  # noqa: E402
from gptlite.tokenizer import CharTokenizer  # noqa: E402

SMALL = {"model": "run", "prompt": "x", "max_tokens": 4}  # served under the name of its run folder, "run"


@dataclass
class Options:
    tree: str = option("", "the gptlite checkout whose server to run (default: this one)")
    port: int = option(18411, "the port to serve on")


def make_run(folder: Path) -> None:
    cfg = build_config({"vocab_size": 100, "block_size": 256, "n_layer": 2, "n_head": 4, "n_embd": 32})
    save_checkpoint(folder / "ckpt.pt", {"config": config_to_dict(cfg), "model": GPT(cfg.model).state_dict()})
    CharTokenizer(string.printable).save(folder / "tokenizer.json")


def peak_mb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) // 1024
    return 0


def small(url: str) -> tuple[int, float]:
    start = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json=SMALL, timeout=300)
    return response.status_code, time.perf_counter() - start


def long_stop_strings(url: str) -> None:
    for stops in (["q" * 250_000] * 4, ["q" * 256] * 4):
        long = {**SMALL, "max_tokens": 50, "stop": stops}
        with ThreadPoolExecutor(1) as pool:
            attack = pool.submit(httpx.post, url + "/v1/completions", json=long, timeout=300)
            time.sleep(0.3)
            code, seconds = small(url)
            status = attack.result().status_code
        print(f"stop strings {len(stops)} x {len(stops[0]):,}: that request {status}; a small one beside it {code} in "
              f"{seconds:.3f} s")  # fmt: skip


def huge_body(url: str, port: int, pid: int) -> None:
    body = json.dumps({**SMALL, "prompt": "x" * 80_000_000}).encode()
    before = peak_mb(pid)

    def send() -> tuple[str, float]:
        start = time.perf_counter()
        connection = socket.create_connection(("127.0.0.1", port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        try:
            connection.sendall(head.encode())
            connection.sendall(body)
        except OSError:  # the server answered and closed before the whole body was sent
            pass
        status = connection.recv(200).split(b"\r\n")[0].decode()
        connection.close()
        return status, time.perf_counter() - start

    slowest = 0.0
    with ThreadPoolExecutor(1) as pool:
        attack = pool.submit(send)
        while not attack.done():
            slowest = max(slowest, small(url)[1])
        status, seconds = attack.result()
    print(f"80 MB body: '{status}' after {seconds:.2f} s; small requests beside it took at most {slowest:.3f} s; "
          f"the server's peak memory {before} -> {peak_mb(pid)} MB")  # fmt: skip


def abandoned_requests(url: str) -> None:
    def abandon(_) -> None:
        try:
            httpx.post(url + "/v1/completions", json={**SMALL, "max_tokens": 250}, timeout=0.3)
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(abandon, range(32)))
    start = time.perf_counter()
    refused = 0
    while small(url)[0] != 200:
        refused += 1
        time.sleep(0.05)
    print(f"32 abandoned requests: the next request served after {time.perf_counter() - start:.2f} s ({refused} "
          "refused with 429 before)")  # fmt: skip


def run(options: Options) -> int:
    print(machine_line(), flush=True)
    tree = Path(options.tree or ROOT)
    url = f"http://127.0.0.1:{options.port}"
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary) / "run"
        folder.mkdir()
        make_run(folder)
        command = [sys.executable, "-m", "gptlite.serve", f"--model={folder}", f"--port={options.port}"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        server = subprocess.Popen([*command, "--device=cpu", "--log_level=warning"], cwd=folder, env=env)
        try:
            while True:
                try:
                    httpx.get(url + "/v1/models")
                    break
                except httpx.ConnectError:
                    if server.poll() is not None:
                        raise RuntimeError("the server did not start") from None
                    time.sleep(0.2)
            for _ in range(3):
                small(url)
            print(f"serving {tree}; a small request alone: {min(small(url)[1] for _ in range(5)):.3f} s")
            long_stop_strings(url)
            huge_body(url, options.port, server.pid)
            abandoned_requests(url)
        finally:
            server.terminate()
            server.wait(60)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_serve_attacks.py", lambda: run(parse(Options, argv, "bench_serve_attacks.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
