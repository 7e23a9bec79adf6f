"""Text out of generation: UTF-8 safe streaming across BPE pieces, stop strings and the end-of-text token."""

import random

import pytest

from gptlite.inference.generate import TextStream, generate_text
from gptlite.tokenizer import ByteTokenizer
from tests.conftest import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:the context reached block_size")


class EotBytes(ByteTokenizer):
    """Byte-level ids below 97 (the tiny model's vocabulary), one of which plays end-of-text."""

    vocab_size = 97

    def __init__(self, eot_id: int | None = None):
        self.eot_id = eot_id


def stream_bytes(text: str, stop=(), chunk: int = 1) -> list[str]:
    """Feed text's UTF-8 bytes `chunk` ids at a time; the released pieces, then the closing piece."""
    data = list(text.encode("utf-8"))
    stream = TextStream(ByteTokenizer(), stop)
    pieces = [stream.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return pieces + [stream.close()]


def test_multibyte_characters_split_across_tokens_stream_whole():
    text = "héllo wörld, 日本語 ✓"
    pieces = stream_bytes(text)
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # 'é' is two bytes: nothing, then the whole character


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_strings_cut_exactly(chunk):
    assert "".join(stream_bytes("once upon a time, the end", stop=["e e", ", "], chunk=chunk)) == "once upon a time"
    assert "".join(stream_bytes("aaab", stop=["aab"], chunk=chunk)) == "a"  # overlapping starts
    assert "".join(stream_bytes("wörld", stop=["ö"], chunk=chunk)) == "w"  # a stop inside a split character
    assert "".join(stream_bytes("no stop here", stop=["xyz", ""], chunk=chunk)) == "no stop here"


def test_stream_holds_back_only_what_could_start_a_stop_string():
    stream = TextStream(ByteTokenizer(), stop=["END"])
    assert stream.feed(b"abc E") == "abc "  # "E" might begin "END"
    assert stream.feed(b"N") == ""
    assert stream.feed(b"d") == "ENd"  # it did not
    assert stream.feed(b" END tail") == " "
    assert stream.done and stream.feed(b"more") == "" and stream.close() == ""


def greedy_text(model, tokenizer, prompt, n, **kwargs) -> list[str]:
    texts = None
    for pieces in generate_text(model, tokenizer, prompt, n, temperature=0, **kwargs):
        texts = pieces if texts is None else [t + p for t, p in zip(texts, pieces, strict=True)]
    return texts


def test_generate_text_stops_at_stop_strings_and_eot():
    model = tiny_model()
    tokenizer = EotBytes()
    prompts = ["HI", "A LONGER PROMPT"]
    free = greedy_text(model, tokenizer, prompts, 40)
    assert all(len(t) == 40 for t in free)
    stop = free[0][10:13]
    cut = greedy_text(model, tokenizer, prompts, 40, stop=[stop])
    for full, got in zip(free, cut, strict=True):
        assert got == (full[: full.index(stop)] if stop in full else full)
    # the end-of-text token ends a row and is not printed
    eot = free[1][7]
    ended = greedy_text(model, EotBytes(eot_id=ord(eot)), prompts, 40)
    assert ended == [full[: full.index(eot)] if eot in full else full for full in free]
    assert greedy_text(model, EotBytes(eot_id=ord(eot)), prompts, 40, stop_at_eot=False) == free


def test_generate_text_samples_and_empty_prompt():
    model = tiny_model()
    texts = None
    for pieces in generate_text(model, EotBytes(), "", 12, num_samples=3, seed=5):
        assert len(pieces) == 3
        texts = pieces if texts is None else [t + p for t, p in zip(texts, pieces, strict=True)]
    assert all(len(t) == 12 for t in texts) and len(set(texts)) > 1


def first_stop_cut(text: str, stop: list[str]) -> str:
    """The reference: the text before the stop string that is complete first as the text arrives (of two
    completed by one character, the one that begins first), written as the definition, by brute force."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings_match_the_definition_on_random_text(chunk):
    """Random texts over a small alphabet, random (overlapping, self-similar) stop strings: the streamed text
    equals the definition's, whatever the chunking."""
    rng = random.Random(0)
    for _ in range(2_000):
        text = "".join(rng.choice("abé") for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice("abé") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        assert "".join(stream_bytes(text, stop=stop, chunk=chunk)) == first_stop_cut(text, stop), (text, stop)


def test_a_long_stop_string_holds_back_only_what_it_has_matched():
    """The check keeps one position per stop string (its time per character does not grow with the stop string's
    length; docs/serve.md has the figures): a stop string of 250,000 characters that stops matching releases
    everything held back for it."""
    stream = TextStream(ByteTokenizer(), stop=["x" * 249_999 + "y"])
    released = "".join(stream.feed(b"x" * 1_000) for _ in range(5)) + stream.feed(b"z")
    assert released == "x" * 5_000 + "z" and stream.pending == ""
