"""The checkpoint file: written atomically with a checksum beside it (`save_checkpoint`), and read back without
unpickling arbitrary objects (`weights_only=True`) once it is known whole (`verify_checkpoint`, `load_file`).

The checksum file is a side file: it never outranks the data it describes. Where it is missing, not the line
`sha256sum` writes for this file, or of other bytes, the checkpoint is checked by what it is, the CRC-32 that
torch.save's zip archive keeps of every record it holds: a checkpoint whose records all hold is whole, and loads.

A checkpoint is a plain dict of tensors and primitive values: gptlite.checkpoint.training_state lays its entries out,
beside the parts of the training state that write and read them.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import warnings
import zipfile
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


def checksum_line(path: Path, digest: str) -> bytes:
    """The line `sha256sum` writes for path (and `sha256sum -c` reads): its hex digest, two spaces, its name."""
    return f"{digest}  {path.name}\n".encode()


def write_checksum(path: str | Path, digest: str) -> None:
    """Write path's checksum file, atomically: the one line of `checksum_line`."""
    path = Path(path)
    _write_durably(checksum_path(path), lambda f: f.write(checksum_line(path, digest)))


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
        write_checksum(path, writer.sha.hexdigest())
    except BaseException as e:  # a full disk, an interruption: nothing half-written stays behind
        for leftover in (tmp, checksum_path(path).with_name(checksum_path(path).name + ".tmp")):
            leftover.unlink(missing_ok=True)
        cause = next((c for c in (e, getattr(writer, "error", None), e.__context__) if isinstance(c, OSError)), None)
        if cause is not None:
            raise fault(cause, f"could not save checkpoint {path}") from None
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, read a chunk at a time."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def checksum_problem(path: Path) -> tuple[str | None, str]:
    """(What is wrong with the checksum file of `path`, a real file; None where it holds, the file's sha256)."""
    checksum = checksum_path(path)
    digest = file_digest(path)
    if not checksum.is_file():
        return f"it has no checksum file {checksum.name}", digest
    text = checksum.read_bytes()
    line = re.fullmatch(rb"([0-9a-f]{64}) [ *](.+)\n", text)
    if line is None or line[2] != path.name.encode():
        return f"{checksum.name} is not the line sha256sum writes for it ({len(text)} bytes)", digest
    if line[1].decode() != digest:
        return f"its {path.stat().st_size} bytes do not match the sha256 in {checksum.name}", digest
    return None, digest


def broken_record(path: Path) -> str | None:
    """The first record of a torch.save zip archive whose bytes fail the CRC-32 saved with them (or why the file is
    no such archive); None where every record holds."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"it is not a whole zip archive as torch.save writes ({e})"
    return None if bad is None else f"its record {bad} fails the CRC-32 saved with it"


def verify_checkpoint(path: str | Path) -> str | None:
    """Check that a checkpoint file is whole (for ckpt.pt and best.pt, the symlink's target beside its checksum).
    Returns None where its checksum file holds. Where that file is missing, malformed or disagrees, the checkpoint
    is checked by what it is, the CRC-32 of each of its records: whole, it is returned a line saying that its
    checksum file is the one in error; otherwise a ValueError says the checkpoint is damaged."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    problem, _ = checksum_problem(real)
    if problem is None:
        return None
    broken = broken_record(real)
    if broken is not None:
        raise ValueError(
            f"checkpoint {path} is damaged: {problem}, and {broken}; it was cut short or changed after it was "
            "saved, or is not a gptlite checkpoint"
        )
    return f"checkpoint {path} is whole (every record holds its CRC-32) though {problem}: the checkpoint is kept"


def load_file(path: Path, map_location: str | torch.device, on_note: Callable[[str], None] | None = None) -> dict:
    """A checkpoint file, once it is known whole (`verify_checkpoint`; a line on a checksum file in error goes to
    `on_note`, default warnings.warn); damaged or not a gptlite checkpoint, a ValueError naming it."""
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; train first (python train.py ... --out_dir={path.parent})"
        )
    note = verify_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); it is damaged or not "
            "a gptlite checkpoint"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"checkpoint {path} is not a gptlite checkpoint (no 'model' and 'config' entries)")
    if note is not None:
        (on_note or (lambda line: warnings.warn(line, stacklevel=3)))(note)
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
