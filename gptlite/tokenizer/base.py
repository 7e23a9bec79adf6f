"""The tokenizer interface every tokenizer implements (encode, decode, token_bytes, vocab_size, eot_id,
apply_chat_template), the two that need no file (bytes and characters), and the streaming decoder."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # beside a data folder's shards, and copied into every run's out_dir


class Tokenizer:
    """The interface every tokenizer implements, and conversations on top of it (see gptlite.tokenizer.chat)."""

    kind: str
    vocab_size: int
    eot_id: int | None = None
    chat_template: str | None = None  # the tokenizer's own; None: gptlite's default, ChatML
    added: dict[str, int]  # special tokens gptlite added past the vocabulary (ChatML's markers), text -> id

    def __getattr__(self, name: str):
        if name == "added":  # a tokenizer made before any was added
            self.added = {}
            return self.added
        raise AttributeError(name)

    # -- conversations --------------------------------------------------------------------------------

    def add_special(self, text: str) -> int:
        """The id of a special token: the tokenizer's own, or a new one past the vocabulary (recorded in its file)."""
        own = self.special_id(text)
        if own is not None:
            return own
        self.added[text] = self.vocab_size
        self.vocab_size += 1
        return self.added[text]

    def special_id(self, text: str) -> int | None:
        """A special token's id, if the tokenizer knows it (its own, or one gptlite added)."""
        return self.added.get(text)

    def special_texts(self) -> dict[str, str | None]:
        """What a chat template may name: bos_token, eos_token (transformers passes the same)."""
        return {"bos_token": None, "eos_token": None}

    def special_names(self) -> dict[str, str | None]:
        """The names of its special tokens, as a tokenizer_config.json names them (eos_token, bos_token, unk_token,
        pad_token). gptlite's, for a tokenizer of a run it wrote: the eos is the first of `end_ids` (the end of a
        turn where there is one), the eos every export of the run names; no unk or pad. A Hugging Face directory's
        tokenizer has its own (HFTokenizer)."""
        ends = self.end_ids()
        eos = self.token_bytes(ends[:1]).decode("utf-8", errors="replace") if ends else None
        return {"eos_token": eos, "bos_token": self.special_texts()["bos_token"], "unk_token": None, "pad_token": None}

    def specials_in_text(self) -> dict[str, int]:
        """The special tokens that text is read as where it spells them (`encode_with_specials`), text -> id: each
        special token the tokenizer has (tiktoken's <|endoftext|>, the chat markers gptlite added), by its own
        text. The name of a special token it lacks stays plain text, as transformers reads text."""
        own = {self.token_bytes([i]).decode("utf-8", errors="replace"): i for i in sorted(self.special_token_ids())}
        return {**own, **self.added}

    def encode_with_specials(self, text: str) -> list[int]:
        """The ids of text in which each special token the tokenizer has is that token where the text spells it
        (`specials_in_text`), and the rest is encoded as `encode` does: how transformers reads a prompt, and the one
        way the server reads text (gptlite.serve)."""
        specials = self.specials_in_text()
        if not specials:
            return self.encode(text)
        pattern = "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
        ids = []
        pos = 0
        for match in re.finditer(pattern, text):
            ids += self.encode(text[pos : match.start()]) + [specials[match.group()]]
            pos = match.end()
        return ids + self.encode(text[pos:])

    def special_token_ids(self) -> set[int]:
        """The ids of the special tokens (end of text, chat markers): tokens that stand for no text of their own, so
        a grammar over text (gptlite.serve.grammar) never allows them as characters."""
        return set(self.added.values()) | ({self.eot_id} if self.eot_id is not None else set())

    def use_default_template(self) -> None:
        """A tokenizer without a chat template gets ChatML, its two markers special tokens (added if need be)."""
        from gptlite.tokenizer.chat import CHATML, IM_END, IM_START

        if self.chat_template is None:
            self.add_special(IM_START)
            self.add_special(IM_END)
            self.chat_template = CHATML

    @property
    def end_of_turn_id(self) -> int | None:
        """The token that ends an assistant's turn: ChatML's <|im_end|>, else the end-of-sequence token."""
        from gptlite.tokenizer.chat import IM_END

        own = self.special_id(IM_END)
        return own if own is not None else getattr(self, "eos_id", None) or self.eot_id

    def end_ids(self) -> list[int]:
        """The ids that end a generated sequence, the end of a turn first: ChatML's <|im_end|> where the tokenizer
        has it, the model's own stop tokens (a Hugging Face directory's generation_config.json), then its
        end-of-sequence and end-of-text tokens. The one list that sample.py --chat, RL's rollouts, the server and
        every export name (config.json's and generation_config.json's eos_token_id, the tokenizer files'
        eos_token, the GGUF's eos), so that every runtime stops where sample.py --chat stops."""
        ids = [self.end_of_turn_id, *getattr(self, "stop_ids", ()), getattr(self, "eos_id", None), self.eot_id]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def encode_special(self, text: str, specials: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
        """(ids, the character offset where each token starts) of text in which the added special tokens (or
        `specials`, text -> id) are special; ordinary text between them is encoded as `encode` does."""
        specials = self.added if specials is None else specials
        ids = []
        starts = []
        pos = 0
        pattern = "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) if specials else None
        for match in re.finditer(pattern, text) if pattern else ():
            part_ids, part_starts = self.encode_offsets(text[pos : match.start()])
            ids += part_ids + [specials[match.group()]]
            starts += [pos + s for s in part_starts] + [match.start()]
            pos = match.end()
        part_ids, part_starts = self.encode_offsets(text[pos:])
        return ids + part_ids, starts + [pos + s for s in part_starts]

    def encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """encode(text) and the character offset where each token starts (from the tokens' bytes)."""
        ids = self.encode(text)
        ends = list(itertools.accumulate(len(self.token_bytes([i])) for i in ids))
        byte_starts = [0, *ends[:-1]] if ids else []
        to_char = char_of_byte(text)
        return ids, [to_char[min(b, len(to_char) - 1)] for b in byte_starts]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, specials: dict[str, int] | None = None
    ) -> list[int]:
        """The ids of a conversation rendered with the tokenizer's chat template (transformers' ids for a model
        directory's template), or ChatML for a tokenizer without one; the rendered text's special tokens are those
        gptlite added, or `specials` (text -> id: the server passes `specials_in_text`)."""
        from gptlite.tokenizer.chat import check_messages, render

        self.use_default_template()
        text = render(self.chat_template, check_messages(messages), add_generation_prompt, self.special_texts())
        return self.encode_special(text, specials)[0]

    def chat_targets(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """A conversation's ids and, for each, whether it is a target: part of an assistant's turn (its content and
        end-of-turn token, see `turn_ends`), what fine-tuning learns to predict."""
        from gptlite.tokenizer.chat import assistant_spans, check_messages

        self.use_default_template()
        text, spans = assistant_spans(
            self.chat_template, check_messages(messages), self.special_texts(), self.turn_ends()
        )
        ids, starts = self.encode_special(text)
        return ids, [any(a <= s < b for a, b in spans) for s in starts]

    def turn_ends(self) -> list[str]:
        """The texts that end an assistant's turn in a rendered conversation (what chat fine-tuning and preference
        pairs train on ends after the last of them): ChatML's <|im_end|> where the tokenizer has it, else the
        tokens that end a reply (`end_ids`: a model directory's own, such as Gemma's <end_of_turn>, which its
        generation_config.json lists beside <eos>)."""
        from gptlite.tokenizer.chat import IM_END

        if self.special_id(IM_END) is not None:
            return [IM_END]
        return [self.token_bytes([i]).decode("utf-8", errors="replace") for i in self.end_ids()]

    # -- text ------------------------------------------------------------------------------------------

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
        """The bytes the ids stand for (an added special token: its text)."""
        if not self.added:
            return self._token_bytes(ids)
        text = {i: t.encode("utf-8") for t, i in self.added.items()}
        out, run = [], []
        for i in ids:
            if i in text:
                out += [self._token_bytes(run), text[i]]
                run = []
            else:
                run.append(i)
        return b"".join([*out, self._token_bytes(run)])

    def _token_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; invalid UTF-8 (a BPE piece cut mid-character) becomes U+FFFD."""
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        raise NotImplementedError

    # -- identity --------------------------------------------------------------------------------------

    def fingerprint(self, size: int | None = None) -> str:
        """The tokenizer's identity by content: a sha256 (its first 16 hex digits) of every id's piece (the bytes it
        stands for) and whether it is special, in id order, over the first `size` ids (default: all). Two tokenizers
        that give the same ids to the same pieces have the same fingerprint whatever their file's kind (GPT-2's BPE
        through tiktoken or as a tokenizer.json), and a tokenizer grown by special tokens at its end keeps its
        fingerprint over its first ids. Kept in the shards' manifest.json and in every checkpoint."""
        n = self.vocab_size if size is None else size
        specials = self.special_token_ids()
        sha = hashlib.sha256()
        for i, piece in enumerate(self.pieces(n)):
            sha.update(b"S" if i in specials else b"T")
            sha.update(len(piece).to_bytes(4, "little"))
            sha.update(piece)
        return sha.hexdigest()[:16]

    def pieces(self, size: int | None = None) -> list[bytes]:
        """The bytes of each of the first `size` ids (default: all), in id order."""
        return [self.token_bytes([i]) for i in range(self.vocab_size if size is None else size)]

    def identity(self) -> dict:
        """What a checkpoint and a manifest record of the tokenizer: its fingerprint and its number of ids."""
        return {"fingerprint": self.fingerprint(), "vocab_size": self.vocab_size}

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as JSON, atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        d = {
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            **self.to_dict(),
            "chat_template": self.chat_template,
            "added": self.added,
        }
        tmp.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255."""

    kind, vocab_size = "byte", 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _token_bytes(self, ids: Iterable[int]) -> bytes:
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

    def _token_bytes(self, ids: Iterable[int]) -> bytes:
        return "".join(self.chars[i] for i in ids).encode("utf-8")

    def to_dict(self) -> dict:
        return {"type": "char", "chars": "".join(self.chars)}


def extends(longer: Tokenizer, shorter: Tokenizer) -> bool:
    """Whether `longer` is `shorter` with special tokens added at its end (a chat template's markers, which
    data/prepare.py --chat adds to a base model's tokenizer): the same pieces under the same ids, the rest added."""
    n = shorter.vocab_size
    if longer.vocab_size < n or longer.fingerprint(n) != shorter.fingerprint():
        return False
    added = set(longer.added.values())
    return all(i in added for i in range(n, longer.vocab_size))


def check_same_tokenizer(model: Tokenizer, model_name: str, data: Tokenizer, data_name: str, fix: str) -> None:
    """Refuse to train, fine-tune or evaluate a model on tokens of another tokenizer: the ids would mean other
    pieces, and every figure would be silently wrong. Equal tokenizers pass, and so does one grown from the other
    by special tokens at its end (`extends`: a base's vocabulary grown by the chat markers). Otherwise a ValueError
    naming both, with their fingerprints and the share of pieces they have in common, and `fix`."""
    if extends(data, model) or extends(model, data):
        return
    shared = len(set(model.pieces()) & set(data.pieces()))
    raise ValueError(
        f"{data_name} was tokenized with another tokenizer than {model_name}'s: {data.vocab_size:,} ids with "
        f"fingerprint {data.fingerprint()} against {model.vocab_size:,} ids with fingerprint {model.fingerprint()} "
        f"({shared:,} of {model.vocab_size:,} pieces shared); {fix}"
    )


def char_of_byte(text: str) -> list[int]:
    """For each UTF-8 byte of text (and one past the end), the index of the character it belongs to."""
    out = [i for i, c in enumerate(text) for _ in range(len(c.encode("utf-8", errors="surrogatepass")))]
    return out + [len(text)]


class StreamDecoder:
    """Turns a stream of token ids into text, holding back bytes of a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self.utf8.decode(self.tokenizer.token_bytes(ids))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
