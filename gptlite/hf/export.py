"""Out: a gptlite model -> a directory transformers loads (config.json, model.safetensors and the tokenizer's files)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptlite.config import GPTConfig
from gptlite.files import write_folder
from gptlite.hf.families.base import Family, part_sizes
from gptlite.hf.matching import family_of
from gptlite.hf.tokenizer_files import hf_tokenizer_files
from gptlite.hf.weights import save_weights
from gptlite.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from gptlite.model.network import Transformer


def from_gptlite(family: Family, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gptlite's state dict -> the transformers names (a tied head left out, as save_pretrained does; GPT-2's
    biases as zeros where the model has none)."""
    out = {}
    for ours, theirs, transposed in family.entries(config):
        w = state.get(ours)
        if w is None:  # a bias of a bias=False model: GPT-2 has them, so they are zeros
            weight = state[ours.removesuffix("bias") + "weight"]
            w = torch.zeros(weight.size(0), dtype=weight.dtype)
        w = w.t() if transposed else w
        if w.dim() == 3 and len(theirs) > 1:  # experts' stacked (E, rows, in): transformers' tensor per expert
            w = w.flatten(0, 1)  # (E * rows, in)
        parts = w.split(part_sizes(ours, config)) if len(theirs) > 1 else (w,)
        for name, part in zip(theirs, parts, strict=True):
            out[family.their_name(name)] = part.detach().to("cpu").contiguous().clone()
    return out


def special_ids(tokenizer: Tokenizer | None) -> tuple[int | None, int | list[int] | None]:
    """(bos_token_id, eos_token_id) for config.json and generation_config.json: eos is the tokenizer's end_ids (the
    end of a turn first), one id or a list, as transformers' generate takes either."""
    if tokenizer is None:
        return None, None
    stops = tokenizer.end_ids()
    bos = tokenizer.bos_id if isinstance(tokenizer, HFTokenizer) else tokenizer.eot_id
    return bos, (stops[0] if len(stops) == 1 else stops) if stops else None


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json: what transformers' generate() stops at, and the id it pads finished rows with."""
    bos, eos = special_ids(tokenizer)
    stops = tokenizer.end_ids()
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": stops[-1] if stops else None}


def hf_config(family: Family, config: GPTConfig, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    """config.json for transformers: what every family writes, then the family's own keys."""
    bos, eos = special_ids(tokenizer)
    common = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        # written always: some classes' defaults (SmolLM3's, Phi-3's) are ids past a small vocabulary
        "pad_token_id": generation_config(tokenizer)["pad_token_id"] if tokenizer is not None else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
    }
    return family.hf_config(config, common)


def export_hf(
    model: Transformer,
    directory: str | Path,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    architecture: str | None = None,
) -> list[Path]:
    """Write config.json and model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained(directory)`
    loads with the same logits, as the class its switches map to (`architecture`, by default the one the model was
    loaded from, tells Mistral from Llama), and, given a tokenizer transformers can reproduce, its files. Everything
    is checked before the first write, and the folder ends holding exactly these files, all written or none: a
    folder that holds anything is replaced only with overwrite=True, and then moves aside whole to
    DIR-previous-TIME (which `log` is told)."""
    from gptlite.inference.quantize import is_quantized

    if is_quantized(model):
        raise ValueError(
            "a quantized model cannot be exported: its weights are rounded; export the float model "
            "(quantize after loading, e.g. sample.py --quantize=int8)"
        )
    family = family_of(model.config, architecture or model.source_architecture)
    state = model.state_dict()
    dtype = state["tok_emb.weight"].dtype
    weights = from_gptlite(family, state, model.config)
    files = {"config.json": json.dumps(hf_config(family, model.config, dtype, tokenizer), indent=2) + "\n"}
    if tokenizer is not None:
        files.update(hf_tokenizer_files(tokenizer, model.config.block_size))
        files["generation_config.json"] = json.dumps(generation_config(tokenizer), indent=2) + "\n"
    directory = Path(directory)
    names = ["model.safetensors", *files]
    if directory.is_dir() and not overwrite:
        held = sorted(p.name for p in directory.iterdir())
        present = [n for n in names if n in held] + [n for n in held if n not in names]
        if present:
            raise FileExistsError(
                f"{directory} already holds {', '.join(present[:3])}{' ...' if len(present) > 3 else ''}"
                "; export to a new directory, or pass overwrite=True (--overwrite) to replace it (the "
                "earlier folder is kept beside it as DIR-previous-TIME)"
            )

    def write(folder: Path) -> None:
        save_weights(weights, folder / "model.safetensors")
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")

    previous = write_folder(directory, write, overwrite=True, what="export folder", log=log)
    if previous and log:
        log(f"moved the earlier contents of {directory} to {previous}")
    return [directory / name for name in names]
