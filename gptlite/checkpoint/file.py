"""The checkpoint file: written atomically with a checksum beside it (`save_checkpoint`), and read back without
unpickling arbitrary objects (`weights_only=True`) once its checksum holds (`load_file`).

A checkpoint is a plain dict of tensors and primitive values: gptlite.checkpoint.training_state lays its entries out,
beside the parts of the training state that write and read them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from gptlite.files import fault, fsync_dir, make_dir

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


def checksum_path(path: Path) -> Path:
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
    tmp = path.with_name(path.name + ".tmp")
    writer = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(checkpoint, writer)
            f.flush()
            os.fsync(f.fileno())
        line = f"{writer.sha.hexdigest()}  {path.name}\n".encode()
        _write_durably(checksum_path(path), lambda f: f.write(line))
    except BaseException as e:  # a full disk, an interruption: nothing half-written stays behind
        for leftover in (tmp, checksum_path(path).with_name(checksum_path(path).name + ".tmp")):
            leftover.unlink(missing_ok=True)
        cause = next((c for c in (e, getattr(writer, "error", None), e.__context__) if isinstance(c, OSError)), None)
        if cause is not None:
            raise fault(cause, f"could not save checkpoint {path}") from None
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def verify_checkpoint(path: str | Path) -> None:
    """Raise ValueError if a checkpoint file's bytes do not match the sha256 saved beside it (beside the
    symlink's target for ckpt.pt and best.pt). A file without a checksum (older gptlite) is not checked."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    checksum = checksum_path(real)
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


def load_file(path: Path, map_location: str | torch.device) -> dict:
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


def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of a state dict's floating-point tensors that hold a NaN or an infinity."""
    return [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def git_commit(folder: str | Path) -> str:
    """The commit checked out in the git work tree that holds `folder`, for a checkpoint's meta ("unknown" outside
    one, or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=folder)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
