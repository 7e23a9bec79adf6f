"""Conversations end to end: chat templates with transformers' ids, the assistant's spans as targets, data/prepare.py
--chat and its refusals, a model that learns to answer and sample.py --chat that answers."""

import json
import random
import re
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gptlite.checkpoint import load_checkpoint
from gptlite.data.prepare import prepare
from gptlite.data.shards import TARGET, read_roles, read_shard, roles_path
from gptlite.hf import export_hf
from gptlite.hf.__main__ import main as hf_main
from gptlite.tokenizer import ByteTokenizer, get_tokenizer, load_tokenizer
from gptlite.tokenizer.chat import CHATML
from tests.conftest import ROOT, run_train, tiny_model

QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}{{- '<|im_start|>' + message.role + '\\n' "
    "+ message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_LIKE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo 🙂  there\t!"},
    {"role": "assistant", "content": "Hi.\n\nHow are you?"},
    {"role": "user", "content": "Fine."},
    {"role": "assistant", "content": "Good."},
]


def model_dir(tmp_path, template: str, layout: str):
    """A tokenizer folder of a chat model (ChatML and Llama 3 markers as special tokens), its template in
    chat_template.jinja (transformers 5) or in tokenizer_config.json (the older Hub layout)."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok.train_from_iterator(
        ["To be, or not to be, that is the question. How are you? Fine. Good."] * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    if layout == "config":
        config["chat_template"] = template
    else:
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("template", [QWEN_LIKE, LLAMA_LIKE], ids=["qwen-like", "llama-like"])
@pytest.mark.parametrize("layout", ["jinja", "config"])
def test_template_ids_equal_transformers(tmp_path, template, layout):
    folder = model_dir(tmp_path, template, layout)
    ours, theirs = get_tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    for generation in (False, True):
        messages = CONVERSATION[:4] if generation else CONVERSATION
        expected = theirs.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ours.apply_chat_template(messages, add_generation_prompt=generation) == list(expected)


def test_the_targets_are_exactly_the_assistants_turns(tmp_path):
    for tokenizer, end in (
        (get_tokenizer(str(model_dir(tmp_path, QWEN_LIKE, "jinja"))), "<|im_end|>"),
        (ByteTokenizer(), "<|im_end|>"),
    ):
        ids, targets = tokenizer.chat_targets(CONVERSATION)
        assert ids == tokenizer.apply_chat_template(CONVERSATION)
        spans, run = [], []
        for i, t in zip(ids, targets, strict=True):
            if t:
                run.append(i)
            elif run:
                spans, run = [*spans, run], []
        spans += [run] if run else []
        assert [tokenizer.decode(s) for s in spans] == ["Hi.\n\nHow are you?" + end, "Good." + end]
    assert ByteTokenizer().chat_template is None  # the default, ChatML, is added when a conversation needs it
    byte = ByteTokenizer()
    byte.use_default_template()
    assert byte.chat_template == CHATML and byte.vocab_size == 258 and byte.end_of_turn_id == 257


def write_chats(path, n: int, seed: int = 0, extra: list | None = None):
    rng = random.Random(seed)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 8)))},
                {"role": "assistant", "content": "I like tea."},
            ]
        }
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, *(extra or [])]))
    return path


def test_prepare_chat_writes_roles_and_counts_what_it_leaves_out(tmp_path, capsys):
    long = {"messages": [{"role": "user", "content": "x" * 500}, {"role": "assistant", "content": "no"}]}
    silent = {"messages": [{"role": "user", "content": "anyone?"}]}
    source = write_chats(tmp_path / "c.jsonl", 60, extra=[long, silent])
    logged = []
    manifest = prepare([str(source)], "byte", tmp_path / "d", chat=True, block_size=64, log=logged.append)
    assert manifest["conversations"] == {"kept": 60, "cut": 0, "too_long": 1, "no_assistant": 1}
    assert "60 conversations kept (0 cut to block_size), 1 left out as too long, 1 without an assistant turn" in logged
    tokens = manifest["train_tokens"] + manifest["val_tokens"]
    assert logged[-1].startswith(f"60 conversations, {tokens:,} tokens ({tokens / 60:,.1f} per conversation; ")
    # the progress bar counts the same tokens as the summary (not the roles files' bytes beside them too)
    assert re.findall(r"tokens=([\d,]+)", capsys.readouterr().err)[-1] == f"{tokens:,}"
    tokenizer = load_tokenizer(tmp_path / "d")
    assert tokenizer.chat_template == CHATML and tokenizer.vocab_size == 258  # recorded for every command
    shard = tmp_path / "d" / "train_000000.bin"
    tokens = read_shard(shard)
    roles = read_roles(roles_path(shard), len(tokens))
    targets = bytes(int(t) for t, r in zip(tokens, roles, strict=True) if r & TARGET and t < 256)
    assert targets == b"I like tea." * len(targets.split(b"I like tea.")[:-1])
    cut = prepare([str(source)], "byte", tmp_path / "cut", chat=True, block_size=64, too_long="cut", log=lambda *a: 0)
    assert cut["conversations"]["cut"] == 0 and cut["conversations"]["no_assistant"] == 2  # its answer was cut off


@pytest.mark.parametrize(
    "record,message",
    [
        ({"text": "hi"}, r"c\.jsonl line 1 has no field 'messages' \(found: text\); pass --messages_field"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            r"message 1 has role 'robot'; use one of system, user, assistant",
        ),
        ({"messages": "hello"}, r"messages must be a non-empty list"),
    ],
)
def test_bad_conversations_are_one_line(tmp_path, record, message):
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data/prepare.py"),
            "--input",
            str(tmp_path / "c.jsonl"),
            "--chat",
            "--tokenizer=byte",
            f"--out_dir={tmp_path / 'd'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert __import__("re").search(message, result.stderr) and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_a_template_that_fails_is_one_line(tmp_path):
    folder = model_dir(
        tmp_path / "m" if (tmp_path / "m").mkdir() is None else None,
        "{{ raise_exception('only user and assistant') }}",
        "jinja",
    )
    with pytest.raises(
        ValueError, match="the chat template failed to render this conversation: only user and assistant"
    ):
        get_tokenizer(str(folder)).apply_chat_template(CONVERSATION)


@pytest.mark.slow  # starts processes or compiles: left out by -m 'not slow'
def test_a_model_learns_to_answer_and_sample_chat_answers(tmp_path):
    """Users type random letters, the assistant always says 'I like tea.': trained on the assistant's turns only,
    the loss falls near 0 (it could not if the random letters were targets), and sample.py --chat answers."""
    source = write_chats(tmp_path / "chats.jsonl", 400)
    prepare([str(source)], "byte", tmp_path / "data", chat=True, block_size=64, log=lambda *a: 0)
    run = tmp_path / "run"
    summary = run_train(
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={run}",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=64",
        "--batch_size=16",
        "--learning_rate=3e-3",
        "--warmup_iters=10",
        "--max_iters=150",
        "--eval_interval=150",
        "--eval_iters=0",
        "--log_interval=10",
        "--device=cpu",
    )
    assert summary["history"][-1][1] < 0.05 and summary["val_history"][-1][1] < 0.05
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            f"--out_dir={run}",
            "--chat",
            "--temperature=0",
            "--max_new_tokens=30",
            "--device=cpu",
        ],
        input="qwerty\nabc\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["I like tea.", "I like tea."]


def test_a_conversation_keeps_its_earlier_turns_in_the_kv_cache():
    """Each turn prefills only what the cache does not hold: its replies equal a fresh cache's."""
    import torch

    from gptlite import GPT
    from gptlite.inference.conversation import Conversation
    from gptlite.inference.sampling import Sampling
    from gptlite.tokenizer import CharTokenizer
    from tests.conftest import tiny_config

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n.")
    tokenizer.use_default_template()
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, block_size=256)).eval()
    talk = Conversation(model, tokenizer, Sampling(temperature=0), max_new_tokens=12, system="be brief")
    first = "".join(talk.reply("hello there"))
    held = len(talk.fed)
    second = "".join(talk.reply("and again"))
    assert talk.reused == held > 0  # the first turn's tokens stayed in the cache
    fresh = Conversation(model, tokenizer, Sampling(temperature=0), max_new_tokens=12, system="be brief")
    fresh.messages += [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first}]
    assert "".join(fresh.reply("and again")) == second and fresh.reused == 0


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_pretrained_model_without_a_chat_template_grows_for_chatmls_markers(tmp_path, tie):
    """--chat data for a model whose tokenizer has no chat template: the data's tokenizer adds ChatML's two markers
    past the model's ids, and training grows the embeddings (and an untied head) for them, each new row the mean
    of the existing rows; LoRA, which would keep those rows frozen, is refused in one line."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["I like tea. abcdefgh"] * 20, trainer)
    base = tmp_path / "base"
    pretrained = tiny_model(pos_emb="rope", norm="rmsnorm", vocab_size=tok.get_vocab_size(), tie_embeddings=tie)
    export_hf(pretrained, base)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    data = tmp_path / "data"
    prepare([str(write_chats(tmp_path / "c.jsonl", 40))], str(base), data, chat=True, block_size=32, log=lambda *a: 0)
    V = pretrained.config.vocab_size
    assert load_tokenizer(data).vocab_size == V + 2  # <|im_start|> and <|im_end|>, past the model's ids

    run = tmp_path / "run"
    args = [f"--init_from={base}", f"--data_dir={data}", "--block_size=32", "--batch_size=4", "--device=cpu"]
    result = run_train(*args, f"--out_dir={run}", "--learning_rate=0", "--max_iters=1", "--eval_iters=1")
    assert result.code == 0, result.err
    assert "the data's tokenizer has 2 token(s) that" in result.out and "grow by 2 row(s)" in result.out
    weights = load_checkpoint(run)["model"]
    for name in ["tok_emb.weight"] + ([] if tie else ["lm_head.weight"]):
        before = pretrained.state_dict()[name]
        assert weights[name].shape == (V + 2, before.shape[1])
        assert torch.equal(weights[name][:V], before)  # learning_rate=0: the pretrained rows as they were
        torch.testing.assert_close(weights[name][V:], before.mean(0).expand(2, -1))
    error = run_train(*args, f"--out_dir={tmp_path / 'lora'}", "--lora_rank=4").error
    assert "adds 2 token(s)" in error and "fine-tune without --lora_rank" in error
    # exported, the markers are transformers' special tokens at their ids, and the end of a turn ends a sequence
    assert hf_main(["export", f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}"]) == 0
    theirs, ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"), load_tokenizer(run)
    assert len(theirs) == V + 2 and theirs.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [V, V + 1]
    assert theirs.eos_token == "<|im_end|>"
    assert theirs.apply_chat_template(CONVERSATION[1:3], return_dict=False) == ours.apply_chat_template(
        CONVERSATION[1:3]
    )


def test_gemmas_targets_are_its_model_turns_through_end_of_turn(tmp_path):
    """Gemma's template ends a turn with <end_of_turn> and a newline; its eos is <eos>, and <end_of_turn> is one of
    the ids its generation_config.json ends a reply with: a target is a `model` turn's content and <end_of_turn>,
    not the newline after it (the next turn's), as a Gemma 3 directory's own files say."""
    from tests.helpers.gemma3 import gemma3_dir

    gemma3_dir(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    ids, targets = tokenizer.chat_targets(CONVERSATION)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(CONVERSATION)
    assert ids == list(theirs["input_ids"])
    marked = tokenizer.token_bytes(
        [i if t else tokenizer.special_id("<pad>") for i, t in zip(ids, targets, strict=True)]
    )
    turns = [s for s in marked.decode().split("<pad>") if s]
    assert turns == ["Hi.\n\nHow are you?<end_of_turn>", "Good.<end_of_turn>"]
