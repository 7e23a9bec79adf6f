"""A checkpoint directory's weight files, read one tensor at a time: safetensors (one file, or shards listed in
model.safetensors.index.json) through their published layout (an 8-byte header length, a JSON header of dtype,
shape and byte offsets, then the data), each tensor read straight into its own memory with no file mapped, so
that loading holds one copy of the weights; or a weights-only torch file. Damaged files are one-line errors
naming the file."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from pathlib import Path

import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a file; anything else is a one-line ValueError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {what} holds one JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; {what} holds one JSON object")
    return value


def damaged(path: Path, cause: str) -> ValueError:
    return ValueError(
        f"{path} cannot be read ({cause[:200]}); it is cut short or not a weights file: download or save it again"
    )


class Weights:
    """The tensors of a checkpoint directory by name, each read when asked for (`pop`), checked finite."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.where: dict[str, tuple[Path, dict]] = {}  # name -> (file, its safetensors header entry)
        self.loaded: dict[str, torch.Tensor] = {}  # a torch file's tensors, read whole
        if (directory / "model.safetensors").is_file():
            files = [directory / "model.safetensors"]
        elif (directory / "model.safetensors.index.json").is_file():
            files = shard_files(directory / "model.safetensors.index.json")
        elif (directory / "pytorch_model.bin").is_file():
            self.loaded, files = read_torch_file(directory / "pytorch_model.bin"), []
        else:
            raise FileNotFoundError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")
        for path in files:
            self.where.update({name: (path, entry) for name, entry in read_header(path).items()})

    def names(self) -> list[str]:
        return [*self.where, *self.loaded]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.loaded[name].shape) if name in self.loaded else tuple(self.where[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return self.loaded[name].dtype if name in self.loaded else DTYPES[self.where[name][1]["dtype"]]

    def file(self, name: str) -> Path:
        """The file that holds the tensor `name`."""
        return self.where[name][0] if name in self.where else self.directory / "pytorch_model.bin"

    def pop(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`, read now: into `out` (of its shape; a safetensors tensor of out's dtype goes straight
        from the file into out's memory, with no copy in between) or into a tensor of its own."""
        path = self.file(name)
        if name in self.loaded:
            tensor = self.loaded.pop(name)
            tensor = out.copy_(tensor) if out is not None else tensor
        else:
            tensor = read_tensor(*self.where.pop(name), out=out)
        if tensor.is_floating_point() and not finite(tensor):
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; the checkpoint is damaged")
        return tensor

    def __contains__(self, name: str) -> bool:
        return name in self.where or name in self.loaded


def finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every value is finite, checked a million at a time (no second tensor of the whole one's size)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def shard_files(index: Path) -> list[Path]:
    weight_map = read_json(index, "a sharded checkpoint's index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map (tensor name -> shard file); save the checkpoint again")
    files = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shard {missing[0]}, which is not in {index.parent}; download it again")
    return files


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"} (offsets from the data's start, made
    absolute here), checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(path, f"{size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise damaged(path, f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise damaged(path, f"its header is not JSON: {e}") from None
    header.pop("__metadata__", None)
    for name, entry in header.items():
        start, end = entry.get("data_offsets", (0, -1))
        if entry.get("dtype") not in DTYPES or not 0 <= start <= end or 8 + length + end > size:
            raise damaged(path, f"tensor {name} ends past the file's {size} bytes or has dtype {entry.get('dtype')}")
        entry["data_offsets"] = (8 + length + start, 8 + length + end)
    return header


def read_tensor(path: Path, entry: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, read into `out` (its shape; converted if its dtype differs) or into memory
    of its own."""
    dtype, shape, (start, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
    if out is not None and (out.dtype != dtype or not out.is_contiguous()):
        return out.copy_(read_tensor(path, entry))  # a transient copy of this one tensor
    tensor = torch.empty(shape, dtype=dtype) if out is None else out
    if tensor.numel() * tensor.element_size() != end - start:
        raise damaged(path, f"tensor of shape {shape} in {end - start} bytes")
    with open(path, "rb") as f:
        f.seek(start)
        if end > start and f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != end - start:
            raise damaged(path, "the file ended early")
    return tensor


def read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A weights-only torch state dict (pytorch_model.bin), memory-mapped."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch's errors for a file cut short or of another format
        raise damaged(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{path} does not hold a state dict (tensor name -> tensor); save the model's state_dict()")
    return state


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file, readable as any file the user writes (safetensors creates it private)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except Exception as e:  # safetensors' own error type for I/O failures (a full disk): an OSError with its errno
        if type(e).__name__ != "SafetensorError":
            raise
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else errno.EIO, str(e), str(path)) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
