"""gptlite: a small, fast, readable GPT toolkit. `from gptlite import GPT, GPTConfig`."""

from gptlite.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from gptlite.config import GPTConfig, TrainConfig
from gptlite.data import ShardLoader, find_shards, read_shard, write_shard
from gptlite.generate import generate, generate_tokens, sample_next
from gptlite.model import GPT
from gptlite.tokenizer import Tokenizer, get_tokenizer, load_tokenizer

__all__ = [
    "GPT",
    "GPTConfig",
    "ShardLoader",
    "Tokenizer",
    "TrainConfig",
    "find_shards",
    "generate",
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
