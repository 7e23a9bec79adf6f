"""Hugging Face tokenizer.json files and your own BPE: the ids of transformers' AutoTokenizer, decoding, special tokens,
the tiktoken fast path, `python -m gptlite.tokenizer train` from every input kind, its refusals, and a trained
tokenizer through prepare -> train -> sample -> evaluate -> export."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gptlite.checkpoint import load_model
from gptlite.hf import export_hf
from gptlite.tokenizer import HFTokenizer, get_tokenizer, load_tokenizer, tokenizer_from_dict
from gptlite.tokenizer.__main__ import main as tokenizer_main
from tests.conftest import ROOT, run_train, shared_file, tiny_model

TEXTS = [
    "Hello world",
    "héllo wörld — 日本語のテキスト 🙂🙃 naïve café",
    "  spaces\tand\ttabs  \n\n\n  trailing   ",
    "it's we'll they've 123 4567 89012 !!?? <|endoftext|> x",
    "def f(x):\n    return x ** 2  # squares\n\r\n\tindented\r\n",
    "",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    text = shared_file("data/tinyshakespeare.txt").read_text()[:300_000]
    (folder / "a.txt").write_text(text[:150_000] + "".join(TEXTS))
    (folder / "b.txt").write_text(text[150_000:])
    return folder


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert tokenizer_main(["train", "--input", str(corpus), "--vocab_size", "600", f"--out_dir={out}"]) == 0
    return out


def assert_same_ids(ours, directory, texts=TEXTS):
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in texts:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text


def test_a_trained_tokenizer_gives_transformers_ids_and_round_trips(trained, corpus):
    ours = load_tokenizer(trained)
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == 600 and ours.eot_id == 0 and ours.eos_id == 0
    assert ours.fast is not None  # byte-level BPE with one split pattern: tiktoken encodes it
    assert_same_ids(ours, trained, [*TEXTS, (corpus / "b.txt").read_text()[:20_000]])
    every_byte = bytes(range(256)).decode("latin-1")
    assert ours.decode(ours.encode(every_byte)) == every_byte  # every byte is in the vocabulary
    slow = HFTokenizer(ours.spec, ours.bos, ours.eos)
    slow.fast = None
    for text in TEXTS:
        assert slow.encode(text) == ours.encode(text) and slow.encode_batch(TEXTS) == ours.encode_batch(TEXTS)
    saved = tokenizer_from_dict(json.loads(json.dumps({"vocab_size": 600, **ours.to_dict()})))
    assert saved.encode(TEXTS[1]) == ours.encode(TEXTS[1]) and saved.eot_id == ours.eot_id


def model_folder(tmp_path, pre, decoder, model, specials, config, template=None):
    """A Hugging Face model's tokenizer folder built in the test (no download)."""
    tok = RustTokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre, decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if decoder.__class__.__name__ == "ByteLevel" else [],
    )
    tok.train_from_iterator([shared_file("data/tinyshakespeare.txt").read_text()[:100_000], *TEXTS], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )
    if template:
        (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_a_model_directorys_tokenizer_with_its_special_tokens(tmp_path):
    """A Llama-3-like tokenizer: GPT-2's ByteLevel regex (no fast path: merges are not ignored), bos/eos named in
    tokenizer_config.json, a chat template beside it."""
    folder = model_folder(
        tmp_path,
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        models.BPE(),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": {
                "__type": "AddedToken",
                "content": "<|eot_id|>",
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            },
        },
        "{{ messages }}",
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    ours = get_tokenizer(str(folder))
    assert (ours.bos_id, ours.eos_id, ours.eot_id) == (0, 2, 2) and ours.fast is None
    assert ours.stop == ["<|end_of_text|>", "<|eot_id|>"] and ours.chat_template == "{{ messages }}"
    assert_same_ids(ours, folder)
    assert ours.encode("<|eot_id|>") == [2]  # as transformers: special tokens are recognised in text


def test_a_sentencepiece_style_tokenizer_decodes_as_transformers_does(tmp_path):
    folder = model_folder(
        tmp_path,
        pre_tokenizers.Metaspace(),
        decoders.Metaspace(),
        models.BPE(byte_fallback=True),
        ["<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    ours, theirs = get_tokenizer(str(folder / "tokenizer.json")), transformers.AutoTokenizer.from_pretrained(folder)
    for text in ["Hello world", "First Citizen:\nBefore we proceed", "a  b"]:
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids and ours.decode(ids) == theirs.decode(ids)
    assert ours.eot_id == ours.eos_id == 1


@pytest.mark.parametrize("kind", ["file", "folder", "glob", "jsonl", "parquet"])
def test_training_reads_every_input_kind(corpus, tmp_path, kind):
    texts = [t for t in (corpus / "a.txt").read_text().split("\n\n") if t]
    if kind == "jsonl":
        source = tmp_path / "c.jsonl"
        source.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    elif kind == "parquet":
        source = tmp_path / "c.parquet"
        pq.write_table(pa.table({"content": texts}), source)
    else:
        source = {"file": corpus / "a.txt", "folder": corpus, "glob": corpus / "*.txt"}[kind]
    field = ["--text_field=content"] if kind in ("jsonl", "parquet") else []
    assert (
        tokenizer_main(["train", "--input", str(source), "--vocab_size=400", f"--out_dir={tmp_path / 'out'}", *field])
        == 0
    )
    assert load_tokenizer(tmp_path / "out").vocab_size == 400
    assert (
        tokenizer_main(
            [
                "train",
                "--input",
                str(source),
                "--vocab_size=300",
                f"--out_dir={tmp_path / 'capped'}",
                "--max_chars=2000",
                *field,
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--vocab_size=200"],
            r"vocab_size=200 is too small: the 256 bytes and 7 special tokens take 263 ids; give at least",
        ),
        (["--input", "nowhere.txt"], r"input nowhere\.txt is not a file, directory, glob with matches, or URL"),
        (["--input", "EMPTY"], r"are empty; there is no text to train on"),
        (["--max_chars=0"], r"max_chars=0 must be >= 1"),
        ([], r"tokenizer\.json exists; choose another --out_dir or pass --overwrite"),
        (["--input", "OWN", "--overwrite"], r"tokenizer\.json is a file this command writes; train on the corpus"),
    ],
)
def test_bad_training_input_is_one_line(trained, corpus, tmp_path, capsys, args, message):
    (tmp_path / "EMPTY").write_text("")
    args = [a.replace("EMPTY", str(tmp_path / "EMPTY")).replace("OWN", str(trained / "tokenizer.json")) for a in args]
    base = {"--input": ["--input", str(corpus / "a.txt")], "--vocab_size": ["--vocab_size=400"]}
    given = {a.split("=")[0] for a in args}
    argv = ["train", *args, *(v for k, v in base.items() if k not in given for v in v), f"--out_dir={trained}"]
    before = (trained / "tokenizer.json").read_bytes()
    assert tokenizer_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err
    assert (trained / "tokenizer.json").read_bytes() == before


def test_an_interrupted_training_writes_nothing(corpus, tmp_path, monkeypatch, capsys):
    import gptlite.tokenizer.__main__ as command

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "train_bpe", interrupted)
    assert tokenizer_main(["train", "--input", str(corpus), "--vocab_size=400", f"--out_dir={tmp_path / 'out'}"]) == 130
    assert "interrupted (SIGINT); nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", r"is not valid JSON"),
        ('{"model": {"type": "BPE", "vocab": 3}}', r"is not a valid Hugging Face tokenizer"),
        ('{"foo": 1}', r"has unknown tokenizer type None"),
    ],
)
def test_a_bad_tokenizer_json_is_one_line(tmp_path, content, message):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        get_tokenizer(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"empty holds no tokenizer\.json; pass a tokenizer\.json or the folder"
    ):
        get_tokenizer(str(tmp_path / "empty"))


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_a_trained_tokenizer_through_prepare_train_sample_evaluate_export(trained, corpus, tmp_path):
    data, run, hf = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    prepare = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data/prepare.py"),
            "--input",
            str(corpus),
            "--tokenizer",
            str(trained),
            f"--out_dir={data}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert prepare.returncode == 0, prepare.stderr
    run_train(
        f"--data_dir={data}",
        f"--out_dir={run}",
        "--pos_emb=rope",
        "--norm=rmsnorm",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=4",
        "--max_iters=4",
        "--eval_interval=4",
        "--eval_iters=2",
        "--device=cpu",
    )
    assert load_tokenizer(run).encode(TEXTS[1]) == load_tokenizer(trained).encode(TEXTS[1])
    for command in (
        ["sample.py", f"--out_dir={run}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=20"],
        ["-m", "gptlite.evaluate", f"--out_dir={run}"],
        ["-m", "gptlite.hf", "export", f"--out_dir={run}", f"--hf_dir={hf}"],
    ):
        path = [str(ROOT / command[0])] if command[0].endswith(".py") else command[:2]
        result = subprocess.run(
            [
                sys.executable,
                *path,
                *command[len(path) :],
                "--device=cpu" if "hf" not in command[1] else "--overwrite=false",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert result.returncode == 0, (command, result.stderr)
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert_same_ids(load_tokenizer(trained), hf)
    # one end of sequence everywhere: the end of a turn (<|im_end|>, 2) first, then the end of text (0)
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert exported.config.eos_token_id == exported.generation_config.eos_token_id == [2, 0]
    assert transformers.AutoTokenizer.from_pretrained(hf).eos_token == "<|im_end|>"


def test_a_folder_with_gpt2s_vocab_and_merges_files_loads_as_transformers_reads_it(corpus, tmp_path):
    """A GPT-2 model directory from before tokenizer.json (vocab.json and merges.txt): read from its own files,
    with the ids transformers' GPT2TokenizerFast gives, instead of asking tiktoken to download GPT-2's."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(corpus / "a.txt")], trainer)
    tok.model.save(str(tmp_path))  # vocab.json and merges.txt, as GPT-2's directories had them
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)  # reads the two files as it always has
    assert not (tmp_path / "tokenizer.json").exists()
    for ours in (load_tokenizer(tmp_path), get_tokenizer(str(tmp_path))):
        assert ours.vocab_size == 500 and ours.eot_id == tok.token_to_id("<|endoftext|>")
        for text in TEXTS:
            assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
            assert ours.decode(ours.encode(text)) == text
    # sample.py, evaluate and the server (load_model) take the directory's own files too
    model_dir = tmp_path / "gpt2"
    export_hf(tiny_model(ffn="gelu", bias=True, vocab_size=500), model_dir)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (model_dir / name).write_bytes((tmp_path / name).read_bytes())
    _, loaded = load_model(init_from=str(model_dir))
    assert isinstance(loaded, HFTokenizer) and loaded.encode(TEXTS[1]) == theirs(TEXTS[1])["input_ids"]
