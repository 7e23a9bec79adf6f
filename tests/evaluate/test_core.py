"""CORE against a reference scorer written from the method (nanochat's core_eval.py) on transformers with the same
weights, item by item: every task type, few-shot examples, a custom delimiter, sequences cropped to the context,
max_per_task; each faulty bundle refused in one line; the command; and train.py --core_every."""

import csv
import json
import random
import re
import shutil

import jinja2
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

import gptlite.evaluate.core as core_module
from gptlite import GPT, GPTConfig, plot
from gptlite.config import build_config
from gptlite.evaluate import command as evaluate_command
from gptlite.evaluate.core import core_bundle, core_score, read_bundle, task_correct
from gptlite.hf import export_hf
from gptlite.tokenizer import get_tokenizer
from gptlite.train.metrics import read_metrics
from tests.conftest import run_train, shared_file

transformers.logging.set_verbosity_error()
BLOCK = 64  # the tiny model's context: the few-shot prompts of the longer tasks are cropped to it


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """(the gptlite model, the same weights in transformers, transformers' tokenizer of its files)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, ffn="gelu", bias=True
    )
    model = GPT(config).eval()
    with torch.no_grad():  # large random weights: options' losses differ by far more than rounding
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("hf")
    export_hf(model, folder, tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, hf, transformers.AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------
# A bundle in the published layout


def lines() -> list[str]:
    text = shared_file("data/tinyshakespeare.txt").read_text()[:20_000]
    return [line.strip() for line in text.splitlines() if line.strip()]


def greedy_continuation(hf, hf_tokenizer, context: str, delimiter: str) -> str | None:
    """Three tokens the model predicts greedily after a zero-shot language-modeling prompt, as a continuation that
    the prompt then tokenizes to (None if it does not): an item the model gets right."""
    unstripped = context.strip() + delimiter
    ids = [hf_tokenizer.eos_token_id] + hf_tokenizer(unstripped.strip())["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids[-(BLOCK - 3) :]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    full = unstripped.strip() + hf_tokenizer.decode(out[0, len(ids[-(BLOCK - 3) :]) :])
    return full[len(unstripped) :] if full.startswith(unstripped) and len(full) > len(unstripped) else None


def write_bundle(folder, hf, hf_tokenizer) -> dict:
    """core.yaml, eval_meta_data.csv and eval_data/ with a task of each type, few-shot tasks, custom delimiters and
    one whose prompts outgrow the context; returns core.yaml's tasks by label."""
    rng = random.Random(0)
    text = lines()
    tasks, baselines = [], {}

    def add(label, kind, shots, items, baseline, delimiter=None):
        path = folder / "eval_data" / "tiny" / f"{label}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        task = {"label": label, "dataset_uri": f"tiny/{label}.jsonl", "num_fewshot": [shots], "icl_task_type": kind}
        tasks.append(task if delimiter is None else {**task, "continuation_delimiter": delimiter})
        baselines[label] = baseline

    def at() -> int:
        return rng.randrange(len(text) - 8)

    def mc(n, k):
        return [
            {"query": text[i], "choices": text[i + 1 : i + 1 + k], "gold": rng.randrange(k)}
            for i in (at() for _ in range(n))
        ]

    def schema(n):
        return [
            {
                "context_options": [text[i], text[i + 2], text[i + 4]],
                "continuation": text[i + 1],
                "gold": rng.randrange(3),
            }
            for i in (at() for _ in range(n))
        ]

    def lm(n, delimiter, shots):
        items = []
        for j in range(n):
            i = at()
            context = f"{text[i]} {text[i + 1]}" + ("  " if j % 3 == 0 else "")  # trailing spaces: stripped
            right = greedy_continuation(hf, hf_tokenizer, context, delimiter) if j % 2 == 0 and not shots else None
            items.append({"context": context, "continuation": right or text[i + 2].split(" ")[0]})
        return items

    add("mc", "multiple_choice", 0, mc(8, 4), 25)
    add("mc_fewshot", "multiple_choice", 3, mc(6, 2), 50, delimiter="\nAnswer: ")
    add("mc_cropped", "multiple_choice", 4, mc(5, 4), 25)  # 4-shot prompts are longer than BLOCK
    add("schema", "schema", 0, schema(6), 33.3)
    add("schema_fewshot", "schema", 2, schema(5), 33.3)
    add("lm", "language_modeling", 0, lm(8, " ", 0), 0)
    add("lm_colon", "language_modeling", 0, lm(6, ": ", 0), 0, delimiter=": ")
    add("lm_fewshot", "language_modeling", 2, lm(5, " ", 2), 0)
    (folder / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": tasks}))
    with open(folder / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Random baseline"])
        writer.writerows([label, "tiny", baseline] for label, baseline in baselines.items())
    return {t["label"]: t for t in tasks}


@pytest.fixture(scope="module")
def bundle(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bundle")
    _, hf, hf_tokenizer = models
    return folder, write_bundle(folder, hf, hf_tokenizer)


# ---------------------------------------------------------------------------------------------
# The reference: the method as the issue states it, one item at a time, on transformers

TEMPLATES = {  # the few-shot examples, each followed by a blank line, then the item
    "multiple_choice": (
        "{% for s in shots %}{{ s.query }}{{ d }}{{ s.choices[s.gold] }}\n\n{% endfor %}"
        "{{ item.query }}{{ d }}{{ option }}"
    ),
    "schema": (
        "{% for s in shots %}{{ s.context_options[s.gold] }}{{ d }}{{ s.continuation }}\n\n{% endfor %}"
        "{{ option }}{{ d }}{{ item.continuation }}"
    ),
    "language_modeling": (
        "{% for s in shots %}{{ s.context | trim }}{{ d }}{{ s.continuation }}\n\n{% endfor %}"
        "{{ item.context | trim }}{{ d }}{% if option %}{{ item.continuation }}{% endif %}"
    ),
}


def reference_correct(hf, hf_tokenizer, folder, task: dict, max_per_task: int | None) -> list[bool]:
    items = [json.loads(line) for line in (folder / "eval_data" / task["dataset_uri"]).read_text().splitlines()]
    random.Random(1337).shuffle(items)
    items = items[:max_per_task] if max_per_task else items
    kind, shots, d = task["icl_task_type"], task["num_fewshot"][0], task.get("continuation_delimiter", " ")
    template = jinja2.Template(TEMPLATES[kind])
    bos = hf_tokenizer.bos_token_id
    results = []
    for i, item in enumerate(items):
        others = [j for j in range(len(items)) if j != i]
        examples = [items[j] for j in random.Random(1234 + i).sample(others, shots)] if shots else []
        options = {"multiple_choice": item.get("choices"), "schema": item.get("context_options")}.get(kind, [0, 1])
        texts = [template.render(shots=examples, d=d, item=item, option=o) for o in options]
        if kind == "language_modeling":
            texts[0] = texts[0].strip()
        ids = [[bos] + hf_tokenizer(t)["input_ids"] for t in texts]
        if kind == "multiple_choice":
            start = next((k for k in range(min(map(len, ids))) if len({s[k] for s in ids}) > 1), min(map(len, ids)))
            spans = [(start, len(s)) for s in ids]
        elif kind == "schema":
            same = next((k for k in range(min(map(len, ids))) if len({s[-1 - k] for s in ids}) > 1), min(map(len, ids)))
            spans = [(len(s) - same, len(s)) for s in ids]
        else:
            assert ids[1][: len(ids[0])] == ids[0]
            spans, ids = [(len(ids[0]), len(ids[1]))], ids[1:]
        means, greedy = [], []
        for seq, (start, end) in zip(ids, spans, strict=True):
            cut = max(0, len(seq) - BLOCK)
            seq, start, end = seq[cut:], start - cut, end - cut
            with torch.no_grad():
                logits = hf(torch.tensor([seq])).logits[0]  # (T, V): every position through the head
            ce = F.cross_entropy(logits[start - 1 : end - 1], torch.tensor(seq[start:end]), reduction="none")
            means.append(ce.mean().item())
            greedy.append(logits[start - 1 : end - 1].argmax(-1).tolist() == seq[start:end])
        best = min(range(len(means)), key=means.__getitem__)  # the first of the lowest mean losses
        results.append(greedy[0] if kind == "language_modeling" else best == item["gold"])
    return results


@pytest.mark.slow  # a GPT-2-vocabulary head over every position of the reference: seconds
@pytest.mark.parametrize("max_per_task", [None, 5])
def test_core_equals_the_reference_scorer_item_by_item(models, tokenizer, bundle, max_per_task):
    model, hf, hf_tokenizer = models
    folder, spec = bundle
    tasks = read_bundle(folder, max_per_task)
    assert [t.label for t in tasks] == list(spec)
    for task in tasks:
        for batch_tokens in (150, 4096):  # two rows per forward, and every item's rows in one
            ours = task_correct(model, tokenizer, task, batch_tokens)
            assert ours == reference_correct(hf, hf_tokenizer, folder, spec[task.label], max_per_task), task.label
    scores = core_score(model, tokenizer, tasks)
    accuracy = {label: r["accuracy"] for label, r in scores["tasks"].items()}
    assert 0 < accuracy["lm"] < 1 and 0 < accuracy["mc"] < 1  # right and wrong items: both outcomes are compared
    assert scores["tasks"]["mc_fewshot"]["centered"] == pytest.approx((accuracy["mc_fewshot"] - 0.5) / 0.5)
    assert scores["metric"] == pytest.approx(sum(r["centered"] for r in scores["tasks"].values()) / len(tasks))


# ---------------------------------------------------------------------------------------------
# Faulty bundles


def broken(folder, fault: str) -> None:
    """Copy of a good bundle in `folder`, with one fault."""
    core_yaml = yaml.safe_load((folder / "core.yaml").read_text())
    if fault == "no core.yaml":
        (folder / "core.yaml").unlink()
        return
    if fault == "no csv":
        (folder / "eval_meta_data.csv").unlink()
    elif fault == "no data":
        (folder / "eval_data" / "tiny" / "schema.jsonl").unlink()
    elif fault == "unknown type":
        core_yaml["icl_tasks"][1]["icl_task_type"] = "generation_task_with_answers"
    elif fault == "no baseline":
        core_yaml["icl_tasks"][0]["label"] = "mmlu"
    elif fault == "no field":
        core_yaml["icl_tasks"][2].pop("dataset_uri")
    elif fault == "row without a field":
        path = folder / "eval_data" / "tiny" / "mc.jsonl"
        path.write_text(path.read_text() + '{"query": "a", "gold": 0}\n')
    elif fault == "gold out of range":
        path = folder / "eval_data" / "tiny" / "schema.jsonl"
        path.write_text('{"context_options": ["a", "b"], "continuation": "c", "gold": 2}\n' + path.read_text())
    (folder / "core.yaml").write_text(yaml.safe_dump(core_yaml))


@pytest.mark.parametrize(
    "fault,error,message",
    [
        ("no core.yaml", FileNotFoundError, r"core\.yaml does not exist; a CORE bundle holds core\.yaml, eval_meta"),
        ("no csv", FileNotFoundError, r"eval_meta_data\.csv does not exist; a CORE bundle holds"),
        ("no data", FileNotFoundError, r"schema\.jsonl \(the data of CORE task 'schema'\) does not exist; check its"),
        ("unknown type", ValueError, r"task 2 \(mc_fewshot\) has icl_task_type 'generation_task_with_answers'; use"),
        ("no baseline", ValueError, r"eval_meta_data\.csv has no row for task 'mmlu' \('Eval Task'\); add its random"),
        ("no field", ValueError, r"core\.yaml: task 3 has no 'dataset_uri'; each of icl_tasks gives label, dataset"),
        ("row without a field", ValueError, r"mc\.jsonl line 9 has no field 'choices'; a multiple_choice item holds"),
        (
            "gold out of range",
            ValueError,
            r"schema\.jsonl line 1: gold 2 must be the index of the right option, 0\.\.1",
        ),
    ],
)
def test_a_faulty_bundle_is_named_with_the_fix(bundle, tmp_path, fault, error, message):
    folder = tmp_path / "bundle"
    shutil.copytree(bundle[0], folder)
    broken(folder, fault)
    with pytest.raises(error, match=message):
        read_bundle(folder)


def test_too_few_items_for_the_few_shot_examples_and_a_missing_folder(bundle, tmp_path):
    with pytest.raises(ValueError, match=r"task 'mc_fewshot' keeps 3 item\(s\) but draws 3 few-shot examples .* keep "
                       r"at least 4 items per task \(max_per_task\)"):  # fmt: skip
        read_bundle(bundle[0], max_per_task=3)
    with pytest.raises(FileNotFoundError, match=r"CORE bundle .*nowhere is not a folder; a CORE bundle holds"):
        read_bundle(tmp_path / "nowhere")


def test_an_offline_bundle_download_says_where_to_put_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default folder, data/eval_bundle, is relative to here
    monkeypatch.setattr(core_module, "EVAL_BUNDLE_URL", "http://127.0.0.1:9/eval_bundle.zip")  # nothing listens
    message = (
        r"could not download http://127\.0\.0\.1:9/eval_bundle\.zip .*: unzip it and put its eval_bundle folder at "
        r"data/eval_bundle, or pass the folder with --core_bundle=DIR"
    )
    with pytest.raises(ConnectionError, match=message):
        core_bundle("", "--core_bundle")
    assert not (tmp_path / "data").exists()


# ---------------------------------------------------------------------------------------------
# The command, and CORE during training


def test_the_command_prints_each_task_and_writes_core_to_json(models, tokenizer, bundle, tmp_path, capsys):
    model, _, _ = models
    folder, spec = bundle
    run = tmp_path / "model"
    export_hf(model, run, tokenizer)
    out = tmp_path / "r.json"
    code = evaluate_command.main(
        [f"--init_from={run}", "--task=core", f"--bundle={folder}", "--max_per_task=5", f"--json={out}"]
    )
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split(":")[1].strip() for line in printed[:-1]] == list(spec)
    assert re.fullmatch(r"core: mc: accuracy \d\.\d{4} \| centered -?\d\.\d{4} \| 5 items \| \d+\.\d s", printed[0])
    results = json.loads(out.read_text())["core"]
    assert printed[-1].startswith(f"core: CORE {results['metric']:.4f} over {len(spec)} tasks")
    expected = core_score(model, tokenizer, read_bundle(folder, 5))
    assert results["tasks"] == expected["tasks"] and results["metric"] == expected["metric"]
    assert set(results["tasks"]["lm"]) == {"accuracy", "centered"}


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    from gptlite.data.prepare import prepare

    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(shared_file("data/tinyshakespeare.txt").read_text()[:20_000])
    data = tmp_path_factory.mktemp("data")
    prepare([str(corpus)], str(shared_file("tokenizers/gpt2.tiktoken")), data, log=lambda *a: None)
    return data


def test_train_scores_core_every_n_steps_into_metrics(bundle, gpt2_data, tmp_path):
    data = gpt2_data
    out = tmp_path / "run"
    summary = run_train(
        f"--data_dir={data}",
        f"--out_dir={out}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        f"--block_size={BLOCK}",
        "--batch_size=2",
        "--max_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--core_every=2",
        f"--core_bundle={bundle[0]}",
        "--core_max_per_task=5",
        "--device=cpu",
    )
    assert summary.code == 0, summary.err
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "core" in r]
    assert [(r["step"], r["tokens"]) for r in rows] == [(2, 2 * 2 * BLOCK), (3, 3 * 2 * BLOCK)]  # every 2, and the end
    assert all(-1 <= r["core"] <= 1 for r in rows) and set(rows[0]) == {"step", "tokens", "core"}
    assert f"step     2 | core {rows[0]['core']:.4f}" in summary.out
    assert plot.main([str(out), "--x=tokens", "--log"]) == 0
    from matplotlib.image import imread

    assert imread(out / "loss.png").shape[:2] == (500, 1600)  # loss, val bits per byte and CORE: 16 x 5 inches


def test_core_options_of_train_are_checked(bundle, gpt2_data, tmp_path):
    with pytest.raises(ValueError, match=r"core_every=-1 must be >= 0 and core_max_per_task=0 >= 1"):
        build_config({"vocab_size": 97, "core_every": -1, "core_max_per_task": 0})
    with pytest.raises(ValueError, match=r"core_every=0 scores it never; set core_every=N \(steps\)"):
        build_config({"vocab_size": 97, "core_bundle": str(bundle[0])})
    data = tmp_path / "data"
    shutil.copytree(gpt2_data, data)
    (data / "tokenizer.json").unlink()
    shape = ["--vocab_size=50304", f"--block_size={BLOCK}", "--batch_size=2", "--n_layer=1", "--n_embd=16"]
    run = run_train(f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", *shape, "--n_head=2", "--core_every=2")
    message = (
        r"--core_every scores text prompts, which needs the data's tokenizer: .*tokenizer\.json does not exist; "
        r"prepare the data with data/prepare\.py, or leave --core_every out"
    )
    assert re.fullmatch(message, run.error)
    assert not (tmp_path / "run").exists()  # refused before the run folder is claimed
