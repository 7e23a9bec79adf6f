"""Tokenizers behind one small interface (encode, decode, token_bytes, vocab_size, eot_id), saved as JSON.

Specs accepted by `get_tokenizer`:
    "byte"                     the 256 byte values; needs no file
    "char"                     one id per character seen in the corpus (pass the corpus text)
    "gpt2", "cl100k_base", ... any tiktoken encoding name (tiktoken downloads its files once)
    "path/to/ranks.tiktoken"   a tiktoken ranks file: the offline route, GPT-2's split pattern and
                               <|endoftext|> (id = number of ranks) unless told otherwise
The JSON written by `save` holds everything decoding needs (for tiktoken, the ranks themselves), so
`sample.py` never needs the network or a pickle.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # beside a data folder's shards, and copied into every run's out_dir
# GPT-2's pre-tokenization pattern (as in tiktoken_ext.openai_public.r50k_pat_str)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


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


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE encoding; text is encoded as plain text (special-token strings are not special)."""

    kind = "tiktoken"

    def __init__(self, encoding):
        self.enc = encoding
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding._special_tokens.get(EOT)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)

    def encode_to_numpy(self, text: str) -> np.ndarray:
        # tiktoken's buffer path, special tokens off: the ids of encode_ordinary without a list of ints
        try:
            return self.enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (from JSON escapes): replaced, as encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.enc.encode_to_numpy(text, disallowed_special=())

    def encode_documents(self, texts: list[str], eot: bool) -> tuple[np.ndarray, np.ndarray]:
        """As Tokenizer's, in one call into tiktoken for short records: the texts joined by <|endoftext|> with
        that special token allowed, which tiktoken encodes text by text between the specials, so the ids are
        those of encode_ordinary per text. Not where a text holds the string <|endoftext|> itself (plain text
        there), nor without end-of-text tokens to count the texts by."""
        if not eot or self.eot_id is None:  # eot_id is <|endoftext|>'s id, when the encoding has it
            return super().encode_documents(texts, eot)
        joined = EOT + EOT.join(texts)
        if joined.count(EOT) != len(texts):  # a text holds the string <|endoftext|> (or there are no texts)
            return super().encode_documents(texts, eot)
        try:
            tokens = self.enc.encode_to_numpy(joined, allowed_special={EOT})
        except UnicodeEncodeError:  # lone surrogates (from JSON escapes): text by text, as encode_to_numpy does
            return super().encode_documents(texts, eot)
        starts = np.flatnonzero(tokens == self.eot_id)  # (len(texts),): ordinary text never encodes to a special id
        return tokens, np.diff(starts, append=len(tokens))

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes(list(ids))

    def to_dict(self) -> dict:
        ranks = {base64.b64encode(token).decode("ascii"): rank for token, rank in self.enc._mergeable_ranks.items()}
        return {
            "type": "tiktoken",
            "name": self.enc.name,
            "pat_str": self.enc._pat_str,
            "special_tokens": self.enc._special_tokens,
            "mergeable_ranks": ranks,
        }


def _tiktoken_encoding(name: str, pat_str: str, ranks: dict[bytes, int], special_tokens: dict[str, int]):
    import tiktoken

    return tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)


def from_ranks_file(path: str | Path) -> TiktokenTokenizer:
    """A tokenizer from a `.tiktoken` ranks file, with GPT-2's split pattern and <|endoftext|> after the ranks."""
    from tiktoken.load import load_tiktoken_bpe

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken ranks file {path} does not exist")
    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as e:  # tiktoken raises plain ValueError/binascii errors for a malformed file
        raise ValueError(f"{path} is not a tiktoken ranks file (lines of 'base64-token rank'): {e}") from None
    # byte-level BPE falls back to single bytes: without all 256 of them tiktoken's encoder panics on some text
    single = sum(1 for token in ranks if len(token) == 1)
    if single < 256 or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path} is incomplete: {len(ranks)} tokens, {single} of the 256 single bytes"
                         f"{'' if sorted(ranks.values()) == list(range(len(ranks))) else ', ranks not 0..N-1'}; "
                         "a byte-level BPE ranks file holds every byte value (download it again)")
    return TiktokenTokenizer(_tiktoken_encoding(path.stem, GPT2_PATTERN, ranks, {EOT: len(ranks)}))


def from_tiktoken_name(name: str) -> TiktokenTokenizer:
    """A named tiktoken encoding; a failed download says how to work offline."""
    import tiktoken

    if name not in tiktoken.list_encoding_names():
        raise ValueError(
            f"unknown tokenizer '{name}'; use byte, char, a tiktoken encoding "
            f"({', '.join(tiktoken.list_encoding_names())}) or a path to a .tiktoken ranks file"
        )
    try:
        return TiktokenTokenizer(tiktoken.get_encoding(name))
    except Exception as e:
        if "Connection" in type(e).__name__ or "Timeout" in type(e).__name__ or isinstance(e, OSError):
            raise ConnectionError(
                f"tiktoken could not download the files of '{name}' ({type(e).__name__}); offline, pass a local "
                f"ranks file instead (--tokenizer=path/to/{name}.tiktoken) or set TIKTOKEN_CACHE_DIR to a cache "
                "that already holds them"
            ) from None
        raise


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
    if spec.endswith(".tiktoken") or os.path.sep in spec or os.path.isfile(spec):
        return from_ranks_file(spec)
    return from_tiktoken_name(spec)


def tokenizer_from_dict(d: dict, source: str = "tokenizer JSON") -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_dict()` output."""
    kind = d.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "tiktoken":
        ranks = {base64.b64decode(token): rank for token, rank in d["mergeable_ranks"].items()}
        return TiktokenTokenizer(_tiktoken_encoding(d["name"], d["pat_str"], ranks, d["special_tokens"]))
    raise ValueError(f"{source} has unknown tokenizer type {kind!r}; expected byte, char or tiktoken")


def tokenizer_from_spec(spec: str) -> Tokenizer:
    """A saved tokenizer JSON (a path ending in .json), a .tiktoken ranks file or a tiktoken encoding name."""
    return load_tokenizer(spec) if spec.endswith(".json") else get_tokenizer(spec)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer JSON written by `Tokenizer.save`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist; run data/prepare.py to create it")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {path} is not valid JSON: {e}") from None
    return tokenizer_from_dict(d, str(path))


class StreamDecoder:
    """Turns a stream of token ids into text, holding back bytes of a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self.utf8.decode(self.tokenizer.token_bytes(ids))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
