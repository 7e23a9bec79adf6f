"""The tokenizer files of an export: what transformers' AutoTokenizer reads, with the same ids as gptlite's tokenizer:
a Hugging Face tokenizer's own tokenizer.json and tokenizer_config.json; for GPT-2's tiktoken BPE, GPT-2's
vocab.json and merges.txt rebuilt from the ranks; for the byte and char tokenizers, a tokenizer.json that maps each
byte or character to its id (a BPE with no merges)."""

from __future__ import annotations

import json
from itertools import pairwise

from gptlite.tokenizer import EOT, GPT2_PATTERN, ByteTokenizer, CharTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer
from gptlite.tokenizer.chat import IM_END
from gptlite.tokenizer.huggingface import byte_decoder


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters, in which vocab.json and merges.txt are written."""
    return {b: c for c, b in byte_decoder().items()}


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that tiktoken's ranks encode: token r (of two bytes or more) is the merge of the two parts
    that byte-pair encoding with the ranks below r leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(pairwise(parts))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(
                f"the ranks are not a byte-pair merge list: token {rank} ({token!r}) is no merge of two tokens"
            )
        merges.append((parts[0], parts[1]))
    return merges


def as_hf_tokenizer(tokenizer: ByteTokenizer | CharTokenizer) -> HFTokenizer:
    """The byte or char tokenizer as a Hugging Face one with the same ids: a BPE without merges whose vocabulary is
    the 256 bytes (written as GPT-2's byte-level characters, with its byte-level pre-tokenizer and decoder) or the
    characters (the text cut into characters, joined back as they are), then the special tokens gptlite added, at
    their ids, and the chat template."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    if isinstance(tokenizer, ByteTokenizer):
        chars = bytes_to_unicode()
        rust = RustTokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        rust.decoder = decoders.ByteLevel()
    else:
        rust = RustTokenizer(models.BPE({c: i for i, c in enumerate(tokenizer.chars)}, []))
        rust.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character a word of its own
        rust.decoder = decoders.Fuse()
    spec = json.loads(rust.to_str())
    return with_added_tokens(HFTokenizer(spec, chat_template=tokenizer.chat_template), tokenizer.added)


def with_added_tokens(tokenizer: HFTokenizer, added: dict[str, int]) -> HFTokenizer:
    """`tokenizer` with the special tokens gptlite added past its vocabulary (data/prepare.py --chat's ChatML
    markers, recorded in gptlite's tokenizer.json alone) written into its Hugging Face spec at their ids, so that
    transformers knows them; with ChatML's markers, the end of a turn is the end of a sequence, as for a model
    whose own template is ChatML."""
    from tokenizers import Tokenizer as RustTokenizer

    rust = RustTokenizer.from_str(json.dumps(tokenizer.spec))
    for text, i in sorted(added.items(), key=lambda item: item[1]):  # ids past the vocabulary, in order
        rust.add_special_tokens([text])
        if rust.token_to_id(text) != i:
            raise ValueError(f"the added token {text!r} would get id {rust.token_to_id(text)}, not its {i}")
    eos = IM_END if IM_END in added else tokenizer.eos
    return HFTokenizer(json.loads(rust.to_str()), tokenizer.bos, eos, tokenizer.stop, tokenizer.chat_template)


def gpt2_tokenizer_problem(tokenizer: Tokenizer) -> str | None:
    """Why the export cannot give transformers `tokenizer` (None when it can): a Hugging Face tokenizer goes as it
    is; the byte and char tokenizers as a Hugging Face one (see as_hf_tokenizer); a tiktoken one as GPT-2's
    tokenizer, which reproduces byte-pair encodings with GPT-2's split pattern only."""
    if isinstance(tokenizer, (HFTokenizer, ByteTokenizer, CharTokenizer)):
        return None
    if not (isinstance(tokenizer, TiktokenTokenizer) and tokenizer.enc._pat_str == GPT2_PATTERN):
        return (
            f"transformers' GPT-2 tokenizer reproduces byte-pair encodings with GPT-2's split pattern only; this "
            f"tokenizer is {tokenizer.kind}{'' if tokenizer.kind != 'tiktoken' else ' with another pattern'}"
        )
    ranks = tokenizer.enc._mergeable_ranks
    if tokenizer.enc._special_tokens != {EOT: len(ranks)} or sorted(ranks.values()) != list(range(len(ranks))):
        return "its ids are not ranks 0..N-1 followed by <|endoftext|>, as GPT-2's vocab.json lays them out"
    return None


def hf_tokenizer_files(tokenizer: Tokenizer, max_length: int) -> dict[str, str]:
    """The files transformers' AutoTokenizer reads, with the same ids as `tokenizer`: a Hugging Face tokenizer's
    tokenizer.json and tokenizer_config.json, or GPT-2's vocab.json, merges.txt and tokenizer_config.json."""
    problem = gpt2_tokenizer_problem(tokenizer)
    if problem:
        raise ValueError(f"the tokenizer cannot be written for transformers: {problem}")
    if isinstance(tokenizer, (ByteTokenizer, CharTokenizer)):
        tokenizer = as_hf_tokenizer(tokenizer)
    elif isinstance(tokenizer, HFTokenizer) and tokenizer.added:
        tokenizer = with_added_tokens(tokenizer, tokenizer.added)
    if isinstance(tokenizer, HFTokenizer):
        from gptlite.tokenizer.trainer import hf_files

        ends = tokenizer.end_ids()  # the end of a turn first: the eos that config.json and the GGUF name too
        return hf_files(tokenizer, max_length, tokenizer.tok.id_to_token(ends[0]) if ends else None)
    ranks = tokenizer.enc._mergeable_ranks
    chars = bytes_to_unicode()
    text = lambda token: "".join(chars[b] for b in token)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()} | {EOT: tokenizer.eot_id}
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in bpe_merges(ranks))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "add_prefix_space": False,
        "add_bos_token": False,
        "model_max_length": max_length,
        "errors": "replace",
    }
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + merges,
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
    }
