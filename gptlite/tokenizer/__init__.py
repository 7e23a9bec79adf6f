"""Tokenizers behind one small interface (encode, decode, token_bytes, vocab_size, eot_id, apply_chat_template):
each made from a spec (`get_tokenizer`), saved as JSON and loaded back.

Specs accepted by `get_tokenizer`:
    "byte"                     the 256 byte values; needs no file
    "char"                     one id per character seen in the corpus (pass the corpus text)
    "gpt2", "cl100k_base", ... any tiktoken encoding name (tiktoken downloads its files once)
    "path/to/ranks.tiktoken"   a tiktoken ranks file: the offline route, GPT-2's split pattern and
                               <|endoftext|> (id = number of ranks) unless told otherwise
    "path/to/tokenizer.json"   a Hugging Face tokenizer file, or a folder that holds one (a model directory, or what
                               `python -m gptlite.tokenizer train` writes), with its special tokens and chat template;
                               a model directory with GPT-2's vocab.json and merges.txt instead
The JSON written by `save` holds everything decoding needs (for tiktoken, the ranks themselves; for a Hugging Face
tokenizer, its tokenizer.json whole), so `sample.py` never needs the network or a pickle.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path

from gptlite.tokenizer.base import (
    EOT,
    TOKENIZER_FILE,
    ByteTokenizer,
    CharTokenizer,
    StreamDecoder,
    Tokenizer,
    check_same_tokenizer,
)
from gptlite.tokenizer.huggingface import HFTokenizer, has_bpe_files, is_hf_tokenizer_json, load_hf_tokenizer
from gptlite.tokenizer.tiktoken_bpe import (
    GPT2_PATTERN,
    TiktokenTokenizer,
    from_ranks_file,
    from_tiktoken_name,
    tiktoken_encoding,
)

__all__ = [
    "EOT",
    "GPT2_PATTERN",
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "StreamDecoder",
    "TiktokenTokenizer",
    "Tokenizer",
    "check_same_tokenizer",
    "get_tokenizer",
    "load_tokenizer",
    "tokenizer_from_dict",
    "tokenizer_from_spec",
]


def get_tokenizer(spec: str, text: str | Iterable[str] | None = None) -> Tokenizer:
    """Build a tokenizer from a spec string (see the module docstring); `char` learns from `text`."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        if text is None:
            raise ValueError("the char tokenizer needs the corpus text to learn its vocabulary")
        chars: set[str] = set()
        for chunk in [text] if isinstance(text, str) else text:
            chars.update(chunk)
        return CharTokenizer(chars)
    if spec.endswith(".json") or os.path.isdir(spec):
        return load_tokenizer(spec)
    if spec.endswith(".tiktoken") or os.path.sep in spec or os.path.isfile(spec):
        return from_ranks_file(spec)
    return from_tiktoken_name(spec)


def tokenizer_from_dict(d: dict, source: str = "tokenizer JSON") -> Tokenizer:
    """Rebuild a tokenizer from what `Tokenizer.save` wrote: its kind, and its chat template and added special
    tokens."""
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "char":
        tokenizer = CharTokenizer(d["chars"])
    elif kind == "tiktoken":
        ranks = {base64.b64decode(token): rank for token, rank in d["mergeable_ranks"].items()}
        tokenizer = TiktokenTokenizer(tiktoken_encoding(d["name"], d["pat_str"], ranks, d["special_tokens"]))
    elif kind == "huggingface":
        tokenizer = HFTokenizer(d["tokenizer"], d.get("bos"), d.get("eos"), d.get("stop", ()), d.get("chat_template"))
    else:
        raise ValueError(f"{source} has unknown tokenizer type {kind!r}; expected byte, char, tiktoken or huggingface")
    tokenizer.chat_template = d.get("chat_template") or tokenizer.chat_template
    for text, i in sorted((d.get("added") or {}).items(), key=lambda item: item[1]):
        if tokenizer.add_special(text) != i:
            raise ValueError(f"{source}: its added token {text!r} should have id {i}; the file is damaged")
    return tokenizer


def tokenizer_from_spec(spec: str) -> Tokenizer:
    """A tokenizer JSON (gptlite's or Hugging Face's) or a folder holding one, a .tiktoken ranks file or a tiktoken
    encoding name."""
    return load_tokenizer(spec) if spec.endswith(".json") or os.path.isdir(spec) else get_tokenizer(spec)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer JSON written by `Tokenizer.save`, or a Hugging Face tokenizer.json; a folder stands for its
    tokenizer.json (a run or data folder, a model directory)."""
    path = Path(path)
    if has_bpe_files(path):  # a model directory with GPT-2's vocab.json and merges.txt instead of a tokenizer.json
        return load_hf_tokenizer(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} holds no {TOKENIZER_FILE}; pass a tokenizer.json or the folder that holds one (or GPT-2's "
            "vocab.json and merges.txt)"
            if path.is_dir()
            else f"tokenizer file {path} does not exist; run data/prepare.py to create it"
        )
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"tokenizer file {file} is not valid JSON: {e}; put back an intact copy (a run's comes from its data "
            "folder, a Hugging Face model's from its hub repository) or pass --tokenizer"
        ) from None
    if is_hf_tokenizer_json(d):
        return load_hf_tokenizer(file)
    return tokenizer_from_dict(d, str(file))
