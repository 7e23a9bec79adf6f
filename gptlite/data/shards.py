"""Token shards in llm.c's file layout: the header, reading and writing, checksums and the manifest (numpy only).

A shard is a 1,024-byte header of 256 little-endian int32 followed by the tokens:
    header[0] magic, header[1] version, header[2] token count, the rest zero.
    magic 20240520, version 1: tokens are uint16 (vocabularies up to 65,536 ids)
    magic 20240801, version 7: tokens are uint32 (larger vocabularies)
This is the layout of llm.c and of modded-nanogpt's FineWeb shards, so their files train here as they are.
Data preparation imports this module, not `gptlite.data.loader` (whose loader needs torch), so it starts fast.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {  # magic -> (version, token dtype)
    20240520: (1, np.dtype("<u2")),
    20240801: (7, np.dtype("<u4")),
}
UINT16_VOCAB = 2**16
# A conversation's data (data/prepare.py --chat) has beside each token shard `x.bin` a roles file `x.roles` in the
# same layout, magic ROLES_MAGIC, one byte per token: bit TARGET marks a token the model learns to predict (an
# assistant's), bit START the first token of a conversation. Token shards stay llm.c's. A preference pair's data
# (data/prepare.py --preference) is laid out as the prompt (START on its first token), then the chosen answer, then the
# rejected one, each answer's tokens TARGET and its first token ANSWER as well.
ROLES_MAGIC, ROLES_VERSION = 20241124, 1
TARGET = 1
START = 2
ANSWER = 4


def write_shard(path: str | Path, tokens: np.ndarray | list[int], vocab_size: int) -> None:
    """Write tokens to a shard file atomically (temp file + rename), uint16 when vocab_size <= 65,536."""
    magic = 20240520 if vocab_size <= UINT16_VOCAB else 20240801
    version, dtype = FORMATS[magic]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}] for {path}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, tokens.size)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_roles(path: str | Path, roles: np.ndarray | list[int]) -> None:
    """Write a roles file (see ROLES_MAGIC) atomically, one byte per token of its shard."""
    roles = np.asarray(roles, dtype=np.uint8)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (ROLES_MAGIC, ROLES_VERSION, roles.size)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes() + roles.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: str | Path) -> np.memmap:
    """Memory-map a shard's tokens after validating magic, version and size. Nothing is read into RAM."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"shard {path} does not exist")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(
            f"shard {path} is truncated: {size} bytes is smaller than the {HEADER_BYTES}-byte header; prepare the "
            "data again"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in FORMATS:
        raise ValueError(
            f"shard {path} has bad magic {magic}; expected {' or '.join(map(str, FORMATS))} "
            "(an llm.c-format token shard, as written by data/prepare.py)"
        )
    expected_version, dtype = FORMATS[magic]
    if version != expected_version:
        raise ValueError(f"shard {path} has unknown version {version} for magic {magic}; expected {expected_version}")
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size < expected:
        raise ValueError(
            f"shard {path} is truncated: header says {count} tokens ({expected} bytes) but the file has {size} bytes; "
            "prepare the data again"
        )
    if size > expected:
        raise ValueError(f"shard {path} has {size - expected} bytes beyond the {count} tokens its header declares")
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map zero bytes
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def roles_path(shard: str | Path) -> Path:
    """The roles file beside a token shard: train_000000.bin -> train_000000.roles."""
    return Path(shard).with_suffix(".roles")


def read_roles(path: str | Path, tokens: int) -> np.ndarray:
    """Memory-map a roles file after checking its header and that it has one byte per token of its shard."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"roles file {path} does not exist; a chat data folder has one beside each shard: "
            "prepare the data again with data/prepare.py --chat"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    size = path.stat().st_size
    if len(header) < 3 or int(header[0]) != ROLES_MAGIC or int(header[1]) != ROLES_VERSION:
        raise ValueError(
            f"{path} is not a gptlite roles file (magic {ROLES_MAGIC}, version {ROLES_VERSION}); "
            "prepare the data again with data/prepare.py --chat"
        )
    count = int(header[2])
    if count != tokens or size != HEADER_BYTES + count:
        raise ValueError(
            f"{path} holds {max(0, size - HEADER_BYTES)} role bytes (header: {count}) for a shard of "
            f"{tokens} tokens; prepare the data again (--overwrite)"
        )
    if count == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(count,))


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks (what `sha256sum` prints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


MANIFEST = "manifest.json"  # written last by data/prepare.py: the folder's preparation is complete
PROGRESS = "progress.json"  # an unfinished preparation's state


def verify_manifest(data_dir: str | Path, checksums: bool = True) -> dict:
    """Check a prepared data_dir against its manifest.json and return the manifest: every listed shard is
    there with its token count (and, with checksums, its sha256), and no other shard is."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{data_dir} has no manifest.json: its preparation did not finish (run the same data/prepare.py "
            "command again to continue) or the shards were not made by data/prepare.py"
        )
    manifest = json.loads(path.read_text())
    listed = {s["file"] for s in manifest["shards"]}
    extra = sorted(p.name for p in data_dir.glob("*.bin") if p.name not in listed)
    if extra:
        raise ValueError(
            f"{data_dir} holds shards its manifest does not list ({', '.join(extra)}); remove them or prepare again"
        )
    for shard in manifest["shards"]:
        shard_path = data_dir / shard["file"]
        tokens = read_shard(shard_path)  # checks that it exists and its header
        if len(tokens) != shard["tokens"]:
            raise ValueError(
                f"shard {shard_path} holds {len(tokens):,} tokens but the manifest says {shard['tokens']:,}; "
                "prepare the data again (--overwrite)"
            )
        expected = manifest.get("sha256", {}).get(shard["file"])
        if manifest.get("chat") or manifest.get("preference"):
            read_roles(
                roles_path(shard_path), len(tokens)
            )  # a chat (or preference) preparation's roles: there, and of its length
            roles_sha = manifest["sha256"].get(roles_path(shard_path).name)
            if checksums and roles_sha and file_sha256(roles_path(shard_path)) != roles_sha:
                raise ValueError(
                    f"roles file {roles_path(shard_path)} does not match its sha256 in the manifest; "
                    "prepare the data again (--overwrite)"
                )
        if checksums and expected and file_sha256(shard_path) != expected:
            raise ValueError(
                f"shard {shard_path} does not match its sha256 in the manifest ({expected[:12]}...): the file "
                "changed or is corrupt; prepare the data again (--overwrite) or download it again"
            )
    return manifest


def find_shards(spec: str | Path, split: str) -> list[Path]:
    """Shard files for a split: a directory (every *.bin whose name contains `split`), a glob, or a file. A
    directory whose preparation has not finished (progress.json without manifest.json) is refused; shards
    from elsewhere, without either file, are fine."""
    spec = str(spec)
    if os.path.isdir(spec):
        if (Path(spec) / PROGRESS).is_file() and not (Path(spec) / MANIFEST).is_file():
            raise ValueError(
                f"{spec} holds an unfinished preparation ({PROGRESS}, no {MANIFEST}); finish it by "
                "running the same data/prepare.py command again"
            )
        files = [p for p in sorted(Path(spec).glob("*.bin")) if split in p.name]
    elif not glob.has_magic(spec) and not os.path.exists(spec):
        raise FileNotFoundError(
            f"data {spec} does not exist; prepare data there first (python data/prepare.py "
            f"--input=... --out_dir={spec}) or check the path"
        )
    else:
        files = [Path(p) for p in sorted(glob.glob(spec))]
    if not files:
        raise FileNotFoundError(
            f"no {split} shards found at {spec}; expected *{split}*.bin files there (run data/prepare.py first)"
        )
    return files


def check_vocab(files: list[Path], vocab_size: int, chunk: int = 1 << 24, fix: str = "") -> None:
    """Raise ValueError naming the shard if any token id is >= vocab_size (scans in bounded chunks); `fix` is the
    advice (default: train.py's)."""
    for path in files:
        tokens = read_shard(path)
        if tokens.dtype == np.uint16 and vocab_size >= UINT16_VOCAB:
            continue
        for i in range(0, len(tokens), chunk):
            hi = int(tokens[i : i + chunk].max())
            if hi >= vocab_size:
                raise ValueError(
                    f"shard {path} holds token id {hi} but the model's vocab_size is {vocab_size}; "
                    + (fix or f"set --vocab_size to at least {hi + 1} or re-tokenize the data")
                )


# ---------------------------------------------------------------------------------------------
# writing a split's shards as tokens arrive (data preparation)

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int, dtype: str = "auto") -> np.dtype:
    """uint16 for vocabularies up to 65,536 ids, else uint32; an explicit dtype must hold every id."""
    name = ("uint16" if vocab_size <= 2**16 else "uint32") if dtype == "auto" else dtype
    limit = 2 ** (8 * DTYPES[name].itemsize)
    if vocab_size > limit:
        raise ValueError(
            f"the tokenizer's {vocab_size:,} ids do not fit {name} (at most {limit:,}); use dtype uint32 or auto"
        )
    return DTYPES[name]


class ShardWriter:
    """Appends one split's tokens to its open shard, `{split}_{i:06d}.bin.tmp`. A full shard gets its
    header, is synced and checksummed, and takes its final name at `commit()`, once progress.json lists it."""

    suffix = ".bin"

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, state: dict | None = None):
        self.out_dir = out_dir
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.header = np.zeros(HEADER_INTS, dtype="<i4")  # llm.c's: magic, version, token count, zeros
        self.header[:2] = self.magic_and_version()
        state = state or {"shards": [], "open_tokens": 0}
        self.shards: list[dict] = list(state["shards"])  # finished: {"file", "tokens", "sha256"}
        self.pending: list[dict] = []  # finished, final name not yet taken
        self.fill, self.file = state["open_tokens"], None
        if self.fill:  # continue the open shard, dropping tokens written after the last checkpoint
            self.file = open(self.tmp_path(len(self.shards)), "r+b")
            self.file.truncate(self.header.nbytes + self.fill * dtype.itemsize)
            self.file.seek(0, os.SEEK_END)

    def magic_and_version(self) -> tuple[int, int]:
        magic = next(m for m, (_, d) in FORMATS.items() if d == self.dtype)
        return magic, FORMATS[magic][0]

    def header_bytes(self, count: int) -> bytes:
        self.header[2] = count
        return self.header.tobytes()

    def tmp_path(self, index: int) -> Path:
        return self.out_dir / f"{self.split}_{index:06d}{self.suffix}.tmp"

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards + self.pending) + self.fill

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.file is None:
                self.file = open(self.tmp_path(len(self.shards) + len(self.pending)), "wb")
                self.file.write(self.header_bytes(0))  # the count is filled in when the shard is full
            n = min(len(tokens), self.shard_tokens - self.fill)
            self.file.write(tokens[:n].tobytes())
            self.fill, tokens = self.fill + n, tokens[n:]
            if self.fill == self.shard_tokens:
                self.close_shard()

    def close_shard(self) -> None:
        self.file.seek(0)
        self.file.write(self.header_bytes(self.fill))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        tmp = Path(self.file.name)
        self.pending.append({"file": tmp.name.removesuffix(".tmp"), "tokens": self.fill, "sha256": file_sha256(tmp)})
        self.file, self.fill = None, 0

    def state(self) -> dict:
        """What progress.json records: finished shards (renamed or not) and the open shard's token count."""
        if self.file is not None:
            self.file.flush()  # so the recorded count is on disk if this process dies
        return {"shards": self.shards + self.pending, "open_tokens": self.fill}

    def commit(self) -> None:
        """Give finished shards their final names (after progress.json has recorded them)."""
        for shard in self.pending:
            os.replace(self.out_dir / (shard["file"] + ".tmp"), self.out_dir / shard["file"])
        self.shards += self.pending
        self.pending = []

    def finish(self) -> None:
        """Close the last, partly filled shard (its final name comes at the next commit)."""
        if self.fill:
            self.close_shard()


class RolesWriter(ShardWriter):
    """The roles files of a chat preparation, written as ShardWriter writes token shards and in step with them (the
    same shard_tokens: `{split}_{i:06d}.roles` holds the roles of `{split}_{i:06d}.bin`)."""

    suffix = ".roles"

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, state: dict | None = None):
        super().__init__(out_dir, split, np.dtype(np.uint8), shard_tokens, state)

    def magic_and_version(self) -> tuple[int, int]:
        return ROLES_MAGIC, ROLES_VERSION
