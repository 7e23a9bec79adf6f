"""Scoring a model, and the command that does it: bits per byte over token windows (gptlite.evaluate.bpb), zero-shot
HellaSwag accuracy (gptlite.evaluate.hellaswag_task), the CORE metric as nanochat computes it (gptlite.evaluate.core)
any task of EleutherAI's lm-eval harness, in this process (gptlite.evaluate.lm_harness), and the rewards of
completions to held-out prompts (gptlite.train.rl).

    python -m gptlite.evaluate --model=RUN [--task=val,hellaswag,core] [--data_dir=DIR | --text=FILE] [--json=FILE]
    python -m gptlite.evaluate --model=gpt2 --task=hellaswag [--hellaswag_file=PATH] [--limit=N]
    python -m gptlite.evaluate --model=gpt2 --task=core [--bundle=DIR] [--max_per_task=N]
    python -m gptlite.evaluate --model=RUN --task=lm_eval:arc_easy,piqa [--include_path=DIR] [--num_fewshot=N]
    python -m gptlite.evaluate --model=RUN --task=rl --rl_prompts=HELD_OUT.jsonl --reward=exact [--rl_samples=N]
    torchrun --nproc_per_node=8 -m gptlite.evaluate --model=gpt2 --task=core    # the items split over 8 GPUs

--model names a training run's folder, a Hugging Face directory or a hub name (gpt2[-medium|-large|-xl]); --out_dir
and --init_from, its old spellings, still work.

--task is comma-separated; `lm_eval:` comes last and everything after it names lm-eval tasks. Under torchrun, CORE
and lm-eval share their items among the ranks; val and hellaswag run whole on every rank. Rank 0 prints and writes
--json.

Each kind of score is a module of its own (see gptlite.evaluate); this one holds the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.cli import MODEL_KINDS, ModelOptions, model_to_read, parse, reworded, run_command
from gptlite.config import option
from gptlite.evaluate.bpb import byte_lengths, evaluate_windows
from gptlite.evaluate.core import EVAL_BUNDLE_DIR, EVAL_BUNDLE_URL, core_bundle, core_score, read_bundle
from gptlite.evaluate.hellaswag_task import HELLASWAG_FILE, HELLASWAG_URL, hellaswag, hellaswag_file
from gptlite.evaluate.spans import BATCH_TOKENS
from gptlite.files import fault
from gptlite.inference.quantize import layer_types, quantized_as
from gptlite.model.network import Transformer
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, check_same_tokenizer, load_tokenizer
from gptlite.train.distributed import processes
from gptlite.train.objective import make_judge

if TYPE_CHECKING:
    from gptlite.config import TrainConfig
    from gptlite.train.rl import Reward

TASKS = ("val", "hellaswag", "core", "rl")  # gptlite's own; lm-eval's come after LM_EVAL
LM_EVAL = "lm_eval:"


# ---------------------------------------------------------------------------------------------
# The command


@dataclass
class EvaluateOptions(ModelOptions):
    model: str = reworded(
        ModelOptions, "model", f"the model to score: {MODEL_KINDS} (a run: its newest checkpoint and tokenizer)"
    )
    tokenizer: str = reworded(
        ModelOptions,
        "tokenizer",
        "a tokenizer.json, .tiktoken file or tiktoken name (default: the run's; GPT-2's BPE for GPT-2)",
    )
    compile: bool = field(default=False, init=False)  # scoring runs the plain model: no --compile
    quantize: str = reworded(
        ModelOptions, "quantize", "int8 or int4: score the model with weight-only quantized weights (int4: on the CPU)"
    )
    task: str = option(
        "val", "comma-separated: val, hellaswag, core, rl, then lm_eval:TASK[,TASK...] (lm-eval's tasks, last)"
    )
    data_dir: str = option("", "val: the shards whose val split to score (default: the run's)")
    text: str = option("", "val: score this text file instead of val shards")
    hellaswag_file: str = option(
        str(HELLASWAG_FILE), f"hellaswag_val.jsonl (downloaded from {HELLASWAG_URL} when missing)"
    )
    bundle: str = option(
        "", f"core: the DCLM eval bundle folder (default: {EVAL_BUNDLE_DIR}, downloaded from {EVAL_BUNDLE_URL} once)"
    )
    max_per_task: int | None = option(None, "core: the first N items of each task, after its fixed shuffle")
    include_path: str = option("", "lm_eval: a folder of task YAML files of your own")
    num_fewshot: int | None = option(None, "lm_eval: few-shot examples per prompt (default: each task's own)")
    apply_chat_template: bool = option(False, "lm_eval: prompts through the tokenizer's chat template (chat models)")
    system_prompt: str = option("", "lm_eval: a system message before every prompt")
    rl_prompts: str = option("", "rl: a JSONL file of prompts with answers, held out from training")
    reward: str = option("", "rl: the reward function: gsm8k, exact, package.module:function or file.py:function")
    rl_prompt_field: str = option("prompt", "rl: the records' prompt field (text, or a list of messages)")
    rl_answer_field: str = option("answer", "rl: the records' answer field (what gsm8k and exact compare with)")
    rl_samples: int = option(8, "rl: completions sampled per prompt (mean reward, pass@k), besides the greedy one")
    rl_max_new_tokens: int = option(256, "rl: the longest completion, in tokens")
    rl_temperature: float = option(1.0, "rl: the sampled completions' temperature")
    seed: int = option(0, "rl: the seed of the sampled completions")
    limit: int | None = option(None, "hellaswag, lm_eval: the first N examples (of each task) only")
    batch_size: int = option(
        8, "windows (val), examples (hellaswag), generations (lm_eval) or prompts (rl) per forward"
    )
    batch_tokens: int = option(BATCH_TOKENS, "core, lm_eval: padded tokens per forward, many items' sequences together")
    json: str = option("", "also write the results to this JSON file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = parse(EvaluateOptions, argv, "python -m gptlite.evaluate", __doc__)
        args.model = model_to_read(args, "gptlite.evaluate")
        with processes() as (rank, local_rank, _):  # under torchrun, the process group
            results = run(args, local_rank, log=print if rank == 0 else lambda *a, **k: None)
        if args.json and rank == 0:
            tmp = Path(f"{args.json}.tmp")
            try:
                tmp.write_text(json.dumps(results, indent=1) + "\n")
                tmp.replace(args.json)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise fault(e, f"could not write {args.json}") from None
        return 0

    return run_command("gptlite.evaluate", body, "nothing was written")


def split_tasks(task: str) -> tuple[list[str], list[str]]:
    """--task as (gptlite's tasks, lm-eval's task names): everything after LM_EVAL names lm-eval tasks."""
    ours, marker, theirs = task.partition(LM_EVAL)
    return [t for t in ours.split(",") if t], ([t.strip() for t in theirs.split(",") if t.strip()] if marker else [])


def check(args: EvaluateOptions) -> tuple[list[str], list[str]]:
    """Every argument, checked before the model loads: (gptlite's tasks, lm-eval's tasks). args.model is the one
    model name (gptlite.cli.model_to_read)."""
    from gptlite.checkpoint import is_run
    from gptlite.hf import check_model_name

    check_model_name(args.model)  # a mistyped path is said as itself, not as what a run would have had
    tasks, harness = split_tasks(args.task)
    problems = [f"--task: unknown {t!r} ({', '.join(TASKS)}, {LM_EVAL}TASK)" for t in tasks if t not in TASKS]
    if LM_EVAL in args.task and not harness:
        problems.append(f"--task={args.task} names no lm-eval task after {LM_EVAL}; e.g. --task={LM_EVAL}arc_easy,piqa")
    elif not tasks and not harness:
        problems.append(f"--task is empty; name one or more of {', '.join(TASKS)}, {LM_EVAL}TASK")
    for name in ("limit", "max_per_task", "batch_size", "batch_tokens", "rl_samples", "rl_max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"--{name}={value} must be >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        problems.append(f"--num_fewshot={args.num_fewshot} must be >= 0")
    if "val" in tasks and not (args.data_dir or args.text or is_run(args.model)):
        problems.append(
            f"--task=val of {args.model} (not a gptlite run folder: no training data of its own) needs --data_dir=DIR "
            "or --text=FILE"
        )
    if "rl" in tasks and not (args.rl_prompts and args.reward):
        problems.append("--task=rl needs --rl_prompts=FILE.jsonl and --reward=gsm8k|exact|module:function")
    if args.rl_temperature <= 0:
        problems.append(f"--rl_temperature={args.rl_temperature} must be > 0 (pass@1 is scored greedily besides)")
    if args.text and Path(args.text).is_dir():
        problems.append(f"--text={args.text} is a folder; give a text file (or --data_dir=DIR for prepared shards)")
    elif args.text and not Path(args.text).is_file():
        problems.append(f"text file {args.text} does not exist")
    if args.include_path and not Path(args.include_path).is_dir():
        problems.append(f"--include_path={args.include_path} is not a folder; give the folder of your task YAML files")
    folder = Path(args.json).parent if args.json else None
    if folder is not None and not folder.is_dir():
        problems.append(f"--json={args.json}: folder {folder} does not exist; create it or write the results elsewhere")
    elif args.json and Path(args.json).exists() and not earlier_results(Path(args.json)):
        problems.append(
            f"--json={args.json} exists and is not an earlier result of this command (an input, a "
            "checkpoint?); write the results to another file"
        )
    elif folder is not None and not writable(folder):
        problems.append(f"--json={args.json}: folder {folder} cannot be written; write the results elsewhere")
    if problems:
        raise ValueError("; ".join(problems))
    return tasks, harness


def writable(folder: Path) -> bool:
    """Whether a file can be made in folder: tried, with a temporary file removed at once, before any task runs
    (permissions alone do not say it: root, read-only mounts, /proc)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".gptlite-json-check-"):
            return True
    except OSError:
        return False


def earlier_results(path: Path) -> bool:
    """True if path holds what --json writes (a JSON object naming the model, device and dtype): only such a file
    is replaced, never an input or a checkpoint given there by mistake."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and {"model", "device", "dtype"} <= results.keys()


def run(args: EvaluateOptions, local_rank: int = 0, log: Callable[..., None] = print) -> dict:
    """The command's work: check every argument and read every input, load the model once, run each task, `log` a
    line per task (CORE: per CORE task), lm-eval's table last."""
    from gptlite.checkpoint import open_model

    tasks, harness = check(args)
    # what the tasks read, downloaded if need be and checked, before any task spends minutes
    if "hellaswag" in tasks:
        hellaswag_path = hellaswag_file(args.hellaswag_file)
    if "core" in tasks:
        core_tasks = read_bundle(core_bundle(args.bundle), args.max_per_task)
    if "rl" in tasks:
        from gptlite.train.rl import load_reward

        reward = load_reward(args.reward, args.rl_answer_field)
    if harness:
        from gptlite.evaluate.lm_harness import task_manager

        manager = task_manager(harness, args.include_path)
    # under torchrun, each rank on its own GPU; the kernels' first build says so before the tasks' lines
    model, tokenizer = open_model(args, "gptlite.evaluate", local_rank)
    device = args.device
    dtype = args.dtype
    # what was done, not what was asked: int4 keeps int8 where its kernel cannot take a layer's shape
    quantized = {"quantize": quantized_as(model), "quantized_layers": layer_types(model)}
    results = {"model": args.model, "device": device, "dtype": dtype, **quantized}
    for task in tasks:
        start = time.perf_counter()
        if task == "val":
            results["val"] = score_val(args, model, tokenizer, device, log)
        elif task == "hellaswag":
            scores = hellaswag(model, tokenizer, hellaswag_path, args.limit, args.batch_size)
            seconds = time.perf_counter() - start
            results["hellaswag"] = {**scores, "seconds": seconds}
            log(
                f"hellaswag: acc {scores['acc']:.4f} | acc_norm {scores['acc_norm']:.4f} | {scores['n']:,} examples "
                f"| {seconds:.1f} s ({1000 * seconds / scores['n']:.0f} s per 1,000)"
            )
        elif task == "rl":
            scores = score_rewards(args, model, tokenizer, reward)
            seconds = time.perf_counter() - start
            results["rl"] = {**scores, "seconds": seconds}
            k = args.rl_samples
            log(
                f"rl: pass@1 {scores['pass@1']:.4f} (greedy) | mean reward {scores['mean_reward']:.4f} | "
                f"pass@{k} {scores[f'pass@{k}']:.4f} ({k} samples at temperature {args.rl_temperature:g}) | "
                f"{scores['mean_length']:.1f} tokens | {scores['prompts']:,} prompts | {seconds:.1f} s"
            )
        else:
            scores = core_score(model, tokenizer, core_tasks, args.batch_tokens, log)
            seconds = time.perf_counter() - start
            results["core"] = {**scores, "seconds": seconds}
            log(f"core: CORE {scores['metric']:.4f} over {len(core_tasks)} tasks | {seconds:.1f} s")
    if harness:
        from gptlite.evaluate.lm_harness import evaluate_tasks

        results["lm_eval"], table = evaluate_tasks(
            model,
            tokenizer,
            manager,
            harness,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            apply_chat_template=args.apply_chat_template,
            system_prompt=args.system_prompt,
            batch_size=args.batch_size,
            batch_tokens=args.batch_tokens,
        )
        log(table)
    return results


def score_rewards(args: EvaluateOptions, model: Transformer, tokenizer: Tokenizer, reward: Reward) -> dict:
    """--task=rl: the greedy and sampled completions of --rl_prompts, scored by the reward (gptlite.train.rl)."""
    from gptlite.train.rl import read_prompts, reward_needs_answer, score_prompts

    room = model.config.block_size - args.rl_max_new_tokens
    if room < 1:
        raise ValueError(
            f"--rl_max_new_tokens={args.rl_max_new_tokens} leaves no room for a prompt in the model's "
            f"block_size={model.config.block_size}; lower it"
        )
    prompts = read_prompts(
        args.rl_prompts,
        tokenizer,
        args.rl_prompt_field,
        args.rl_answer_field,
        room,
        need_answer=reward_needs_answer(args.reward),
    )
    return score_prompts(
        model,
        tokenizer,
        prompts,
        reward,
        args.rl_samples,
        args.rl_max_new_tokens,
        args.rl_temperature,
        args.seed,
        args.batch_size,
    )


def score_val(
    args: EvaluateOptions, model: Transformer, tokenizer: Tokenizer, device: str, log: Callable[..., None]
) -> dict:
    """--task=val: the loss of --text, or of the val split of --data_dir (default: the run's) as training scores it
    there. Text: every window's tokens, and bits per byte. Conversations: the assistant's tokens alone (what
    fine-tuning trains on). Preference pairs: DPO's loss and figures against the model the DPO run started from.
    The last two are the run's objective's own evaluation (gptlite.train.objective.make_judge), so that the figures are
    train.py's val figures for the same model and split. Logs its line; returns its results."""
    start = time.perf_counter()
    if args.text:
        ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))
        if len(ids) < 2:
            raise ValueError(
                f"text file {args.text} gives {len(ids)} token(s); scoring needs at least 2 (one to predict "
                "from, one to predict)"
            )
        return score_text(model, tokenizer, [torch.tensor(ids)], args.batch_size, args.text, start, log)
    from gptlite.data.loader import find_shards, read_shard

    cfg, trained_on = judge_config(args, model)
    data_tokenizer = Path(cfg.data_dir) / TOKENIZER_FILE
    if data_tokenizer.is_file():
        check_same_tokenizer(
            tokenizer,
            args.model,
            load_tokenizer(data_tokenizer),
            f"the data in {cfg.data_dir}",
            f"score data prepared with the model's tokenizer (data/prepare.py --tokenizer={args.model})",
        )
    what = f"{cfg.data_dir} val split"
    judge = make_judge(cfg, tokenizer, device, contextlib.nullcontext(), log)
    if judge.val_loader.kind == "text":  # every window of the val shards' token streams, as --text scores a file
        files = find_shards(cfg.data_dir, "val")
        streams = [torch.from_numpy(read_shard(p).astype("int64")) for p in files]
        return score_text(model, tokenizer, streams, args.batch_size, what, start, log)
    if judge.needs_reference:  # the objective of preference pairs: DPO's, against the model its run started from
        judge.start(dpo_reference(args, cfg, trained_on, device))  # a frozen copy of it, DPO's reference
        scored = f"{len(judge.val_loader.conversations):,} preference pairs, by DPO's loss against {cfg.init_from}"
    else:
        scored = f"the assistant's tokens of {len(judge.val_loader.conversations):,} conversations"
    evaluation = judge.evaluate(model)
    seconds = time.perf_counter() - start
    log(f"val: {evaluation.line} | {scored} of {what} | {seconds:.1f} s")
    figures = {name.removeprefix("val_"): value for name, value in evaluation.fields.items()}
    return {**figures, "data": judge.val_loader.kind, "scored": scored, "on": what, "seconds": seconds}


def score_text(
    model: Transformer,
    tokenizer: Tokenizer,
    streams: list[torch.Tensor],
    batch_size: int,
    what: str,
    start: float,
    log: Callable[..., None],
) -> dict:
    """The loss and bits per byte of every window of the token streams (gptlite.evaluate.bpb)."""
    lengths = byte_lengths(tokenizer, model.config.vocab_size)
    loss, bpb, n = evaluate_windows(model, streams, batch_size, lengths, progress=True)
    seconds = time.perf_counter() - start
    bpb_text = "n/a" if bpb is None else f"{bpb:.4f}"
    log(f"val: loss {loss:.4f} | bpb {bpb_text} | {n:,} tokens of {what} | {seconds:.1f} s")
    return {"loss": loss, "bpb": bpb, "tokens": n, "data": "text", "on": what, "seconds": seconds}


def judge_config(args: EvaluateOptions, model: Transformer) -> tuple[TrainConfig, str | None]:
    """(the config the val split is scored under, the kind of data the run trained on: text, conversations, pairs,
    None for pretrained weights). The config is the run's own (its objective's settings: DPO's beta and loss, the
    model it started from), or for pretrained weights the model's; the data --data_dir's (default: the run's), every
    window scored (eval_iters=0), --batch_size at a time."""
    from gptlite.checkpoint import is_run, load_checkpoint
    from gptlite.config import TrainConfig, build_config

    cfg = TrainConfig(model=model.config)
    trained_on = None
    if is_run(args.model):
        ckpt = load_checkpoint(args.model)
        cfg = build_config(ckpt["config"])
        trained_on = (ckpt.get("data") or {}).get("kind")
    data_dir = args.data_dir or cfg.data_dir
    if not data_dir:  # (a checkpoint made by hand, not by train.py, which always names its data)
        raise ValueError(
            f"--task=val: the run {args.model} names no data_dir in its checkpoint's config; give "
            "--data_dir=DIR (prepared shards) or --text=FILE"
        )
    cfg = dataclasses.replace(cfg, model=model.config, data_dir=data_dir, eval_iters=0, batch_size=args.batch_size)
    return cfg, trained_on


def dpo_reference(args: EvaluateOptions, cfg: TrainConfig, trained_on: str | None, device: str) -> Transformer:
    """The model a DPO run started from (its --init_from), which DPO's figures measure the run against."""
    from gptlite.checkpoint import load_source

    if trained_on != "pairs" or not cfg.init_from:
        raise ValueError(
            f"{cfg.data_dir} holds preference pairs, which are scored as DPO scores them: against the model a DPO run "
            f"started from, and {args.model} is not a DPO run; score a DPO run's folder "
            "(--model=RUN), or text or conversations (--data_dir=DIR)"
        )
    return load_source(cfg.init_from, torch.float32, block_size=cfg.model.block_size).to(device)
