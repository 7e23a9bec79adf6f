"""CORE and lm-eval throughput at GPT-2 124M's shape (random weights, float32 on the CPU, bfloat16 weights on CUDA).

1. CORE items/s: gptlite.evaluate.core (many items' sequences per forward, the output head only at scored
   positions) against nanochat's loop (one item per forward, every position's logits, the losses of every
   position), written here on the same model and the same sequences, in turns, `rounds` times; the best time of
   each, and how many items the two score alike (all, but for ties closer than rounding). The bundle is made from
   the last tenth of tiny Shakespeare (the val split of data/shakespeare/prepare.py), modelled on CORE's 22 tasks:
   each one's kind, few-shot count and number of options, `items` items each, as nanochat's --max-per-task runs.
2. lm-eval wall time: the same local tasks (multiple choice and greedy generation with a stop sequence) through
   gptlite's model class, through lm-eval's own hf backend on the same weights (exported with gptlite.hf), and
   (--serve) through gptlite.serve in this process with lm-eval's local-completions client (token-id prompts,
   echo and logprobs, `batch_size` prompts a request), each after a warm-up run of two documents, in turns; the
   best time of each.

    python benchmarks/bench_core.py [--items=11] [--docs=32] [--rounds=2] [--core=true] [--lm_eval=true]
    python benchmarks/bench_core.py --n_layer=2 --n_embd=64 --n_head=2 --block_size=128 --items=11 --docs=4  # a check
    python benchmarks/bench_core.py --write_bundle=DIR [--items=100]   # only write the bundle, e.g. to score a model

Needs transformers and lm-eval[hf] (pip install -e ".[test]") for part 2.
"""

from __future__ import annotations

import csv
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gptlite.cli import parse, run_command  # noqa: E402
from gptlite.config import option  # noqa: E402
from gptlite.device import machine_line  # noqa: E402


@dataclass
class Options:
    n_layer: int = option(12, "the model's shape (default GPT-2 124M's)")
    n_head: int = option(12, "attention heads")
    n_embd: int = option(768, "width")
    block_size: int = option(1024, "context")
    items: int = option(11, "CORE: items per task (22 tasks; a 10-shot task needs 11)")
    batch_tokens: int = option(8192, "CORE and gptlite's lm-eval class: padded tokens per forward")
    rounds: int = option(2, "timed runs of each kind, in turn (the best counts: the first pays for first calls)")
    core: bool = option(True, "time CORE, batched against one item at a time")
    lm_eval: bool = option(True, "time lm-eval through gptlite against its hf backend")
    serve: bool = option(True, "lm-eval: also through gptlite.serve and lm-eval's local-completions client")
    docs: int = option(32, "lm-eval: documents per task")
    batch_size: int = option(8, "lm-eval: generations per batch (both), and the hf backend's batch size")
    corpus: str = option(
        str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "the text the tasks come from (its last tenth)"
    )
    tokenizer: str = option(str(ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"), "GPT-2's BPE ranks")
    write_bundle: str = option("", "only write the CORE bundle to this new folder, and time nothing")


def lines_of(path: str) -> list[str]:
    """The lines of more than 20 characters of the text's last tenth (held out from a model trained on the rest)."""
    text = Path(path).read_text(encoding="utf-8")
    return [line.strip() for line in text[int(0.9 * len(text)) :].splitlines() if len(line.strip()) > 20]


# CORE's 22 tasks as nanochat's core.yaml lists them: (label, icl_task_type, num_fewshot, options)
CORE_TASKS = (
    ("hellaswag_zeroshot", "multiple_choice", 0, 4),
    ("jeopardy", "language_modeling", 10, 1),
    ("bigbench_qa_wikidata", "language_modeling", 10, 1),
    ("arc_easy", "multiple_choice", 10, 4),
    ("arc_challenge", "multiple_choice", 10, 4),
    ("copa", "multiple_choice", 0, 2),
    ("commonsense_qa", "multiple_choice", 10, 5),
    ("piqa", "multiple_choice", 10, 2),
    ("openbook_qa", "multiple_choice", 0, 4),
    ("lambada_openai", "language_modeling", 0, 1),
    ("hellaswag", "multiple_choice", 10, 4),
    ("winograd", "schema", 0, 2),
    ("winogrande", "schema", 0, 2),
    ("bigbench_dyck_languages", "language_modeling", 10, 1),
    ("agi_eval_lsat_ar", "multiple_choice", 3, 5),
    ("bigbench_cs_algorithms", "language_modeling", 10, 1),
    ("bigbench_operators", "language_modeling", 10, 1),
    ("bigbench_repeat_copy_logic", "language_modeling", 10, 1),
    ("squad", "language_modeling", 10, 1),
    ("coqa", "language_modeling", 0, 1),
    ("boolq", "multiple_choice", 10, 2),
    ("bigbench_language_identification", "multiple_choice", 10, 4),
)


def write_bundle(folder: Path, lines: list[str], items: int) -> None:
    """A bundle in the published layout with CORE's tasks (kinds, few-shot counts, options), `items` items each, as
    nanochat's --max-per-task runs score them: contexts of two lines, options and continuations of one."""
    rng = random.Random(0)

    def item(kind: str, options: int) -> dict:
        i = rng.randrange(len(lines) - 12)
        if kind == "multiple_choice":
            return {"query": " ".join(lines[i : i + 2]), "choices": lines[i + 2 : i + 2 + options], "gold": 0}
        if kind == "schema":
            return {"context_options": lines[i : i + options], "continuation": lines[i + options], "gold": 0}
        return {"context": " ".join(lines[i : i + 2]), "continuation": lines[i + 2].split(" ")[0]}

    (folder / "eval_data").mkdir(parents=True)
    for label, kind, _, options in CORE_TASKS:
        rows = [item(kind, options) for _ in range(items)]
        for row in rows:  # the right option anywhere
            row["gold"] = rng.randrange(options)
        if kind == "language_modeling":
            rows = [{k: v for k, v in row.items() if k != "gold"} for row in rows]
        (folder / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = [
        {"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [shots], "icl_task_type": kind}
        for label, kind, shots, _ in CORE_TASKS
    ]
    import yaml

    (folder / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": spec}))
    with open(folder / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows([label, 0 if options == 1 else 100 / options] for label, _, _, options in CORE_TASKS)


def one_item_at_a_time(model, tokenizer, task) -> list[bool]:
    """nanochat's loop on gptlite's model: each item's sequences in one forward, padded, every position's logits and
    losses, the span's mean loss (or greedy check) read from them."""
    import torch
    import torch.nn.functional as F

    from gptlite.evaluate.core import begin_ids, item_rows, prompts

    begin = begin_ids(tokenizer)
    vocab = tokenizer.vocab_size
    device = model.tok_emb.weight.device
    correct = []
    for i in range(len(task.items)):
        rows = item_rows(task, i, [begin + tokenizer.encode(p) for p in prompts(task, i)], model.config.block_size)
        width = max(len(r.tokens) for r in rows)
        idx = torch.tensor([r.tokens + [begin[0]] * (width - len(r.tokens)) for r in rows], device=device)  # (B, T)
        with torch.no_grad():
            logits = model(idx)[0][..., :vocab]  # (B, T, V)
            losses = F.cross_entropy(logits.flatten(0, 1).float(), idx.roll(-1, 1).flatten(), reduction="none")
            losses = losses.view(len(rows), width)  # (B, T)
            predictions = logits.argmax(-1)  # (B, T)
        if task.kind == "language_modeling":
            r = rows[0]
            correct.append(bool((predictions[0, r.start - 1 : r.end - 1] == idx[0, r.start : r.end]).all()))
        else:
            means = [losses[j, r.start - 1 : r.end - 1].mean().item() for j, r in enumerate(rows)]
            correct.append(means.index(min(means)) == task.items[i]["gold"])
    return correct


def best_of(rounds: int, runs: dict) -> dict:
    """The lowest wall time of each named callable over `rounds` turns, and each one's last result."""
    times = {name: math.inf for name in runs}
    results = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name] = min(times[name], time.perf_counter() - start)
    return {name: (times[name], results[name]) for name in runs}


def bench_core(args: Options, model, tokenizer, tmp: Path) -> None:
    from gptlite.evaluate.core import read_bundle, task_correct

    write_bundle(tmp / "bundle", lines_of(args.corpus), args.items)
    tasks = read_bundle(tmp / "bundle")
    n = sum(len(t.items) for t in tasks)
    measured = best_of(
        args.rounds,
        {
            "batched": lambda: [task_correct(model, tokenizer, t, args.batch_tokens) for t in tasks],
            "one item at a time": lambda: [one_item_at_a_time(model, tokenizer, t) for t in tasks],
        },
    )
    (t_batched, batched), (t_single, single) = measured["batched"], measured["one item at a time"]
    alike = sum(a == b for x, y in zip(batched, single, strict=True) for a, b in zip(x, y, strict=True))
    print(f"CORE: {len(tasks)} tasks, {n} items, best of {args.rounds}; both loops score {alike} of {n} items alike")
    print(f"  batched ({args.batch_tokens} tokens per forward): {t_batched:8.2f} s  {n / t_batched:8.2f} items/s")
    print(f"  one item at a time (nanochat's loop):   {t_single:8.2f} s  {n / t_single:8.2f} items/s")
    print(f"  ratio: {t_single / t_batched:.2f}x the items/s")


def write_lm_eval_tasks(folder: Path, lines: list[str], docs: int) -> None:
    data = folder / "docs.jsonl"
    rows = [
        {
            "question": " ".join(lines[i : i + 2]),
            "choices": lines[i + 2 : i + 6],
            "label": i % 4,
            "answer": lines[i + 2],
        }
        for i in range(0, 40 * docs, 40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {folder / 'cache'}\n"
        "test_split: test\n"
    )
    (folder / "bench_mc.yaml").write_text(
        "task: bench_mc\noutput_type: multiple_choice\n" + source + "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "bench_gen.yaml").write_text(
        "task: bench_gen\noutput_type: generate_until\n" + source + "doc_to_text: '{{question}}\\nAnswer:'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  do_sample: false\n"
        "  max_gen_toks: 32\nmetric_list:\n  - metric: exact_match\n"
    )


def bench_lm_eval(args: Options, model, tokenizer, tmp: Path, dtype: str) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gptlite.evaluate.lm_harness import GPTLiteLM
    from gptlite.hf import export_hf

    (tmp / "tasks").mkdir()
    write_lm_eval_tasks(tmp / "tasks", lines_of(args.corpus), args.docs)
    export_hf(model, tmp / "hf", tokenizer)
    manager = TaskManager(include_path=str(tmp / "tasks"), include_defaults=False)
    ours = GPTLiteLM(model, tokenizer, batch_size=args.batch_size, batch_tokens=args.batch_tokens)
    device = str(model.tok_emb.weight.device)
    theirs = HFLM(pretrained=str(tmp / "hf"), device=device, batch_size=args.batch_size, dtype=dtype)
    names = ["bench_mc", "bench_gen"]

    def evaluate(lm, limit=None):
        out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True)
        return {n: [s["resps"] for s in out["samples"][n]] for n in names}

    contenders = {"gptlite": ours, "hf": theirs}
    server = None
    if args.serve:
        server, contenders["serve"] = served_client(model, tokenizer, tmp / "hf", args)
    try:
        for lm in contenders.values():  # warm-up: the datasets built and cached, the first calls made
            evaluate(lm, 2)
        measured = best_of(args.rounds, {name: (lambda lm=lm: evaluate(lm)) for name, lm in contenders.items()})
    finally:
        if server is not None:
            server.close()
    (t_ours, ours_out), (t_hf, hf_out) = measured["gptlite"], measured["hf"]
    same = ours_out["bench_gen"] == hf_out["bench_gen"]
    print(
        f"lm-eval: {args.docs} documents of a 4-way multiple-choice task and of greedy generation (32 tokens), "
        f"best of {args.rounds}"
    )
    print(f"  gptlite's model class:                 {t_ours:8.2f} s")
    print(f"  lm-eval's hf backend (batch size {args.batch_size}):   {t_hf:8.2f} s")
    print(f"  ratio: hf / gptlite = {t_hf / t_ours:.2f}; generated texts {'the same' if same else 'DIFFER'}")
    if args.serve:
        t_serve, serve_out = measured["serve"]
        same = serve_out["bench_gen"] == hf_out["bench_gen"]
        print(f"  gptlite.serve + local-completions (batch size {args.batch_size}): {t_serve:8.2f} s")
        print(f"  ratio: hf / served = {t_hf / t_serve:.2f}; generated texts {'the same' if same else 'DIFFER'}")


class InProcessServer:
    """gptlite.serve on a free local port, on a thread of this process."""

    def __init__(self, model, tokenizer, max_batch: int):
        import socket
        import threading

        import uvicorn

        from gptlite.serve.app import create_app
        from gptlite.serve.connection import uvicorn_config
        from gptlite.serve.engine import Engine

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.engine = Engine(model, tokenizer, max_batch=max_batch).start()
        app = create_app(self.engine, tokenizer, "bench")
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, 30.0, 5.0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.close()


def served_client(model, tokenizer, hf_dir: Path, args: Options):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    server = InProcessServer(model, tokenizer, max(args.batch_size, 4))
    client = LocalCompletionsAPI(
        base_url=server.url + "/v1/completions",
        model="bench",
        tokenizer_backend="huggingface",
        tokenizer=str(hf_dir),
        tokenized_requests=True,
        max_length=args.block_size,
        batch_size=args.batch_size,
        max_retries=1,
    )
    return server, client


def run(args: Options) -> int:
    print(machine_line(), flush=True)
    import torch

    if args.write_bundle:
        write_bundle(Path(args.write_bundle), lines_of(args.corpus), args.items)
        print(f"wrote a CORE bundle of {len(CORE_TASKS)} tasks x {args.items} items to {args.write_bundle}")
        return 0

    from gptlite import GPT, GPTConfig
    from gptlite.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        ffn="gelu",
        bias=True,
    )
    model = GPT(config).to(device, getattr(torch, dtype)).eval()
    threads = torch.get_num_threads()
    print(f"model: {model.num_params() / 1e6:.0f}M parameters, {device}, {dtype}, {threads} CPU threads")
    with tempfile.TemporaryDirectory(prefix="gptlite_bench_core_") as tmp:
        if args.core:
            bench_core(args, model, tokenizer, Path(tmp))
        if args.lm_eval:
            bench_lm_eval(args, model, tokenizer, Path(tmp), dtype)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("bench_core.py", lambda: run(parse(Options, argv, "bench_core.py", __doc__)))


if __name__ == "__main__":
    sys.exit(main())
