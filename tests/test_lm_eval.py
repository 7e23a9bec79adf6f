"""lm-eval tasks from local YAML files through gptlite's model class against lm-eval's own hf backend on the same
weights: multiple choice, rolling log-likelihood, greedy generation with stop sequences (and through a chat
template with a system prompt); the command's --task=lm_eval:...; its errors."""

import json
import sys

import pytest
import torch
import transformers

from gptlite import GPT, GPTConfig, evaluate
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
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    source = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {folder / 'cache'}\n"
        "test_split: test\n"
    )
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
    code = evaluate.main(
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
        code = evaluate.main([f"--model={model_dir}", *args])
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
    assert "needs EleutherAI's lm-eval harness: pip install -e '.[eval]'" in error("--task=lm_eval:tiny_mc")


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
