"""Any task of EleutherAI's lm-evaluation-harness (lm-eval), in this process, on gptlite's own forward and KV-cache
generation: `GPTLiteLM`, the harness's model class, and `evaluate_tasks`, which runs tasks through it.

The class does what lm-eval's own `hf` backend (HFLM) does, so that its figures equal that backend's on the same
weights, only batched on gptlite's code:
- Tokens: the tokenizer's, with what a Hugging Face tokenizer adds before a text (Llama's BOS) unless the text starts
  with it; a context's trailing spaces go to the continuation; an empty context is the BOS (else EOS) token.
- loglikelihood: the continuation's log-probabilities over the model's whole vocabulary, summed, and whether each
  token is the greedy one; context and continuation cropped on the left to block_size + 1 tokens. The requests are
  spans of gptlite.evaluate.spans: those of one context (a document's choices) share a pass over it, many go
  through each forward, and the output head sees only the positions that predict a continuation token.
- loglikelihood_rolling: a text cut into windows of block_size tokens, each predicted from the one before
  (lm-eval's own get_rolling_token_windows), the windows' log-likelihoods summed.
- generate_until: greedy (or sampled, as the task asks) decoding through gptlite.inference.generate's KV cache, contexts
  cropped to leave room for max_gen_toks, until the end-of-sequence token or every row of a batch has written a stop
  sequence; the text is cut before the first stop sequence, as HFLM cuts it.
Under torchrun the harness shares the requests among the ranks (rank, world_size, gathers through torch.distributed).

A task that fails inside lm-eval, while it is built from its YAML file or while it runs (its prompts, its metrics and
their aggregation), is a one-line ValueError naming the task, the YAML file it came from, lm-eval's error and where in
the file to look; a task of lm-eval's own is named without blaming a file. An error raised in the model class or
elsewhere in gptlite's code is left as it is.

This module needs lm-eval (`pip install -e ".[eval]"`); without it, importing it is an ImportError that says so.
"""

from __future__ import annotations

import difflib
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gptlite.cli import USER_ERRORS, in_words
from gptlite.evaluate.spans import BATCH_TOKENS, Row, score_spans
from gptlite.extras import missing_extra
from gptlite.inference.generate import PAD, TextStream, generate_tokens
from gptlite.model.network import Transformer
from gptlite.tokenizer import Tokenizer

try:
    import jinja2
    import lm_eval
    from lm_eval.api.model import LM, TemplateLM
    from lm_eval.api.task import Task
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table
except ImportError as e:
    raise missing_extra("eval", e.name or "lm-eval", "--task=lm_eval:... (EleutherAI's lm-eval harness)") from None

GPTLITE_DIR = Path(__file__).resolve().parents[1]  # gptlite's own code: its errors are never a task's
LM_EVAL_TASKS = Path(lm_eval.__file__).resolve().parent / "tasks"  # lm-eval's own task YAML files


def task_manager(names: list[str], include_path: str = "") -> TaskManager:
    """lm-eval's index of tasks (its own, and the YAML files under include_path), after checking that it knows every
    name (a task, a group or a tag). lm-eval leaves a YAML file it cannot read out of its index without a word, so an
    unknown name also names the first such file under include_path."""
    manager = TaskManager(include_path=include_path or None)
    known = manager.all_tasks
    unknown = [n for n in names if n not in known]
    if unknown:
        close = close_name(unknown[0], known)
        hint = f"did you mean '{close}'? " if close else ""
        unreadable = unreadable_yaml(Path(include_path), manager) if include_path else []
        if unreadable:
            path, why = unreadable[0]
            more = f" (and {len(unreadable) - 1} more YAML files)" if len(unreadable) > 1 else ""
            raise ValueError(
                f"--task=lm_eval:{unknown[0]}: lm-eval knows no task of that name; {hint}lm-eval could not read "
                f"{path}{more}, which may define it: {why}; fix that file"
            )
        raise ValueError(
            f"--task=lm_eval:{unknown[0]}: lm-eval knows no task of that name; {hint}(`lm-eval ls tasks` lists them; "
            "--include_path=DIR adds your own task YAML files)"
        )
    return manager


def unreadable_yaml(folder: Path, manager: TaskManager) -> list[tuple[Path, str]]:
    """The YAML files under folder that lm-eval left out of its index because it could not read them (a YAML syntax
    error, an `include:` of a missing file), each with lm-eval's error on one line. A file that reads but defines no
    task (a template other files include) is not one of them."""
    from lm_eval.tasks._yaml_loader import load_yaml  # what lm-eval's index reads each file with

    indexed = {entry.yaml_path.resolve() for entry in manager.task_index.values() if entry.yaml_path}
    unreadable = []
    for path in sorted(folder.glob("**/*.yaml")):
        if path.resolve() in indexed:
            continue
        try:
            load_yaml(path, resolve_func=False, recursive=True)
        except Exception as e:  # anything lm-eval's index skipped the file for
            unreadable.append((path, one_line(e)))
    return unreadable


def close_name(name: str, known: list[str]) -> str | None:
    """The task name a typo most likely meant: one that differs by a letter or two (difflib's ratio of at least 0.8:
    'hellaswg' -> 'hellaswag'; its default of 0.6 took 'nonexistent_task' for 'injongointent_tasks'), else the
    shortest that extends the name ('lambada' -> 'lambada_openai'), else None."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    if close:
        return close[0]
    longer = sorted((k for k in known if k.startswith(name + "_")), key=len)
    return longer[0] if longer else None


def evaluate_tasks(
    model: Transformer,
    tokenizer: Tokenizer,
    manager: TaskManager,
    names: list[str],
    *,
    num_fewshot: int | None,
    limit: int | None,
    apply_chat_template: bool,
    system_prompt: str,
    batch_size: int,
    batch_tokens: int,
) -> tuple[dict, str]:
    """Run lm-eval's tasks on the model: (the harness's own `results` mapping, its table of them). num_fewshot,
    limit, apply_chat_template and system_prompt ("" for none) are lm-eval's settings; batch_size and batch_tokens
    bound a forward pass (GPTLiteLM). A task that fails in lm-eval is a ValueError naming it and its YAML file (see
    task_error)."""
    lm = GPTLiteLM(model, tokenizer, batch_size=batch_size, batch_tokens=batch_tokens)
    if apply_chat_template and not tokenizer.chat_template:
        raise ValueError(
            "--apply_chat_template: this model's tokenizer has no chat template (a base model?); leave the flag out, "
            "or evaluate a model fine-tuned on conversations"
        )
    tasks, asked_for = build_tasks(manager, names)
    try:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            system_instruction=system_prompt or None,
            log_samples=False,
        )
    except Exception as e:
        task = failing_task(e)
        if task is None:  # gptlite's own code, the model class, or lm-eval's outside any one task
            raise
        task_error(manager, asked_for.get(task, task), task, "failed while lm-eval ran it", e)
    if out is None:  # a rank other than 0: the results went to rank 0
        return {}, ""
    return out["results"], make_table(out)


def build_tasks(manager: TaskManager, names: list[str]) -> tuple[list, dict[str, str]]:
    """lm-eval's Task and Group objects of the names, each name built on its own so that a failure names it (see
    task_error); and the name asked for of each task built (a group's or a tag's for their tasks)."""
    tasks = []
    asked_for = {}
    for name in names:
        try:
            loaded = manager.load(name)
        except Exception as e:
            task_error(manager, name, failing_task(e) or name, "could not be built", e)
        tasks += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
        asked_for.update(dict.fromkeys(loaded["tasks"], name))
    return tasks, asked_for


# -- a task's errors ----------------------------------------------------------------------------------


def failing_task(error: Exception) -> str | None:
    """The name of the task whose code raised `error` (caught in the function that called lm-eval): that of the
    innermost frame of the traceback that works on a task (see task_in). None where a frame on the way belongs to
    the model class (lm-eval's LM, whose requests are every task's) or to gptlite's own code: an error there is no
    task's."""
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__.tb_next):  # the first frame is the caller's own
        here = frame.f_locals
        if isinstance(here.get("self"), LM) or in_gptlite(frame.f_code.co_filename):
            return None
        found = task_in(here) or found  # the frames run from the outermost in: the last one found is the innermost
    return found


def task_in(here: dict[str, Any]) -> str | None:
    """The name of the task a frame (its local variables) works on: a Task's method (`self`), lm-eval's evaluator
    code on one (`task`), or ConfigurableTask(config=...) before it has read its config (the config's `task`)."""
    me = here.get("self")
    for candidate in (me, here.get("task")):
        if isinstance(candidate, Task):
            # config.task, not task_name: a task whose config failed has a random task_name
            name = getattr(getattr(candidate, "config", None), "task", None)
            if name is None and candidate is me and isinstance(here.get("config"), dict):
                name = here["config"].get("task")
            if name:
                return name
    return None


def in_gptlite(filename: str) -> bool:
    """Whether a frame's file is gptlite's own code (not a jinja template's "<template>", which names no file)."""
    return Path(filename).is_absolute() and Path(filename).resolve().is_relative_to(GPTLITE_DIR)


def task_error(manager: TaskManager, asked: str, task: str, doing: str, error: Exception) -> NoReturn:
    """Raise `error` of the task `task` (of the name `asked` on the command line) as one line: a ValueError that names
    the task, its YAML file, lm-eval's error and where in the file to look. For a task of lm-eval's own (or one of no
    file) the line blames no file: a ValueError for the kinds of error gptlite reports as one line (a download, a
    missing package), else a RuntimeError chained to lm-eval's traceback (a fault in lm-eval or its data)."""
    entry = manager.task_index.get(task) or manager.task_index.get(asked)  # an inline task of a group: the group's
    path = entry.yaml_path if entry else None
    what = f"task '{task}'" if task == asked else f"task '{task}' of '{asked}'"
    if path is None or Path(path).resolve().is_relative_to(LM_EVAL_TASKS):
        line = f"--task=lm_eval:{asked}: lm-eval's own {what} {doing}: {one_line(error)}"
        if isinstance(error, USER_ERRORS):
            raise ValueError(line) from error
        raise RuntimeError(f"{line} (a fault in lm-eval or its data: see the traceback above)") from error
    raise ValueError(
        f"--task=lm_eval:{asked}: {what}, in {path}, {doing}: {one_line(error)}; {fix_hint(error)}"
    ) from error


def one_line(error: Exception) -> str:
    """An error of lm-eval or the libraries it calls, on one line, with its kind; with the error it was raised while
    handling, where there is one, as that is often the cause (lm-eval calls a metric with keyword arguments, and on a
    TypeError, such as an option of metric_list the metric does not take, again with a positional one, whose
    TypeError hides the first)."""
    if isinstance(error, OSError) and str(error).startswith("[Errno"):
        return in_words(error)
    text = error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else error  # not KeyError's repr
    line = f"{type(error).__name__}: {' '.join(str(text).split())}"
    context = error.__context__
    if context is not None and error.__cause__ is None and not error.__suppress_context__:
        line += f" (raised while handling {type(context).__name__}: {' '.join(str(context).split())})"
    return line


def fix_hint(error: Exception) -> str:
    """Where in a task's YAML file to look, from where the error was raised."""
    modules = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(error.__traceback__)]
    if isinstance(error, jinja2.TemplateError):
        return "check its doc_to_text, doc_to_target and doc_to_choice templates against the fields of its dataset"
    if modules and modules[-1].split(".")[0] in ("datasets", "huggingface_hub", "fsspec"):
        return "check its dataset_path, dataset_name, dataset_kwargs (data_files) and split names"
    if "lm_eval.tasks._yaml_loader" in modules:
        return "check its !function lines: each names module.function of a .py file beside the YAML file"
    return (
        "check its keys, output_type, metric_list (each metric's name, aggregation and options) and filter_list "
        "against lm-eval's task guide (docs/task_guide.md in its repository)"
    )


def prefix_ids(tokenizer: Tokenizer) -> list[int]:
    """What a Hugging Face tokenizer puts before a text it encodes with its special tokens (Llama's BOS; nothing for
    GPT-2), which lm-eval's hf backend lets it add."""
    rust = getattr(tokenizer, "tok", None)  # gptlite.tokenizer.HFTokenizer's tokenizers.Tokenizer
    if rust is None:
        return []
    plain = rust.encode("a", add_special_tokens=False).ids
    special = rust.encode("a", add_special_tokens=True).ids
    return special[: special.index(plain[0])] if plain and plain[0] in special else []


class GPTLiteLM(TemplateLM):
    """lm-eval's model interface on a gptlite model (see the module docstring)."""

    backend = "causal"

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int = 8, batch_tokens: int = BATCH_TOKENS):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.prefix = prefix_ids(tokenizer)
        self.prefix_text = tokenizer.decode(self.prefix) if self.prefix else None
        self._rank, self._world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self._device = model.tok_emb.weight.device

    # -- tokens ----------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_id", None)
        return self.tokenizer.eot_id if eos is None else eos

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_id", None)
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def tokenizer_name(self) -> str:
        return f"gptlite-{self.tokenizer.kind}-{self.tokenizer.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode_special(string)[0] if tok.added else tok.encode(string)  # special tokens of a chat template
        if self.prefix and add_special_tokens is not False and not string.startswith(self.prefix_text):
            ids = self.prefix + ids
        return ids

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the tokenizer's template; without a generation prompt the last message is
        left open to be continued (transformers' continue_final_message, which lm-eval's hf backend asks for)."""
        from gptlite.tokenizer.chat import check_messages, render

        messages = check_messages(chat_history, "lm-eval's prompt")
        text = render(self.tokenizer.chat_template, messages, add_generation_prompt, self.tokenizer.special_texts())
        if not add_generation_prompt:
            final = messages[-1]["content"].strip()
            text = text[: text.rindex(final) + len(final)]
        return text

    # -- scoring ---------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (key, context ids, continuation ids), cropped on the left to
        block_size + 1 tokens, as HFLM crops them."""
        rows = []
        groups = {}  # the requests of one context (a document's choices) share a pass over it
        for r, (_, context, continuation) in enumerate(requests):
            tokens = (context + continuation)[-(self.max_length + 1) :]
            rows.append(Row(tokens, len(tokens) - len(continuation), len(tokens)))
            groups.setdefault(tuple(context), []).append(r)
        vocab = self.model.config.vocab_size
        loss, _, greedy = score_spans(self.model, rows, vocab, self.batch_tokens, list(groups.values()))
        answers = [(-nats, bool(g)) for nats, g in zip(loss, greedy, strict=True)]
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows = []
        owners = []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id, self.max_length, 1),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # requests of the same generation arguments run together
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        eos = self.tokenizer.decode([self.eot_token_id])
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise ValueError(
                    f"an lm-eval task generates up to {max_new} tokens, more than this model's block_size="
                    f"{self.max_length} leaves for a prompt; lower its max_gen_toks"
                )
            contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new) :] for i in members}
            order = sorted(members, key=lambda i: -len(contexts[i]))  # rows of similar lengths pad less
            for first in range(0, len(order), self.batch_size):
                batch = order[first : first + self.batch_size]
                texts = self._generate([contexts[i] for i in batch], max_new, until, kwargs)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    @torch.no_grad()
    def _generate(self, contexts: list[list[int]], max_new: int, until: list[str], kwargs: dict) -> list[str]:
        """Each context's continuation: decoded up to the end-of-sequence token, cut before the first stop sequence.
        Generation stops once every row has ended or written a stop sequence."""
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        sampling = {"top_k": kwargs.get("top_k"), "top_p": kwargs.get("top_p")} if temperature else {}
        eos = self.eot_token_id
        streams = [TextStream(self.tokenizer, until) for _ in contexts]  # only to see when a row has stopped
        new: list[list[int]] = [[] for _ in contexts]
        steps = generate_tokens(
            self.model,
            contexts,
            max_new,
            temperature=temperature,
            stop_tokens=[eos],
            vocab_limit=self.tokenizer.vocab_size,
            **sampling,
        )
        for nxt in steps:
            for row, token in enumerate(nxt.tolist()):
                if token == PAD or streams[row].done:
                    continue
                if token == eos:
                    streams[row].close()
                else:
                    new[row].append(token)
                    streams[row].feed([token])
            if all(s.done for s in streams):
                steps.close()
                break
        return [postprocess_generated_text(self.tokenizer.decode(ids), until, None) for ids in new]

    # -- processes under torchrun -----------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat([p.reshape(-1, *tensor.shape[1:]) if tensor.dim() else p[None] for p in parts])

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()
