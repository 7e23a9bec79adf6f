"""Hugging Face's layout: GPT-2 and Llama checkpoints in (`from_pretrained`), gptlite models out (`export_hf`).

Everything that speaks transformers' names lives here, so the model never learns them. Two architectures
map onto gptlite's switches, weight for weight:
    GPT2LMHeadModel   pos_emb="learned", norm="layernorm", ffn="gelu" (GPT-2 has biases everywhere; a
                      model with bias=False exports zeros for them)
    LlamaForCausalLM  pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False; a tied head and as many
                      key/value heads as query heads (no grouped-query attention)
A checkpoint directory holds config.json and model.safetensors (or shards listed in
model.safetensors.index.json, or pytorch_model.bin). The names "gpt2", "gpt2-medium", "gpt2-large" and
"gpt2-xl" are downloaded from the Hub with huggingface_hub.

    python -m gptlite.hf export --out_dir=RUN --hf_dir=DIR [--overwrite]   # a run's checkpoint -> DIR

This module turns a checkpoint into a GPTConfig and a state dict (`load_pretrained`; GPT.from_pretrained builds the
model from them) and a model back into files; it never imports gptlite.model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.config import GPTConfig
from gptlite.files import write_folder
from gptlite.tokenizer import EOT, GPT2_PATTERN, HFTokenizer, TiktokenTokenizer, Tokenizer

if TYPE_CHECKING:
    from gptlite.model import GPT

GPT2_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# buffers some checkpoints store beside their weights (GPT-2's causal masks, old Llamas' RoPE frequencies)
BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")


@dataclass(frozen=True)
class Family:
    """How one transformers architecture names gptlite's weights. Each entry is (gptlite name, its names in
    transformers, transposed): several names are concatenated along dim 0 (Llama's q, k, v into gptlite's
    qkv), and GPT-2's Conv1D layers store their matrices transposed."""

    architecture: str
    model_type: str
    top: tuple[tuple[str, tuple[str, ...], bool], ...]
    layer: tuple[tuple[str, tuple[str, ...], bool], ...]
    layer_prefix: str  # with {i} for the block's index
    prefix: str  # what save_pretrained puts before the names above ("" for Llama, whose names carry "model.")


GPT2 = Family(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    top=(("tok_emb.weight", ("wte.weight",), False), ("pos_emb.table.weight", ("wpe.weight",), False),
         ("norm.weight", ("ln_f.weight",), False), ("norm.bias", ("ln_f.bias",), False)),
    layer=(("attn_norm.weight", ("ln_1.weight",), False), ("attn_norm.bias", ("ln_1.bias",), False),
           ("attn.qkv.weight", ("attn.c_attn.weight",), True), ("attn.qkv.bias", ("attn.c_attn.bias",), False),
           ("attn.out_proj.weight", ("attn.c_proj.weight",), True), ("attn.out_proj.bias", ("attn.c_proj.bias",), False),
           ("ffn_norm.weight", ("ln_2.weight",), False), ("ffn_norm.bias", ("ln_2.bias",), False),
           ("ffn.fc.weight", ("mlp.c_fc.weight",), True), ("ffn.fc.bias", ("mlp.c_fc.bias",), False),
           ("ffn.out_proj.weight", ("mlp.c_proj.weight",), True), ("ffn.out_proj.bias", ("mlp.c_proj.bias",), False)),
    layer_prefix="h.{i}.",
    prefix="transformer.",
)
LLAMA = Family(
    architecture="LlamaForCausalLM",
    model_type="llama",
    top=(("tok_emb.weight", ("model.embed_tokens.weight",), False), ("norm.weight", ("model.norm.weight",), False)),
    layer=(("attn_norm.weight", ("input_layernorm.weight",), False),
           ("attn.qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), False),
           ("attn.out_proj.weight", ("self_attn.o_proj.weight",), False),
           ("ffn_norm.weight", ("post_attention_layernorm.weight",), False),
           # SwiGLU's fc: its first half is the gate (through silu), the second the value
           ("ffn.fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), False),
           ("ffn.out_proj.weight", ("mlp.down_proj.weight",), False)),
    layer_prefix="model.layers.{i}.",
    prefix="",
)
FAMILIES = {f.model_type: f for f in (GPT2, LLAMA)}
EXPORTABLE = ("GPT-2's (ffn='gelu', norm='layernorm', pos_emb='learned') and Llama's (ffn='swiglu', norm='rmsnorm', "
              "pos_emb='rope', bias=False)")


def entries(family: Family, n_layer: int) -> list[tuple[str, tuple[str, ...], bool]]:
    """Every weight of a model with n_layer blocks: (gptlite name, transformers names, transposed)."""
    out = list(family.top)
    for i in range(n_layer):
        p = family.layer_prefix.format(i=i)
        out += [(f"blocks.{i}.{ours}", tuple(p + t for t in theirs), transposed) for ours, theirs, transposed in family.layer]
    return out


# ---------------------------------------------------------------------------------------------
# In: a transformers checkpoint -> GPT


def checkpoint_dir(name_or_dir: str, weights: bool = True) -> Path:
    """A local directory holding the checkpoint: name_or_dir itself, or the download of a GPT-2 name."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if name_or_dir not in GPT2_NAMES:
        raise FileNotFoundError(
            f"{name_or_dir} is neither a directory nor one of {', '.join(GPT2_NAMES)}; pass a directory in Hugging "
            "Face's layout (config.json and model.safetensors)")
    repo = GPT2_NAMES[name_or_dir]
    offline = (f"where you are online, download it (huggingface-cli download {repo} config.json model.safetensors "
               f"--local-dir DIR) and pass that directory instead of '{name_or_dir}'")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError(f"downloading {name_or_dir} needs huggingface_hub (pip install huggingface_hub); or {offline}") from None
    try:
        return Path(snapshot_download(repo, allow_patterns=["config.json", *(["model.safetensors"] if weights else [])]))
    except Exception as e:  # huggingface_hub's errors for no network, offline mode, a missing repository, ...
        raise ConnectionError(f"could not download {name_or_dir} from the Hugging Face Hub ({type(e).__name__}); {offline}") from None


def read_config(directory: Path) -> tuple[Family, GPTConfig]:
    """The family and the GPTConfig of directory/config.json; what gptlite cannot hold is refused in one line."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a Hugging Face checkpoint directory holds config.json and its weights")
    c = read_json(path, "a Hugging Face config.json")
    family = FAMILIES.get(c.get("model_type"))
    if family is None:
        raise ValueError(f"{path}: model_type={c.get('model_type')!r} is not supported; gptlite loads "
                         f"{', '.join(f'{f.architecture} ({f.model_type})' for f in FAMILIES.values())}")
    unsupported = []
    if c.get("tie_word_embeddings", True) is False:
        unsupported.append("an untied output head (tie_word_embeddings=false)")
    try:
        if family is GPT2:
            if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
                unsupported.append(f"activation_function={c['activation_function']!r} (gptlite's GELU is GPT-2's tanh "
                                   "approximation, gelu_new)")
            if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
                unsupported.append("attention scaled other than by 1/sqrt(head width)")
            config = dict(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"], n_head=c["n_head"],
                          n_embd=c["n_embd"], bias=True, pos_emb="learned", norm="layernorm",
                          norm_eps=c.get("layer_norm_epsilon", 1e-5), ffn="gelu", ffn_hidden=c.get("n_inner") or 4 * c["n_embd"])
        else:
            heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            if kv_heads != heads:
                unsupported.append(f"grouped-query attention ({kv_heads} key/value heads for {heads} query heads)")
            if c.get("attention_bias") or c.get("mlp_bias"):
                unsupported.append("biases in the attention or MLP layers")
            if c.get("hidden_act", "silu") != "silu":
                unsupported.append(f"hidden_act={c['hidden_act']!r} (gptlite's SwiGLU uses silu)")
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                unsupported.append(f"RoPE scaling of type {rope.get('rope_type', rope.get('type'))!r}")
            if c.get("head_dim") not in (None, c["hidden_size"] // heads):
                unsupported.append(f"head_dim={c['head_dim']} other than hidden_size / num_attention_heads")
            config = dict(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=c["num_hidden_layers"],
                          n_head=heads, n_embd=c["hidden_size"], bias=False, pos_emb="rope",
                          rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), norm="rmsnorm",
                          norm_eps=c.get("rms_norm_eps", 1e-6), ffn="swiglu", ffn_hidden=c["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]}, which a {family.architecture} config needs") from None
    if unsupported:
        raise ValueError(f"{path}: gptlite cannot hold this {family.architecture}: {'; '.join(unsupported)}")
    return family, GPTConfig(**config)


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a file; anything else is a one-line ValueError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {what} holds one JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; {what} holds one JSON object")
    return value


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, from safetensors (one file or shards) or a weights-only torch file; a file that
    cannot be read, a missing shard and non-finite values are one-line errors naming the file."""
    if (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    elif (directory / "model.safetensors.index.json").is_file():
        index = directory / "model.safetensors.index.json"
        weight_map = read_json(index, "a sharded checkpoint's index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file); save the checkpoint again")
        files = [directory / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard {missing[0]}, which is not in {directory}; download it again")
    elif (directory / "pytorch_model.bin").is_file():
        files = [directory / "pytorch_model.bin"]
    else:
        raise FileNotFoundError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")
    weights = {}
    for path in files:
        part = read_weight_file(path)
        bad = next((k for k, v in part.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if bad is not None:
            raise ValueError(f"{path}: tensor {bad} holds NaN or infinite values; the checkpoint is damaged")
        weights.update(part)
    return weights


def read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors or weights-only torch file."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' and torch's errors for a file cut short or of another format
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} cannot be read ({cause[:200]}); it is cut short or not a weights file: download or "
                         "save it again") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path} does not hold a state dict (tensor name -> tensor); save the model's state_dict()")
    return state


def to_gptlite(family: Family, weights: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict -> gptlite's, for a model of `config`; refuses missing and unknown weights."""
    weights = {k.removeprefix(family.prefix): v for k, v in weights.items()}  # the Hub's gpt2 has no prefix
    state, used = {}, set()
    for ours, theirs, transposed in entries(family, config.n_layer):
        missing = [t for t in theirs if t not in weights]
        if missing:
            raise ValueError(f"the checkpoint has no {missing[0]}, which a {family.architecture} of "
                             f"{config.n_layer} layers needs")
        w = torch.cat([weights[t] for t in theirs])
        state[ours] = w.t() if transposed else w
        used.update(theirs)
    if "pos_emb.table.weight" in state:  # a smaller block_size keeps the first positions
        state["pos_emb.table.weight"] = state["pos_emb.table.weight"][: config.block_size]
    embedding = family.top[0][1][0]
    head = weights.get("lm_head.weight")
    if head is not None and not torch.equal(head, weights[embedding]):
        raise ValueError("the checkpoint's lm_head.weight differs from its token embedding: gptlite ties the two "
                         "and cannot hold an untied head")
    unknown = sorted(k for k in weights if k not in used and k != "lm_head.weight" and not k.endswith(BUFFERS))
    if unknown:
        raise ValueError(f"the checkpoint has weights a {family.architecture} of gptlite's kind does not: "
                         f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
    state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def fingerprint(name_or_dir: str) -> str:
    """The sha256 of a checkpoint's config.json and weight files, in name order: what a LoRA run records of its base
    weights, to find out when they are not the ones its adapters were trained on."""
    import hashlib

    directory = checkpoint_dir(name_or_dir)
    names = ["config.json", *WEIGHT_FILES]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names += sorted(set(map(str, read_json(index, "a sharded checkpoint's index").get("weight_map", {}).values())))
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")
    digest = hashlib.sha256()
    for name in names:
        if (directory / name).is_file():
            digest.update(name.encode())
            with open(directory / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    return digest.hexdigest()


def pretrained_config(name_or_dir: str, **overrides) -> GPTConfig:
    """The GPTConfig of a pretrained checkpoint (downloading only its config.json), with `block_size` (at most
    the checkpoint's) and `dropout` overridden if given."""
    _, config = read_config(checkpoint_dir(name_or_dir, weights=False))
    return _override(config, overrides, name_or_dir)


def _override(config: GPTConfig, overrides: dict, source: str) -> GPTConfig:
    wrong = sorted(set(overrides) - {"block_size", "dropout"})
    if wrong:
        raise ValueError(f"{source}: the pretrained model fixes {', '.join(wrong)}; only block_size (smaller) and "
                         "dropout can be changed")
    block_size = overrides.get("block_size", config.block_size)
    if config.pos_emb == "learned" and block_size > config.block_size:
        raise ValueError(f"block_size={block_size} is more than the {config.block_size} positions {source} learned; "
                         f"use block_size <= {config.block_size}")
    return GPTConfig(**{**vars(config), **overrides})


def load_pretrained(name_or_dir: str, **overrides) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The GPTConfig and the gptlite state dict of a GPT-2 or Llama checkpoint (see the module docstring), for
    GPT.from_pretrained. `block_size` may be set smaller (learned positions are cropped, as nanoGPT does) and
    `dropout` set for fine-tuning."""
    directory = checkpoint_dir(name_or_dir)
    family, config = read_config(directory)
    config = _override(config, overrides, name_or_dir)
    return config, to_gptlite(family, read_weights(directory), config)


# ---------------------------------------------------------------------------------------------
# Out: GPT -> a directory transformers loads


def family_of(config: GPTConfig) -> Family:
    """The transformers architecture a model's switches map to; others are refused, naming the switches that do."""
    switches = (config.pos_emb, config.norm, config.ffn)
    if switches == ("learned", "layernorm", "gelu"):
        return GPT2
    if switches == ("rope", "rmsnorm", "swiglu") and not config.bias:
        return LLAMA
    raise ValueError(f"a model with pos_emb={config.pos_emb!r}, norm={config.norm!r}, ffn={config.ffn!r}, "
                     f"bias={config.bias} has no transformers architecture; exportable are {EXPORTABLE}")


def from_gptlite(family: Family, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gptlite's state dict -> the transformers names (tied head left out, as save_pretrained does; GPT-2's
    biases as zeros where the model has none)."""
    out = {}
    for ours, theirs, transposed in entries(family, config.n_layer):
        w = state.get(ours)
        if w is None:  # a bias of a bias=False model: GPT-2 has them, so they are zeros
            weight = state[ours.removesuffix("bias") + "weight"]
            w = torch.zeros(weight.size(0), dtype=weight.dtype)
        w = w.t() if transposed else w
        for name, part in zip(theirs, w.chunk(len(theirs))):
            out[family.prefix + name] = part.detach().to("cpu").contiguous().clone()
    return out


def hf_config(family: Family, config: GPTConfig, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    """config.json for transformers."""
    eos = tokenizer.eot_id if tokenizer is not None else None
    bos = tokenizer.bos_id if isinstance(tokenizer, HFTokenizer) else eos
    eos = tokenizer.eos_id if isinstance(tokenizer, HFTokenizer) and tokenizer.eos_id is not None else eos
    common = {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": config.vocab_size,
              "tie_word_embeddings": True, "bos_token_id": bos, "eos_token_id": eos,
              "torch_dtype": str(dtype).removeprefix("torch."), "initializer_range": 0.02}
    if family is GPT2:
        return {**common, "n_positions": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
                "n_head": config.n_head, "n_inner": config.ffn_hidden, "activation_function": "gelu_new",
                "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                "attn_pdrop": config.dropout, "scale_attn_weights": True}
    return {**common, "hidden_size": config.n_embd, "intermediate_size": config.ffn_hidden,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_head, "head_dim": config.n_embd // config.n_head,
            "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": config.dropout,
            # transformers < 5 reads rope_theta, 5 and later rope_parameters
            "rope_theta": config.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}


def export_hf(model: GPT, directory: str | Path, tokenizer: Tokenizer | None = None, overwrite: bool = False,
              log: Callable[[str], None] | None = None) -> list[Path]:
    """Write config.json and model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained(directory)`
    loads with the same logits, and, given a GPT-2 BPE tokenizer, the files `AutoTokenizer` reads. Everything is
    checked before the first write, and the folder ends holding exactly these files, all written or none: a folder
    that holds anything is replaced only with overwrite=True, and then moves aside whole to DIR-previous-TIME (which
    `log` is told)."""
    from gptlite.quantize import Int8Linear

    if isinstance(model.lm_head, Int8Linear):
        raise ValueError("an int8-quantized model cannot be exported: its weights are rounded; export the float model "
                         "(quantize after loading, e.g. sample.py --quantize=int8)")
    family = family_of(model.config)
    state = model.state_dict()
    dtype = state["tok_emb.weight"].dtype
    weights = from_gptlite(family, state, model.config)
    files = {"config.json": json.dumps(hf_config(family, model.config, dtype, tokenizer), indent=2) + "\n"}
    if tokenizer is not None:
        files.update(hf_tokenizer_files(tokenizer, model.config.block_size))
    directory = Path(directory)
    names = ["model.safetensors", *files]
    if directory.is_dir() and not overwrite:
        held = sorted(p.name for p in directory.iterdir())
        present = [n for n in names if n in held] + [n for n in held if n not in names]
        if present:
            raise FileExistsError(f"{directory} already holds {', '.join(present[:3])}{' ...' if len(present) > 3 else ''}"
                                  "; export to a new directory, or pass overwrite=True (--overwrite) to replace it (the "
                                  "earlier folder is kept beside it as DIR-previous-TIME)")

    def write(folder: Path) -> None:
        save_weights(weights, folder / "model.safetensors")
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")

    previous = write_folder(directory, write, overwrite=True, what="export folder")
    if previous and log:
        log(f"moved the earlier contents of {directory} to {previous}")
    return [directory / name for name in names]


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file, readable as any file the user writes (safetensors creates it private)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# ---------------------------------------------------------------------------------------------
# GPT-2's tokenizer files, from tiktoken ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters, in which vocab.json and merges.txt are written."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that tiktoken's ranks encode: token r (of two bytes or more) is the merge of the two parts
    that byte-pair encoding with the ranks below r leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(f"the ranks are not a byte-pair merge list: token {rank} ({token!r}) is no merge of two tokens")
        merges.append((parts[0], parts[1]))
    return merges


def gpt2_tokenizer_problem(tokenizer: Tokenizer) -> str | None:
    """Why the export cannot give transformers `tokenizer` (None when it can): a Hugging Face tokenizer goes as it
    is; a tiktoken one as GPT-2's tokenizer, which reproduces byte-pair encodings with GPT-2's split pattern only."""
    if isinstance(tokenizer, HFTokenizer):
        return None
    if not (isinstance(tokenizer, TiktokenTokenizer) and tokenizer.enc._pat_str == GPT2_PATTERN):
        return (f"transformers' GPT-2 tokenizer reproduces byte-pair encodings with GPT-2's split pattern only; this "
                f"tokenizer is {tokenizer.kind}{'' if tokenizer.kind != 'tiktoken' else ' with another pattern'}")
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
    if isinstance(tokenizer, HFTokenizer):
        from gptlite.tokenizer.trainer import hf_files

        return hf_files(tokenizer, max_length)
    ranks = tokenizer.enc._mergeable_ranks
    chars = bytes_to_unicode()
    text = lambda token: "".join(chars[b] for b in token)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()} | {EOT: tokenizer.eot_id}
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in bpe_merges(ranks))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT, "eos_token": EOT, "unk_token": EOT,
              "add_prefix_space": False, "add_bos_token": False, "model_max_length": max_length, "errors": "replace"}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False), "merges.txt": "#version: 0.2\n" + merges,
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
