"""Tokenizers: round trips, GPT-2 from the shared ranks file against tiktoken's own definition, JSON save/load."""

import json
import os
import subprocess
import sys

import pytest
import requests
import tiktoken
import tiktoken_ext.openai_public

from gptlite import tokenizer as tok
from gptlite.tokenizer import (
    GPT2_PATTERN,
    ByteTokenizer,
    CharTokenizer,
    StreamDecoder,
    TiktokenTokenizer,
    get_tokenizer,
    load_tokenizer,
)
from tests.conftest import shared_file

TEXTS = [
    "Hello world",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "héllo wörld — 日本語 🙂",
    "  spaces\tand\ttabs  \n\n\n  trailing   ",
    "it's we'll they've 123 4567 <|endoftext|> !!??",
    "",
]
CORPUS = "".join(TEXTS)


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer(str(gpt2_ranks()))


@pytest.fixture(params=["byte", "char", "gpt2"])
def any_tokenizer(request, gpt2):
    return {"byte": ByteTokenizer(), "char": get_tokenizer("char", CORPUS), "gpt2": gpt2}[request.param]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert all(0 <= i < any_tokenizer.vocab_size for i in ids)
    assert any_tokenizer.decode(ids) == text
    assert any_tokenizer.token_bytes(ids) == text.encode("utf-8")


def test_encode_batch_matches_encode(any_tokenizer):
    assert any_tokenizer.encode_batch(TEXTS) == [any_tokenizer.encode(t) for t in TEXTS]


def test_byte_tokenizer():
    t = get_tokenizer("byte")
    assert isinstance(t, ByteTokenizer)
    assert t.vocab_size == 256 and t.eot_id is None
    assert t.encode("aé") == [97, 0xC3, 0xA9]
    assert t.decode([0xC3]) == "\ufffd"  # half a character decodes to U+FFFD, not an exception


def test_char_tokenizer():
    t = get_tokenizer("char", ["hello", " world"])  # an iterable of chunks, as prepare streams it
    assert isinstance(t, CharTokenizer)
    assert t.chars == sorted(set("hello world"))
    assert t.vocab_size == 8 and t.eot_id is None
    assert t.encode("hello") == [t.chars.index(c) for c in "hello"]
    assert t.encode(" ") == [0]  # sorted: space first


def test_char_tokenizer_unknown_character():
    t = get_tokenizer("char", "abc")
    with pytest.raises(ValueError, match=r"character 'z' is not in this char tokenizer's vocabulary of 3 characters"):
        t.encode("abz")


def test_char_tokenizer_needs_text():
    with pytest.raises(ValueError, match="char tokenizer needs the corpus text"):
        get_tokenizer("char")
    with pytest.raises(ValueError, match="needs a non-empty corpus"):
        get_tokenizer("char", "")


def test_gpt2_from_ranks_file(gpt2):
    assert isinstance(gpt2, TiktokenTokenizer)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257
    assert gpt2.eot_id == 50256
    assert gpt2.decode([50256]) == "<|endoftext|>"
    # special-token text is encoded as plain text, never as the special id
    assert 50256 not in gpt2.encode("<|endoftext|>")
    assert gpt2.encode(" the") == [262]


def test_gpt2_pattern_is_tiktokens():
    assert GPT2_PATTERN == tiktoken_ext.openai_public.r50k_pat_str


def test_gpt2_ranks_file_matches_tiktoken_definition(gpt2):
    """Built by hand from tiktoken's published gpt2 constructor arguments, the encodings agree."""
    from tiktoken.load import load_tiktoken_bpe

    ref = tiktoken.Encoding(
        name="gpt2-ref",
        pat_str=tiktoken_ext.openai_public.r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(gpt2_ranks())),
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )
    for text in TEXTS:
        assert gpt2.encode(text) == ref.encode_ordinary(text)


@pytest.mark.parametrize("kind", ["byte", "char", "gpt2"])
def test_save_load_json_round_trip(tmp_path, gpt2, kind):
    t = {"byte": ByteTokenizer(), "char": get_tokenizer("char", CORPUS), "gpt2": gpt2}[kind]
    path = tmp_path / "tokenizer.json"
    t.save(path)
    d = json.loads(path.read_text(encoding="utf-8"))  # plain JSON, not a pickle
    assert d["vocab_size"] == t.vocab_size
    assert d["eot_id"] == t.eot_id
    assert not list(tmp_path.glob("*.tmp"))

    loaded = load_tokenizer(path)
    assert type(loaded) is type(t)
    assert loaded.vocab_size == t.vocab_size and loaded.eot_id == t.eot_id
    for text in TEXTS:
        ids = t.encode(text)
        assert loaded.encode(text) == ids
        assert loaded.decode(ids) == t.decode(ids) == text


def test_saved_gpt2_needs_no_ranks_file(tmp_path, gpt2):
    """The JSON holds the ranks themselves: loading it does not touch the .tiktoken file or the network."""
    path = tmp_path / "tokenizer.json"
    gpt2.save(path)
    d = json.loads(path.read_text(encoding="utf-8"))
    assert d["type"] == "tiktoken" and len(d["mergeable_ranks"]) == 50256
    assert d["special_tokens"] == {"<|endoftext|>": 50256}
    code = (
        "import tiktoken.load, sys\n"
        "def boom(*a, **k): raise AssertionError('ranks file read')\n"
        "tiktoken.load.load_tiktoken_bpe = boom\n"
        "from gptlite.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(path)!r})\n"
        "print(t.encode('Hello world'), 'gptlite.model.network' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[15496, 995] False"


def test_save_load_under_a_non_utf8_locale(tmp_path):
    """The JSON is UTF-8 whatever the locale's encoding (here ASCII), so non-ASCII char vocabularies survive."""
    path = tmp_path / "tokenizer.json"
    code = (
        "import locale\n"
        "from gptlite.tokenizer import get_tokenizer, load_tokenizer\n"
        f"get_tokenizer('char', 'h\\u00e9llo \\u65e5\\U0001f642').save({str(path)!r})\n"
        f"t = load_tokenizer({str(path)!r})\n"
        "print(locale.getpreferredencoding(), ascii(t.decode(t.encode('\\u00e9\\U0001f642'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8", "PYTHONIOENCODING"))}
    env.update(LC_ALL="C", PYTHONUTF8="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "'\\xe9\\U0001f642'"
    assert "\u65e5" in json.loads(path.read_text(encoding="utf-8"))["chars"]


@pytest.mark.parametrize("kind", ["byte", "gpt2"])
def test_stream_decoder_matches_decode(gpt2, kind):
    t = ByteTokenizer() if kind == "byte" else gpt2
    text = "héllo wörld — 日本語 🙂 and ✓"
    ids = t.encode(text)
    dec = StreamDecoder(t)
    pieces = [dec.feed([i]) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == t.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # a split character is held back, never replaced
    if kind == "byte":
        # the 4 bytes of 🙂 give nothing until the last one
        fresh = StreamDecoder(t)
        assert [fresh.feed([b]) for b in "🙂".encode()] == ["", "", "", "🙂"]


def test_stream_decoder_flush_replaces_an_unfinished_character():
    dec = StreamDecoder(ByteTokenizer())
    assert dec.feed([0xE6, 0x97]) == ""
    assert dec.flush() == "\ufffd"


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt3'; use byte, char, a tiktoken encoding \(.*gpt2.*\)"):
        get_tokenizer("gpt3")


def test_missing_ranks_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tiktoken ranks file .*nope\.tiktoken does not exist"):
        get_tokenizer(str(tmp_path / "nope.tiktoken"))


def test_malformed_ranks_file(tmp_path):
    path = tmp_path / "bad.tiktoken"
    path.write_text("this is not base64 and not a rank\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken is not a tiktoken ranks file"):
        get_tokenizer(str(path))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*none\.json does not exist; run data/prepare\.py"):
        load_tokenizer(tmp_path / "none.json")


def test_invalid_tokenizer_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(
        ValueError, match=r"t\.json is not valid JSON: .*; put back an intact copy .* or pass --tokenizer$"
    ):
        load_tokenizer(path)
    path.write_text(json.dumps({"type": "sentencepiece"}))
    with pytest.raises(ValueError, match=r"t\.json has unknown tokenizer type 'sentencepiece'"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    "error",
    [
        requests.exceptions.ConnectionError("Max retries exceeded with url: openaipublic.blob.core.windows.net"),
        requests.exceptions.ReadTimeout("read timed out"),
        OSError("Network is unreachable"),
    ],
)
def test_named_encoding_download_failure_says_how_to_work_offline(monkeypatch, error):
    def fail(name):
        raise error

    monkeypatch.setattr(tiktoken, "get_encoding", fail)
    with pytest.raises(ConnectionError, match=r"could not download the files of 'gpt2'.*offline.*gpt2\.tiktoken"):
        get_tokenizer("gpt2")


def test_named_encoding_other_errors_propagate(monkeypatch):
    def fail(name):
        raise KeyError("something else")

    monkeypatch.setattr(tiktoken, "get_encoding", fail)
    with pytest.raises(KeyError, match="something else"):
        tok.from_tiktoken_name("gpt2")


def gpt2_ranks():
    """The GPT-2 BPE ranks file of ../shared (fails in CI if missing, skips elsewhere)."""
    return shared_file("tokenizers/gpt2.tiktoken")


def test_a_fingerprint_is_the_tokenizers_content_whatever_its_file(tmp_path, gpt2):
    # GPT-2's BPE through tiktoken, and as the vocab.json and merges.txt an export writes, which transformers' and
    # gptlite's Hugging Face tokenizers read: the same pieces under the same ids, the same fingerprint
    from gptlite.hf.tokenizer_files import hf_tokenizer_files

    for name, text in hf_tokenizer_files(gpt2, 1024).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    as_files = load_tokenizer(tmp_path)
    assert type(as_files).__name__ == "HFTokenizer" and as_files.pieces() == gpt2.pieces()
    assert as_files.fingerprint() == gpt2.fingerprint()
    gpt2.save(tmp_path / "saved.json")
    assert load_tokenizer(tmp_path / "saved.json").fingerprint() == gpt2.fingerprint()
    # one piece moved to another id is another tokenizer, as is another corpus's char vocabulary
    swapped = CharTokenizer("abc")
    swapped.chars = ["b", "a", "c"]
    assert CharTokenizer("abc").fingerprint() != swapped.fingerprint() != CharTokenizer("abd").fingerprint()


def test_a_tokenizer_grown_by_chat_markers_is_the_same_tokenizer():
    from gptlite.tokenizer import check_same_tokenizer

    base = CharTokenizer("abc")
    grown = CharTokenizer("abc")
    grown.use_default_template()  # ChatML's two markers, past the vocabulary
    assert grown.vocab_size == base.vocab_size + 2 and grown.fingerprint(base.vocab_size) == base.fingerprint()
    check_same_tokenizer(base, "base", grown, "chat data", "fix")  # either way round: no error
    check_same_tokenizer(grown, "chat model", base, "text data", "fix")
    with pytest.raises(ValueError, match=r"^other data was tokenized with another tokenizer than base's: 3 ids with "
                       r"fingerprint \w{16} against 3 ids with fingerprint \w{16} \(2 of 3 pieces shared\); prepare "
                       r"it again$"):  # fmt: skip
        check_same_tokenizer(base, "base", CharTokenizer("abd"), "other data", "prepare it again")
    # pieces added past the vocabulary that are not special tokens are another tokenizer too
    other = CharTokenizer("abcd")
    with pytest.raises(ValueError, match="another tokenizer"):
        check_same_tokenizer(base, "base", other, "data", "fix")
