"""GGUF out: a gptlite model and its tokenizer in one file that llama.cpp (and Ollama, LM Studio, llamafile) runs.

The file is written with the `gguf` package, ggml's own Python writer, laid out as llama.cpp's
convert_hf_to_gguf.py lays out the same model: each family's file (gptlite.hf.families) names its llama.cpp
architecture, writes its hyperparameters and lays out its tensors, e.g.
    gpt2    GPT-2's switches (learned positions, LayerNorm, GELU); q, k and v stay fused (attn_qkv)
    llama   Llama's (RoPE, RMSNorm, SwiGLU, no biases), Mistral's and SmolLM2's too; q and k rows are reordered
            from the halves that gptlite (and transformers) rotate to the interleaved pairs llama.cpp rotates,
            and Llama 3's RoPE scaling is the per-frequency factors of a rope_freqs tensor
    qwen2   Llama's with biases on q, k and v (llama.cpp rotates halves for it: nothing is reordered)
    qwen3   Llama's with RMSNorm on each head's q and k
and granite, smollm3, olmo2, gemma3, lfm2, olmoe, qwen3moe and granitemoe (the router and the experts stacked)
likewise; this module writes what every file has (the tokenizer, the types, the file itself) and asks the family for
the rest.
The tokenizer goes inside as llama.cpp's byte-level BPE ("gpt2" model): every id's token in GPT-2's byte-level
characters, the merges, each special token marked a control token, and the name of the pre-tokenizer whose
splitting is gptlite's (GPT-2's pattern: "gpt-2"; GPT-4's, which `python -m gptlite.tokenizer train` uses, and
Llama 3's: "llama-bpe"; Qwen2's: "qwen2"; SmolLM's digits-first GPT-2 split: "smollm"). Ids past the tokenizer
(a vocabulary padded to 50,304) are unused tokens. gptlite never puts BOS before plain text, so the file says
llama.cpp should not either. A chat template goes in as it is.

Types: f32 keeps every tensor in float32; f16 and bf16 store the weight matrices so, and norms, biases and learned
positions in float32, as llama.cpp's converter does; q8_0 and q4_0 quantize the matrices with the `gguf` package's
reference quantizer (blocks of 32; a matrix whose input width is not a multiple of 32 goes in f16, and the export's
line says which: matrix_types). A model gptlite quantized itself (gptlite.inference.quantize) exports as the one type
its weights are: int4 in groups of 32 as q4_0, the same codes and scales bit for bit (q4_0's rule; a scale below
float16's normal range loses bits there); int8 as q8_0: the vocabulary's tables (in groups of 32 with float16 scales,
q8_0's rule) bit for bit, the blocks' matrices each block of 32 rounded again (one scale per row is not q8_0's one scale
per block).

    python -m gptlite.hf export --format=gguf --out_dir=RUN --out=FILE.gguf [--type=f32|f16|bf16|q8_0|q4_0]
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.config import GPTConfig
from gptlite.extras import need
from gptlite.files import fault, fsync_dir, make_dir, temp_path
from gptlite.hf.families import FAMILIES
from gptlite.hf.families.base import Family
from gptlite.hf.matching import matching_family, speedrun_options, switches_of, trained_with
from gptlite.hf.tokenizer_files import bpe_merges, bytes_to_unicode, with_added_tokens
from gptlite.tokenizer import GPT2_PATTERN, ByteTokenizer, CharTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer
from gptlite.tokenizer.chat import check_messages, render

if TYPE_CHECKING:
    from gptlite.model.network import Transformer

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# pre-tokenizer patterns as tokenizer.json files hold them -> llama.cpp's name for that splitting
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def split_patterns() -> dict[str, str]:
    from gptlite.tokenizer.trainer import GPT4_PATTERN

    return {GPT4_PATTERN: "llama-bpe", LLAMA3_PATTERN: "llama-bpe", QWEN2_PATTERN: "qwen2"}


# ---------------------------------------------------------------------------------------------
# What goes in: the architecture, the tokenizer


def gguf_architecture(config: GPTConfig, architecture: str | None = None) -> tuple[Family, str]:
    """The transformers family and llama.cpp's architecture name of a model's switches; a model llama.cpp cannot
    run is refused in one line naming its settings and the train.py flags that make one it runs."""
    speedrun = speedrun_options(config)
    if speedrun:  # as family_of says it
        named = ", ".join(f"{k}={getattr(config, k)}" for k in speedrun)
        raise ValueError(
            f"llama.cpp has no architecture for a model with {named}, "
            "speedrun options that change what the model computes; train without the speedrun options to export it"
        )
    family = matching_family(config, architecture)
    if family is None:
        raise ValueError(
            f"llama.cpp has no architecture for a model with {switches_of(config)}; "
            + trained_with(config, lambda c: gguf_family(c, architecture), lambda f: f"llama.cpp's {f.gguf_name}")
        )
    if family.gguf_name is None:
        written = sorted({f.architecture for f in FAMILIES.values() if f.gguf_name})
        raise ValueError(
            f"GGUF export of a {family.architecture} is not implemented (gptlite writes GGUF for "
            f"{', '.join(written)}); export it with python -m gptlite.hf export and convert that directory with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    problem = family.gguf_problem(config)
    if problem:
        raise ValueError(problem)
    return family, family.gguf_architecture(config)


def gguf_family(config: GPTConfig, architecture: str | None = None) -> Family | None:
    """The family of a model GGUF export takes, or None."""
    family = matching_family(config, architecture)
    return family if family is not None and family.gguf_name and not family.gguf_problem(config) else None


def pre_tokenizer_name(spec: dict) -> str | None:
    """llama.cpp's name for the way a byte-level BPE tokenizer.json splits text before merging (None: none that
    llama.cpp knows)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if spec.get("normalizer") or any(step.get("add_prefix_space") for step in steps):
        return None
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if (
        kinds == ["Split", "ByteLevel"]
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and not steps[1].get("use_regex", True)
    ):
        return split_patterns().get(steps[0].get("pattern", {}).get("Regex"))
    return None


class GGUFVocab:
    """A tokenizer as llama.cpp's byte-level BPE holds it: the token of every id (GPT-2's byte-level characters),
    each id's type, the merges, the pre-tokenizer's name, the end-of-sequence and beginning ids."""

    def __init__(
        self,
        tokens: list[str],
        specials: set[int],
        merges: list[str],
        pre: str,
        eos: int | None,
        bos: int | None,
        template: str | None,
    ):
        self.tokens = tokens
        self.specials = specials
        self.merges = merges
        self.pre = pre
        self.eos = eos
        self.bos = bos
        self.template = template


def gguf_vocab(tokenizer: Tokenizer | None, where: str) -> GGUFVocab:
    """The tokenizer in llama.cpp's terms; one that llama.cpp cannot reproduce is refused in one line."""
    if tokenizer is None:
        raise ValueError(
            f"{where} has no tokenizer, and a GGUF file carries its own; pass --tokenizer=PATH (a tokenizer.json or a "
            ".tiktoken file)"
        )
    if isinstance(tokenizer, (ByteTokenizer, CharTokenizer)):
        raise ValueError(
            f"{where}: a {tokenizer.kind}-level tokenizer has no form llama.cpp runs; GGUF export takes byte-pair "
            "tokenizers (GPT-2's, a Hugging Face byte-level BPE, or one from python -m gptlite.tokenizer train)"
        )
    if isinstance(tokenizer, TiktokenTokenizer):
        return tiktoken_vocab(tokenizer, where)
    if isinstance(tokenizer, HFTokenizer):
        return hf_vocab(with_added_tokens(tokenizer, tokenizer.added) if tokenizer.added else tokenizer, where)
    raise ValueError(f"{where}: a {tokenizer.kind} tokenizer cannot go into a GGUF file")


def tiktoken_vocab(tokenizer: TiktokenTokenizer, where: str) -> GGUFVocab:
    """GPT-2's BPE from its tiktoken ranks: token r is rank r, <|endoftext|> after them."""
    ranks = tokenizer.enc._mergeable_ranks
    if tokenizer.enc._pat_str != GPT2_PATTERN or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"{where}: a tiktoken tokenizer goes into GGUF only as GPT-2's (its split pattern, ranks 0..N-1); this one "
            "is another; train a Hugging Face BPE instead (python -m gptlite.tokenizer train)"
        )
    chars = bytes_to_unicode()
    tokens = [""] * len(ranks)
    for token, rank in ranks.items():
        tokens[rank] = "".join(chars[b] for b in token)
    specials = {}
    for text, i in {**tokenizer.enc._special_tokens, **tokenizer.added}.items():
        specials[i] = text
    tokens += [""] * (max(specials, default=len(tokens) - 1) + 1 - len(tokens))
    for i, text in specials.items():
        tokens[i] = text
    merges = [" ".join("".join(chars[b] for b in part) for part in pair) for pair in bpe_merges(ranks)]
    eot = tokenizer.eot_id
    return GGUFVocab(tokens, set(specials), merges, "gpt-2", tokenizer.end_ids()[0], eot, tokenizer.chat_template)


def hf_vocab(tokenizer: HFTokenizer, where: str) -> GGUFVocab:
    """A Hugging Face byte-level BPE's tokenizer.json: its vocabulary, merges and added tokens."""
    spec = tokenizer.spec
    model = spec.get("model") or {}
    decoder = spec.get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    if model.get("type") != "BPE" or not any(d.get("type") == "ByteLevel" for d in decoders):
        raise ValueError(
            f"{where}: its tokenizer is a {model.get('type', 'unknown')} model without GPT-2's byte-level "
            "characters; GGUF export takes byte-level BPE tokenizers only"
        )
    pre = pre_tokenizer_name(spec)
    if pre is None:
        raise ValueError(
            f"{where}: its tokenizer splits text in a way gptlite cannot name for llama.cpp (pre_tokenizer "
            f"{json_brief(spec.get('pre_tokenizer'))}, normalizer {json_brief(spec.get('normalizer'))}); GGUF export "
            "knows GPT-2's, GPT-4's and Llama 3's, Qwen2's and SmolLM's splits"
        )
    by_id = {i: token for token, i in model["vocab"].items()}
    specials = set()
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special", True):
            specials.add(added["id"])
    tokens = [by_id.get(i, "") for i in range(max(by_id) + 1)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    stops = tokenizer.end_ids()  # the end of a turn first: llama.cpp stops there, as sample.py --chat does
    return GGUFVocab(
        tokens, specials, merges, pre, stops[0] if stops else None, tokenizer.bos_id, tokenizer.chat_template
    )


def json_brief(value) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------------------
# The tensors, named and laid out as llama.cpp reads them


def gguf_tensors(
    family: Family, state: dict[str, torch.Tensor], config: GPTConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp's name, the tensor in float32) of every weight, in llama.cpp's layout (the family's rules)."""
    return family.gguf_tensors(state, config)


# why a matrix is not of the file's type, as the export's line says it
WIDTH_NOT_32 = "whose input width is not a multiple of 32"
POSITIONS_F32 = "(learned positions, kept so as llama.cpp's converter keeps them)"
CONV_F32 = "(LFM2's convolution kernels, which llama.cpp's convolution takes in f32)"
SSM_F32 = "(Mamba-2's convolution kernels, A and D, which llama.cpp's convolution and scan take in f32)"


def storage_type(name: str, shape: tuple[int, ...], kind: str) -> tuple[str, str]:
    """(the type one tensor of `shape` (rows, input width) goes in, in a file of `kind`; why that is not `kind`, or
    ""): vectors and norms in f32 whatever the kind, learned positions in f32 too, and a matrix whose rows are not
    whole blocks of 32 weights (its input width) in f16 where `kind` quantizes rows in blocks of 32 (q8_0, q4_0)."""
    if kind == "f32" or len(shape) <= 1 or name.endswith("_norm.weight"):
        return "f32", ""
    if name == "position_embd.weight":
        return "f32", POSITIONS_F32
    if name.endswith("shortconv.conv.weight"):
        return "f32", CONV_F32
    if name.endswith(("ssm_conv1d.weight", "ssm_a", "ssm_d")):
        return "f32", SSM_F32
    if kind in ("q8_0", "q4_0") and shape[-1] % 32:
        return "f16", WIDTH_NOT_32
    return kind, ""


def stored(name: str, tensor: torch.Tensor, kind: str):
    """(the array to write, its ggml type) of one tensor for a file of `kind`, as storage_type says."""
    import gguf

    data = tensor.numpy()
    qtype = gguf.GGMLQuantizationType[storage_type(name, data.shape, kind)[0].upper()]
    if qtype == gguf.GGMLQuantizationType.F32:
        return data, qtype
    return gguf.quants.quantize(data, qtype), qtype


def matrix_types(path: Path, kind: str) -> str:
    """What the GGUF file `path`, written as `kind`, holds, read back from it in one line: how many weight matrices
    are of which type, and for each type other than `kind` which matrices and why (see storage_type), e.g. "q4_0 for
    2 matrices; f16 for 13 matrices whose input width is not a multiple of 32: token_embd, and attn_q, ... in every
    block".
    Vectors (norms, biases) are f32 in every file and go unsaid."""
    import gguf

    reader = gguf.GGUFReader(path)
    blocks = int(reader.fields[f"{reader.fields['general.architecture'].contents()}.block_count"].contents())
    groups: dict[tuple[str, str], list[str]] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) < 2:
            continue
        written = tensor.tensor_type.name.lower()
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the input width first
        planned, why = storage_type(tensor.name, shape, kind)
        groups.setdefault((written, why if written == planned and written != kind else ""), []).append(tensor.name)
    parts = []
    for (written, why), names in sorted(groups.items(), key=lambda item: (item[0][0] != kind, item[0])):
        count = f"{len(names)} {'matrix' if len(names) == 1 else 'matrices'}"
        if written == kind:
            parts.append(f"{kind} for {count}")
        else:
            parts.append(f"{written} for {count}{' ' + why if why else ''}: {tensor_roles(names, blocks)}")
    return "; ".join(parts)


def tensor_roles(names: list[str], blocks: int) -> str:
    """GGUF tensor names said briefly: "token_embd, and attn_q, attn_k in every block, ffn_down in blocks 0, 3"."""
    outside = []
    layers = {}
    for name in names:
        parts = name.removesuffix(".weight").split(".")
        if parts[0] == "blk":
            layers.setdefault(parts[2], []).append(int(parts[1]))
        else:
            outside.append(".".join(parts))
    by_blocks: dict[tuple[int, ...], list[str]] = {}
    for role, where in layers.items():
        by_blocks.setdefault(tuple(sorted(where)), []).append(role)
    inside = [
        f"{', '.join(roles)} in {'every block' if len(where) == blocks else 'blocks ' + ', '.join(map(str, where))}"
        for where, roles in by_blocks.items()
    ]
    return ", and ".join(filter(None, [", ".join(outside), *inside]))


# ---------------------------------------------------------------------------------------------
# The file


def add_hyperparameters(writer, family: Family, config: GPTConfig) -> None:
    """The keys every architecture has, then the family's own."""
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_hidden)
    writer.add_head_count(config.n_head)
    writer.add_vocab_size(config.vocab_size)
    family.add_hyperparameters(writer, config)


def add_tokenizer(writer, vocab: GGUFVocab, vocab_size: int) -> None:
    """The tokenizer's keys; ids past it (a padded vocabulary) are unused tokens."""
    import gguf

    tokens, types = [], []
    for i in range(vocab_size):
        token = vocab.tokens[i] if i < len(vocab.tokens) else ""
        if not token:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if i in vocab.specials else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(vocab.merges)
    if vocab.eos is not None:
        writer.add_eos_token_id(vocab.eos)
    if vocab.bos is not None:
        writer.add_bos_token_id(vocab.bos)
    writer.add_add_bos_token(False)  # gptlite never puts BOS before plain text (a chat template writes its own)
    writer.add_add_eos_token(False)
    if vocab.template:
        writer.add_chat_template(vocab.template)


def check_out(out: Path, overwrite: bool, stem: str = "model") -> None:
    """Refuse an --out that is not a .gguf file's path, suggesting one where the user meant it (in the folder given,
    `stem`.gguf), and an existing file unless `overwrite`."""
    if out.is_dir():
        raise ValueError(
            f"--out={out} is a folder; give the path of the .gguf file to write (e.g. --out={out / stem}.gguf)"
        )
    if out.suffix != ".gguf":
        raise ValueError(f"--out={out} must name a .gguf file (e.g. --out={out.with_suffix('.gguf')})")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose another --out, or pass --overwrite to replace it")


def export_gguf(
    model: Transformer,
    out: str | Path,
    tokenizer: Tokenizer | None,
    kind: str = "f32",
    overwrite: bool = False,
    architecture: str | None = None,
    name: str = "",
    where: str = "the model",
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write `model` and `tokenizer` to the GGUF file `out` (see the module docstring), as `kind` (one of
    GGUF_TYPES). Everything is checked before anything is written; the file is written beside `out` under a
    temporary name and takes its name only when whole, so an interrupted export leaves no partial file and an
    earlier file is replaced (with overwrite=True) only by a whole one. The temporaries of `out` that killed
    exports left are removed, and `log` (a note on stderr by default) is told."""
    from gptlite.inference.quantize import dequantized_state_dict, gguf_type_of, is_quantized

    gguf = need("gguf", "gguf", "GGUF export")
    if kind not in GGUF_TYPES:
        raise ValueError(f"--type={kind} must be one of {', '.join(GGUF_TYPES)}")
    if is_quantized(model) and kind != gguf_type_of(model):
        raise ValueError(
            f"a model quantized as {gguf_type_of(model) or 'int4 in groups other than 32'} exports only as "
            f"{gguf_type_of(model) or 'nothing llama.cpp has'}, not --type={kind}: export the float model with "
            f"--type={kind}"
        )
    state = dequantized_state_dict(model) if is_quantized(model) else model.state_dict()
    out = Path(out)
    check_out(out, overwrite)
    family, arch = gguf_architecture(model.config, architecture or model.source_architecture)
    vocab = gguf_vocab(tokenizer, where)
    if len(vocab.tokens) > model.config.vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {len(vocab.tokens)} ids, more than the model's {model.config.vocab_size}"
        )
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[kind]
    folder = make_dir(out.parent or Path("."))
    tmp = temp_path(out, log)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        writer.add_name(name or out.stem)
        writer.add_file_type(file_type)
        if kind in ("q8_0", "q4_0"):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_hyperparameters(writer, family, model.config)
        add_tokenizer(writer, vocab, model.config.vocab_size)
        for tensor_name, tensor in gguf_tensors(family, state, model.config):
            data, qtype = stored(tensor_name, tensor, kind)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException as e:  # no partial file stays behind; an earlier one is untouched
        with contextlib.suppress(OSError):  # flushing what is left fails as the write did: that fault is said below
            writer.close()
        problem = fault(e, f"could not write {out} (nothing there changed)", tmp) if isinstance(e, OSError) else None
        tmp.unlink(missing_ok=True)
        if problem:
            raise problem from None
        raise
    os.replace(tmp, out)
    fsync_dir(folder)
    return out


# ---------------------------------------------------------------------------------------------
# Ollama's Modelfile: the chat template in Go's template language

ROLES = ("system", "user", "assistant")


def marker(role: str) -> str:
    return f"\x00{role}\x00"  # a message's content, found again in the rendering


@dataclass(frozen=True)
class Wrappers:
    """A chat template that writes every message as the same text around its content: what comes first, the text
    before each role's content, the text after every message, the generation prompt, and the system message it
    writes when a conversation has none (empty: none)."""

    head: str
    prefixes: dict[str, str]
    after: str
    generation: str
    default_system: str

    def render(self, messages: list[dict]) -> str:
        default = self.default_system if messages[0]["role"] != "system" else ""
        body = "".join(self.prefixes[m["role"]] + m["content"] + self.after for m in messages)
        return self.head + default + body + self.generation

    def go_template(self) -> str:
        """The same in Ollama's Go template language (literal text only between its actions)."""
        branches = "".join(
            f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{self.prefixes[role]}{{{{ .Content }}}}'
            f"{self.after}"
            for i, role in enumerate(ROLES)
        )
        default = (
            f'{{{{ if ne (index .Messages 0).Role "system" }}}}{self.default_system}{{{{ end }}}}'
            if self.default_system
            else ""
        )
        return f"{self.head}{default}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{self.generation}"


def role_wrappers(template: str, tokenizer: Tokenizer) -> Wrappers | None:
    """The Wrappers of a chat template, found by rendering conversations whose contents are markers and checked by
    rendering two more; None when the template is not of that kind (it numbers turns, trims or rewrites contents,
    ...)."""
    special = tokenizer.special_texts()
    draw = lambda messages, prompt=False: render(template, check_messages(messages), prompt, special)  # noqa: E731
    system, user, assistant = ({"role": role, "content": marker(role)} for role in ROLES)
    try:
        text, prompt_text = draw([system, user, assistant]), draw([system, user, assistant], True)
        alone, mixed = draw([user]), draw([user, system])
    except ValueError:
        return None
    cuts = [text.find(marker(role)) for role in ROLES]
    if -1 in cuts or cuts != sorted(cuts) or not prompt_text.startswith(text):
        return None
    after = text[cuts[2] + len(marker("assistant")) :]  # every message ends as the last one does
    between = [text[cuts[0] + len(marker("system")) : cuts[1]], text[cuts[1] + len(marker("user")) : cuts[2]]]
    if not all(piece.startswith(after) for piece in between) or marker("user") not in alone:
        return None
    prefixes = {"user": between[0][len(after) :], "assistant": between[1][len(after) :]}
    head_and_system = text[: cuts[0]]  # the head, then the system prefix
    before_user = alone[: alone.find(marker("user"))]  # the head (and a default system message), the user prefix
    if not before_user.endswith(prefixes["user"]):
        return None
    before_user = before_user[: len(before_user) - len(prefixes["user"])]
    if head_and_system.startswith(before_user):  # no default system message: what comes before is the head
        head, default_system = before_user, ""
        prefixes["system"] = head_and_system[len(head) :]
    else:  # a system message of its own when there is none: a system message after a user one shows its prefix
        after_user = mixed.find(marker("user")) + len(marker("user"))
        if marker("system") not in mixed[after_user:] or not mixed[after_user:].startswith(after):
            return None
        prefixes["system"] = mixed[after_user + len(after) : mixed.find(marker("system"), after_user)]
        if not head_and_system.endswith(prefixes["system"]):
            return None
        head = head_and_system[: len(head_and_system) - len(prefixes["system"])]
        if not before_user.startswith(head):
            return None
        default_system = before_user[len(head) :]
    wrappers = Wrappers(head, prefixes, after, prompt_text[len(text) :], default_system)
    for conversation in (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "?"},
        ],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}],
    ):
        if wrappers.render(conversation) != draw(conversation, True):
            return None
    return wrappers


def modelfile_path(out: Path) -> Path:
    """The Ollama Modelfile of the GGUF file `out`: model-q8_0.gguf's is model-q8_0.Modelfile beside it, so that
    files of several types share a folder, each with its own (`ollama create NAME -f` takes any file name)."""
    return out.with_suffix(".Modelfile")


def ollama_modelfile(out: Path, tokenizer: Tokenizer, where: str) -> str:
    """An Ollama Modelfile for the GGUF file `out` beside it: FROM, the chat template as a Go template when it can
    be written as one (see role_wrappers), and the end-of-turn texts as stop parameters."""
    import json

    lines = [f"# {where} as Ollama runs it: ollama create NAME -f {modelfile_path(out).name}", f"FROM ./{out.name}"]
    wrappers = role_wrappers(tokenizer.chat_template, tokenizer)
    template = wrappers.go_template() if wrappers is not None else ""
    literals = "" if wrappers is None else template.replace("{{", "").replace("}}", "")  # no braces in the text
    if wrappers is None or "{" in literals or "}" in literals or '"""' in template:
        lines.append(
            "# the chat template has no form in Ollama's template language that gptlite can write; Ollama reads "
            "the GGUF file's own (tokenizer.chat_template)"
        )
        stops = []
    else:
        lines.append(f'TEMPLATE """{template}"""')
        stops = [wrappers.after.strip()] if wrappers.after.strip() else []
    eos = tokenizer.eos if isinstance(tokenizer, HFTokenizer) else None
    for stop in dict.fromkeys([*stops, *getattr(tokenizer, "stop", []), *([eos] if eos else [])]):
        lines.append(f"PARAMETER stop {json.dumps(stop)}")
    return "\n".join(lines) + "\n"
