"""tiktoken's byte-level BPE encodings: a named encoding (downloaded once by tiktoken) or a local `.tiktoken` ranks
file, the offline route."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gptlite.tokenizer.base import EOT, Tokenizer

# GPT-2's pre-tokenization pattern (as in tiktoken_ext.openai_public.r50k_pat_str)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


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

    def special_token_ids(self) -> set[int]:
        return super().special_token_ids() | set(self.enc._special_tokens.values())

    def _token_bytes(self, ids: Iterable[int]) -> bytes:
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


def tiktoken_encoding(name: str, pat_str: str, ranks: dict[bytes, int], special_tokens: dict[str, int]):
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
        raise ValueError(
            f"{path} is incomplete: {len(ranks)} tokens, {single} of the 256 single bytes"
            f"{'' if sorted(ranks.values()) == list(range(len(ranks))) else ', ranks not 0..N-1'}; "
            "a byte-level BPE ranks file holds every byte value (download it again)"
        )
    return TiktokenTokenizer(tiktoken_encoding(path.stem, GPT2_PATTERN, ranks, {EOT: len(ranks)}))


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
