"""llama.cpp, the reference for gptlite's GGUF files, run in a child process of its own.

llama.cpp is native code, and on some CPUs its kernels crash: on Intel Xeons with AMX, the path that repacks q8_0
weights for AMX dies of SIGSEGV (ggml-org/llama.cpp#20824). In the test process such a crash would end the whole
suite, so every check loads the file in a child process that writes back what llama.cpp computed; a child that dies
fails one test, with a message that names the library, the signal and the CPU, and the suite runs on.

The child loads the model with llama.cpp's extra buffer types off (`use_extra_bufts = False`, what `--no-repack`
sets in llama.cpp's own tools): the plain CPU kernels, which compute the same on an AMD EPYC with AVX2 and an Intel
Xeon with AVX-512 and AMX, instead of the copies of the weights that each CPU's repacking makes. The reference is
then the same file format read by the same code on every machine that runs the suite.

    python tests/helpers/llama_cpp_reference.py REQUEST.json     # the child: what the parent runs, not a user
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

N_CTX = 64  # the longest sequence the tests evaluate


@dataclass
class LlamaCppResult:
    """What llama.cpp made of one GGUF file: its metadata, the ids of each text asked to `tokenize`, the text of
    each id list asked to `detokenize`, and the logits (T, vocab) of each id list asked to `evaluate`."""

    metadata: dict[str, str]
    tokens: list[list[int]]
    texts: list[str]
    logits: list


def llama_cpp(
    path: Path,
    tokenize: list[str] = (),
    special: bool = False,
    detokenize: list[list[int]] = (),
    evaluate: list[list[int]] = (),
    crash: bool = False,
    timeout: float = 600,
) -> LlamaCppResult:
    """Load `path` in llama.cpp in a child process and return what it computed; `special` tokenizes special tokens'
    texts as those tokens. `crash=True` makes the child die of SIGSEGV once the model is loaded (the test of this
    harness). A child that dies or fails ends the calling test with pytest.fail, naming llama.cpp and the CPU."""
    request = {
        "path": str(path),
        "tokenize": list(tokenize),
        "special": special,
        "detokenize": [list(ids) for ids in detokenize],
        "evaluate": [list(ids) for ids in evaluate],
        "crash": crash,
    }
    with tempfile.TemporaryDirectory(prefix="llama_cpp_") as folder:
        return run_child(request, Path(folder), timeout)


def run_child(request: dict, folder: Path, timeout: float) -> LlamaCppResult:
    """Run the child on `request` with `folder` for its answers; read them back, or fail the test."""
    import numpy as np
    import pytest

    name = Path(request["path"]).name
    (folder / "request.json").write_text(json.dumps({**request, "out": str(folder)}))
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(folder / "request.json")], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"llama.cpp did not finish with {name} in {timeout:.0f} s ({where()})", pytrace=False)
    if done.returncode != 0:
        pytest.fail(failure(done.returncode, done.stderr, name), pytrace=False)
    result = json.loads((folder / "result.json").read_text())
    logits = [np.load(folder / f"logits_{i}.npy") for i in range(len(request["evaluate"]))]
    texts = [base64.b64decode(t).decode("utf-8", errors="replace") for t in result["texts"]]
    return LlamaCppResult(result["metadata"], result["tokens"], texts, logits)


def where() -> str:
    """The library's version and the CPU, for a failure's message: these crashes depend on both."""
    from gptlite.device import cpu_summary

    try:
        from importlib.metadata import version

        library = f"llama-cpp-python {version('llama-cpp-python')}"
    except Exception:  # noqa: BLE001 - a message's detail, never the reason a test fails
        library = "llama-cpp-python"
    return f"{library} on {cpu_summary()}"


def failure(returncode: int, stderr: str, name: str) -> str:
    """One line first (what died, of what, where), then the child's last lines of output."""
    if returncode < 0:
        try:
            how = f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"died of signal {-returncode}"
        first = f"llama.cpp {how} in a child process reading {name} ({where()}): a crash in llama.cpp's native code"
    else:
        first = f"llama.cpp's child process failed (exit {returncode}) reading {name} ({where()})"
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    return f"{first}\n{tail}" if tail else first


def child(request_file: str) -> int:
    """The child's work: load the file with extra buffer types off, compute what the request asks, write it."""
    import ctypes

    import llama_cpp
    import llama_cpp.llama_cpp as api
    import numpy as np

    request = json.loads(Path(request_file).read_text())
    defaults = api.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = without_extra_buffers  # what llama_cpp.Llama builds its model's params from
    llm = llama_cpp.Llama(
        model_path=request["path"], n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, n_threads=2, verbose=False
    )
    if request["crash"]:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a fault in native code would
    out = Path(request["out"])
    tokens = [llm.tokenize(t.encode(), add_bos=False, special=request["special"]) for t in request["tokenize"]]
    texts = [base64.b64encode(llm.detokenize(ids)).decode() for ids in request["detokenize"]]
    for i, ids in enumerate(request["evaluate"]):
        llm.reset()
        llm.eval(ids)
        np.save(out / f"logits_{i}.npy", np.array(llm.scores[: len(ids)], dtype=np.float64))
    metadata = {str(k): str(v) for k, v in llm.metadata.items()}
    (out / "result.json").write_text(json.dumps({"metadata": metadata, "tokens": tokens, "texts": texts}))
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1]))
