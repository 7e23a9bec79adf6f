"""Data: the token shards' file format (`shards`: numpy only), the batch loaders over them (`loader`), downloads
(`download`) and the preparation of a corpus into shards (`prepare`, which data/prepare.py runs).

`from gptlite.data import ShardLoader, read_shard, write_shard, ...` works as it did when this was one module. The
names load on first use (PEP 562), so that preparing data, which needs only the shard format, does not import torch.
"""

import importlib

_SHARD_NAMES = (
    "ANSWER",
    "FORMATS",
    "HEADER_BYTES",
    "HEADER_INTS",
    "MANIFEST",
    "PROGRESS",
    "START",
    "TARGET",
    "UINT16_VOCAB",
    "RolesWriter",
    "ShardWriter",
    "check_vocab",
    "file_sha256",
    "find_shards",
    "read_roles",
    "read_shard",
    "roles_path",
    "token_dtype",
    "verify_manifest",
    "write_roles",
    "write_shard",
)
_LOADER_NAMES = (
    "ChatLoader",
    "PairLoader",
    "ShardLoader",
    "data_identity",
    "evaluation_batches",
    "is_chat_data",
    "is_preference_data",
    "make_loader",
    "make_loaders",
    "make_val_loader",
    "spans",
)
_EXPORTS = {
    **{name: "gptlite.data.shards" for name in _SHARD_NAMES},
    **{name: "gptlite.data.loader" for name in _LOADER_NAMES},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gptlite.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
