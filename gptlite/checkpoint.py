"""Checkpoints and the run folders that hold them: atomic, checksummed saves; a run directory that keeps the newest
few plus the best, claimed and locked by one run at a time; safe loading (`weights_only=True`) that falls back past
a damaged file; rebuilding a model from one; and the training state a checkpoint holds, gathered from every rank
and put back on a resume.

A checkpoint is a plain dict of tensors and primitive values (train.py builds it with `run_checkpoint`, below):
    config          the flat training config (see gptlite.config.config_to_dict)
    model           the uncompiled, unwrapped module's state_dict (no `_orig_mod.` or `module.` prefixes); a LoRA
                    run's holds its adapters alone (lora_A, lora_B)
    optimizer       the optimizers' state (AdamW's, and Muon's with optimizer="muon") keyed by parameter name
                    (torch.distributed.checkpoint's full state dict, one for all)
    scaler          the fp16 GradScaler's state ({} when unused)
    step            optimizer steps taken; the learning-rate schedule is a function of it
    loader          the objective's position in its data (gptlite.objective: the train loader's state, see
                    gptlite.data.ShardLoader.state; an RL run's prompt order, gptlite.rl.PromptLoader.state)
    world_size      the processes that trained
    rng             one entry per rank: python, numpy, torch CPU and CUDA generator states
    best_val_loss   the lowest val loss so far (best.pt's)
    val_loss        this save's val loss (None for a save without an evaluation: a stop)
    meta            git_commit, command (the command line), wandb_run_id (what a resumed run continues) and
                    hf_architecture (the Hugging Face architecture --init_from was read as: how it exports back)
and, where they apply:
    lora            a LoRA run's adapters: base (its --init_from), sha256 (those base weights' fingerprint,
                    gptlite.hf.fingerprint), rank, alpha, targets
    ema             ema_decay: the weights' moving average (gptlite.optim.WeightAverage.state_dict)
    trained_model   a run that ended as its moving average: the weights it trained, which --resume continues from
                    (`model` then holds the average)

A run directory (train.py's out_dir) holds
    ckpt_000500.pt          one file per save, each beside ckpt_000500.pt.sha256 (`sha256sum -c` reads it)
    ckpt.pt, best.pt        symlinks to the newest file and to the one with the lowest val loss
A file is written under a temporary name and renamed only once it and its checksum are on disk, so a crash
at any moment leaves the earlier files whole; loading a directory takes the newest file whose checksum holds.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gptlite.config import GPTConfig, build_config
from gptlite.files import FolderLock, fault, fsync_dir, make_dir
from gptlite.lora import add_lora, lora_state_dict, merge_lora
from gptlite.model import GPT
from gptlite.tokenizer import TOKENIZER_FILE, Tokenizer, get_tokenizer, load_tokenizer, tokenizer_from_spec
from gptlite.tokenizer.huggingface import has_bpe_files

CHECKPOINT_NAME = "ckpt.pt"  # the newest checkpoint of a run directory
BEST_NAME = "best.pt"  # the checkpoint with the lowest val loss
STEP_FILE = "ckpt_{step:06d}.pt"
STEP_FILE_RE = re.compile(r"ckpt_(\d+)\.pt")
CHECKSUM_SUFFIX = ".sha256"
READ_CHUNK = 1 << 20


class _HashingWriter:
    """Passes torch.save's writes to a file and hashes them on the way, so the checksum needs no second read.
    A failed write is kept in `error` (torch.save reports it as a RuntimeError of its own)."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.error = None

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def _write_durably(path: Path, write: Callable) -> None:
    """Call write(f) on path's temp file, fsync it, then rename it over path."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: str | Path, checkpoint: dict) -> None:
    """Write atomically with a checksum: path.tmp, then path.sha256, then rename path.tmp to path.

    Until the last rename the old `path` (if any) is untouched. Give each save a new name (as
    `save_run_checkpoint` does): overwriting a name leaves a moment where its old bytes meet the new checksum.
    """
    path = Path(path)
    make_dir(path.parent)
    tmp, writer = path.with_name(path.name + ".tmp"), None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(checkpoint, writer)
            f.flush()
            os.fsync(f.fileno())
        line = f"{writer.sha.hexdigest()}  {path.name}\n".encode()
        _write_durably(_checksum_path(path), lambda f: f.write(line))
    except BaseException as e:  # a full disk, an interruption: nothing half-written stays behind
        for leftover in (tmp, _checksum_path(path).with_name(_checksum_path(path).name + ".tmp")):
            leftover.unlink(missing_ok=True)
        cause = next((c for c in (e, getattr(writer, "error", None), e.__context__) if isinstance(c, OSError)), None)
        if cause is not None:
            raise fault(cause, f"could not save checkpoint {path}") from None
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def step_files(run_dir: str | Path) -> list[Path]:
    """The ckpt_NNNNNN.pt files of a run directory, newest step first."""
    run_dir = Path(run_dir)
    found = [(int(m.group(1)), p) for p in run_dir.glob("ckpt_*.pt") if (m := STEP_FILE_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _step(path: Path) -> int:
    return int(STEP_FILE_RE.fullmatch(path.name).group(1))


def run_files(run_dir: str | Path) -> list[Path]:
    """What a run wrote in its folder: step files and their checksums, ckpt.pt, best.pt, metrics.jsonl and the
    copied tokenizer.json (the `--overwrite` of a fresh run moves them aside)."""
    run_dir = Path(run_dir)
    named = [run_dir / n for n in (CHECKPOINT_NAME, BEST_NAME, "metrics.jsonl", TOKENIZER_FILE)]
    return [
        p
        for p in [*step_files(run_dir), *map(_checksum_path, step_files(run_dir)), *named]
        if p.is_file() or p.is_symlink()
    ]


def holds_run(run_dir: str | Path) -> bool:
    """Whether a run saved anything in run_dir: a checkpoint, or a row of metrics."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    return (
        bool(step_files(run_dir))
        or (run_dir / CHECKPOINT_NAME).exists()
        or (metrics.is_file() and metrics.stat().st_size > 0)
    )


def remove_leftovers(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files a crash or a full disk left in a run folder (held by this process)."""
    run_dir = Path(run_dir)
    leftovers = [*run_dir.glob("*.pt*.tmp"), *(run_dir / f"{n}.tmp" for n in ("metrics.jsonl", TOKENIZER_FILE))]
    leftovers = [p for p in leftovers if p.exists() or p.is_symlink()]
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def _point(link: Path, target: Path) -> None:
    """Atomically make `link` a relative symlink to `target` (a new link renamed over the old one)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def save_run_checkpoint(run_dir: str | Path, checkpoint: dict, keep_last: int = 3, best: bool = False) -> Path:
    """Save as run_dir/ckpt_{step}.pt, point ckpt.pt (and best.pt when `best`) at it, then delete all but the
    newest `keep_last` step files and best.pt's target, and any temp files a crash left behind."""
    run_dir = Path(run_dir)
    path = run_dir / STEP_FILE.format(step=checkpoint["step"])
    save_checkpoint(path, checkpoint)
    _point(run_dir / CHECKPOINT_NAME, path)
    if best:
        _point(run_dir / BEST_NAME, path)
    keep = set(step_files(run_dir)[:keep_last])
    if (run_dir / BEST_NAME).is_symlink():
        keep.add(run_dir / os.readlink(run_dir / BEST_NAME))
    for old in step_files(run_dir):
        if old not in keep:
            old.unlink()
            _checksum_path(old).unlink(missing_ok=True)
    for leftover in run_dir.glob("*.pt*.tmp"):  # a save or a link swap cut short by a crash
        leftover.unlink()
    for checksum in run_dir.glob("ckpt_*.pt" + CHECKSUM_SUFFIX):
        if not checksum.with_suffix("").exists():  # the crash came between the checksum and the rename
            checksum.unlink()
    fsync_dir(run_dir)
    return path


def discard_damaged(run_dir: str | Path, step: int) -> list[Path]:
    """After a resume from `step` because newer files were damaged: delete the damaged step files newer than it
    (and best.pt if it named one) and point ckpt.pt at step's file; returns the deleted files. Intact newer
    files stay (they are not this run's saves: load_checkpoint follows ckpt.pt)."""
    run_dir = Path(run_dir)
    damaged = []
    for path in step_files(run_dir):
        if _step(path) > step:
            try:
                verify_checkpoint(path)
            except ValueError:
                damaged.append(path)
    best = run_dir / BEST_NAME
    if best.is_symlink() and run_dir / os.readlink(best) in damaged:
        best.unlink()
    for path in damaged:
        path.unlink()
        _checksum_path(path).unlink(missing_ok=True)
    resumed = run_dir / STEP_FILE.format(step=step)
    if damaged and resumed.is_file():
        _point(run_dir / CHECKPOINT_NAME, resumed)
    return damaged


def claim_run_folder(run_dir: str | Path, resume: bool, overwrite: bool, log: Callable[[str], None]) -> FolderLock:
    """Make run_dir and lock it for this run (a second train.py on it is refused, naming the process), delete the
    temporary files a crash left, and refuse a fresh run (not `resume`) into a folder that holds an earlier run's
    checkpoints or metrics, unless `overwrite`, which moves them into run_dir/previous-TIME/ first. Returns the
    lock, held until released or the process ends."""
    run_dir = Path(run_dir)
    make_dir(run_dir, "out_dir")
    lock = FolderLock(run_dir, "out_dir")
    try:
        for path in remove_leftovers(run_dir):
            log(f"deleted {path}, a temporary file an interrupted save left")
        earlier = run_files(run_dir) if not resume and holds_run(run_dir) else []
        if earlier and not overwrite:
            raise ValueError(
                f"out_dir {run_dir} holds an earlier run ({', '.join(p.name for p in earlier[:3])}"
                f"{', ...' if len(earlier) > 3 else ''}); continue it with --resume, choose another --out_dir, or "
                "pass --overwrite to move its files into a previous-TIME folder inside it first"
            )
        if earlier:
            previous = make_dir(run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
            for path in earlier:
                os.replace(path, previous / path.name)
            log(f"moved the earlier run's {len(earlier)} files into {previous} (--overwrite)")
    except BaseException:
        lock.release()
        raise
    return lock


def copy_tokenizer(data_dir: str | Path, run_dir: str | Path) -> None:
    """Copy the data's tokenizer.json, if it has one, into the run folder (sample.py and the server decode with
    it): copied whole under a temporary name, then renamed."""
    source = Path(data_dir) / TOKENIZER_FILE
    run_dir = Path(run_dir)
    if not source.is_file():
        return
    tmp = run_dir / f"{TOKENIZER_FILE}.tmp"
    try:
        shutil.copyfile(source, tmp)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise fault(e, f"could not copy {source} into {run_dir}") from None
    os.replace(tmp, run_dir / TOKENIZER_FILE)


def git_commit(folder: str | Path) -> str:
    """The commit checked out in the git work tree that holds `folder`, for a checkpoint's meta ("unknown" outside
    one, or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=folder)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def verify_checkpoint(path: str | Path) -> None:
    """Raise ValueError if a checkpoint file's bytes do not match the sha256 saved beside it (beside the
    symlink's target for ckpt.pt and best.pt). A file without a checksum (older gptlite) is not checked."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    checksum = _checksum_path(real)
    if not checksum.is_file():
        return
    expected = (checksum.read_text().split() or [""])[0]
    sha = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            sha.update(chunk)
    if sha.hexdigest() != expected:
        raise ValueError(
            f"checkpoint {path} is damaged: its {real.stat().st_size} bytes do not match the sha256 in "
            f"{checksum.name} (cut short or changed after it was saved)"
        )


def _load_file(path: Path, map_location: str | torch.device) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; train first (python train.py ... --out_dir={path.parent})"
        )
    verify_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); it is damaged or not "
            "a gptlite checkpoint"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"checkpoint {path} is not a gptlite checkpoint (no 'model' and 'config' entries)")
    return ckpt


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", on_fallback: Callable[[str], None] | None = None
) -> dict:
    """Load a checkpoint file, or a run directory's newest intact one, without unpickling arbitrary objects.

    A damaged file (checksum mismatch, unreadable) raises ValueError. In a directory a damaged file is
    skipped for the next older one, and `on_fallback` (default: warnings.warn) gets a line saying so.
    """
    path = Path(path)
    if path.suffix == ".pt":
        return _load_file(path, map_location)
    candidates = step_files(path) if path.is_dir() else []
    link = path / CHECKPOINT_NAME
    named = STEP_FILE_RE.fullmatch(os.readlink(link)) if link.is_symlink() else None
    if named:  # the run's newest save; newer step files are not its saves (another run's, or a cut-short swap)
        candidates = [p for p in candidates if _step(p) <= int(named.group(1))]
    legacy = path / CHECKPOINT_NAME  # a run directory written before ckpt_NNNNNN.pt files
    if legacy.is_file() and not legacy.is_symlink():
        candidates.append(legacy)
    if not candidates:
        raise FileNotFoundError(
            f"checkpoint {legacy} does not exist (nor any ckpt_NNNNNN.pt in {path}); "
            f"train first (python train.py ... --out_dir={path})"
        )
    damaged = []
    for candidate in candidates:
        try:
            ckpt = _load_file(candidate, map_location)
        except ValueError as e:
            damaged.append(str(e))
            continue
        if damaged:
            message = f"{'; '.join(damaged)}; loaded {candidate} instead"
            if on_fallback:
                on_fallback(message)
            else:
                warnings.warn(message, stacklevel=2)
        return ckpt
    raise ValueError("; ".join(damaged) + ("" if len(damaged) == 1 else f"; no intact checkpoint is left in {path}"))


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
    lora, config = ckpt["lora"], build_config(ckpt["config"])
    check_lora_base(lora["base"], lora["sha256"], "this LoRA run")
    model = GPT.from_pretrained(lora["base"], torch.float32, block_size=config.model.block_size)
    add_lora(model, lora["rank"], lora["alpha"], 0.0, tuple(lora["targets"]))
    model.check_state({**model.state_dict(), **ckpt["model"]}, "the LoRA checkpoint")
    model.load_state_dict(ckpt["model"], strict=False)
    return merge_lora(model).requires_grad_(True) if merge else model


def check_lora_base(base: str, sha256: str | None, run: str) -> str:
    """The sha256 of the base weights in `base` (gptlite.hf.fingerprint), which a LoRA run records. A run's adapters
    only make sense on the weights they were trained on: when `sha256`, the one `run` recorded, differs, a
    ValueError; weights that cannot be read are a FileNotFoundError."""
    from gptlite.hf import fingerprint

    try:
        found = fingerprint(base)
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


def load_model(
    out_dir: str | Path = "", init_from: str = "", tokenizer: str = "", quantize: str = ""
) -> tuple[GPT, Tokenizer]:
    """A model to sample from or evaluate, on the CPU in float32, with its tokenizer: a run's newest checkpoint
    (out_dir), or pretrained weights (init_from: see GPT.from_pretrained). The tokenizer is `tokenizer` (a
    tokenizer.json or a folder holding one, a .tiktoken file or tiktoken name) if given, else the run's
    tokenizer.json (in out_dir, or beside its training data), else a pretrained directory's own tokenizer.json,
    else, for a GPT-2 checkpoint (50,257 ids), GPT-2's BPE through tiktoken.
    quantize="int8" quantizes the weights for inference (see gptlite.quantize)."""
    from gptlite.quantize import check_mode

    check_mode(quantize)  # before anything is loaded
    model, tok = _load_model(out_dir, init_from, tokenizer)
    return (model.quantize(quantize) if quantize else model), tok


def _load_model(out_dir: str | Path, init_from: str, tokenizer: str) -> tuple[GPT, Tokenizer]:
    if init_from:
        model = GPT.from_pretrained(init_from)
        if tokenizer:
            return model, tokenizer_from_spec(tokenizer)
        if (Path(init_from) / TOKENIZER_FILE).is_file() or has_bpe_files(Path(init_from)):  # the directory's own
            return model, load_tokenizer(init_from)
        if model.config.vocab_size != 50257:
            raise ValueError(
                f"{init_from} is not GPT-2 ({model.config.vocab_size} ids), so its tokenizer is unknown to "
                "gptlite (no tokenizer.json beside its weights); pass one (--tokenizer=PATH: a "
                "tokenizer.json, a folder holding one, or a .tiktoken file)"
            )
        return model, get_tokenizer("gpt2")
    out_dir = Path(out_dir)
    ckpt = load_checkpoint(out_dir)
    if tokenizer:
        return model_from_checkpoint(ckpt), tokenizer_from_spec(tokenizer)
    for path in (out_dir / TOKENIZER_FILE, Path(ckpt["config"].get("data_dir", "")) / TOKENIZER_FILE):
        if path.is_file():
            return model_from_checkpoint(ckpt), load_tokenizer(path)
    raise FileNotFoundError(
        f"no {TOKENIZER_FILE} in {out_dir} or the training data_dir; copy the data's {TOKENIZER_FILE} into {out_dir}"
    )


def rng_state() -> dict:
    """This process's python, numpy, torch CPU and current CUDA device generator states, checkpoint-safe
    (tensors and tuples only, so `weights_only` loading accepts them)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict) -> None:
    """Restore generator states saved by `rng_state`."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# ---------------------------------------------------------------------------------------------
# The training state: what a checkpoint holds beside the weights, gathered from every rank and put back.
# torch.distributed.checkpoint is imported where it is used: it takes a second to import, which sample.py and the
# server, loading a checkpoint's weights alone, need not pay.


def gather_training_state(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], world_size: int
) -> tuple[dict, dict, list[dict]]:
    """(model state, optimizers' state, every rank's random generator states) as one checkpoint holds them: whole
    tensors on rank 0's CPU, keyed by parameter name, also when FSDP gives each rank a shard. A collective: every
    rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizers, options=options)
    rngs = [rng_state()]
    if world_size > 1:
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state())
    return model_state, optimizer_state, rngs


def load_training_state(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: dict, strict: bool = True
) -> None:
    """Load a checkpoint's weights and optimizer state (moments, momentum buffers, step counts). Every group's
    hyperparameters (lr_ratio, weight decay, betas, momentum) stay those of this run's config: one changed with
    --key=value on --resume takes effect, and a checkpoint saved before groups had an lr_ratio loads. `strict=False`
    loads a LoRA checkpoint's adapters into a model whose frozen weights came from elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    hyper = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    set_state_dict(
        model,
        optimizers,
        model_state_dict=ckpt["model"],
        optim_state_dict=ckpt["optimizer"],
        options=StateDictOptions(full_state_dict=True, strict=strict),
    )
    for opt, groups in zip(optimizers, hyper, strict=True):
        for group, values in zip(opt.param_groups, groups, strict=True):
            group.update(values)


def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of a state dict's floating-point tensors that hold a NaN or an infinity."""
    return [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def run_checkpoint(
    *,
    config: dict,
    model: dict[str, torch.Tensor],
    optimizer: dict,
    scaler: dict,
    step: int,
    loader: dict,
    world_size: int,
    rng: list[dict],
    best_val_loss: float,
    val_loss: float | None,
    meta: dict,
    lora: dict | None = None,
    ema: dict | None = None,
    trained_model: dict[str, torch.Tensor] | None = None,
) -> dict:
    """A training checkpoint as the module's docstring lays it out, from its entries. A LoRA run's (`lora` given)
    keeps the adapters alone of `model` and `trained_model`; `lora`, `ema` and `trained_model` are left out where
    they are None."""
    checkpoint = {
        "config": config,
        "model": lora_state_dict(model) if lora else model,
        "optimizer": optimizer,
        "scaler": scaler,
        "step": step,
        "loader": loader,
        "world_size": world_size,
        "rng": rng,
        "best_val_loss": best_val_loss,
        "val_loss": val_loss,
        "meta": meta,
    }
    if lora:
        checkpoint["lora"] = lora
    if ema is not None:
        checkpoint["ema"] = ema
    if trained_model:
        checkpoint["trained_model"] = lora_state_dict(trained_model) if lora else trained_model
    return checkpoint
