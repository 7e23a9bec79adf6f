"""Preparation's state on disk: progress.json after every batch (an interrupted preparation resumes from it and
writes what an uninterrupted one would), manifest.json once complete (a re-run with the same settings returns at
once), and what is deleted or restored between the two."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from gptlite.data.prepare.workers import SPLITS
from gptlite.data.shards import HEADER_BYTES, MANIFEST, PROGRESS
from gptlite.tokenizer import TOKENIZER_FILE


def settings_key(settings: dict) -> str:
    """A short fingerprint of the settings (progress.json is rewritten often; the source list can be long)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def read_state(path: Path) -> dict | None:
    """A manifest.json or progress.json of ours, or None if it is missing or damaged (then: start afresh)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def finished_manifest(out_dir: Path, settings: dict) -> dict | None:
    """The manifest of a complete preparation with these settings, if out_dir holds one and all its shards."""
    manifest = read_state(out_dir / MANIFEST)
    if manifest is None or {k: manifest.get(k) for k in settings} != settings:
        return None
    return manifest if all((out_dir / s["file"]).is_file() for s in manifest["shards"]) else None


WRITERS = ("train", "val", "train_roles", "val_roles")  # progress.json's writers: token shards, a chat's roles files


def shard_files(out_dir: Path) -> list[Path]:
    """Every shard, roles file and temporary one of a preparation in out_dir."""
    patterns = ("_*.bin", "_*.bin.tmp", "_*.roles", "_*.roles.tmp")
    return [p for split in SPLITS for pattern in patterns for p in out_dir.glob(split + pattern)]


def restore(out_dir: Path, progress: dict) -> bool:
    """Bring out_dir back to the state progress.json records: finish renames that an interruption cut short,
    remove shards written after it, cut the open shards back to their recorded length. False (and nothing
    changed) if the files on disk cannot give that state; then the preparation starts afresh."""
    keep: dict[Path, Path | None] = {}  # file to keep -> name to move it to
    for key in (k for k in WRITERS if k in progress):
        split, roles = key.removesuffix("_roles"), key.endswith("_roles")
        shards, open_tokens = progress[key]["shards"], progress[key]["open_tokens"]
        for shard in shards:
            final = out_dir / shard["file"]
            tmp = final.with_name(final.name + ".tmp")
            if final.is_file():
                keep[final] = None
            elif tmp.is_file():
                keep[tmp] = final
            else:
                return False
        if open_tokens:
            tmp = out_dir / f"{split}_{len(shards):06d}{'.roles' if roles else '.bin'}.tmp"
            itemsize = 1 if roles else np.dtype(progress["dtype"]).itemsize
            if not tmp.is_file() or tmp.stat().st_size < HEADER_BYTES + open_tokens * itemsize:
                return False
            keep[tmp] = None
    for path in shard_files(out_dir):
        if path not in keep:
            path.unlink()
    for path, final in keep.items():
        if final is not None:
            os.replace(path, final)
    return True


def resumable(out_dir: Path, key: str, log) -> dict | None:
    """progress.json's state if out_dir holds an interrupted preparation with these settings whose files can be
    brought back to it (see `restore`), else None; nothing is deleted here unless it is resumed."""
    path = out_dir / PROGRESS
    if not path.is_file():
        return None
    progress = read_state(path)
    if (
        progress
        and progress.get("settings") == key
        and (out_dir / TOKENIZER_FILE).is_file()
        and restore(out_dir, progress)
    ):
        return progress
    log(f"{out_dir} holds an unfinished preparation with other settings or damaged files; starting afresh")
    return None


def clear_preparation(out_dir: Path, log) -> None:
    """Delete out_dir's shards, manifest and progress (called once the new preparation's inputs and tokenizer
    are known to be good), saying so first if there was an earlier preparation."""
    state = [p for p in (out_dir / MANIFEST, out_dir / PROGRESS) if p.is_file()]
    earlier = state + shard_files(out_dir)
    if state:
        log(
            f"replacing the earlier preparation in {out_dir} ({len(earlier)} files: manifest, progress and shards) "
            "made with other inputs or settings"
        )
    elif earlier:
        log(f"deleting {len(earlier)} unfinished shard file(s) that a failed start left in {out_dir}")
    for stale in earlier:
        stale.unlink(missing_ok=True)
