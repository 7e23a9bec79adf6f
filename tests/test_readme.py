"""The README's commands, run as written on the models the README trains: the char model of
configs/shakespeare_char_cpu.toml in out/char, and out/mine on a BPE of your own (the tokenizer section's
commands), each trained for a few steps (--max_iters=20) in a folder of its own, with the files the commands name
(prompt.txt, notes.txt, corpus/) beside them. A README example that fails on those models (beam search asked for
more tokens than its block holds, a JSON schema the char vocabulary cannot spell) fails here. The servers run as
written too, each port the README names (8000, 8001) replaced by a free one; a command holding a placeholder in
capitals (TASK, NAME) is not run.

The other sections' commands run as written too, each in a folder holding the files it names: a download the
command keeps (tiny Shakespeare, HellaSwag) already kept there, a URL served from 127.0.0.1, GPT-2's BPE as the
ranks file (the README's offline spelling), a Hugging Face model a tiny stand-in at the path the README names. A line
that needs a GPU, torchrun's ranks or a download with no local form is checked instead: its script's --help lists
its keys, its config builds, the extra it installs exists."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import ROOT, shared_file
from tests.helpers.serving import free_port

README = (ROOT / "README.md").read_text()


def bash_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks of a Markdown text, continuation lines joined, comments cut; a quoted
    argument that goes on over lines (python -c "...", curl -d '...') is one command, its lines joined by newlines."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        command = ""
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).strip()
            if not line:
                continue
            command = f"{command}\n{line}" if command else line
            if quotes_closed(command):
                lines.append(command)
                command = ""
    return lines


def quotes_closed(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:  # "No closing quotation"
        return False
    return True


def on_the_char_model(command: str) -> bool:
    """A command of the README that reads out/char and returns (the server runs until stopped: its own tests)."""
    return "out/char " in command + " " and command.startswith(("python sample.py", "python -m gptlite.evaluate"))


def argv(command: str) -> list[str]:
    """The command's words with its optional parts ([--top_p=0.95]) taken, run by this Python; python -c's code
    as it is."""
    if command.startswith("python -c "):
        return [sys.executable, *shlex.split(command)[1:]]
    words = shlex.split(command.replace("[", "").replace("]", ""))
    assert words[0] == "python"
    script = words[1] if words[1] == "-m" else str(ROOT / words[1])
    return [sys.executable, script, *words[2:]]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> Path:
    """A folder laid out as the README's commands expect: data/shakespeare_char, out/char, prompt.txt, notes.txt."""
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(ROOT / "configs")  # the commands run from the repository's root
    shakespeare = shared_file("data/tinyshakespeare.txt")
    prepare = [sys.executable, str(ROOT / "data/shakespeare/prepare.py"), f"--input={shakespeare}"]
    subprocess.run([*prepare, "--out_dir=data/shakespeare_char"], cwd=root, check=True, capture_output=True)
    train = "python train.py configs/shakespeare_char_cpu.toml --data_dir=data/shakespeare_char --out_dir=out/char"
    assert train in bash_lines(README)
    run_briefly(train, root)
    (root / "prompt.txt").write_text("ROMEO:\nWhat light")
    (root / "notes.txt").write_text(shakespeare.read_text()[:5000])
    return root


def run_briefly(command: str, root: Path) -> None:
    """A README command that trains, run for 20 steps."""
    done = subprocess.run(
        [*argv(command), "--max_iters=20", "--eval_interval=20", "--eval_iters=2"], cwd=root, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()


@pytest.fixture(scope="module")
def readme_bpe(readme_run) -> Path:
    """readme_run with out/mine, made as the README's tokenizer section says: a BPE trained on corpus/ (here a
    slice of tiny Shakespeare), the data prepared with it, and a model trained on that."""
    corpus = readme_run / "corpus"
    corpus.mkdir()
    (corpus / "shakespeare.txt").write_text(shared_file("data/tinyshakespeare.txt").read_text()[:200_000])
    section = README.split("## Train your own tokenizer")[1].split("\n## ")[0]
    commands = bash_lines(section)
    starts = ("python -m gptlite.tokenizer train", "python data/prepare.py", "python train.py configs/")
    assert len(commands) == 3 and all(c.startswith(start) for c, start in zip(commands, starts, strict=True))
    for command in commands[:2]:
        done = subprocess.run(argv(command), cwd=readme_run, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
    assert commands[2].endswith("--out_dir=out/mine")
    run_briefly(commands[2], readme_run)
    return readme_run


def test_the_readme_names_its_commands_on_the_char_model():
    commands = [c for c in bash_lines(README) if on_the_char_model(c)]
    assert len(commands) >= 6, commands
    assert any("--num_beams" in c for c in commands) and any("--compile" in c for c in commands)


@pytest.mark.slow  # starts processes, and one of them compiles
@pytest.mark.parametrize("command", [c for c in bash_lines(README) if on_the_char_model(c)])
def test_each_readme_command_runs_as_written_on_the_readmes_char_model(command, readme_run):
    done = subprocess.run(argv(command), cwd=readme_run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    assert done.stdout.strip()


@pytest.mark.slow  # starts a process
def test_the_readmes_python_example_runs_on_the_readmes_char_model(readme_run):
    code = re.search(r"## Use the model from Python\n\n```python\n(.*?)```", README, re.S)[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=readme_run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ROMEO:")


def readme_servers() -> list[tuple[str, list[str]]]:
    """The README's Serve section: each server command, with the requests after it (curl, python -c) that go to its
    port, as written."""
    section = README.split("## Serve")[1].split("\n## ")[0]
    servers: list[tuple[str, list[str]]] = []
    for command in bash_lines(section):
        if command.startswith("python -m gptlite.serve"):
            servers.append((command, []))
        elif command.startswith(("curl ", "python -c")) and not re.search(r"\b(?:TASK|NAME)\b", command):
            servers[-1][1].append(command)
    return servers


def request_body(command: str) -> dict:
    """The JSON a curl command of the README sends (its -d)."""
    words = shlex.split(command)
    return json.loads(words[words.index("-d") + 1])


def test_the_readmes_json_schema_example_leaves_max_tokens_room_for_the_longest_json_it_allows():
    """The schema bounds its JSON: every key required and no other, each string a run of one character class whose
    characters JSON writes as one byte each (ASCII, no escapes), up to its maxLength; so the longest JSON it allows
    is those strings at their longest, compact (the server's grammar writes no spaces), and each token spells one
    byte or more of it."""
    every_character = "".join(map(chr, range(0x110000)))
    (request,) = [r for _, requests in readme_servers() for r in requests if "json_schema" in r]
    body = request_body(request)
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["additionalProperties"] is False and schema["required"] == list(schema["properties"])
    longest = {}
    for name, prop in schema["properties"].items():
        assert prop["type"] == "string" and re.fullmatch(r"\^(\[.+\])\+\$", prop["pattern"]), prop
        spelled = set(re.findall(prop["pattern"][1:-2], every_character))
        assert spelled and all(c.isascii() and json.dumps(c) == f'"{c}"' for c in spelled), prop  # no escapes
        longest[name] = min(spelled) * prop["maxLength"]
    text = json.dumps(longest, separators=(",", ":"))
    jsonschema.validate(json.loads(text), schema)
    assert body["max_tokens"] >= len(text.encode()), (body["max_tokens"], text)
    assert f"the longest JSON it allows, {len(text)} characters above" in " ".join(README.split())


@pytest.mark.slow  # starts servers
@pytest.mark.parametrize("index", range(len(readme_servers())))
def test_each_readme_server_example_runs_as_written_on_the_readmes_models(index, readme_bpe):
    server, requests = readme_servers()[index]
    assert requests, server
    port = str(free_port())
    written = re.search(r"--port=(\d+)", server)
    server = server.replace(written[0], f"--port={port}") if written else f"{server} --port={port}"
    for request in requests:
        assert f"127.0.0.1:{written[1] if written else 8000}/" in request, request
    requests = [re.sub(r"127\.0\.0\.1:\d+/", f"127.0.0.1:{port}/", r) for r in requests]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(argv(server), cwd=readme_bpe, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).close()
                break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        for request in requests:
            words = shlex.split(request)
            done = subprocess.run(argv(request) if words[0] == "python" else words, cwd=readme_bpe, env=env,
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0 and done.stdout.strip(), f"{request}\n{done.stdout}\n{done.stderr}"
            assert '"error"' not in done.stdout, f"{request}\n{done.stdout}"
            if "json_schema" in request:  # whole JSON that the request's schema accepts
                (choice,) = json.loads(done.stdout)["choices"]
                assert choice["finish_reason"] == "stop", choice
                jsonschema.validate(
                    json.loads(choice["text"]), request_body(request)["response_format"]["json_schema"]["schema"]
                )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            log, _ = process.communicate(timeout=30)
        finally:
            process.kill()
    assert "Traceback" not in log, log


def quickstart_clone(root: Path) -> None:
    """A checkout of the quick start's files at `root` (gptlite itself a link to this one), with a .venv whose
    python is this one and whose pip installs nothing: setup.sh finds torch there and keeps it, offline."""
    for name in ("train.py", "sample.py", "pyproject.toml"):
        (root / name).write_text((ROOT / name).read_text())
    for folder in ("scripts", "configs"):
        (root / folder).mkdir()
        for path in (ROOT / folder).iterdir():
            (root / folder / path.name).write_text(path.read_text())
    for script in ("data/prepare.py", "data/shakespeare/prepare.py"):
        (root / script).parent.mkdir(parents=True, exist_ok=True)
        (root / script).write_text((ROOT / script).read_text())
    (root / "gptlite").symlink_to(ROOT / "gptlite")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in "-m pip "*) exit 0;; esac\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)


@pytest.mark.slow  # starts the quick start twice: set-up, preparation, training and sampling each
def test_the_offline_quick_start_then_its_shakespeare_form_both_run_in_one_clone(tmp_path):
    """The README's quick start offline (tiny Shakespeare cannot be downloaded: it trains on Python's standard
    library), then its SHAKESPEARE= form in the same clone: each corpus trains in a folder of its own, so the second
    does not meet the first's run (once: "cannot --resume the run in out/quickstart on other data", rc 2). A folder
    left by the quick start before that, holding the standard library's run in out/quickstart, is moved aside
    whole. Each run trains a few steps (train.py's arguments after the command)."""
    quickstart = [c for c in bash_lines(README) if c.endswith("bash scripts/quickstart.sh")]
    assert quickstart == ["bash scripts/quickstart.sh", "SHAKESPEARE=tinyshakespeare.txt bash scripts/quickstart.sh"]
    clone = tmp_path / "clone"
    clone.mkdir()
    quickstart_clone(clone)
    (clone / "tinyshakespeare.txt").write_text(shared_file("data/tinyshakespeare.txt").read_text())
    offline = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy")}
    offline |= {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}  # nothing listens there
    offline["OMP_NUM_THREADS"] = "1"  # the test's cost on a CPU that other tests share: no threads spinning
    brief = " --max_iters=20 --eval_interval=20 --eval_iters=2"

    def run(command: str) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-c", command + brief], cwd=clone, env=offline, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    first = run(quickstart[0])
    assert "training on Python's standard-library source" in first.stdout and "in out/quickstart_stdlib" in first.stdout
    stdlib_run = clone / "out" / "quickstart_stdlib"
    saved = sorted(p.name for p in stdlib_run.iterdir())
    assert "ckpt_000020.pt" in saved

    second = run(quickstart[1])
    assert f"corpus: tiny Shakespeare from {clone / 'tinyshakespeare.txt'}" in second.stdout
    assert json.loads((clone / "out/quickstart/run.json").read_text())["config"]["data_dir"] == "data/shakespeare_char"
    assert (clone / "out/quickstart/ckpt_000020.pt").is_file()
    assert sorted(p.name for p in stdlib_run.iterdir()) == saved  # the first run's folder, as it was

    # the layout of the quick start before each corpus had a folder: the standard library's run in out/quickstart
    shutil.rmtree(clone / "out" / "quickstart")
    shutil.copytree(stdlib_run, clone / "out" / "quickstart", symlinks=True)
    third = run(quickstart[1])
    assert (
        "quickstart: out/quickstart held a run on data/python_stdlib_char, not data/shakespeare_char: moved it to "
        "out/quickstart.1 (nothing deleted)" in third.stdout
    )
    assert sorted(p.name for p in (clone / "out/quickstart.1").iterdir()) == saved
    assert json.loads((clone / "out/quickstart/run.json").read_text())["config"]["data_dir"] == "data/shakespeare_char"


def readme_command(start: str) -> str:
    """The one command of the README that starts with `start`, as written."""
    (command,) = [c for c in bash_lines(README) if c.startswith(start)]
    return command


def gpt2_offline(command: str) -> str:
    """The command with `--tokenizer gpt2` as the README says to run it offline: the ranks file's path in place of
    the name (tiktoken's own download of the name needs the network)."""
    ranks = shared_file("tokenizers/gpt2.tiktoken")
    offline = re.sub(r"--tokenizer[ =]gpt2(?=\s|$)", f"--tokenizer {shlex.quote(str(ranks))}", command)
    assert offline != command, command
    return offline


def no_proxy_env() -> dict[str, str]:
    """This environment without proxies, so that a URL on 127.0.0.1 is fetched directly."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return env | {"no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1", "PYTHONPATH": str(ROOT)}


def run_in(root: Path, words: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(words, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{words}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow  # starts processes
def test_the_readmes_shakespeare_preparation_runs_as_written_with_the_download_already_kept(tmp_path):
    """`python data/shakespeare/prepare.py`, char level and GPT-2, in a copy of the script whose download is already
    kept where the script keeps it (data/shakespeare/input.txt beside it, so nothing is fetched): each writes its
    folder under the copy's data/, as the README's comments say. GPT-2 is the ranks file, as the README's offline
    note says."""
    script = tmp_path / "data" / "shakespeare" / "prepare.py"
    script.parent.mkdir(parents=True)
    script.write_text((ROOT / "data/shakespeare/prepare.py").read_text())
    (tmp_path / "gptlite").symlink_to(ROOT / "gptlite")
    text = shared_file("data/tinyshakespeare.txt").read_text()
    (script.parent / "input.txt").write_text(text)
    char = "python data/shakespeare/prepare.py"
    assert char in bash_lines(README)
    gpt2 = gpt2_offline(readme_command("python data/shakespeare/prepare.py --tokenizer gpt2"))
    for command, out_dir, vocab in ((char, "shakespeare_char", 65), (gpt2, "shakespeare_gpt2", 50257)):
        run_in(tmp_path, [sys.executable, str(script), *shlex.split(command)[2:]])
        manifest = json.loads((tmp_path / "data" / out_dir / "manifest.json").read_text())
        assert manifest["vocab_size"] == vocab, manifest


@pytest.fixture
def served_book(tmp_path):
    """A local copy of the README's https://example.com/book.txt, served on 127.0.0.1: the URL to use instead."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    (site / "book.txt").write_text("Chapter one. It was a bright cold day in April.\n" * 50)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/book.txt"
    server.shutdown()
    server.server_close()


@pytest.mark.slow  # starts processes
def test_the_readmes_data_prepare_lines_run_as_written_on_files_a_user_made(tmp_path, served_book):
    """data/prepare.py's README lines in a folder holding what they name (corpus.txt, more/*.txt, a_folder/,
    dump/*.jsonl, shards/*.parquet), the book's URL served from 127.0.0.1 and GPT-2 the ranks file, as the README's
    offline note says; then --verify checks data/mycorpus. Each folder counts every document it was given."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    play = shared_file("data/tinyshakespeare.txt").read_text()
    scenes = play.split("\n\n")
    (tmp_path / "corpus.txt").write_text(play[:20_000])
    for folder, names in (("more", ("a.txt", "b.txt")), ("a_folder", ("c.txt",)), ("dump", ()), ("shards", ())):
        (tmp_path / folder).mkdir()
        for i, name in enumerate(names):
            (tmp_path / folder / name).write_text(play[20_000 * (i + 1) : 20_000 * (i + 2)])
    (tmp_path / "more" / "notes.md").write_text("not a .txt: more/*.txt leaves it out")
    for i in range(2):
        records = [json.dumps({"content": scene, "id": n}) for n, scene in enumerate(scenes[i * 40 : i * 40 + 40])]
        (tmp_path / "dump" / f"part{i}.jsonl").write_text("\n".join(records) + "\n")
        pq.write_table(pa.table({"text": scenes[i * 30 : i * 30 + 30]}), tmp_path / "shards" / f"part{i}.parquet")

    mycorpus = readme_command("python data/prepare.py --input corpus.txt more/")
    assert "https://example.com/book.txt" in mycorpus
    mycorpus = gpt2_offline(mycorpus.replace("https://example.com/book.txt", served_book))
    dump = gpt2_offline(readme_command("python data/prepare.py --input 'dump/*.jsonl'"))
    parquet = gpt2_offline(readme_command("python data/prepare.py --input 'shards/*.parquet'"))
    expected = {"data/mycorpus": 5, "data/dump": 80, "data/parquet": 60}  # text files, then records
    for command, out_dir in ((mycorpus, "data/mycorpus"), (dump, "data/dump"), (parquet, "data/parquet")):
        run_in(tmp_path, argv(command), env=no_proxy_env())
        manifest = json.loads((tmp_path / out_dir / "manifest.json").read_text())
        assert manifest["documents"] == expected[out_dir], (out_dir, manifest)
        assert sorted(p.name for p in (tmp_path / out_dir).glob("*.bin")) == ["train_000000.bin", "val_000000.bin"]

    verify = readme_command("python data/prepare.py --verify")
    assert "--out_dir data/mycorpus" in verify
    assert run_in(tmp_path, argv(verify)).strip()


@pytest.mark.slow  # starts processes
def test_the_readmes_train_lines_run_as_written_on_tiny_shakespeare(readme_run):
    """The README's Train lines that a CPU runs: the 90-second recipe and --budget=90s (each a few steps, as
    run_briefly runs them), then --resume on out/char, which readme_run trained to its end (20 steps): it takes the
    run's settings from the folder and has nothing left to do."""
    speedrun = readme_command("python train.py configs/shakespeare_char_cpu_90s.toml")
    assert speedrun.endswith("--out_dir=out/speedrun")
    run_briefly(speedrun, readme_run)
    assert (readme_run / "out/speedrun/ckpt_000020.pt").is_file()

    budget = readme_command("python train.py --data_dir=data/shakespeare_char --out_dir=out/b90 --budget=90s")
    run_briefly(budget, readme_run)
    assert json.loads((readme_run / "out/b90/run.json").read_text())["config"]["budget"] == "90s"

    resume = readme_command("python train.py --out_dir=out/char --resume")
    assert resume == "python train.py --out_dir=out/char --resume"
    done = subprocess.run(argv(resume), cwd=readme_run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert '"data_dir": "data/shakespeare_char"' in done.stdout  # the run's own settings, taken from out/char
    assert "done at step 20" in done.stdout  # readme_run's run had finished: nothing left to train


@pytest.mark.slow  # starts a process
def test_train_help_as_written_names_every_key_the_readmes_train_lines_use():
    """`python train.py --help` as written; each --key of the README's train.py and torchrun lines is one of its
    keys, those of the lines no test here runs (a GPU, torchrun, Hugging Face models) included."""
    help_line = readme_command("python train.py --help")
    assert help_line == "python train.py --help"
    done = subprocess.run(argv(help_line), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    keys = set(re.findall(r"^  --(\w+)=", done.stdout, re.M))
    used = {
        key
        for command in bash_lines(README)
        if command.startswith(("python train.py", "torchrun"))
        for key in re.findall(r"--(\w+)", command.split("train.py", 1)[1])  # train.py's, not torchrun's
    }
    assert {"budget", "resume", "core_every", "init_from", "lora_rank", "dpo_beta", "rl_prompts"} <= used
    assert used - {"help"} <= keys, used - keys


def script_words(command: str) -> tuple[str, ...]:
    """The words of a README command that name what it runs: `python X.py` or `python -m MODULE [SUBCOMMAND]`."""
    words = shlex.split(command)
    if words[1] != "-m":
        return tuple(words[:2])
    has_subcommand = len(words) > 3 and not words[3].startswith("-")
    return tuple(words[: 4 if has_subcommand else 3])


@pytest.mark.slow  # starts a process for each script
def test_every_readme_python_command_names_a_script_and_keys_its_help_lists():
    """Each `python ...` line of the README, those no test runs as written included (Hugging Face models, a GPU,
    HellaSwag, CORE, lm-eval, FineWeb's download, chat, DPO, RL, the benchmarks): its script exists, --help runs, and
    each --key the line passes is one that --help lists. scripts/layout_report.py takes no options (it would run its
    whole report, the suite's collection included): it is checked to exist."""
    commands = [c for c in bash_lines(README) if c.startswith("python ") and not c.startswith("python -c ")]
    scripts: dict[tuple[str, ...], list[str]] = {}
    for command in commands:
        scripts.setdefault(script_words(command), []).append(command)
    assert ("python", "data/fineweb/download.py") in scripts and ("python", "-m", "gptlite.hf", "export") in scripts
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for words, lines in scripts.items():
        assert words[1] == "-m" or (ROOT / words[1]).is_file(), words
        if words == ("python", "scripts/layout_report.py"):
            assert lines == ["python scripts/layout_report.py"]
            continue
        done = subprocess.run([*argv(" ".join(words)), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, f"{words}\n{done.stderr[-2000:]}"
        listed = set(re.findall(r"^\s+--(\w+)", done.stdout, re.M))
        for line in lines:
            passed = set(re.findall(r"(?:^|\s|\[)--(\w+)", line)) - {"help"}
            assert passed <= listed, (line, passed - listed)


def test_each_extra_the_readme_installs_is_one_pyproject_defines():
    """`pip install -e ".[NAME]"` is not run here (no index offline): each extra it names exists in pyproject.toml."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.findall(r'pip install -e "\.\[(\w+)\]"', README)
    assert {"data", "eval", "serve", "gguf", "test"} <= set(named)
    assert set(named) <= set(extras), set(named) - set(extras)


def stand_in_for_smollm2(folder: Path, corpus: Path) -> None:
    """A tiny LlamaForCausalLM at the README's models/SmolLM2-135M, with a byte-level BPE of GPT-4's split (as
    SmolLM2's own, one GGUF knows) trained on `corpus`: the real model is a download; its stand-in has its files."""
    import transformers

    from gptlite.tokenizer import load_tokenizer

    train_bpe = [sys.executable, "-m", "gptlite.tokenizer", "train", f"--input={corpus}", "--vocab_size=300"]
    run_in(ROOT, [*train_bpe, f"--out_dir={folder}"], env={**os.environ, "PYTHONPATH": str(ROOT)})
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=load_tokenizer(folder).vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def readme_block(section: str, index: int) -> list[str]:
    """The commands of the index-th bash block of the README's section that starts with `section`."""
    text = README.split(f"\n## {section}")[1].split("\n## ")[0]
    return bash_lines(re.findall(r"```bash\n.*?```", text, re.S)[index])


@pytest.mark.slow  # starts a dozen processes
def test_the_readmes_open_model_chat_dpo_and_rl_lines_run_as_written_on_a_stand_in_model(tmp_path):
    """The README's fine-tune of SmolLM2, then its chat, DPO and RL lines, in order, as written, on a tiny stand-in
    at models/SmolLM2-135M, with the files they name (corpus.txt, chats.jsonl, pairs.jsonl, train.jsonl, test.jsonl)
    made here. The optional parts are taken (LoRA, a PEFT adapter), `--dpo_loss=sigmoid|ipo` its first choice;
    each training run takes a few steps (--max_iters appended); sample.py --chat gets one user turn on stdin."""
    play = shared_file("data/tinyshakespeare.txt").read_text()
    (tmp_path / "corpus.txt").write_text(play[:30_000])
    stand_in_for_smollm2(tmp_path / "models" / "SmolLM2-135M", tmp_path / "corpus.txt")
    sums = [(i, i + 3) for i in range(40)]
    chats = [{"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
             for a, b in sums]  # fmt: skip
    pairs = [{"prompt": f"{a}+{b}?", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"} for a, b in sums]
    prompts = [{"prompt": f"{a}+{b}?", "answer": f"#### {a + b}"} for a, b in sums]
    for name, records in (("chats", chats), ("pairs", pairs), ("train", prompts[:20]), ("test", prompts[20:21])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    commands = readme_block("Pretrained weights", 1) + readme_block("Chat", 0) + readme_block("Chat", 1)
    assert [c.split()[1] for c in commands].count("train.py") == 4 and len(commands) == 12, commands
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in commands:
        words = argv(re.sub(r"=(\w+)(?:\|\w+)+", r"=\1", command))  # sigmoid|ipo: the first
        if command.startswith("python train.py"):
            steps = 1 if "--rl " in command else 4  # each RL step samples --rl_samples answers of 256 tokens
            words += [f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=2"]
        done = subprocess.run(words, cwd=tmp_path, env=env, input="What is 2+5?\n", capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "out/smol_hf/config.json").is_file() and (tmp_path / "out/smol_gguf/smol.gguf").is_file()
    assert (tmp_path / "out/sft_hf/adapter_config.json").is_file()
    assert "pass@1" in done.stdout and "| 1 prompts |" in done.stdout  # the last: evaluate on test.jsonl's one


@pytest.mark.slow  # starts processes
def test_the_readmes_hellaswag_line_on_a_run_folder_runs_as_written(tmp_path):
    """`--model=out/gpt2 --task=val,hellaswag --json=out/gpt2/scores.json` on a tiny GPT-2-tokenizer run at out/gpt2,
    with HellaSwag's download already kept where the command keeps it (data/hellaswag/hellaswag_val.jsonl: a few
    rows of its format made here)."""
    ranks = shared_file("tokenizers/gpt2.tiktoken")
    (tmp_path / "play.txt").write_text(shared_file("data/tinyshakespeare.txt").read_text()[:50_000])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prepare = [sys.executable, str(ROOT / "data/prepare.py"), "--input=play.txt", f"--tokenizer={ranks}"]
    run_in(tmp_path, [*prepare, "--out_dir=data/play"], env=env)
    shape = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--device=cpu"]
    train = [sys.executable, str(ROOT / "train.py"), "--data_dir=data/play", "--out_dir=out/gpt2", *shape]
    run_in(tmp_path, [*train, "--max_iters=2", "--eval_interval=2", "--eval_iters=2"], env=env)
    rows = [
        {"ctx": f"{who} went to the market and", "endings": [" bought bread.", " sang.", " slept.", " ran home."],
         "label": i % 4}
        for i, who in enumerate(("Romeo", "Juliet", "The nurse", "A friar"))
    ]  # fmt: skip
    kept = tmp_path / "data/hellaswag/hellaswag_val.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("".join(json.dumps(row) + "\n" for row in rows))

    command = readme_command("python -m gptlite.evaluate --model=out/gpt2 --task=val,hellaswag")
    assert command == "python -m gptlite.evaluate --model=out/gpt2 --task=val,hellaswag --json=out/gpt2/scores.json"
    run_in(tmp_path, argv(command), env=env)
    scores = json.loads((tmp_path / "out/gpt2/scores.json").read_text())
    assert scores["hellaswag"]["n"] == len(rows) and 0 <= scores["hellaswag"]["acc"] <= 1
    assert scores["val"]["on"] == "data/play val split"  # the run's own data, found from out/gpt2


def test_each_config_the_readmes_train_lines_name_builds_with_the_lines_keys():
    """The recipes no test here trains from (the GPU's, torchrun's GPT-2 124M, the GPT-2 fine-tune) and the others:
    each configs/*.toml a README train.py line names reads and validates with the line's --key=value settings."""
    from gptlite.config import build_config, read_toml

    lines = [c for c in bash_lines(README) if re.search(r"train\.py configs/\S+\.toml", c)]
    named = {re.search(r"configs/\S+\.toml", c)[0] for c in lines}
    assert {"configs/shakespeare_char_gpu.toml", "configs/gpt2_124m.toml", "configs/finetune_shakespeare.toml"} <= named
    for line in lines:
        path = re.search(r"configs/\S+\.toml", line)[0]
        settings = dict(re.findall(r"--(\w+)=(\S+)", line.split("train.py", 1)[1]))  # not torchrun's
        cfg = build_config({**read_toml(ROOT / path), **settings})
        assert cfg.data_dir == settings["data_dir"], (line, cfg.data_dir)


@pytest.mark.slow  # starts processes
def test_the_readmes_export_and_transformers_lines_run_as_written_on_a_gpt2_shaped_run(tmp_path):
    """`python -m gptlite.hf export --model=out/finetune --out=out/finetune_hf`, then the python -c line that loads it
    in transformers, as written, on a tiny run of GPT-2's shape (--ffn=gelu --bias=true) at out/finetune: the
    README's fine-tune itself starts from GPT-2's weights, a download."""
    (tmp_path / "play.txt").write_text(shared_file("data/tinyshakespeare.txt").read_text()[:50_000])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prepare = [sys.executable, str(ROOT / "data/prepare.py"), "--input=play.txt", "--tokenizer=char"]
    run_in(tmp_path, [*prepare, "--out_dir=data/play"], env=env)
    shape = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--ffn=gelu", "--bias=true"]
    train = [sys.executable, str(ROOT / "train.py"), "--data_dir=data/play", "--out_dir=out/finetune", *shape]
    run_in(tmp_path, [*train, "--batch_size=2", "--max_iters=2", "--eval_interval=2", "--eval_iters=2"], env=env)

    export = readme_command("python -m gptlite.hf export --model=out/finetune ")
    assert export == "python -m gptlite.hf export --model=out/finetune --out=out/finetune_hf"
    load = readme_command('python -c "from transformers import AutoModelForCausalLM;')
    assert "from_pretrained('out/finetune_hf')" in load
    run_in(tmp_path, argv(export), env=env)
    run_in(tmp_path, argv(load), env=env)
    assert json.loads((tmp_path / "out/finetune_hf/config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
