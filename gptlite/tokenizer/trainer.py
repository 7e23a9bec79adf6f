"""Train a byte-level BPE on your own corpus with the `tokenizers` library: GPT-4's split pattern (tiktoken's
cl100k, as nanochat's trainer uses), all 256 bytes in the base vocabulary so that no text is ever unknown,
<|endoftext|>, ChatML's two markers and a few reserved special tokens. The result is a Hugging Face tokenizer.json
plus the tokenizer_config.json that lets `transformers.AutoTokenizer.from_pretrained(DIR)` load it, with ChatML as
its chat template: a model pretrained on it is fine-tuned on conversations with the markers it already has, so a
LoRA fine-tune (whose embeddings are frozen) needs no new rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from gptlite.files import fault
from gptlite.tokenizer.base import EOT
from gptlite.tokenizer.chat import CHATML, IM_END, IM_START
from gptlite.tokenizer.huggingface import HFTokenizer

# tiktoken's cl100k_base pattern (GPT-4's): letters with a leading non-letter, numbers of 1-3 digits, punctuation runs
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s+"""
)
RESERVED = 4  # <|reserved_0|> .. <|reserved_3|>: room for special tokens a fine-tune adds (tools, ...)
CHUNK_CHARS = 1 << 20  # long documents reach the trainer in pieces of about this size, cut at line ends


def special_tokens(reserved: int = RESERVED) -> list[str]:
    return [EOT, IM_START, IM_END, *(f"<|reserved_{i}|>" for i in range(reserved))]


def check_vocab_size(vocab_size: int, reserved: int = RESERVED) -> None:
    minimum = 256 + len(special_tokens(reserved)) + 1
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 bytes and {len(special_tokens(reserved))} "
            f"special tokens take {minimum - 1} ids; give at least {minimum} (e.g. 8192)"
        )


def chunks(texts: Iterable[str], max_chars: int | None = None) -> Iterator[str]:
    """The texts in pieces of at most about CHUNK_CHARS, cut at line ends (the split pattern never joins across a
    newline run, so the counts are those of the whole text), up to max_chars characters in all."""
    left = max_chars if max_chars is not None else float("inf")
    for text in texts:
        if left <= 0:
            return
        text = text[: int(min(len(text), left))]
        left -= len(text)
        while len(text) > CHUNK_CHARS:
            cut = text.rfind("\n", 0, CHUNK_CHARS) + 1 or CHUNK_CHARS
            yield text[:cut]
            text = text[cut:]
        if text:
            yield text


def train_bpe(texts: Iterable[str], vocab_size: int, reserved: int = RESERVED) -> HFTokenizer:
    """A byte-level BPE of vocab_size ids (special tokens first, then the 256 bytes, then the merges) learnt from
    the texts, which are read as a stream."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size, reserved)
    tok = Tokenizer(models.BPE(ignore_merges=True))  # a word in the vocabulary is one token (also tiktoken's rule)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT4_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens(reserved)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(json.loads(tok.to_str()), bos=None, eos=EOT, chat_template=CHATML)


def tokenizer_config(tokenizer: HFTokenizer, max_length: int | None = None, eos: str | None = None) -> dict:
    """tokenizer_config.json for transformers' AutoTokenizer (a PreTrainedTokenizerFast over tokenizer.json); `eos`
    names another eos_token than the tokenizer's own (an export names the end of a turn, gptlite.hf.export)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length or 10**30,
        "bos_token": tokenizer.bos,
        "eos_token": eos or tokenizer.eos,
        "unk_token": None,
        "pad_token": None,
    }
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return config


def hf_files(tokenizer: HFTokenizer, max_length: int | None = None, eos: str | None = None) -> dict[str, str]:
    """The files of a Hugging Face tokenizer folder: tokenizer.json and tokenizer_config.json (`eos`: see
    tokenizer_config)."""
    return {
        "tokenizer.json": json.dumps(tokenizer.spec, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(tokenizer_config(tokenizer, max_length, eos), indent=2) + "\n",
    }


def write_files(folder: Path, files: dict[str, str]) -> None:
    """All the files or none: each is written to a temporary file first, and only when every one is written whole do
    they take their names, tokenizer.json last (a folder whose tokenizer.json exists holds the rest too)."""
    order = sorted(files, key=lambda name: name == "tokenizer.json")
    temporaries = {name: folder / f".{name}.tmp" for name in order}
    try:
        for name, tmp in temporaries.items():
            tmp.write_text(files[name], encoding="utf-8")
    except BaseException as e:
        for tmp in temporaries.values():
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise fault(e, f"could not write the tokenizer files in {folder} (nothing there changed)") from None
        raise
    for name, tmp in temporaries.items():
        os.replace(tmp, folder / name)
