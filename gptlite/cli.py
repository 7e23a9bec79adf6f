"""The command line every gptlite command shares: its options read into a dataclass, one-line errors and clean
interruptions.

Options. A command's options are the fields of a dataclass (see `option`), read with `parse`: defaults < a TOML
file (an argument ending in .toml) < `--key=value` or `--key value` on the command line. Values are converted to
the field's type ("none" for a field that allows None; true/false for a boolean, whose `--flag` alone means true;
a list field takes every value up to the next `--key`, and gathers repeated `--key=value`s), an unknown key gets a
"did you mean", every problem is reported together, and `--help` lists each field with its help and default. A
renamed option keeps its old spelling working, with a one-line note (`renamed_option`); every command that reads a
model names it with --model (`model_to_read`).

Errors and interruptions (`run_command`), the same exit codes for every command: a user's error, a missing or
unwritable file included, is one line on stderr (exit 2); a computation that diverged (train.py's on_nan=stop) is
one line too (exit 1); SIGINT or SIGTERM, sent to the process group or to the main process alone, ends the
command cleanly (exit 130 or 143, as shells report them) with a line saying what was kept and how to continue; a
reader of its output that went away (`--help | head -1`) ends it quietly (exit 141, as SIGPIPE would).
While train.py's loop runs, `StopSignals` records the signals instead: the step finishes and a checkpoint is
saved first.

This module does not import torch at import time (data preparation starts without it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from gptlite.config import (
    DTYPE_CHOICES,
    FALSE_WORDS,
    QUANTIZE_CHOICES,
    TRUE_WORDS,
    GPTConfig,
    TrainConfig,
    choice_list,
    choice_problems,
    convert,
    flat_fields,
    option,
    read_toml,
    unknown_key,
)
from gptlite.files import CAUSES

USER_ERRORS = (ValueError, TypeError, OSError, ConnectionError, ImportError)  # OSError covers missing files
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Options


def field_types(cls: type) -> dict[str, Any]:
    """Every option of a dataclass with its type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def is_list(typ: Any) -> bool:
    return typing.get_origin(typ) is list


def is_bool(typ: Any) -> bool:
    return typ is bool


def split_argv(
    argv: list[str], types: dict[str, Any], positional: str | None = None, shorts: dict[str, str] | None = None
) -> tuple[str | None, dict[str, Any]]:
    """argv -> (the TOML file, if an argument names one; {key: raw value}). See the module docstring for the
    syntax. Keys are returned as given (dashes as underscores); unknown ones are left for the caller to name."""
    toml_path = None
    values = {}
    plain = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("-") and len(arg) == 2 and shorts and arg[1] in shorts:
            arg = "--" + shorts[arg[1]]
        if not arg.startswith("--") or arg == "--":
            if arg.endswith(".toml") and toml_path is None and (positional is None or not plain):
                toml_path = arg
            else:
                plain.append(arg)
            continue
        key, sep, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        typ = types.get(key)
        if sep:
            raw: Any = value
        elif is_list(typ):  # every value up to the next --key
            raw = []
            while i < len(argv) and not argv[i].startswith("--"):
                raw.append(argv[i])
                i += 1
        elif is_bool(typ) or typ is None:  # a flag alone is true; an unknown key takes no value
            raw = "true"
            if is_bool(typ) and i < len(argv) and argv[i].lower() in TRUE_WORDS + FALSE_WORDS:
                raw, i = argv[i], i + 1
        elif i < len(argv) and not argv[i].startswith("--"):
            raw, i = argv[i], i + 1
        else:
            raise ValueError(f"--{key} needs a value: --{key}=VALUE")
        if is_list(typ):
            values.setdefault(key, []).extend(raw if isinstance(raw, list) else [raw])
        else:
            values[key] = raw
    if plain:
        if positional is None:
            raise ValueError(f"unexpected argument '{plain[0]}'; use a CONFIG.toml file and --key=value overrides")
        values[positional] = plain
    return toml_path, values


def convert_option(key: str, value: Any, typ: Any) -> Any:
    """A raw command-line or TOML value as the field's type (lists element by element)."""
    if is_list(typ):
        (item,) = typing.get_args(typ) or (str,)
        items = value if isinstance(value, list) else [value]
        return [convert(key, v, item) for v in items]
    return convert(key, value, typ)


def parse(cls: type[T], argv: list[str], prog: str = "", doc: str = "") -> T:
    """The dataclass `cls` of a command's options from argv (see the module docstring); every problem in one
    ValueError. The set of keys the user gave is kept in the instance's `given` attribute. `--help` / `-h` raises
    `HelpRequested`, whose text `run_command` prints."""
    if "--help" in argv or "-h" in argv:
        raise HelpRequested(help_text(cls, prog, doc))
    types = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    positional = next((name for name, f in fields.items() if f.metadata.get("positional")), None)
    shorts = {f.metadata["short"]: name for name, f in fields.items() if f.metadata.get("short")}
    toml_path, given = split_argv(argv, types, positional, shorts)
    values = {**(read_toml(toml_path) if toml_path else {}), **given}
    problems, kwargs = [], {}
    for key, value in values.items():
        if key not in types:
            problems.append(unknown_key(key, types, what="option", prefix="--"))
            continue
        try:
            kwargs[key] = convert_option(key, value, types[key])
        except ValueError as e:
            problems.append(str(e))
    problems += choice_problems(cls, kwargs)
    missing = [
        f"--{name}"
        for name, f in fields.items()
        if f.init
        and name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        problems.append(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    if problems:
        raise ValueError("; ".join(problems))
    options = cls(**kwargs)
    object.__setattr__(options, "given", frozenset(kwargs))
    return options


class HelpRequested(Exception):
    """--help was given; the exception's text is the help."""


def help_text(cls: type | tuple[type, ...], prog: str, doc: str) -> str:
    """The command's docstring, then one line per option (of each dataclass): its name, default and help."""
    lines = [doc.strip(), "", f"{prog} options (--key=value or --key value; a CONFIG.toml file may set them too):"]
    options = []
    for c in cls if isinstance(cls, tuple) else (cls,):
        types = typing.get_type_hints(c)  # the fields' types, where f.type may be the annotation's text
        # a nested dataclass (train.py's model: GPTConfig) is listed by its own fields, not as one option
        options += [f for f in dataclasses.fields(c) if f.init and not dataclasses.is_dataclass(types[f.name])]
    for f in options:
        meta = f.metadata
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            name = f"--{f.name} (required)"
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            name = f"{f.name.upper()} ..." if meta.get("positional") else f"--{f.name}={default!r}"
        choices = f" (one of {choice_list(meta['choices'])})" if meta.get("choices") else ""
        lines.append(f"  {name}" + (f"  {meta['help']}{choices}" if meta.get("help") else choices))
    return "\n".join(lines)


def renamed_option(options: Any, new: str, old: tuple[str, ...], prog: str, what: str) -> str:
    """The value of option `new` of a parsed command, given under its own name or an old one (in `old`, kept so
    that users' scripts still run): "" when none was given. An old spelling prints one note on stderr with the
    new spelling; two spellings that disagree are a ValueError. `what` says what the value names ("the model to
    read")."""
    given = {name: getattr(options, name) for name in (new, *old) if getattr(options, name)}
    if len(set(given.values())) > 1:
        spelled = " and ".join(f"--{name}={value}" for name, value in given.items())
        raise ValueError(f"{spelled} each name {what}, and they differ; give it once: --{new}=VALUE")
    if not given:
        return ""
    value = next(iter(given.values()))
    used = [f"--{name}" for name in old if name in given]
    if used:
        report(
            f"{prog}: note: {' and '.join(used)} {'names' if len(used) == 1 else 'name'} {what}; it is spelled "
            f"--{new}={value} now ({' and '.join(used)} still {'works' if len(used) == 1 else 'work'})"
        )
    return value


MODEL_KINDS = "a gptlite run folder, a Hugging Face directory or a hub name such as gpt2"


def model_to_read(options: Any, prog: str, default: str = "") -> str:
    """The one model a command reads (sample.py, evaluate, serve, hf export): its --model, or the same value given
    as --out_dir or --init_from, their old spellings (see renamed_option), else `default`. Whatever gptlite loads
    may be named (MODEL_KINDS): gptlite.checkpoint.load_model takes it as one value. Nothing given, and no
    default, is a ValueError."""
    model = renamed_option(options, "model", ("out_dir", "init_from"), prog, "the model to read") or default
    if not model:
        raise ValueError(f"give the model to read: --model=X, where X is {MODEL_KINDS}")
    return model


@dataclasses.dataclass
class ModelOptions:
    """The options of a command that opens a model for use (sample.py, gptlite.serve, gptlite.evaluate), which
    gptlite.checkpoint.open_model reads: the model (--model, or its old spellings) and its tokenizer, the device, the
    weights' precision, compiling and quantization. Each command's options class inherits them, so that each flag
    has its name, default and choices in one place; a command that words a flag's help its own way declares that
    field again with `reworded`, and one that has no use for a flag declares it again with `init=False` (no flag,
    its default kept). --help lists them first, in this order."""

    model: str = option("", f"the model to open: {MODEL_KINDS}")
    out_dir: str = option("", "the old spelling of --model=RUN (still works)")
    init_from: str = option("", "the old spelling of --model=NAME_OR_DIR (still works)")
    tokenizer: str = option(
        "",
        "a tokenizer.json, .tiktoken ranks file or tiktoken name (default: the run's "
        "tokenizer.json, or a Hugging Face directory's own; GPT-2's BPE for GPT-2)",
    )
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = option(
        "auto",
        "weights' precision; auto = bfloat16 on CUDA, float32 elsewhere",
        choices=DTYPE_CHOICES,
    )
    compile: bool = option(False, "torch.compile the model's steps; the first call compiles")
    quantize: str = option(
        "", "int8 or int4: weight-only quantized weights (int4: on the CPU)", choices=QUANTIZE_CHOICES
    )


def reworded(cls: type, name: str, help: str) -> Any:
    """Option `name` of the dataclass `cls` (ModelOptions) as a command words its help: the same default and
    choices, which stay declared once, in `cls`. Declared in the command's class as `name: type = reworded(...)`."""
    declared = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = declared.metadata
    return option(
        declared.default,
        help,
        choices=meta["choices"],
        positional=meta["positional"],
        short=meta["short"],
        default_factory=declared.default_factory,
    )


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """train.py's argv: (its TOML file or None, {key: raw value}); the keys are checked by build_config."""
    return split_argv(argv, {key: typ for key, (_, typ) in flat_fields().items()})


def config_help() -> str:
    """One line per key of train.py (model and training) with its default and help, for `train.py --help`."""
    return help_text((GPTConfig, TrainConfig), "train.py", "").lstrip()


# ---------------------------------------------------------------------------------------------
# Running a command


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def in_words(e: Exception) -> str:
    """An error's message; an OSError that no command described (e.g. "[Errno 28] No space left on device" from
    a write deep in a library) gets its cause in plain words, its path and the fix."""
    if isinstance(e, OSError) and str(e).startswith("[Errno"):
        where = f"{e.filename}: " if e.filename else ""
        cause, fix = CAUSES.get(e.errno, (e.strerror or str(e), "check the path and the disk"))
        return f"{where}{cause}; {fix}"
    return str(e)


class StopSignals(list):
    """The SIGINT / SIGTERM signals received while installed, recorded instead of ending the process, so that a
    loop can finish its step, save and exit. Outside install() and restore(), run_command's handling applies."""

    def install(self) -> None:
        self.previous = {s: signal.signal(s, self.append_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def append_signal(self, signum: int, frame) -> None:
        self.append(signum)

    def restore(self) -> None:
        for s, handler in getattr(self, "previous", {}).items():
            signal.signal(s, handler)
        self.previous = {}


def report(line: str) -> None:
    """A note's or an error's line on stderr. Under torchrun every process runs the same checks on the same inputs
    (and the ranks stop together on a problem rank 0 found), so rank 0 alone prints it: one line, not one per
    process."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


RANK_GRACE_S = 30.0  # seconds a rank other than 0 waits before it ends on an error (report_error)


def report_error(line: str) -> None:
    """The line of an error that ends the command, as report() prints it, except that a rank other than 0 waits
    RANK_GRACE_S before it returns. torchrun ends every rank once one has exited with an error, so a rank that
    ended first could have rank 0 ended before it printed the line (still importing torch, say), and the command
    would stop without a word. torchrun's SIGTERM ends the waiting rank quietly once rank 0 has failed; a rank
    whose problem rank 0 does not share prints its line after the wait, naming itself. Notes (report()) never
    wait: the command goes on after them."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(line, file=sys.stderr)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(RANK_GRACE_S)
    print(f"rank {rank}: {line}", file=sys.stderr)


def run_body(body: Callable[[], int]) -> int:
    """body()'s exit code, or 0 once the help it asked for is printed; stdout flushed here, where a reader that went
    away (`| head -1`) is a BrokenPipeError run_command answers, not a report at the interpreter's exit."""
    try:
        code = body()
    except HelpRequested as e:
        print(str(e))
        code = 0
    sys.stdout.flush()
    return code


def output_closed() -> int:
    """What a command does when the reader of its output went away (`| head -1`): it stops quietly, as a command
    that SIGPIPE ends, with the rest of its output sent nowhere (Python's flush at exit would fail again) and exit
    code 128 + SIGPIPE's number."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def run_command(prog: str, body: Callable[[], int], on_interrupt: str | Callable[[], str] = "nothing was saved") -> int:
    """body()'s exit code, with one-line errors and clean interruptions (see the module docstring), and --help
    printed. `on_interrupt` (or what it returns, when called then) completes the line printed on an interruption:
    what was kept, how to continue."""
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_body(body)
    except BrokenPipeError:  # before USER_ERRORS, which holds OSError: a reader that left is not an error
        return output_closed()
    except KeyboardInterrupt as e:
        previous = dict.fromkeys(previous, signal.SIG_IGN)  # the command ends: a second Ctrl-C is not a traceback
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        kept = on_interrupt() if callable(on_interrupt) else on_interrupt
        print(f"\n{prog}: interrupted ({signal.Signals(signum).name}); {kept}", file=sys.stderr)
        return 128 + signum
    except USER_ERRORS as e:
        report_error(f"{prog}: error: {in_words(e)}")
        return 2
    except FloatingPointError as e:  # the loss or the gradients went non-finite and the run was told to stop
        report_error(f"{prog}: error: {e}")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
