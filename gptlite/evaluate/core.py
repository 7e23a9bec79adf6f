"""The CORE metric of DCLM (Li et al., 2024, "DataComp-LM", section 3.5 and appendix G), scored exactly as nanochat's
core_eval.py scores it, so that a figure here compares with nanochat's: in-context-learning tasks of the DCLM eval
bundle, each task's accuracy centered on its random baseline, and CORE their mean.

The bundle is the folder nanochat downloads (EVAL_BUNDLE_URL, eval_bundle.zip unpacked):
    core.yaml               icl_tasks: label, dataset_uri, num_fewshot ([K]), icl_task_type, continuation_delimiter
    eval_meta_data.csv      a row per task: "Eval Task" (its label) and "Random baseline" (in percent)
    eval_data/<dataset_uri> the task's items, a JSON object per line

How an item is scored:
1. The task's items are shuffled with random.Random(1337) and cut to the first max_per_task; the item at place i
   then takes K few-shot examples from the others, drawn with random.Random(1234 + i).
2. Its prompts, one per option, the examples first, each followed by a blank line (d is the task's delimiter):
       multiple_choice    "{query}{d}{choice}" for each choice; an example is "{query}{d}{choices[gold]}"
       schema             "{option}{d}{continuation}" for each context option; "{context_options[gold]}{d}..."
       language_modeling  "{context.strip()}{d}{continuation}", and the same without the continuation, stripped
3. Each prompt's tokens follow the tokenizer's beginning-of-sequence token (GPT-2's <|endoftext|>). The scored span:
   the tokens after the options' common prefix (multiple choice), the options' common suffix (schema), or the
   continuation's tokens (language modeling). A sequence longer than block_size keeps its last block_size tokens.
4. Multiple choice and schema: right when the option whose span has the lowest mean cross-entropy is the gold
   one. Language modeling: right when every token of the span is the model's greedy prediction.
Per task, centered = (accuracy - baseline / 100) / (1 - baseline / 100).

Where nanochat would stop with an assertion, this scores on: a span that cropping cut into starts at the second
token, and a language-modeling prompt whose tokens without the continuation are no prefix of those with it (BPE
merged across the boundary) scores from where the two differ.

Efficiency: the sequences of many items (ITEMS_PER_PASS) are scored together, never one item at a time, through
gptlite.evaluate.spans: an item's options share one pass over their common prefix (the few-shot examples and the
question), batches fill a token budget, and the output head sees only the positions that predict a span's token.
Under torchrun every rank scores every world_size-th item and the results are all-reduced.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import random
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlite.evaluate.spans import BATCH_TOKENS, Row, score_spans
from gptlite.files import read_jsonl
from gptlite.model.network import Transformer
from gptlite.tokenizer import Tokenizer

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
EVAL_BUNDLE_DIR = Path("data/eval_bundle")  # where the command and train.py keep the download, unpacked
SHUFFLE_SEED = 1337  # the order of a task's items, of which max_per_task keeps the first
FEWSHOT_SEED = 1234  # plus an item's place: the draw of its few-shot examples
FIELDS = {  # icl_task_type -> the fields each of its items holds
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}
ITEMS_PER_PASS = 512  # items tokenized and batched together (a long task's tokens are never all in memory)


@dataclass
class CoreTask:
    """One task of the bundle, its items shuffled and cut as scoring takes them."""

    label: str
    kind: str  # icl_task_type, a key of FIELDS
    num_fewshot: int
    delimiter: str
    baseline: float  # a random guess's accuracy, in percent
    items: list[dict]
    path: Path  # its data file


# ---------------------------------------------------------------------------------------------
# The bundle


def core_bundle(given: str, option: str = "--bundle") -> Path:
    """The bundle folder: the one given, or EVAL_BUNDLE_DIR, downloaded from EVAL_BUNDLE_URL and unpacked once.
    Offline, the error says where to put the unpacked folder, or which `option` passes it."""
    if given:
        return Path(given)
    if EVAL_BUNDLE_DIR.is_dir():
        return EVAL_BUNDLE_DIR
    from gptlite.data.download import download

    # names of this process's own: ranks under torchrun may download at once, and the first to finish wins
    tag = f"{os.getpid()}.tmp"
    archive = EVAL_BUNDLE_DIR.with_name(f"{EVAL_BUNDLE_DIR.name}.{tag}.zip")
    unpacked = EVAL_BUNDLE_DIR.with_name(f"{EVAL_BUNDLE_DIR.name}.{tag}")
    try:
        download(EVAL_BUNDLE_URL, archive)
    except ConnectionError as e:
        raise ConnectionError(
            f"{e}: unzip it and put its eval_bundle folder at {EVAL_BUNDLE_DIR}, or pass the folder with {option}=DIR"
        ) from None
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(unpacked)  # zipfile keeps every member inside `unpacked`
        found = next(unpacked.rglob("core.yaml"), None)
        if found is None:
            raise ValueError(
                f"{EVAL_BUNDLE_URL} holds no core.yaml; unpack a CORE bundle by hand and pass it with {option}=DIR"
            )
        try:
            found.parent.rename(EVAL_BUNDLE_DIR)
        except OSError:  # another process put it there first
            if not EVAL_BUNDLE_DIR.is_dir():
                raise
    finally:
        archive.unlink(missing_ok=True)
        shutil.rmtree(unpacked, ignore_errors=True)
    return EVAL_BUNDLE_DIR


def read_bundle(folder: str | Path, max_per_task: int | None = None) -> list[CoreTask]:
    """The tasks of a bundle folder (see the module docstring), each one's items shuffled and cut to the first
    max_per_task, every file checked: a problem is one error naming the file, and the fix."""
    folder = Path(folder)
    layout = "a CORE bundle holds core.yaml, eval_meta_data.csv and eval_data/ (nanochat's eval_bundle folder)"
    if not folder.is_dir():
        raise FileNotFoundError(f"CORE bundle {folder} is not a folder; {layout}")
    entries = read_core_yaml(folder / "core.yaml", layout)
    baselines = read_baselines(folder / "eval_meta_data.csv", layout)
    tasks = []
    for n, entry in enumerate(entries, 1):
        task = core_task(entry, n, folder, baselines)
        random.Random(SHUFFLE_SEED).shuffle(task.items)
        task.items = task.items[:max_per_task] if max_per_task else task.items
        if task.num_fewshot >= len(task.items):
            raise ValueError(
                f"CORE task {task.label!r} keeps {len(task.items)} item(s) but draws {task.num_fewshot} few-shot "
                f"examples from an item's others; keep at least {task.num_fewshot + 1} items per task "
                "(max_per_task)"
            )
        tasks.append(task)
    return tasks


def read_core_yaml(path: Path, layout: str) -> list[dict]:
    """core.yaml's icl_tasks."""
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; {layout}")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not YAML ({str(e).splitlines()[0]}); {layout}") from None
    entries = spec.get("icl_tasks") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path} has no list of icl_tasks; it lists each task's label, dataset_uri, ... under it")
    return entries


def read_baselines(path: Path, layout: str) -> dict[str, float]:
    """eval_meta_data.csv's random baselines in percent, by task label."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; {layout}")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in ("Eval Task", "Random baseline") if not rows or c not in rows[0]]
    if missing:
        raise ValueError(
            f"{path} has no '{missing[0]}' column; it needs a row per task with its label ('Eval Task') and a "
            "random guess's accuracy in percent ('Random baseline')"
        )
    baselines = {}
    for n, row in enumerate(rows, 2):
        try:
            baselines[row["Eval Task"]] = float(row["Random baseline"])
        except (TypeError, ValueError):
            raise ValueError(
                f"{path} line {n}: Random baseline {row['Random baseline']!r} of {row['Eval Task']!r} is not a "
                "number; give it in percent (e.g. 25 for one of four)"
            ) from None
    return baselines


def core_task(entry: dict, n: int, folder: Path, baselines: dict[str, float]) -> CoreTask:
    """The n-th entry of core.yaml's icl_tasks, with its baseline and its items, checked."""
    where = f"{folder / 'core.yaml'}: task {n}"
    needed = ("label", "dataset_uri", "num_fewshot", "icl_task_type")
    missing = [k for k in needed if not isinstance(entry, dict) or k not in entry]
    if missing:
        raise ValueError(f"{where} has no '{missing[0]}'; each of icl_tasks gives {', '.join(needed)}")
    label = str(entry["label"])
    kind = entry["icl_task_type"]
    if kind not in FIELDS:
        raise ValueError(f"{where} ({label}) has icl_task_type {kind!r}; use one of {', '.join(FIELDS)}")
    shots = entry["num_fewshot"]
    shots = shots[0] if isinstance(shots, list) and len(shots) == 1 else shots
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
        raise ValueError(f"{where} ({label}): num_fewshot {entry['num_fewshot']!r} must be one count, e.g. [0] or [10]")
    if label not in baselines:
        raise ValueError(
            f"{folder / 'eval_meta_data.csv'} has no row for task {label!r} ('Eval Task'); add its random baseline "
            "in percent"
        )
    path = folder / "eval_data" / str(entry["dataset_uri"])
    items = read_items(path, kind, label)
    return CoreTask(label, kind, shots, str(entry.get("continuation_delimiter", " ")), baselines[label], items, path)


def read_items(path: Path, kind: str, label: str) -> list[dict]:
    """A task's data file: a JSON object per line with the fields of its kind (FIELDS); errors name the line."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} (the data of CORE task {label!r}) does not exist; check its dataset_uri")
    items = []
    for where, item in read_jsonl(path, "a task's data holds one JSON object per line"):
        missing = [k for k in FIELDS[kind] if not isinstance(item, dict) or k not in item]
        if missing:
            raise ValueError(f"{where} has no field '{missing[0]}'; a {kind} item holds {', '.join(FIELDS[kind])}")
        options = item.get("choices", item.get("context_options"))
        if kind != "language_modeling":
            if not isinstance(options, list) or not options:
                raise ValueError(f"{where}: {FIELDS[kind][0]} must be a non-empty list of the options")
            gold = item["gold"]
            if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
                raise ValueError(f"{where}: gold {gold!r} must be the index of the right option, 0..{len(options) - 1}")
        items.append(item)
    if not items:
        raise ValueError(f"{path} holds no items of CORE task {label!r}")
    return items


# ---------------------------------------------------------------------------------------------
# Prompts and the sequences to score


def fewshot(task: CoreTask, i: int) -> list[dict]:
    """The few-shot examples of the item at place i: num_fewshot of the others, drawn with Random(1234 + i)."""
    if not task.num_fewshot:
        return []
    others = [*range(i), *range(i + 1, len(task.items))]
    return [task.items[j] for j in random.Random(FEWSHOT_SEED + i).sample(others, task.num_fewshot)]


def prompts(task: CoreTask, i: int) -> list[str]:
    """The item's prompts (see the module docstring): one per option, or for language modeling the prompt without
    the continuation, stripped, and the prompt with it."""
    item = task.items[i]
    d = task.delimiter
    shots = fewshot(task, i)
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{option}{d}{item['continuation']}" for option in item["context_options"]]
    head = "".join(f"{str(s['context']).strip()}{d}{s['continuation']}\n\n" for s in shots)
    without = f"{head}{str(item['context']).strip()}{d}"
    return [without.strip(), f"{without}{item['continuation']}"]


def common_length(sequences: list[list[int]]) -> int:
    """The length of the prefix every sequence shares."""
    n = min(len(s) for s in sequences)
    return next((k for k in range(n) if any(s[k] != sequences[0][k] for s in sequences)), n)


def begin_ids(tokenizer: Tokenizer) -> list[int]:
    """What every sequence starts with: the tokenizer's beginning-of-sequence token, else its end-of-text token
    (GPT-2's <|endoftext|>, which nanochat prepends to GPT-2), else nothing (a char or byte tokenizer)."""
    bos = getattr(tokenizer, "bos_id", None)
    bos = tokenizer.eot_id if bos is None else bos
    return [] if bos is None else [bos]


def item_rows(task: CoreTask, i: int, ids: list[list[int]], block_size: int) -> list[Row]:
    """The rows of the item at place i from its prompts' tokens `ids` (each beginning with begin_ids): their
    spans, then each row cropped to its last block_size tokens."""
    ends = [len(t) for t in ids]
    if task.kind == "multiple_choice":  # the options differ after the shared query
        starts = [common_length(ids)] * len(ids)
    elif task.kind == "schema":  # the options differ before the shared continuation
        shared = common_length([t[::-1] for t in ids])
        starts = [end - shared for end in ends]
    else:  # the continuation: what the prompt with it adds to the prompt without it
        starts = [common_length(ids)]
        ids = ids[1:]
        ends = ends[1:]
    rows = []
    for tokens, start, end in zip(ids, starts, ends, strict=True):
        cut = max(0, len(tokens) - block_size)
        rows.append(Row(tokens[cut:], max(start - cut, 1), end - cut))
    return rows


# ---------------------------------------------------------------------------------------------
# Scoring


def task_correct(
    model: Transformer,
    tokenizer: Tokenizer,
    task: CoreTask,
    batch_tokens: int = BATCH_TOKENS,
    rank: int = 0,
    world: int = 1,
) -> list[bool]:
    """Whether each item of the task is scored right (see the module docstring). This rank scores the items
    rank, rank + world, ...; the others are False here, and the caller adds up the ranks' results. ITEMS_PER_PASS
    items are tokenized and scored together, so that a long task's tokens are never all in memory."""
    begin = begin_ids(tokenizer)
    vocab = min(tokenizer.vocab_size, model.config.vocab_size)
    mine = list(range(rank, len(task.items), world))
    correct = [False] * len(task.items)
    for first in range(0, len(mine), ITEMS_PER_PASS):
        items = mine[first : first + ITEMS_PER_PASS]
        texts = [prompts(task, i) for i in items]
        encoded = iter(tokenizer.encode_batch([text for item in texts for text in item]))
        rows = [
            item_rows(task, i, [begin + next(encoded) for _ in item], model.config.block_size)
            for i, item in zip(items, texts, strict=True)
        ]
        flat = [row for item in rows for row in item]
        ends = list(itertools.accumulate(len(item) for item in rows))
        groups = [list(range(end - len(item), end)) for item, end in zip(rows, ends, strict=True)]  # each item's rows
        loss, count, greedy = score_spans(model, flat, vocab, batch_tokens, groups)
        at = 0  # the first row of the next item
        for i, item in zip(items, rows, strict=True):
            if task.kind == "language_modeling":  # right when the model predicts the whole continuation
                correct[i] = greedy[at] and count[at] > 0
            else:
                # the option of the lowest mean loss; the first of them, as min() then index() pick it, so that a
                # NaN (an option without tokens of its own) wins only from the first place, as in nanochat
                means = [s / n if n else math.nan for s, n in zip(loss[at : at + len(item)], count[at:], strict=False)]
                correct[i] = means.index(min(means)) == task.items[i]["gold"]
            at += len(item)
    return correct


def centered(accuracy: float, baseline: float) -> float:
    """Accuracy rescaled so that a random guess (baseline, in percent) scores 0 and a perfect score 1."""
    return (accuracy - 0.01 * baseline) / (1.0 - 0.01 * baseline)


@torch.no_grad()
def core_score(
    model: Transformer,
    tokenizer: Tokenizer,
    tasks: list[CoreTask],
    batch_tokens: int = BATCH_TOKENS,
    log: Callable[[str], None] | None = None,
) -> dict:
    """CORE of the model over the tasks (read_bundle): {"metric": the mean centered accuracy, "tasks": {label:
    {"accuracy", "centered"}}}; `log` gets a line per task as it finishes. Under torchrun (a process group) the
    ranks share the items and every rank gets the figures. The model is in eval mode meanwhile."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = model.tok_emb.weight.device
    training = model.training
    model.eval()
    unshard = getattr(model, "unshard", None)  # FSDP2: the root's own weights, which hidden() and lm_head use
    if unshard is not None:
        unshard()
    results = {}
    try:
        for task in tasks:
            start = time.perf_counter()
            correct = torch.tensor(task_correct(model, tokenizer, task, batch_tokens, rank, world), device=device)
            correct = correct.float()  # (items,) 1 where right
            if world > 1:
                dist.all_reduce(correct)
            accuracy = correct.sum().item() / len(task.items)
            score = centered(accuracy, task.baseline)
            results[task.label] = {"accuracy": accuracy, "centered": score}
            if log:
                log(
                    f"core: {task.label}: accuracy {accuracy:.4f} | centered {score:.4f} | {len(task.items):,} items "
                    f"| {time.perf_counter() - start:.1f} s"
                )
    finally:
        if unshard is not None:
            model.reshard()
        model.train(training)
    metric = math.fsum(r["centered"] for r in results.values()) / len(results)
    return {"metric": metric, "tasks": results}
