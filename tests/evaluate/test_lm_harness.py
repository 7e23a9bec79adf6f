"""lm-eval tasks from local YAML files through gptlite's model class against lm-eval's own hf backend on the same
weights: multiple choice, rolling log-likelihood, greedy generation with stop sequences (and through a chat
template with a system prompt); the command's --task=lm_eval:...; its errors, those of a task YAML file among them."""

import json
import re
import sys

import pytest
import torch
import transformers

from gptlite import GPT, GPTConfig
from gptlite.evaluate import command as evaluate_command
from gptlite.hf import export_hf
from gptlite.tokenizer import get_tokenizer, load_tokenizer
from tests.conftest import shared_file

lm_eval = pytest.importorskip("lm_eval")  # the eval extra, which CI installs with the test extra
transformers.logging.set_verbosity_error()
CHAT = (  # role: content, a line each
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GPT-2 of large random weights, in transformers' files, with GPT-2's tokenizer and a chat template."""
    tokenizer = get_tokenizer(str(shared_file("tokenizers/gpt2.tiktoken")))
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32, ffn="gelu", bias=True
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("model")
    export_hf(model.eval(), folder, tokenizer)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": CHAT}))
    return folder


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder of three task YAML files over one local JSON-lines file."""
    folder = tmp_path_factory.mktemp("tasks")
    lines = [line.strip() for line in shared_file("data/tinyshakespeare.txt").read_text().splitlines() if line.strip()]
    docs = [
        {
            "question": lines[i],
            "choices": lines[i + 1 : i + 4],
            "label": i % 3,
            "text": " ".join(lines[i : i + 12]),  # longer than the context: several rolling windows
            "answer": lines[i + 1],
        }
        for i in range(0, 240, 30)
    ]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    source = source_of(folder)
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\noutput_type: multiple_choice\n" + source + "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "tiny_rolling.yaml").write_text(
        "task: tiny_rolling\noutput_type: loglikelihood_rolling\n" + source + "doc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\noutput_type: generate_until\n" + source + "doc_to_text: '{{question}}\\nAnswer:'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['Mahjong', ' gau']\n  do_sample: false\n"
        "  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n"
    )
    return folder


def source_of(folder):
    """A task YAML's lines that read the documents the tasks fixture wrote into folder."""
    return (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        f"  cache_dir: {folder / 'cache'}\ntest_split: test\n"
    )


def run_both(model_dir, tasks, names, **options):
    """lm-eval's output for gptlite's model class and for its hf backend, on the same weights and tasks."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gptlite.evaluate.lm_harness import GPTLiteLM

    ours = GPTLiteLM(GPT.from_pretrained(str(model_dir)), load_tokenizer(model_dir), batch_size=3, batch_tokens=200)
    theirs = HFLM(pretrained=str(model_dir), device="cpu", batch_size=3)
    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # ours only: lm-eval's take seconds
    return [lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, **options) for lm in (ours, theirs)]


@pytest.mark.slow  # lm-eval builds its tasks and runs both models: seconds
def test_gptlite_equals_the_hf_backend(model_dir, tasks):
    names = ["tiny_mc", "tiny_rolling", "tiny_gen"]
    ours, theirs = run_both(model_dir, tasks, names)
    for name in names:
        for a, b in zip(ours["samples"][name], theirs["samples"][name], strict=True):
            if name == "tiny_gen":
                assert a["resps"] == b["resps"], a["doc"]["question"]
            else:  # log-likelihoods (and, for multiple choice, greedy flags)
                got, want = (
                    torch.tensor([[r if name == "tiny_rolling" else r[0] for r in x] for x in s["resps"]])
                    for s in (a, b)
                )
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
                if name == "tiny_mc":
                    assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]
        metrics = {k: v for k, v in theirs["results"][name].items() if isinstance(v, float)}
        assert {k: ours["results"][name][k] for k in metrics} == pytest.approx(metrics, rel=1e-5)
    texts = [s["resps"][0][0] for s in ours["samples"]["tiny_gen"]]
    assert len(set(texts)) > 1 and any(len(t) < 10 for t in texts)  # texts differ, some cut by a stop sequence


@pytest.mark.slow
def test_a_chat_template_and_system_prompt_as_the_hf_backend_applies_them(model_dir, tasks):
    ours, theirs = run_both(
        model_dir, tasks, ["tiny_gen"], apply_chat_template=True, system_instruction="Answer briefly.", limit=4
    )
    prompts = [s["arguments"][0][0] for s in ours["samples"]["tiny_gen"]]
    assert all(p.startswith("system: Answer briefly.\nuser: ") and p.endswith("assistant:") for p in prompts)
    assert [s["arguments"] for s in ours["samples"]["tiny_gen"]] == [
        s["arguments"] for s in theirs["samples"]["tiny_gen"]
    ]
    assert [s["resps"] for s in ours["samples"]["tiny_gen"]] == [s["resps"] for s in theirs["samples"]["tiny_gen"]]


@pytest.fixture
def own_tasks_only(monkeypatch):
    """The command's lm-eval index without lm-eval's own thousands of tasks, whose indexing takes seconds."""
    import functools

    from gptlite.evaluate import lm_harness

    monkeypatch.setattr(lm_harness, "TaskManager", functools.partial(lm_harness.TaskManager, include_defaults=False))


@pytest.mark.slow
def test_the_command_writes_lm_evals_results(model_dir, tasks, tmp_path, capsys, own_tasks_only):
    out = tmp_path / "r.json"
    code = evaluate_command.main(
        [
            f"--init_from={model_dir}",
            "--task=lm_eval:tiny_mc,tiny_gen",
            f"--include_path={tasks}",
            "--limit=3",
            f"--json={out}",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads(out.read_text())["lm_eval"]
    assert set(results) == {"tiny_mc", "tiny_gen"} and "acc,none" in results["tiny_mc"]
    assert "|tiny_mc " in captured.out.replace("  ", " ") and "exact_match" in captured.out  # lm-eval's table


def test_lm_eval_mistakes_are_one_line(model_dir, tasks, tmp_path, capsys, monkeypatch, own_tasks_only):
    def error(*args: str) -> str:
        code = evaluate_command.main([f"--model={model_dir}", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        return err

    assert "--task=lm_eval: names no lm-eval task after lm_eval:; e.g. --task=lm_eval:arc_easy,piqa" in error(
        "--task=lm_eval:"
    )
    assert f"--include_path={tmp_path / 'no'} is not a folder" in error(
        "--task=lm_eval:tiny_mc", f"--include_path={tmp_path / 'no'}"
    )
    assert "--task=lm_eval:tiny_mcc: lm-eval knows no task of that name; did you mean 'tiny_mc'?" in error(
        "--task=lm_eval:tiny_mcc", f"--include_path={tasks}"
    )
    assert "--apply_chat_template: this model's tokenizer has no chat template" in error(
        "--task=lm_eval:tiny_gen",
        f"--include_path={tasks}",
        "--apply_chat_template",
        f"--tokenizer={shared_file('tokenizers/gpt2.tiktoken')}",
    )
    monkeypatch.delitem(sys.modules, "gptlite.evaluate.lm_harness", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    assert 'needs the lm_eval package: pip install -e ".[eval]"' in error("--task=lm_eval:tiny_mc")


def multiple_choice(folder, data="docs.jsonl", split="test"):
    """A multiple-choice task YAML's lines after its task: line, up to its metric_list."""
    source = source_of(folder).replace("docs.jsonl", data).replace("test_split: test", f"test_split: {split}")
    return (
        "output_type: multiple_choice\n" + source + "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\n"
    )


def generation(folder, max_gen_toks=4):
    """A generation task YAML's lines after its task: line, up to its metric_list."""
    return (
        "output_type: generate_until\n" + source_of(folder) + "doc_to_text: '{{question}}\\nAnswer:'\n"
        f"doc_to_target: '{{{{answer}}}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: {max_gen_toks}\n"
    )


ACC = "metric_list:\n  - metric: acc\n"
BUILT = "could not be built: "
RAN = "failed while lm-eval ran it: "
METRICS = "; check its keys, output_type, metric_list \\(each metric's name, aggregation and options\\) and filter_list"
DATA = "; check its dataset_path, dataset_name, dataset_kwargs \\(data_files\\) and split names"
TEMPLATES = "; check its doc_to_text, doc_to_target and doc_to_choice templates against the fields of its dataset"
MISTAKES = {  # task: (its YAML file after the task: line, given the tasks fixture's folder; its error after the file)
    # the issue's: an option exact_match does not take, hidden by lm-eval's second call of the metric
    "bad_metric_option": (
        lambda f: generation(f) + "metric_list:\n  - metric: exact_match\n    ignore_cas: true\n",
        RAN + r"TypeError: exact_match_fn\(\) takes 0 positional arguments but 1 was given \(raised while handling "
        r"TypeError: exact_match_hf_evaluate\(\) got an unexpected keyword argument 'ignore_cas'\)" + METRICS,
    ),
    "bad_aggregation": (
        lambda f: multiple_choice(f) + "metric_list:\n  - metric: acc\n    aggregation: exact_match\n",
        RAN + "TypeError: 'NoneType' object is not callable" + METRICS,
    ),
    "unknown_metric": (
        lambda f: multiple_choice(f) + "metric_list:\n  - metric: acc_typo\n",
        BUILT + "KeyError: None" + METRICS,
    ),
    "unknown_key": (
        lambda f: multiple_choice(f) + "metric_lst:\n  - metric: acc\n",
        BUILT + r"TypeError: TaskConfig.__init__\(\) got an unexpected keyword argument 'metric_lst'" + METRICS,
    ),
    "wrong_output_type": (
        lambda f: multiple_choice(f).replace("multiple_choice", "multiple_choise") + ACC,
        BUILT + "ValueError: Got invalid output_type 'multiple_choise', must be in .*" + METRICS,
    ),
    "missing_field": (
        lambda f: multiple_choice(f).replace("{{question}}", "{{questio}}") + ACC,
        BUILT + "UndefinedError: 'questio' is undefined" + TEMPLATES,
    ),
    "missing_data": (
        lambda f: multiple_choice(f, data="nothing.jsonl") + ACC,
        BUILT + "FileNotFoundError: Unable to find '.*nothing.jsonl'" + DATA,
    ),
    "wrong_split": (lambda f: multiple_choice(f, split="tst") + ACC, BUILT + "KeyError: tst" + DATA),
    "missing_function": (
        lambda f: multiple_choice(f).replace("'{{question}}'", "!function no_such_module.doc_to_text") + ACC,
        BUILT + "ImportError: Cannot import module 'no_such_module' .*; check its !function lines: each names "
        "module.function of a .py file beside the YAML file",
    ),
}


@pytest.fixture(scope="module")
def mistakes(tasks, tmp_path_factory):
    """A folder of task YAML files with a mistake each (MISTAKES, one that YAML cannot parse, one generating more
    tokens than the model's block_size leaves), one that works, groups of it and a broken one, and a template."""
    folder = tmp_path_factory.mktemp("mistakes")
    for name, (body, _) in MISTAKES.items():
        (folder / f"{name}.yaml").write_text(f"task: {name}\n" + body(tasks))
    (folder / "unparsed.yaml").write_text("task: unparsed\n" + multiple_choice(tasks) + ACC + "   bad: [\n")
    (folder / "_template.yaml").write_text(multiple_choice(tasks))  # no task: read, but not indexed
    (folder / "too_long.yaml").write_text("task: too_long\n" + generation(tasks, max_gen_toks=64) + ACC)
    (folder / "tiny_ok.yaml").write_text("task: tiny_ok\n" + multiple_choice(tasks) + ACC)
    (folder / "ran_group.yaml").write_text("group: ran_group\ntask:\n  - tiny_ok\n  - bad_metric_option\n")
    (folder / "built_group.yaml").write_text("group: built_group\ntask:\n  - tiny_ok\n  - unknown_key\n")
    return folder


def error_line(capsys, model_dir, folder, name):
    """The command's error on --task=lm_eval:NAME of the folder's tasks: exit code 2 and one line, the last of stderr
    (lm-eval's warnings and progress bars come before it)."""
    code = evaluate_command.main(
        [f"--init_from={model_dir}", f"--task=lm_eval:{name}", f"--include_path={folder}", "--limit=2"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("gptlite.evaluate: error: "), err
    return line


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_task_yaml_mistake_is_one_line_naming_its_file(name, model_dir, mistakes, capsys, own_tasks_only):
    line = error_line(capsys, model_dir, mistakes, name)
    path = re.escape(str(mistakes / f"{name}.yaml"))
    assert re.search(f"--task=lm_eval:{name}: task '{name}', in {path}, {MISTAKES[name][1]}", line), line


def test_a_mistake_in_a_groups_task_names_that_tasks_file(model_dir, mistakes, capsys, own_tasks_only):
    """The failing task among the group's, found while lm-eval runs them and while it builds them."""
    line = error_line(capsys, model_dir, mistakes, "ran_group")
    path = re.escape(str(mistakes / "bad_metric_option.yaml"))
    assert re.search(f"ran_group: task 'bad_metric_option' of 'ran_group', in {path}, {RAN}TypeError: exact_", line)
    line = error_line(capsys, model_dir, mistakes, "built_group")
    path = re.escape(str(mistakes / "unknown_key.yaml"))
    assert re.search(f"built_group: task 'unknown_key' of 'built_group', in {path}, {BUILT}TypeError: Task", line)


def test_a_task_yaml_lm_eval_cannot_read_is_named(model_dir, mistakes, capsys, own_tasks_only):
    """lm-eval leaves the file out of its index without a word: the task is unknown, and the file is named (not
    _template.yaml, which reads but defines no task, as a file other task files include)."""
    line = error_line(capsys, model_dir, mistakes, "unparsed")
    path = re.escape(str(mistakes / "unparsed.yaml"))
    assert re.search(
        f"--task=lm_eval:unparsed: lm-eval knows no task of that name; lm-eval could not read {path}, which may "
        "define it: ParserError: while parsing a block collection .*; fix that file$",
        line,
    ), line


def test_lm_evals_own_task_is_named_without_blaming_a_file(model_dir, mistakes, capsys, monkeypatch, own_tasks_only):
    """A task of lm-eval's own folder: the task named, no file or hint; a kind of error gptlite does not report as
    one line (here jinja's) is a RuntimeError chained to lm-eval's, as it may be a fault in lm-eval."""
    from gptlite.evaluate import lm_harness

    monkeypatch.setattr(lm_harness, "LM_EVAL_TASKS", mistakes)  # as if the folder were lm-eval's own
    line = error_line(capsys, model_dir, mistakes, "bad_metric_option")
    assert line.endswith(
        "--task=lm_eval:bad_metric_option: lm-eval's own task 'bad_metric_option' failed while lm-eval ran it: "
        "TypeError: exact_match_fn() takes 0 positional arguments but 1 was given (raised while handling TypeError: "
        "exact_match_hf_evaluate() got an unexpected keyword argument 'ignore_cas')"
    ), line
    with pytest.raises(
        RuntimeError, match="lm-eval's own task 'missing_field' could not be built: UndefinedError"
    ) as e:
        evaluate_command.main(
            [f"--init_from={model_dir}", "--task=lm_eval:missing_field", f"--include_path={mistakes}"]
        )
    assert type(e.value.__cause__).__name__ == "UndefinedError"


def test_gptlites_own_errors_under_lm_eval_are_left_as_they_are(
    model_dir, mistakes, capsys, monkeypatch, own_tasks_only
):
    """An error raised in the model class is not a task's, though lm-eval runs it for a task."""
    from gptlite.evaluate.lm_harness import GPTLiteLM

    line = error_line(capsys, model_dir, mistakes, "too_long")
    assert line == (
        "gptlite.evaluate: error: an lm-eval task generates up to 64 tokens, more than this model's block_size=64 "
        "leaves for a prompt; lower its max_gen_toks"
    )

    def broken(*args, **kwargs):
        raise RuntimeError("the model broke")

    monkeypatch.setattr(GPTLiteLM, "_loglikelihood_tokens", broken)
    with pytest.raises(RuntimeError, match="^the model broke$"):
        evaluate_command.main([f"--init_from={model_dir}", "--task=lm_eval:tiny_ok", f"--include_path={mistakes}"])


def test_a_task_name_gets_a_close_name_only():
    """'did you mean' names a task a letter or two away, or one the name begins; else nothing (difflib's default
    cutoff offered 'injongointent_tasks' for 'nonexistent_task')."""
    from gptlite.evaluate.lm_harness import close_name

    known = ["injongointent_tasks", "hellaswag", "lambada_openai", "lambada_standard", "arc_easy", "tiny_mc"]
    assert close_name("nonexistent_task", known) is None
    assert close_name("hellaswg", known) == "hellaswag"
    assert close_name("tiny_mcc", known) == "tiny_mc"
    assert close_name("lambada", known) == "lambada_openai"


def test_an_unknown_task_of_lm_evals_own_index_suggests_nothing_far():
    """The issue's case against lm-eval's whole index of tasks: no suggestion for a name like no task's."""
    from gptlite.evaluate.lm_harness import task_manager

    with pytest.raises(ValueError, match="lm_eval:nonexistent_task: lm-eval knows no task of that name; \\(`lm-eval"):
        task_manager(["nonexistent_task"])
