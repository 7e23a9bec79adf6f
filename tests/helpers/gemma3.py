"""A tiny Gemma 3 directory laid out as a user downloads an instruction-tuned one: random weights written by
transformers' save_pretrained (Gemma3ForCausalLM, a window of 8 positions), a byte-level BPE tokenizer.json trained
on tiny Shakespeare with Gemma's special tokens (<bos> put before every encoding, as Gemma's own tokenizer does),
tokenizer_config.json with Gemma 3's chat template and its eos <eos>, and generation_config.json listing both <eos>
and <end_of_turn> as the ids that end a reply (as google/gemma-3-*-it's do)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from tests.conftest import shared_file
from tests.hf.test_families import FAMILIES
from tests.test_hf import randomized

# google/gemma-3-*-it's chat template: <bos>, then <start_of_turn>role\n...<end_of_turn>\n per message, the assistant's
# role named "model", a system prompt put before the first user message
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 0 to 5
PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN = range(6)
VOCAB = 384


def gemma3_tokenizer(folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json: byte-level BPE over tiny Shakespeare, Gemma's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = shared_file("data/tinyshakespeare.txt").read_text()[:200_000]
    tok.train_from_iterator(
        text.splitlines(),
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS)]
    )
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<end_of_turn>") == END_OF_TURN
    tok.save(str(folder / "tokenizer.json"))
    settings = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def gemma3_config(**overrides) -> transformers.Gemma3TextConfig:
    """The tests' tiny Gemma 3 (a window of 8) with the tokenizer's vocabulary and Gemma's special ids."""
    _, config = FAMILIES["gemma3"]
    values = {
        **config.to_dict(),
        "vocab_size": VOCAB,
        "final_logit_softcapping": None,  # as Gemma 3's own configs
        "bos_token_id": BOS,
        "eos_token_id": [EOS, END_OF_TURN],
        "pad_token_id": PAD,
        **overrides,
    }
    return transformers.Gemma3TextConfig(**values)


def gemma3_dir(folder: Path, **overrides) -> transformers.Gemma3ForCausalLM:
    """Write the directory into folder; the transformers model it holds."""
    model = randomized(transformers.Gemma3ForCausalLM(gemma3_config(**overrides)))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD
    )
    model.save_pretrained(folder)
    gemma3_tokenizer(folder)
    return model
