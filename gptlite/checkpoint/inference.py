"""Loading a model to sample from, evaluate, export or train on: a run's newest checkpoint (a LoRA run's adapters on
their checked base weights) or pretrained weights, with its tokenizer.

What names a model to read, for every command (`--model`; train.py's `--init_from`), is resolved here once
(`is_run`, `source_config`, `load_source`, `source_fingerprint`, `load_model`): a gptlite run folder (its newest
checkpoint; a LoRA run's adapters merged onto its base), a Hugging Face directory, or a hub name (gptlite.hf). So
each stage of a pipeline (pretrain -> SFT -> DPO -> RL) takes the last one's run folder as it is, with no export in
between. A command that uses a model (sample.py, the server, evaluation) opens it with `open_model`, from the options
they share (gptlite.cli.ModelOptions): loaded, moved to its device in its precision, quantized, its kernels loaded,
in one order for all three."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.checkpoint.run_folder import CHECKPOINT_NAME, began_run, load_checkpoint, step_files
from gptlite.config import GPTConfig, build_config, check_model_overrides
from gptlite.gpt import GPT
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, get_tokenizer, load_tokenizer, tokenizer_from_spec
from gptlite.tokenizer.huggingface import has_bpe_files
from gptlite.train.lora import add_lora, merge_lora

if TYPE_CHECKING:
    from gptlite.cli import ModelOptions


def is_run(name: str) -> bool:
    """Whether `name` is a folder that holds a gptlite run's checkpoint (ckpt_NNNNNN.pt or ckpt.pt)."""
    path = Path(name)
    return path.is_dir() and (bool(step_files(path)) or (path / CHECKPOINT_NAME).exists())


def check_saved(name: str) -> None:
    """Refuse a run folder whose run has saved no checkpoint yet (stopped before its first save, or still before
    it) as that, rather than as a directory without a Hugging Face config.json."""
    if not is_run(name) and began_run(name):
        raise FileNotFoundError(
            f"the run in {name} has saved no checkpoint yet (it stopped, or is still running, before its first "
            f"save); continue it with python train.py --out_dir={name} --resume, or name another model"
        )


def source_config(name: str, **overrides) -> GPTConfig:
    """The GPTConfig of what --init_from names: a run folder's (from its checkpoint's config) or a pretrained
    checkpoint's (its config.json only), with `block_size` (at most the model's, for learned positions) and
    `dropout` overridden if given."""
    check_saved(name)
    if not is_run(name):
        from gptlite.hf import pretrained_config

        return pretrained_config(name, **overrides)
    config = build_config(load_checkpoint(name)["config"]).model
    check_model_overrides(config, overrides, name)
    return GPTConfig(**{**vars(config), **overrides})


def load_source(name: str, dtype: torch.dtype | None = None, **overrides) -> GPT:
    """The model --init_from names, in eval mode: a run folder's newest checkpoint (a LoRA run merged onto its
    base), or pretrained weights (GPT.from_pretrained), with `block_size` and `dropout` overridden if given (a
    smaller block keeps the first positions of learned ones, as nanoGPT's crop does)."""
    check_saved(name)
    if not is_run(name):
        return GPT.from_pretrained(name, dtype, **overrides)
    ckpt = load_checkpoint(name)
    model = model_from_checkpoint(ckpt)
    config = source_config(name, **overrides)
    if config != model.config:
        state = model.state_dict()
        if config.pos_emb == "learned":
            state["pos_emb.weight"] = state["pos_emb.weight"][: config.block_size]
        model = GPT(config)
        model.load_state_dict(state)
    model.source_architecture = ckpt["meta"].get("hf_architecture")  # how it exports back, if it came from one
    return (model if dtype is None else model.to(dtype)).eval()


def source_fingerprint(name: str) -> str:
    """The sha256 of what --init_from names, which a LoRA run records of its base: a run folder's weights as
    load_source gives them (name by name), or a pretrained checkpoint's files (gptlite.hf.fingerprint)."""
    if not is_run(name):
        from gptlite.hf import fingerprint

        return fingerprint(name)
    digest = hashlib.sha256()
    for key, tensor in sorted(load_source(name).state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_from_checkpoint(ckpt: dict) -> GPT:
    """Build the GPT described by a checkpoint's config and load its weights. A LoRA run's checkpoint holds its
    adapters alone: its base model is loaded from where init_from names it (checked against the sha256 the run
    recorded) and the adapters merged into it."""
    if "lora" in ckpt:
        return lora_model(ckpt)
    model_config: GPTConfig = build_config(ckpt["config"]).model
    model = GPT(model_config)
    model.check_state(ckpt["model"], "the checkpoint")
    model.load_state_dict(ckpt["model"])
    return model


def lora_model(ckpt: dict, merge: bool = True) -> GPT:
    """The base model of a LoRA checkpoint with its adapters, merged into its weights (or as LoRALinear layers)."""
    lora = ckpt["lora"]
    config = build_config(ckpt["config"])
    check_lora_base(lora["base"], lora["sha256"], "this LoRA run")
    model = load_source(lora["base"], torch.float32, block_size=config.model.block_size)
    add_lora(model, lora["rank"], lora["alpha"], 0.0, tuple(lora["targets"]))
    model.check_state({**model.state_dict(), **ckpt["model"]}, "the LoRA checkpoint")
    model.load_state_dict(ckpt["model"], strict=False)
    return merge_lora(model).requires_grad_(True) if merge else model


def check_lora_base(base: str, sha256: str | None, run: str) -> str:
    """The sha256 of the base weights in `base` (source_fingerprint), which a LoRA run records. A run's adapters
    only make sense on the weights they were trained on: when `sha256`, the one `run` recorded, differs, a
    ValueError; weights that cannot be read are a FileNotFoundError."""
    try:
        found = source_fingerprint(base)
    except (OSError, ConnectionError) as e:
        raise FileNotFoundError(
            f"the LoRA run's base model {base} cannot be read ({e}); its adapters need it where --init_from named it"
        ) from None
    if sha256 is not None and found != sha256:
        raise ValueError(
            f"the base weights in {base} are not the ones {run} was trained on (sha256 {found[:12]}..., the run's "
            f"{sha256[:12]}...); put the original weights back there, or start a new run"
        )
    return found


def open_model(
    options: ModelOptions,
    prog: str,
    local_rank: int = 0,
    after_loading: Callable[[], object] | None = None,
    compiling: str = "",
    uncompiled: str = "",
) -> tuple[GPT, Tokenizer]:
    """The model a command uses (sample.py, gptlite.serve, gptlite.evaluate: `prog`) as its options say, in eval
    mode, with its tokenizer. In this order: the quantization is checked (before anything is read); the device and
    precision are chosen (options.device and options.dtype are set to the choice: "auto" resolved, under torchrun
    the GPU of `local_rank`); the model is loaded (load_model: what --model names) and moved to the device in that
    precision; quantized (options.quantize); `after_loading()` is called (sample.py prints the warnings it held, so
    that they come before anything below); on the CPU, gptlite's compiled kernels are loaded (their first build
    says so on stderr, before the command's output); and with options.compile, `compiling` is a note on stderr that
    the first steps wait, or, where `uncompiled` says what the command does without compiling ("serving
    uncompiled"), torch.compile is checked here: where it cannot work, a warning says why and options.compile is set
    to False. Compiling itself is the command's: each compiles its own steps (sample.py the decode step, the server
    its prefill and decode)."""
    from gptlite.device import compile_unavailable, pick_device, pick_dtype
    from gptlite.inference.cpu import native
    from gptlite.inference.quantize import check_mode

    check_mode(options.quantize)  # before anything is loaded
    options.device = pick_device(options.device, local_rank)
    options.dtype = pick_dtype(options.dtype, options.device)
    model, tokenizer = load_model(init_from=options.model, tokenizer=options.tokenizer)
    model = model.to(options.device, getattr(torch, options.dtype)).eval()
    if options.quantize:
        model.quantize(options.quantize)
    if after_loading is not None:
        after_loading()
    if options.device == "cpu":
        native.load_for_command(prog)  # the kernels' first build at start-up, not in the first step
    unavailable = compile_unavailable(options.device.split(":")[0]) if options.compile and uncompiled else None
    if unavailable:  # a speed-up: every step would otherwise end in the compiler's error
        print(f"{prog}: warning: torch.compile is unavailable ({unavailable}); {uncompiled}", file=sys.stderr)
        options.compile = False
    elif options.compile and compiling:
        sys.stderr.write(f"{prog}: note: --compile: {compiling}\n")
    return model, tokenizer


def load_model(out_dir: str | Path = "", init_from: str = "", tokenizer: str = "") -> tuple[GPT, Tokenizer]:
    """A model to sample from or evaluate, on the CPU in float32, with its tokenizer: a run's newest checkpoint
    (out_dir), or what a command's --model names (init_from: a run folder, or pretrained weights: see
    GPT.from_pretrained; a name that is neither is refused by gptlite.hf.check_model_name). The tokenizer is
    `tokenizer` (a tokenizer.json or a folder holding one, a .tiktoken file or tiktoken name) if given, else the
    run's tokenizer.json (in out_dir, or beside its training data), else a pretrained directory's own tokenizer.json,
    else, for a GPT-2 checkpoint (50,257 ids), GPT-2's BPE through tiktoken. A command opens its model with
    open_model, which moves and quantizes it as the command's options say."""
    if init_from and is_run(init_from):  # a run folder, named as --init_from: as --out_dir names it
        out_dir = init_from
    elif init_from:
        check_saved(init_from)
        model = GPT.from_pretrained(init_from)
        if tokenizer:
            return model, tokenizer_from_spec(tokenizer)
        own = source_tokenizer(init_from)
        if own is not None:
            return model, own
        if model.config.vocab_size != 50257:
            raise ValueError(
                f"{init_from} is not GPT-2 ({model.config.vocab_size} ids), so its tokenizer is unknown to "
                "gptlite (no tokenizer.json beside its weights); pass one (--tokenizer=PATH: a "
                "tokenizer.json, a folder holding one, or a .tiktoken file)"
            )
        return model, get_tokenizer("gpt2")
    ckpt = load_checkpoint(out_dir)
    if tokenizer:
        return model_from_checkpoint(ckpt), tokenizer_from_spec(tokenizer)
    own = run_tokenizer(Path(out_dir), ckpt)
    if own is None:
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} in {out_dir} or the training data_dir; copy the data's {TOKENIZER_FILE} into "
            f"{out_dir}"
        )
    return model_from_checkpoint(ckpt), own


def source_tokenizer(name: str) -> Tokenizer | None:
    """The tokenizer of what --init_from names, where gptlite can tell it without a download: a run folder's
    (`run_tokenizer`) or a Hugging Face directory's own files; None for a hub name (or a directory without one)."""
    if is_run(name):
        return run_tokenizer(Path(name), load_checkpoint(name))
    if (Path(name) / TOKENIZER_FILE).is_file() or has_bpe_files(Path(name)):
        return load_tokenizer(name)
    return None


def run_tokenizer(run: Path, ckpt: dict) -> Tokenizer | None:
    """The tokenizer a run trained with: its tokenizer.json, else its data folder's (None if neither is there),
    checked against the fingerprint its checkpoint recorded (a file replaced since is refused, naming both)."""
    for path in (run / TOKENIZER_FILE, Path(ckpt["config"].get("data_dir", "")) / TOKENIZER_FILE):
        if path.is_file():
            break
    else:
        return None
    tokenizer = load_tokenizer(path)
    recorded = ckpt.get("meta", {}).get("tokenizer")  # None in checkpoints from before tokenizers were recorded
    if recorded and tokenizer.fingerprint() != recorded["fingerprint"]:
        raise ValueError(
            f"{path} is not the tokenizer the run in {run} trained with (fingerprint {tokenizer.fingerprint()}, "
            f"{tokenizer.vocab_size:,} ids; its checkpoint records {recorded['fingerprint']}, "
            f"{recorded['vocab_size']:,} ids); put the run's own {TOKENIZER_FILE} back, or pass --tokenizer=PATH"
        )
    return tokenizer
