"""gptlite: a small, fast, readable GPT toolkit. `from gptlite import GPT, GPTConfig`."""

import importlib

# Names are imported on first use (PEP 562), so `import gptlite.config` or `gptlite.tokenizer` does not
# pull in torch through this package's __init__.
_EXPORTS = {
    "load_checkpoint": "gptlite.checkpoint",
    "model_from_checkpoint": "gptlite.checkpoint",
    "save_checkpoint": "gptlite.checkpoint",
    "GPTConfig": "gptlite.config",
    "TrainConfig": "gptlite.config",
    "ShardLoader": "gptlite.data.loader",
    "find_shards": "gptlite.data.shards",
    "read_shard": "gptlite.data.shards",
    "write_shard": "gptlite.data.shards",
    "generate_tokens": "gptlite.inference.generate",
    "sample_next": "gptlite.inference.generate",
    "GPT": "gptlite.gpt",
    "Tokenizer": "gptlite.tokenizer",
    "get_tokenizer": "gptlite.tokenizer",
    "load_tokenizer": "gptlite.tokenizer",
}

__all__ = [
    "GPT",
    "GPTConfig",
    "ShardLoader",
    "Tokenizer",
    "TrainConfig",
    "find_shards",
    "generate_tokens",
    "get_tokenizer",
    "load_checkpoint",
    "load_tokenizer",
    "model_from_checkpoint",
    "read_shard",
    "sample_next",
    "save_checkpoint",
    "write_shard",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gptlite' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
