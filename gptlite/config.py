"""Configuration: the model and training dataclasses, TOML loading and `--key=value` overrides.

Precedence is defaults < TOML file < command line. Every value is converted to its field's type,
unknown keys get a "did you mean" hint, and all problems are reported together in one ValueError.
This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# The architecture's variants (gptlite/model.py has one module class for each); the first is the default
POS_EMB_CHOICES = ("learned", "sinusoidal", "rope")
NORM_CHOICES = ("layernorm", "rmsnorm")
FFN_CHOICES = ("swiglu", "gelu")
FFN_MULTIPLE = 64  # SwiGLU width is rounded up to this, so matmuls tile well on GPUs


@dataclass
class GPTConfig:
    """Shape of a GPT model. The defaults are gptlite's own model; GPT-2's is pos_emb="learned",
    norm="layernorm", ffn="gelu", bias=True, and Llama's pos_emb="rope", norm="rmsnorm", ffn="swiglu".
    `ffn_hidden=None` picks 4 * n_embd for gelu and, for swiglu, the width with the same parameter count."""

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False  # biases in every linear layer and norm (GPT-2 has them; the tied head never does)
    pos_emb: str = "learned"  # learned | sinusoidal | rope
    rope_theta: float = 10000.0  # RoPE's base wavelength (pos_emb="rope")
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    ffn: str = "swiglu"  # swiglu | gelu
    ffn_hidden: int | None = None

    def __post_init__(self) -> None:
        if self.ffn_hidden is None and isinstance(self.n_embd, int) and self.n_embd > 0:
            self.ffn_hidden = default_ffn_hidden(self.n_embd, self.ffn)
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_hidden"):
            value = getattr(self, name)
            if name == "ffn_hidden" and value is None:  # its default comes from n_embd, already named above
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.bias, bool):
            problems.append(f"bias={self.bias!r} must be true or false")
        if not problems and self.n_embd % self.n_head != 0:
            problems.append(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_embd as a multiple of n_head (e.g. n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))})"
            )
        if not problems and self.pos_emb == "sinusoidal" and (self.n_embd % 2) != 0:
            problems.append(f"n_embd={self.n_embd} must be even for pos_emb='sinusoidal'")
        if not problems and self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2 != 0:
            problems.append(f"the head width n_embd / n_head = {self.n_embd // self.n_head} must be even for "
                            "pos_emb='rope', which rotates pairs of its coordinates; change n_embd or n_head")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout!r} must be in [0, 1)")
        for name, choices in (("pos_emb", POS_EMB_CHOICES), ("norm", NORM_CHOICES), ("ffn", FFN_CHOICES)):
            if getattr(self, name) not in choices:
                problems.append(f"{name}={getattr(self, name)!r} must be one of {', '.join(choices)}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))


def default_ffn_hidden(n_embd: int, ffn: str = "swiglu") -> int:
    """GPT-2's MLP is 4 * n_embd wide. SwiGLU has three matrices, so 8/3 * n_embd (rounded up to a multiple
    of FFN_MULTIPLE) keeps the parameter count of that MLP."""
    if ffn == "gelu":
        return 4 * n_embd
    hidden = int(8 * n_embd / 3)
    return FFN_MULTIPLE * ((hidden + FFN_MULTIPLE - 1) // FFN_MULTIPLE)


@dataclass
class TrainConfig:
    """Everything train.py needs. Model fields live in `model`; on the command line both are flat keys."""

    model: GPTConfig = field(default_factory=GPTConfig)
    # data and output
    data_dir: str = ""
    out_dir: str = "out"
    resume: bool = False
    overwrite: bool = False  # a fresh run into a folder holding an earlier run moves its files into previous-TIME/
    # start from pretrained weights: gpt2, gpt2-medium, gpt2-large, gpt2-xl (downloaded) or a directory in Hugging
    # Face's layout (GPT-2 or Llama); the model's shape comes from it ("" = from scratch)
    init_from: str = ""
    # batch: `batch_size` sequences per device per micro-step; `total_batch_size` tokens per optimizer
    # step across all devices (0 = one micro-step, no accumulation)
    batch_size: int = 12
    total_batch_size: int = 0
    max_iters: int = 5000
    # the optimizer: AdamW, or "muon": Muon (gptlite/optim.py) for the matrices inside the blocks, AdamW for the
    # embedding, positions and vectors. The schedule: linear warmup to learning_rate, cosine decay to min_lr at
    # lr_decay_iters, or with lr_schedule="time" at the end of the max_minutes time budget (speedruns: any
    # machine's speed); Muon's learning rate follows it in proportion, from muon_lr down
    optimizer: str = "adamw"  # adamw | muon
    learning_rate: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 100
    lr_decay_iters: int = 0  # 0 = max_iters
    lr_schedule: str = "steps"  # steps | time
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    muon_lr: float = 0.02  # Muon's peak learning rate (for a square matrix; see gptlite.optim.lr_scale)
    muon_momentum: float = 0.95  # Nesterov momentum
    muon_weight_decay: float = 0.0  # decoupled: each step multiplies the matrices by 1 - lr * muon_weight_decay
    # evaluation, logging, checkpoints (out_dir/ckpt_NNNNNN.pt at every evaluation; the newest keep_last
    # are kept, plus best.pt, the lowest val loss), out_dir/metrics.jsonl at every log line
    eval_interval: int = 250
    eval_iters: int = 20  # batches per evaluation; 0 = every window of the val split
    log_interval: int = 10
    keep_last: int = 3
    wandb_log: bool = False
    wandb_project: str = "gptlite"
    wandb_run_name: str = ""
    # system
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (autocast precision)
    compile: bool = False
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    seed: int = 1337
    # faults: a non-finite loss or gradient norm skips that update or stops the run; max_minutes > 0 ends
    # the run with a checkpoint once that much wall-clock time has passed
    on_nan: str = "skip"  # skip | stop
    max_minutes: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        positive = ("batch_size", "max_iters", "eval_interval", "log_interval", "keep_last")
        for name in positive:
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        for name in ("total_batch_size", "warmup_iters", "lr_decay_iters", "eval_iters", "grad_clip", "weight_decay",
                     "max_minutes", "muon_lr", "muon_weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.optimizer not in ("adamw", "muon"):
            problems.append(f"optimizer={self.optimizer!r} must be adamw or muon")
        if not 0 <= self.muon_momentum < 1:
            problems.append(f"muon_momentum={self.muon_momentum} must be in [0, 1) (e.g. 0.95)")
        if self.learning_rate < 0 or self.min_lr < 0 or 0 < self.learning_rate < self.min_lr:
            problems.append(
                f"learning_rate={self.learning_rate}, min_lr={self.min_lr}: need 0 <= min_lr <= learning_rate "
                "(learning_rate=0 trains nothing and ignores min_lr: an evaluation-only run)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be one of auto, float32, bfloat16, float16")
        if self.lr_schedule not in ("steps", "time"):
            problems.append(f"lr_schedule={self.lr_schedule!r} must be steps or time")
        if self.lr_schedule == "time" and not self.max_minutes:
            problems.append("lr_schedule='time' decays over the time budget; set max_minutes > 0")
        if self.on_nan not in ("skip", "stop"):
            problems.append(f"on_nan={self.on_nan!r} must be skip or stop")
        if self.fsdp and self.dtype == "float16":
            problems.append("fsdp=true trains in bfloat16 or float32, not float16 (no sharded loss scaler here); "
                            "use dtype=bfloat16")
        if problems:
            raise ValueError("invalid training config: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Loading: defaults < TOML < --key=value


def _flat_fields() -> dict[str, tuple[type, typing.Any]]:
    """Map every flat key to (dataclass, field type). Model and training keys never collide."""
    out: dict[str, tuple[type, typing.Any]] = {}
    for cls in (GPTConfig, TrainConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name != "model":
                out[f.name] = (cls, hints[f.name])
    return out


def convert(key: str, value: typing.Any, typ: typing.Any) -> typing.Any:
    """Convert a TOML or command-line value to the field's type, or raise ValueError naming the key."""
    allowed = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    # the word "none" means None only for a field that allows it: a str field keeps it as text
    if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in allowed):
        if type(None) in allowed:
            return None
        raise ValueError(f"{key}=None is not allowed; give a {allowed[0].__name__}")
    base = next(t for t in allowed if t is not type(None))
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key}={value!r} is not a boolean; use true or false")
    if base is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not an integer")
        if isinstance(value, (int, str)):
            try:
                return int(value)  # exact at any size (a round trip through float is not above 2**53)
            except ValueError:
                pass
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not an integer") from None
        if not as_float.is_integer():
            raise ValueError(f"{key}={value!r} is not an integer")
        return int(as_float)  # accepts 1e3 and 1_000
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a number") from None
    return str(value)


# nanoGPT's config keys that gptlite names or does otherwise: the pointer a user gets instead of "unknown key"
NANOGPT_KEYS = {
    "gradient_accumulation_steps": "gptlite sets the optimizer step in tokens: --total_batch_size=N, and the "
                                   "micro-steps are N / (batch_size * block_size * number of GPUs)",
    "eval_only": "for an evaluation-only run use --learning_rate=0 --max_iters=1 (one step that changes nothing, "
                 "then an evaluation)",
    "always_save_checkpoint": "gptlite saves a checkpoint at every evaluation and keeps the newest --keep_last=N "
                              "plus best.pt, the one with the lowest val loss",
    "decay_lr": "the learning rate always decays from learning_rate to min_lr; for a constant rate set --min_lr to "
                "the --learning_rate",
    "backend": "the process-group backend is picked for you: nccl with CUDA GPUs, gloo otherwise",
    "dataset": "use --data_dir=DIR, the folder of *train*.bin / *val*.bin shards that data/prepare.py writes",
}


def _unknown_key(key: str, known: typing.Iterable[str]) -> str:
    if key in NANOGPT_KEYS:
        return f"'{key}' is nanoGPT's key: {NANOGPT_KEYS[key]}"
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help to list the keys"
    return f"unknown config key '{key}'{hint}"


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """Split argv into an optional TOML path and `--key=value` overrides (`--flag` means true)."""
    toml_path = None
    overrides: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            overrides[key.replace("-", "_")] = value if sep else "true"
        elif toml_path is None and arg.endswith(".toml"):
            toml_path = arg
        else:
            raise ValueError(f"unexpected argument '{arg}'; use a CONFIG.toml file and --key=value overrides")
    return toml_path, overrides


def read_toml(path: str | Path) -> dict[str, typing.Any]:
    """Read a flat TOML config file (a [model] table is also accepted) with a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; see configs/ for presets")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"config file {path}: 'model' must be a table")
    return {**data, **model}


def build_config(values: dict[str, typing.Any]) -> TrainConfig:
    """Build a TrainConfig from flat key -> value pairs (strings or typed), reporting every problem."""
    known = _flat_fields()
    problems = []
    model_kw: dict[str, typing.Any] = {}
    train_kw: dict[str, typing.Any] = {}
    for key, value in values.items():
        if key not in known:
            problems.append(_unknown_key(key, known))
            continue
        cls, typ = known[key]
        try:
            converted = convert(key, value, typ)
        except ValueError as e:
            problems.append(str(e))
            continue
        (model_kw if cls is GPTConfig else train_kw)[key] = converted
    if problems:
        raise ValueError("; ".join(problems))
    model_error = None
    try:
        model = GPTConfig(**model_kw)
    except ValueError as e:
        model_error, model = str(e), GPTConfig()
    try:
        cfg = TrainConfig(model=model, **train_kw)
    except ValueError as e:
        raise ValueError("; ".join(filter(None, [model_error, str(e)]))) from None
    if model_error:
        raise ValueError(model_error)
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict[str, typing.Any]:
    """A flat, JSON- and checkpoint-friendly dict; `build_config(config_to_dict(c)) == c`."""
    flat = dataclasses.asdict(cfg)
    return {**flat.pop("model"), **flat}


def config_help() -> str:
    """One line per key with its default, for `train.py --help`."""
    lines = []
    for key, (cls, typ) in _flat_fields().items():
        default = getattr(cls(), key) if cls is GPTConfig else getattr(TrainConfig(), key)
        lines.append(f"  --{key}={default!r}")
    return "\n".join(lines)
