"""The tokenizer interface every tokenizer implements (encode, decode, token_bytes, vocab_size, eot_id), the two
that need no file (bytes and characters), and the streaming decoder."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # beside a data folder's shards, and copied into every run's out_dir


class Tokenizer:
    """The interface every tokenizer implements."""

    kind: str
    vocab_size: int
    eot_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_to_numpy(self, text: str) -> np.ndarray:
        """`encode(text)` as a uint32 array (data preparation's path: no Python list where it can be avoided)."""
        ids = self.encode(text)
        return np.fromiter(ids, dtype=np.uint32, count=len(ids))

    def encode_documents(self, texts: list[str], eot: bool) -> tuple[np.ndarray, np.ndarray]:
        """Data preparation's path: the uint32 ids of the texts one after another, each after the end-of-text
        token if `eot`, and the number of ids per text (its end-of-text token included)."""
        ids = [self.encode_to_numpy(text) for text in texts]
        lengths = np.array([len(i) + eot for i in ids], dtype=np.int64)
        if eot:
            head = np.array([self.eot_id], dtype=np.uint32)
            ids = [part for i in ids for part in (head, i)]
        return (np.concatenate(ids) if ids else np.empty(0, dtype=np.uint32)), lengths

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; invalid UTF-8 (a BPE piece cut mid-character) becomes U+FFFD."""
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as JSON, atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        d = {"vocab_size": self.vocab_size, "eot_id": self.eot_id, **self.to_dict()}
        tmp.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255."""

    kind, vocab_size = "byte", 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(ids)

    def to_dict(self) -> dict:
        return {"type": "byte"}


class CharTokenizer(Tokenizer):
    """One id per distinct character of the corpus, in sorted order (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars:
            raise ValueError("a char tokenizer needs a non-empty corpus to learn its vocabulary from")
        self.vocab_size = len(self.chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in this char tokenizer's vocabulary of {self.vocab_size} characters; "
                "use only characters from the training corpus"
            ) from None

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        return "".join(self.chars[i] for i in ids).encode("utf-8")

    def to_dict(self) -> dict:
        return {"type": "char", "chars": "".join(self.chars)}


class StreamDecoder:
    """Turns a stream of token ids into text, holding back bytes of a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self.utf8.decode(self.tokenizer.token_bytes(ids))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
