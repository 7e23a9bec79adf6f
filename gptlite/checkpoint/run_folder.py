"""The run folder (train.py's out_dir): the step files a run saves, the newest few kept plus the best, claimed and
locked by one run at a time, and loading its newest intact checkpoint.

It holds
    ckpt_000500.pt          one file per save, each beside ckpt_000500.pt.sha256 (`sha256sum -c` reads it)
    ckpt_000600.pt.damaged  a step file a resume found damaged, moved aside (never deleted)
    ckpt.pt, best.pt        symlinks to the newest file and to the one with the lowest val loss
    run.json                the resolved config and command line of the run that last held the folder, written as
                            it starts: a --resume before the first checkpoint takes its config from there
A file is written under a temporary name and renamed only once it and its checksum are on disk, so a crash
at any moment leaves the earlier files whole; loading a directory takes the newest whole file (gptlite.checkpoint.file
says what whole is: a checksum file in error never outranks the checkpoint it describes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from gptlite.checkpoint.file import (
    CHECKSUM_SUFFIX,
    broken_record,
    checksum_path,
    checksum_problem,
    load_file,
    save_checkpoint,
    write_checksum,
)
from gptlite.files import FolderLock, fault, fsync_dir, make_dir, write_json
from gptlite.tokenizer import TOKENIZER_FILE

CHECKPOINT_NAME = "ckpt.pt"  # the newest checkpoint of a run directory
BEST_NAME = "best.pt"  # the checkpoint with the lowest val loss
STEP_FILE = "ckpt_{step:06d}.pt"
STEP_FILE_RE = re.compile(r"ckpt_(\d+)\.pt")
RUN_FILE = "run.json"  # the run's resolved config and command line (record_run)


def step_files(run_dir: str | Path) -> list[Path]:
    """The ckpt_NNNNNN.pt files of a run directory, newest step first."""
    run_dir = Path(run_dir)
    found = [(int(m.group(1)), p) for p in run_dir.glob("ckpt_*.pt") if (m := STEP_FILE_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _step(path: Path) -> int:
    return int(STEP_FILE_RE.fullmatch(path.name).group(1))


def run_files(run_dir: str | Path) -> list[Path]:
    """What a run wrote in its folder: step files and their checksums, ckpt.pt, best.pt, metrics.jsonl and the
    copied tokenizer.json (the `--overwrite` of a fresh run moves them aside; run.json is the next run's to
    write)."""
    run_dir = Path(run_dir)
    named = [run_dir / n for n in (CHECKPOINT_NAME, BEST_NAME, "metrics.jsonl", TOKENIZER_FILE)]
    return [
        p
        for p in [*step_files(run_dir), *map(checksum_path, step_files(run_dir)), *named]
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
    leftovers = [
        *run_dir.glob("*.pt*.tmp"),
        *(run_dir / f"{n}.tmp" for n in ("metrics.jsonl", TOKENIZER_FILE, RUN_FILE)),
    ]
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
            checksum_path(old).unlink(missing_ok=True)
    for leftover in run_dir.glob("*.pt*.tmp"):  # a save or a link swap cut short by a crash
        leftover.unlink()
    for checksum in run_dir.glob("ckpt_*.pt" + CHECKSUM_SUFFIX):
        if not checksum.with_suffix("").exists():  # the crash came between the checksum and the rename
            checksum.unlink()
    fsync_dir(run_dir)
    return path


def set_aside(path: Path) -> Path:
    """Rename a damaged file to NAME.damaged (NAME.damaged-2, ... where that is taken), its checksum file beside it
    likewise; returns the new name. Nothing of it is deleted: the user may still want its bytes."""
    target = path.with_name(path.name + ".damaged")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    checksum = checksum_path(path)
    if checksum.is_file():
        os.replace(checksum, target.with_name(checksum.name + target.name.removeprefix(path.name)))
    return target


def repair_run_folder(run_dir: str | Path, step: int) -> list[str]:
    """After a resume from `step`: the step file resumed from gets its checksum file rewritten where that was
    missing or in error (the file is whole: it loaded); the damaged step files newer than it are moved aside
    (`set_aside`; best.pt goes if it named one), and ckpt.pt points at step's file. Intact newer files stay (they
    are not this run's saves: load_checkpoint follows ckpt.pt). Returns a line for each thing done."""
    run_dir = Path(run_dir)
    lines = []
    resumed = run_dir / STEP_FILE.format(step=step)
    if resumed.is_file():
        problem, digest = checksum_problem(resumed)
        if problem is not None and broken_record(resumed) is None:
            write_checksum(resumed, digest)
            lines.append(
                f"{resumed} is whole though {problem}: resumed from it, and rewrote {checksum_path(resumed).name}"
            )
    best = run_dir / BEST_NAME
    moved = False
    for path in step_files(run_dir):
        if _step(path) <= step:
            continue
        problem, _ = checksum_problem(path)
        broken = None if problem is None else broken_record(path)
        if broken is None:
            continue
        if best.is_symlink() and os.readlink(best) == path.name:
            best.unlink()
        target = set_aside(path)
        moved = True
        lines.append(
            f"moved {path} aside to {target.name}: it is newer than the checkpoint resumed from, and damaged "
            f"({problem}, and {broken})"
        )
    if moved and resumed.is_file():
        _point(run_dir / CHECKPOINT_NAME, resumed)
    if lines:
        fsync_dir(run_dir)
    return lines


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


def record_run(run_dir: str | Path, config: dict, command: str) -> None:
    """Write run.json, atomically: the run's resolved config (flat, as a checkpoint holds it) and its command line.
    Called by the process that holds the folder's lock, as the run starts, so that a run stopped before its first
    checkpoint still says what it was (`recorded_config`)."""
    path = Path(run_dir) / RUN_FILE
    try:
        write_json(path, {"config": config, "command": command})
    except OSError as e:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        raise fault(e, f"could not write {path}") from None


def recorded_config(run_dir: str | Path) -> dict | None:
    """The config a run recorded in run_dir/run.json as it started (`record_run`), or None where there is none; a
    file that is not one is a ValueError naming it."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a run's record ({type(e).__name__}: {e}); delete it, and give the run's settings again"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no config; delete it, and give the run's settings again")
    return config


def began_run(run_dir: str | Path) -> bool:
    """Whether a train.py run started in run_dir (it holds the lock file or run.json a run writes first), whatever
    it saved since."""
    run_dir = Path(run_dir)
    return run_dir.is_dir() and ((run_dir / FolderLock.NAME).is_file() or (run_dir / RUN_FILE).is_file())


def load_checkpoint(
    path: str | Path,
    map_location: str | torch.device = "cpu",
    on_fallback: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> dict:
    """Load a checkpoint file, or a run directory's newest intact one, without unpickling arbitrary objects.

    A damaged file (one whose records fail their CRC-32 where its checksum file does not hold; unreadable) raises
    ValueError. In a directory a damaged file is skipped for the next older one, and `on_fallback` (default:
    warnings.warn) gets a line saying so; the line on a checksum file in error beside a whole file goes to
    `on_note` (default: on_fallback).
    """
    on_note = on_note or on_fallback
    path = Path(path)
    if path.suffix == ".pt":
        return load_file(path, map_location, on_note)
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
            ckpt = load_file(candidate, map_location, on_note)
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
