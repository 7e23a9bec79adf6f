"""In: a transformers checkpoint (a directory, or a GPT-2 name downloaded from the Hub) -> a GPTConfig and gptlite's
state dict, tensor by tensor (GPT.from_pretrained builds the model from them), and the fingerprint of its weights."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from gptlite.config import GPTConfig, check_model_overrides
from gptlite.hf.families import FAMILIES, UNSUPPORTED
from gptlite.hf.families.base import ConfigFile, Family, experts_view
from gptlite.hf.weights import WEIGHT_FILES, Weights, read_json

GPT2_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
# buffers some checkpoints store beside their weights (GPT-2's causal masks, old Llamas' RoPE frequencies)
BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")


def check_model_name(name_or_dir: str) -> None:
    """What names a model to read (--model, train.py's --init_from) is a folder here (a gptlite run folder or a
    Hugging Face directory) or a name gptlite downloads (GPT2_NAMES); anything else, a mistyped path most often, is
    a FileNotFoundError that names it and what it may be."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() or name_or_dir in GPT2_NAMES:
        return
    what = "is a file, not a folder" if path.exists() else "is not a folder here, nor a name gptlite downloads"
    raise FileNotFoundError(
        f"{name_or_dir} {what}: a model to read is a gptlite run folder, a Hugging Face directory (config.json and "
        f"model.safetensors; hf download REPO --local-dir DIR fetches one) or one of {', '.join(GPT2_NAMES)}"
    )


def checkpoint_dir(name_or_dir: str, weights: bool = True) -> Path:
    """A local directory holding the checkpoint: name_or_dir itself, or the download of a GPT-2 name."""
    check_model_name(name_or_dir)
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    repo = GPT2_NAMES[name_or_dir]
    offline = (
        f"where you are online, download it (hf download {repo} config.json model.safetensors "
        f"--local-dir DIR) and pass that directory instead of '{name_or_dir}'"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError(
            f"downloading {name_or_dir} needs huggingface_hub (pip install huggingface_hub); or {offline}"
        ) from None
    try:
        return Path(
            snapshot_download(repo, allow_patterns=["config.json", *(["model.safetensors"] if weights else [])])
        )
    except Exception as e:  # huggingface_hub's errors for no network, offline mode, a missing repository, ...
        raise ConnectionError(
            f"could not download {name_or_dir} from the Hugging Face Hub ({type(e).__name__}); {offline}"
        ) from None


def read_config(directory: Path) -> tuple[Family, GPTConfig, int | None]:
    """The family, the GPTConfig and the attention window (None: none) of directory/config.json; what gptlite cannot
    hold is refused in one line naming it."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {directory} is neither a gptlite run folder (no ckpt_NNNNNN.pt) nor a Hugging "
            "Face checkpoint directory (config.json and its weights); name a run's --out_dir or such a directory"
        )
    c = read_json(path, "a Hugging Face config.json")
    kind = c.get("model_type")
    family = FAMILIES.get(kind)
    if family is None:
        what = f"{UNSUPPORTED[kind]}, which gptlite does not have" if kind in UNSUPPORTED else "not supported"
        raise ValueError(
            f"{path}: model_type={kind!r} is {what}; gptlite loads "
            f"{', '.join(f'{f.architecture} ({f.model_type})' for f in FAMILIES.values())}"
        )
    values, window, unsupported = family.values(ConfigFile(family.text_config(c, path), path, family))
    if unsupported:
        raise ValueError(f"{path}: gptlite cannot hold this {family.architecture}: {'; '.join(unsupported)}")
    try:
        return family, GPTConfig(**values), window
    except ValueError as e:  # the values together (the heads' width, ...): the file's
        raise ValueError(f"{path}: {e}") from None


def to_gptlite(
    family: Family, weights: Weights, config: GPTConfig, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """A transformers checkpoint -> gptlite's state dict for a model of `config`, read and converted tensor by
    tensor (in `dtype`, or the checkpoint's); refuses missing and unknown weights, and weights of a dtype a model
    cannot hold (integers, booleans: cast, they would train and run as nonsense), before any is read."""
    left_out = {n for n in weights.names() if family.vision_prefixes and n.startswith(family.vision_prefixes)}
    if left_out:  # a vision-language checkpoint's vision tower: gptlite holds its text model alone
        print(
            f"note: {weights.directory} is a {family.architecture}: its text model is read, and its "
            f"{len(left_out)} weights under {', '.join(family.vision_prefixes)} (the vision tower and projector) "
            "left out",
            file=sys.stderr,
        )
    names = {n.removeprefix(family.prefix): n for n in weights.names() if n not in left_out}  # the Hub's gpt2: none
    for name in names.values():
        dtype_ = weights.dtype(name)
        if not dtype_.is_floating_point and not name.endswith(BUFFERS):
            raise ValueError(
                f"{weights.file(name)}: tensor {name} is {str(dtype_).removeprefix('torch.')}, and a model's weights "
                "are floating point (float32, bfloat16, float16); the file is damaged or not a model's weights: "
                "download or save it again"
            )
    state = {}
    used = set()
    for ours, theirs, transposed in family.entries(config):
        missing = [t for t in theirs if t not in names]
        if missing:
            raise ValueError(
                f"{weights.directory}: the checkpoint has no {missing[0]}, which a {family.architecture} of "
                f"{config.n_layer} layers needs; its weights are incomplete or do not match its config.json "
                "(tie_word_embeddings, num_hidden_layers): download or save the model again"
            )
        fused = read_fused(weights, [names[t] for t in theirs], transposed, dtype)
        state[ours] = experts_view(ours, fused, config)  # a tensor per expert: stacked as gptlite holds experts
        used.update(theirs)
    if "pos_emb.table.weight" in state:  # a smaller block_size keeps the first positions
        state["pos_emb.table.weight"] = state["pos_emb.table.weight"][: config.block_size].clone()
    if config.tie_embeddings and "lm_head.weight" in names:
        head = weights.pop(names["lm_head.weight"])
        if not torch.equal(head.to(state["tok_emb.weight"].dtype), state["tok_emb.weight"]):
            raise ValueError(
                f"{weights.directory}: the checkpoint's lm_head.weight differs from its token embedding though its "
                "config.json ties them (tie_word_embeddings): set tie_word_embeddings to false there, or download "
                "the model again"
            )
        used.add("lm_head.weight")
    used.update(family.left_out(list(names)))  # a vision-language checkpoint's vision tower
    unknown = sorted(n for n in names if n not in used and not n.endswith(BUFFERS))
    if unknown:
        raise ValueError(
            f"{weights.directory}: the checkpoint has weights a {family.architecture} of gptlite's kind does not: "
            f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}; its config.json does not describe "
            "them (a variant gptlite cannot hold, or a damaged config.json): download or save the model again"
        )
    if config.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def read_fused(weights: Weights, names: list[str], transposed: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensors `names` stacked along dim 0 (gptlite's fused q/k/v, gate/up), or one tensor transposed (GPT-2's
    Conv1D), each read straight into its place in one tensor allocated once (in `dtype`, or the checkpoint's)."""
    if transposed:
        (name,) = names
        return weights.pop(name).t().to(dtype or None).contiguous()
    shapes = [weights.shape(n) for n in names]
    out = torch.empty(
        (sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype or weights.dtype(names[0])
    )  # (rows, ...)
    row = 0
    for name, shape in zip(names, shapes, strict=True):
        weights.pop(name, out=out[row : row + shape[0]])
        row += shape[0]
    return out


def pretrained_config(name_or_dir: str, **overrides) -> GPTConfig:
    """The GPTConfig of a pretrained checkpoint (downloading only its config.json), with `block_size` (at most
    the checkpoint's) and `dropout` overridden if given."""
    _, config, window = read_config(checkpoint_dir(name_or_dir, weights=False))
    return _override(config, overrides, name_or_dir, window)


def _override(config: GPTConfig, overrides: dict, source: str, window: int | None) -> GPTConfig:
    check_model_overrides(config, overrides, source)
    block_size = overrides.get("block_size", config.block_size)
    if window and block_size > window:
        raise ValueError(
            f"{source}: its sliding window {window} is shorter than block_size={block_size}; gptlite "
            f"attends to the whole context: use block_size <= {window}"
        )
    return GPTConfig(**{**vars(config), **overrides})


def load_pretrained(
    name_or_dir: str, dtype: torch.dtype | None = None, **overrides
) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """The GPTConfig, the gptlite state dict (in `dtype`, or the checkpoint's own) and the transformers class of a
    checkpoint (see the module docstring), for GPT.from_pretrained. `block_size` may be set smaller (learned
    positions are cropped, as nanoGPT does) and `dropout` set for fine-tuning."""
    directory = checkpoint_dir(name_or_dir)
    family, config, window = read_config(directory)
    config = _override(config, overrides, name_or_dir, window)
    return config, to_gptlite(family, Weights(directory), config, dtype), family.exports_as(config)


def fingerprint(name_or_dir: str) -> str:
    """The sha256 of a checkpoint's config.json and weight files, in name order: what a LoRA run records of its base
    weights, to find out when they are not the ones its adapters were trained on."""
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
