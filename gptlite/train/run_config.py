"""A training run's configuration, resolved: train.py's command line and TOML file (gptlite.config) completed by what
the run builds on. On --resume the run's own checkpoint gives the base (before its first checkpoint, the config it
recorded as it started, run.json), and what cannot change on a resume (the model's shape, a LoRA run's adapters,
the optimizer whose state it holds, the budget its recipe was derived for) is refused in one line; with --init_from
the pretrained model's config.json gives the shape (and vocab_size grows for the special tokens the data's tokenizer
added to the model's); and otherwise the data's tokenizer.json gives vocab_size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptlite.checkpoint import RUN_FILE, load_checkpoint, recorded_config, source_config
from gptlite.cli import HelpRequested, config_help, parse_args
from gptlite.config import TrainConfig, build_config, convert, flat_fields, model_changes, read_toml, unknown_key
from gptlite.scaling.recipe import parse_budget
from gptlite.tokenizer import TOKENIZER_FILE, load_tokenizer
from gptlite.train import lora, preference, rl

NO_DATA_DIR = "data_dir is not set; pass --data_dir=DIR (a folder of *train*.bin / *val*.bin shards)"


def resolve_config(argv: list[str], doc: str = "", notes: list[str] | None = None) -> TrainConfig:
    """train.py's TrainConfig from its argv: defaults < TOML < --key=value, on --resume over the checkpoint's config,
    with --init_from over the pretrained model's shape; otherwise vocab_size comes from the data. With --budget the
    recipe derived for it (gptlite.scaling.derive) goes under the TOML and the command line, and a line per choice
    goes to `notes`. `--help` raises HelpRequested with `doc` and every key."""
    if "-h" in argv or "--help" in argv:
        raise HelpRequested(doc.strip() + "\n\n" + config_help())
    toml_path, overrides = parse_args(argv)
    values = {**(read_toml(toml_path) if toml_path else {}), **overrides}
    unknown = [unknown_key(k, flat_fields()) for k in values if k not in flat_fields()]
    if unknown:  # before anything is read: a typo is named first
        raise ValueError("; ".join(unknown))
    if values.get("budget"):  # a budget that is none, or past what the laws can take, is named before anything else
        parse_budget(str(values["budget"]))
    if values.get("init_from") in ("scratch", "resume"):  # nanoGPT's values, which mean the same here
        if values.pop("init_from") == "resume":
            values.setdefault("resume", True)
    out_dir = values.get("out_dir", TrainConfig.out_dir)
    saved, holder = None, ""
    if convert("resume", values.get("resume", False), bool):
        if convert("overwrite", values.get("overwrite", False), bool):
            raise ValueError(
                f"--overwrite and --resume contradict: --overwrite moves the earlier run in {out_dir} aside for a new "
                "one, --resume continues it; give one of them"
            )
        saved, holder = resumed_config(out_dir)
    if saved and holder == RUN_FILE:
        check_recorded(saved, values, Path(out_dir) / RUN_FILE)
    if saved:
        check_resume(values, saved, out_dir, holder)
        if values.get("budget"):
            (notes if notes is not None else []).append(
                f"--budget={values['budget']}: the run's own; it goes on with the recipe derived when it began"
            )
        values = {**saved, **values}
    elif values.get("init_from"):
        values = {**pretrained_values(str(values["init_from"]), values), **values}
        model_vocab = int(values["vocab_size"])
        values["vocab_size"] = vocab_with_added_tokens(values.get("data_dir") or "", model_vocab)
        if values["vocab_size"] > model_vocab and values.get("lora_rank") not in (None, "none", "None"):
            raise ValueError(
                f"the data's tokenizer in {values['data_dir']} adds {values['vocab_size'] - model_vocab} token(s) to "
                f"{values['init_from']}'s (a chat template's markers): their embeddings must be trained, and LoRA "
                "keeps the embeddings frozen; fine-tune without --lora_rank, or prepare the data with a tokenizer "
                "that has a chat template"
            )
    if "vocab_size" not in values:
        if not values.get("data_dir"):
            raise ValueError(NO_DATA_DIR)
        values["vocab_size"] = read_vocab_size(values["data_dir"])
    if values.get("budget") and not saved:
        values = budget_values(values, notes if notes is not None else [])
    elif values.get("scaling_laws") and not saved:
        raise ValueError(
            f"--scaling_laws={values['scaling_laws']} is read only to derive a recipe for --budget; add --budget=... "
            "(e.g. 90s), or leave --scaling_laws out"
        )
    return check_training_options(build_config(values))


def check_training_options(cfg: TrainConfig) -> TrainConfig:
    """`cfg`, once the options of each way of training agree with themselves: LoRA's (gptlite.train.lora), DPO's
    (gptlite.train.preference) and RL's (gptlite.train.rl), whose rules sit beside that way of training, not in
    gptlite.config, which knows no objective. Every problem together, in one ValueError, as TrainConfig reports its
    own; checked as the run is resolved, before anything is read or written."""
    problems = [*lora.option_problems(cfg), *preference.option_problems(cfg), *rl.option_problems(cfg)]
    if problems:
        raise ValueError("invalid training config: " + "; ".join(problems))
    return cfg


def resumed_config(out_dir: str) -> tuple[dict[str, Any] | None, str]:
    """(The config a --resume goes on with, what holds it): its newest intact checkpoint's, else (a run stopped
    before its first save) the one it recorded as it started (run.json), else None: train.py says so and starts
    from scratch."""
    try:
        ckpt = load_checkpoint(out_dir, on_fallback=lambda message: None)  # train.py reports the fallbacks
    except FileNotFoundError:
        return recorded_config(out_dir), RUN_FILE
    return ckpt["config"], "checkpoint"


def check_recorded(saved: dict[str, Any], values: dict[str, Any], path: Path) -> None:
    """A run.json's config (`saved`), as build_config reads it, but for the keys the command line gives (`values`,
    which win): a key or value edited by hand is named as run.json's, not blamed on the command line."""
    try:
        check_training_options(build_config({k: v for k, v in saved.items() if k not in values}))
    except ValueError as e:
        raise ValueError(
            f"{path}, the config the run recorded as it started: {e}; correct it there (or give the key on the command "
            "line), or delete run.json and give the run's settings again"
        ) from None


def budget_values(values: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """`values` over the recipe derived for values["budget"] (every key given wins, and is said so)."""
    from gptlite.device import pick_device
    from gptlite.scaling.derive import derive

    if values.get("init_from"):
        raise ValueError(
            f"--budget={values['budget']} derives a model to train from scratch, and --init_from="
            f"{values['init_from']} gives one; leave --budget out and set max_iters or max_minutes"
        )
    vocab_size = int(convert("vocab_size", values["vocab_size"], int))
    device = pick_device(str(values.get("device", "auto")))
    derived, lines = derive(
        str(values["budget"]), values["data_dir"], vocab_size, device, values.get("scaling_laws", ""), values
    )
    notes.extend(lines)
    for key, value in values.items():
        if key in derived and str(derived[key]) != str(value):
            notes.append(f"{key}={value}: as given (the recipe's {derived[key]})")
    return {**derived, **values}


def check_resume(values: dict[str, Any], saved: dict[str, Any], out_dir: str, holder: str = "checkpoint") -> None:
    """Refuse what a resume cannot change: the model's shape, a LoRA run's adapters and base model, the weights it
    started from (--init_from), the seed of the random streams a checkpoint holds, the budget (and laws) its recipe
    was derived from, the optimizer (the checkpoint holds its state)."""
    changed = [f"{k}={v} ({holder} has {old})" for k, v, old in model_changes(values, saved)]
    if changed:
        raise ValueError(
            f"cannot change the model shape on --resume from {out_dir}: {', '.join(changed)}; drop those flags to go "
            "on with the run's own, or start a new run in another --out_dir"
        )
    lora = [
        f"{k}={values[k]} ({holder} has {saved.get(k)})"
        for k in ("lora_rank", "lora_targets", "init_from")
        if k in values and saved.get("lora_rank") and str(values[k]) != str(saved.get(k))
    ]
    if lora:
        raise ValueError(f"cannot change the adapters on --resume of the LoRA run in {out_dir}: {', '.join(lora)}")
    if "init_from" in values and not same_source(str(values["init_from"] or ""), str(saved.get("init_from") or "")):
        began = f"init_from={saved['init_from']}" if saved.get("init_from") else "no init_from: it trained from scratch"
        raise ValueError(
            f"cannot apply --init_from={values['init_from']} on --resume from {out_dir}: the run goes on from its own "
            f"weights ({holder} has {began}); drop --init_from to resume, or start a new run from those weights in "
            "another --out_dir"
        )
    if holder == "checkpoint" and "seed" in values and convert("seed", values["seed"], int) != saved.get("seed"):
        raise ValueError(
            f"cannot apply --seed={values['seed']} on --resume from {out_dir}: the run's random streams and data order "
            f"go on from its checkpoint (checkpoint has seed={saved.get('seed')}); drop --seed, or start a new run in "
            "another --out_dir"
        )
    derived = [
        f"--{k}={values[k]}"
        for k in ("budget", "scaling_laws")
        if values.get(k) and str(values[k]) != str(saved.get(k) or "")
    ]
    if derived:
        own = f"--budget={saved['budget']}" if saved.get("budget") else "the keys it was given, no --budget"
        raise ValueError(
            f"cannot apply {' '.join(derived)} on --resume from {out_dir}: a budget derives a new run's recipe (the "
            f"model's size among the rest), and the run goes on with its own ({own}); drop it, or start a new run "
            "in another --out_dir"
        )
    if "optimizer" in values and values["optimizer"] != saved.get("optimizer", "adamw"):
        state = ", whose state it holds" if holder == "checkpoint" else ""
        raise ValueError(
            f"cannot change the optimizer on --resume from {out_dir}: optimizer={values['optimizer']} "
            f"({holder} has {saved.get('optimizer', 'adamw')}{state}); drop --optimizer, or start a new run in "
            "another --out_dir"
        )


def same_source(a: str, b: str) -> bool:
    """Whether two --init_from values name the same model: the same text, or paths to the same folder."""
    return a == b or (bool(a) and bool(b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def pretrained_values(init_from: str, values: dict[str, Any]) -> dict[str, Any]:
    """The model keys of what --init_from names (a run folder's checkpoint config, or a pretrained checkpoint's
    config.json only), after checking that `values` changes none of them but block_size (which may be smaller) and
    dropout."""
    pretrained = dict(vars(source_config(init_from)))
    changed = [f"{k}={v} (the model has {old})" for k, v, old in model_changes(values, pretrained) if k != "block_size"]
    if changed:
        raise ValueError(
            f"--init_from={init_from} fixes the model's shape; drop {', '.join(changed)} "
            "(block_size may be smaller, dropout anything)"
        )
    return pretrained


def vocab_with_added_tokens(data_dir: str, model_vocab: int) -> int:
    """The vocab_size of a pretrained model of `model_vocab` ids trained on data_dir: its own, or more where the
    data's tokenizer is the model's plus special tokens it added past the model's ids (data/prepare.py --chat adds
    ChatML's markers to a tokenizer without a chat template). train.py then grows the embeddings for them
    (GPT.grow_vocab). A tokenizer larger than the model by more than its added tokens is another model's: the
    shards' check says so."""
    path = Path(data_dir) / TOKENIZER_FILE
    if not data_dir or not path.is_file():
        return model_vocab
    tokenizer = load_tokenizer(path)
    own = tokenizer.vocab_size - len(tokenizer.added)
    return tokenizer.vocab_size if own <= model_vocab < tokenizer.vocab_size else model_vocab


def read_vocab_size(data_dir: str) -> int:
    """vocab_size recorded in DATA_DIR/tokenizer.json by data/prepare.py."""
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(
            f"data_dir {data_dir} does not exist or is not a folder; prepare data there first "
            f"(python data/prepare.py --input=... --out_dir={data_dir}, or python data/fineweb/download.py "
            f"--out_dir={data_dir} for FineWeb's GPT-2 tokens) or check the path"
        )
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist, so the vocabulary size is unknown; pass --vocab_size=N "
            "(e.g. 50304 for GPT-2 token shards) or prepare the data with data/prepare.py"
        )
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} has no valid vocab_size ({e}); prepare the data again or pass --vocab_size=N"
        ) from None
