"""Hugging Face `tokenizer.json` files, through the `tokenizers` library (Rust): the tokenizers of today's open
models and the ones `python -m gptlite.tokenizer train` writes.

Encoding gives exactly the ids of transformers' `AutoTokenizer(text, add_special_tokens=False)`: the tokenizer's
own pre-tokenizer and merges, and its added special tokens recognised where the text spells them (as transformers
does; gptlite's tiktoken tokenizers treat such strings as plain text). The special tokens gptlite needs come from
`tokenizer_config.json` (bos_token, eos_token; also special_tokens_map.json and generation_config.json's eos ids)
beside the file: `eot_id` is <|endoftext|>'s id where the vocabulary has it, else the end-of-sequence token's.
A chat template (`chat_template.jinja`, or `chat_template` in tokenizer_config.json) is kept for the chat commands.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

import numpy as np

from gptlite.tokenizer.base import EOT, Tokenizer

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SPECIAL_NAMES = ("eos_token", "bos_token", "unk_token", "pad_token")  # what tokenizer_config.json may name


def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's map of byte values to printable characters, in which byte-level BPE vocabularies are
    written (tokenizers' ByteLevel: bytes 33-126, 161-172 and 174-255 as themselves, the rest from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def is_byte_level(spec: dict) -> bool:
    """Whether a tokenizer.json's decoder is byte-level (every token spells bytes in GPT-2's printable map)."""
    decoders = [spec.get("decoder") or {}]
    decoders += decoders[0].get("decoders", []) if decoders[0].get("type") == "Sequence" else []
    return any(d.get("type") == "ByteLevel" for d in decoders)


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json (the `spec` dict), with the special tokens gptlite uses named by their text."""

    kind = "huggingface"

    def __init__(
        self,
        spec: dict,
        bos: str | None = None,
        eos: str | None = None,
        stop: Iterable[str] = (),
        chat_template: str | None = None,
        names: dict[str, str | None] | None = None,
    ):
        from tokenizers import Tokenizer as RustTokenizer

        self.spec = spec
        self.names = names  # a directory's own names of its special tokens (see special_names); None in a run
        self.tok = RustTokenizer.from_str(json.dumps(spec))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos = bos
        self.eos = eos
        self.chat_template = chat_template
        self.bos_id, self.eos_id = self.token_id(bos), self.token_id(eos)
        self.eot_id = self.token_id(EOT) if self.token_id(EOT) is not None else self.eos_id
        self.stop = [s for s in dict.fromkeys([*stop, *([eos] if eos else [])]) if self.token_id(s) is not None]
        self.stop_ids = [self.token_id(s) for s in self.stop]  # the tokens that end a reply (eos and its kind)
        self._bytes = self.byte_table()
        self.added_tokens = {t["content"] for t in spec.get("added_tokens", [])}
        self.fast = tiktoken_fast_path(spec, self._bytes, self.added_tokens)  # the same ids, several times faster

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    def byte_table(self) -> list[bytes]:
        """Every id's bytes: byte-level tokens through GPT-2's byte map, added tokens as their text, and for other
        models (SentencePiece-style) the token's text with "▁" as a space and <0xNN> as that byte."""
        decoder, byte_level = byte_decoder(), is_byte_level(self.spec)
        added = {t["id"]: t["content"] for t in self.spec.get("added_tokens", [])}
        texts = [""] * self.vocab_size
        for text, i in self.tok.get_vocab(with_added_tokens=True).items():
            texts[i] = text
        table = []
        for i, text in enumerate(texts):
            if i in added:
                table.append(added[i].encode("utf-8"))
            elif byte_level and all(c in decoder for c in text):
                table.append(bytes(decoder[c] for c in text))
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                table.append(bytes([int(text[3:5], 16)]))
            else:
                table.append(text.replace("\u2581", " ").encode("utf-8"))
        return table

    def encode(self, text: str) -> list[int]:
        if self.fast is not None:
            return self.fast.encode(text, allowed_special=self.added_tokens)
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.fast is not None:
            return self.fast.encode_batch(texts, allowed_special=self.added_tokens)
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_documents(self, texts: list[str], eot: bool) -> tuple[np.ndarray, np.ndarray]:
        """As Tokenizer's, the texts encoded in one call (into tiktoken, or into the Rust library, which splits them
        over its threads)."""
        encoded = self.encode_batch(texts) if texts else []
        head = [self.eot_id] if eot else []
        lengths = np.array([len(ids) + len(head) for ids in encoded], dtype=np.int64)
        flat = np.fromiter((t for ids in encoded for t in (*head, *ids)), dtype=np.uint32, count=int(lengths.sum()))
        return flat, lengths

    def _token_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        if is_byte_level(self.spec) or self.added:
            return super().decode(ids)
        return self.tok.decode(list(ids), skip_special_tokens=False)  # its decoder knows its spaces

    def special_id(self, text: str) -> int | None:
        return self.added.get(text, self.token_id(text) if text in self.added_tokens else None)

    def special_texts(self) -> dict[str, str | None]:
        return {"bos_token": self.bos, "eos_token": self.eos}

    def special_names(self) -> dict[str, str | None]:
        """A Hugging Face directory's own names (its tokenizer_config.json, special_tokens_map.json), as
        transformers' AutoTokenizer gives them: a model made elsewhere is described by its own files. A tokenizer
        of a run gptlite wrote has gptlite's (Tokenizer.special_names)."""
        return super().special_names() if self.names is None else dict(self.names)

    def specials_in_text(self) -> dict[str, int]:
        """Those gptlite added alone: the tokenizer's own added tokens the tokenizers library reads where the text
        spells them, as transformers does (split out here, the text between them would be encoded piece by piece,
        which a SentencePiece tokenizer's leading space would change)."""
        return dict(self.added)

    def special_token_ids(self) -> set[int]:
        """Its added tokens marked special (an added token that is not, such as a word, is text), and gptlite's."""
        own = {t["id"] for t in self.spec.get("added_tokens", []) if t.get("special")}
        return super().special_token_ids() | own

    def encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """The Rust library's own character offsets (exact for every kind of tokenizer)."""
        encoding = self.tok.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def to_dict(self) -> dict:
        return {
            "type": "huggingface",
            "tokenizer": self.spec,
            "bos": self.bos,
            "eos": self.eos,
            "stop": self.stop,
            "chat_template": self.chat_template,
        }


def tiktoken_fast_path(spec: dict, token_bytes: list[bytes], added: set[str]):
    """A tiktoken Encoding with exactly this tokenizer's ids, where one exists, else None: a byte-level BPE whose
    pre-tokenizer is one regex split (or GPT-2's ByteLevel regex), no normalizer, `ignore_merges` (a word in the
    vocabulary is one token, as tiktoken does), merges whose results' ids grow with their priority (tiktoken merges
    by the result's id), and plain added tokens (recognised in text, as `allowed_special` does)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        from gptlite.tokenizer.tiktoken_bpe import GPT2_PATTERN as pattern
    elif (
        len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and "Regex" in steps[0].get("pattern", {})
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("use_regex", True)
        and not steps[1].get("add_prefix_space")
    ):
        pattern = steps[0]["pattern"]["Regex"]
    else:
        return None
    plain = all(not (t.get("lstrip") or t.get("rstrip") or t.get("single_word")) for t in spec.get("added_tokens", []))
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer")
        or not model.get("ignore_merges")
        or model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or not plain
        or not is_byte_level(spec)
    ):
        return None
    vocab = model.get("vocab", {})
    merged = [vocab.get("".join(m) if isinstance(m, list) else m.replace(" ", "", 1)) for m in model.get("merges", [])]
    if None in merged or any(a >= b for a, b in pairwise(merged)):
        return None
    ordinary = {t: i for t, i in vocab.items() if t not in added}
    ranks = {token_bytes[i]: i for i in ordinary.values()}
    if len(ranks) != len(ordinary) or sum(len(b) == 1 for b in ranks) < 256:
        return None
    import tiktoken

    specials = {t: i for t, i in ((t["content"], t["id"]) for t in spec.get("added_tokens", []))}
    try:
        return tiktoken.Encoding("gptlite_hf", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError:  # a pattern tiktoken's regex engine does not take
        return None


def is_hf_tokenizer_json(d: dict) -> bool:
    """Whether a parsed JSON file is Hugging Face's tokenizer.json (rather than gptlite's own format)."""
    return isinstance(d, dict) and "model" in d and "type" not in d


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_config(folder: Path, spec: dict) -> dict:
    """What the files beside a tokenizer.json say: bos, eos, the stop tokens, the chat template, and the names of
    its special tokens (SPECIAL_NAMES)."""
    configs = {}
    for name in CONFIG_FILES:
        path = folder / name
        if path.is_file():
            try:
                value = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
            configs[name] = value if isinstance(value, dict) else {}
    config = {**configs.get("special_tokens_map.json", {}), **configs.get("tokenizer_config.json", {})}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():  # what transformers 5 writes
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    by_id = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    eos_ids = configs.get("generation_config.json", {}).get("eos_token_id")
    stop = [by_id[i] for i in ([eos_ids] if isinstance(eos_ids, int) else eos_ids or []) if i in by_id]
    names = {name: token_text(config.get(name)) for name in SPECIAL_NAMES}
    return {
        "bos": names["bos_token"],
        "eos": names["eos_token"],
        "stop": stop,
        "chat_template": template if isinstance(template, str) else None,
        "names": names,
    }


BPE_FILES = ("vocab.json", "merges.txt")  # a byte-level BPE (GPT-2's) in its original two files, no tokenizer.json


def has_bpe_files(folder: Path) -> bool:
    return (
        folder.is_dir() and not (folder / "tokenizer.json").is_file() and all((folder / n).is_file() for n in BPE_FILES)
    )


def bpe_files_spec(folder: Path) -> dict:
    """The tokenizer.json of a folder that holds GPT-2's vocab.json and merges.txt instead: byte-level BPE with
    GPT-2's pre-tokenizer and decoder, as transformers' GPT2TokenizerFast builds it from the same files, its special
    tokens (those tokenizer_config.json or special_tokens_map.json name that the vocabulary holds) added."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab, merges = (str(folder / name) for name in BPE_FILES)
    try:
        tokenizer = RustTokenizer(models.BPE.from_file(vocab, merges))
    except Exception as e:  # the Rust library's errors for a malformed file
        raise ValueError(
            f"{folder}'s vocab.json and merges.txt are not a BPE ({str(e).splitlines()[0][:200]})"
        ) from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = read_config(folder, {})
    specials = {
        t for t in (config["bos"], config["eos"], *config["stop"]) if t and tokenizer.token_to_id(t) is not None
    }
    tokenizer.add_special_tokens(sorted(specials))
    return json.loads(tokenizer.to_str())


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """A Hugging Face tokenizer from its tokenizer.json, or from the folder that holds it (or GPT-2's vocab.json and
    merges.txt), with the special tokens and chat template of the files beside it; one-line errors name the file."""
    path = Path(path)
    if has_bpe_files(path):
        spec = bpe_files_spec(path)
        return HFTokenizer(spec, **read_config(path, spec))
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} holds no tokenizer.json; pass a Hugging Face tokenizer.json or the model folder that holds one"
            if path.is_dir()
            else f"tokenizer file {file} does not exist"
        )
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {file} is not valid JSON ({e}); download or write it again") from None
    if not is_hf_tokenizer_json(spec):
        raise ValueError(
            f"{file} is not a Hugging Face tokenizer.json (it has no 'model'); pass the tokenizer.json of "
            "a Hugging Face model or of python -m gptlite.tokenizer train"
        )
    config = read_config(file.parent, spec)
    try:
        return HFTokenizer(spec, **config)
    except Exception as e:  # the Rust library's errors for a malformed model or pre-tokenizer
        raise ValueError(
            f"{file} is not a valid Hugging Face tokenizer ({str(e).splitlines()[0][:200]}); download or write it again"
        ) from None
