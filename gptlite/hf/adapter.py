"""LoRA adapters out as a PEFT adapter: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR)` loads with the logits of the
gptlite model.

gptlite fuses some of transformers' layers (Llama's q, k and v into qkv, its gate and up into fc); an adapter on a
fused layer, with A (r, in) and B (out, r), becomes one adapter per transformers layer with the same A and that
layer's rows of B: the same update, exactly. GPT-2's layers are fused in transformers too (c_attn), so its adapters
go as they are (PEFT's fan_in_fan_out handles GPT-2's transposed Conv1D weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gptlite.files import write_folder
from gptlite.hf.families.base import part_sizes
from gptlite.hf.matching import family_of
from gptlite.hf.weights import save_weights
from gptlite.train.lora import lora_layers

if TYPE_CHECKING:
    from gptlite.model.network import Transformer


def adapter_tensors(model: Transformer) -> tuple[dict, list[str]]:
    """The PEFT state dict of the model's LoRA layers (transformers' names) and the transformers modules they adapt."""
    family = family_of(model.config, model.source_architecture)
    names = {ours.removesuffix(".weight"): theirs for ours, theirs, _ in family.entries(model.config)}
    tensors, modules = {}, []
    for name, layer in lora_layers(model).items():
        if name not in names:
            raise ValueError(
                f"the adapter on {name} has no place in a {family.architecture} adapter; train adapters on "
                "attn.qkv, attn.out_proj, ffn.fc and ffn.out_proj only"
            )
        theirs = names[name]
        sizes = part_sizes(name, model.config) if len(theirs) > 1 else [layer.out_features]
        for their, rows in zip(theirs, layer.lora_B.detach().split(sizes), strict=True):  # (out_i, r) each
            module = family.their_name(their).removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = layer.lora_A.detach().cpu().contiguous().clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = rows.cpu().contiguous().clone()
            modules.append(module)
    return tensors, modules


def export_adapter(
    model: Transformer,
    directory: str | Path,
    base: str = "",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write the model's LoRA adapters as a PEFT adapter for `base` (the base model's directory or Hub name), all
    or nothing, as export_hf writes a model (an earlier folder moves aside to DIR-previous-TIME with overwrite)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(
            "the model has no LoRA adapters to export (train with --lora_rank=N); export the model itself "
            "without --adapter"
        )
    (rank, alpha), *others = {(layer.rank, layer.alpha) for layer in layers.values()}
    if others:
        raise ValueError("the model's adapters differ in rank or alpha; a PEFT adapter has one of each")
    tensors, modules = adapter_tensors(model)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        # GPT-2's Conv1D layers hold their weights transposed (the entries say which), and PEFT needs telling
        "fan_in_fan_out": any(transposed for _, _, transposed in family_of(model.config).entries(model.config)),
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    directory = Path(directory)
    names = ["adapter_config.json", "adapter_model.safetensors"]
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        held = sorted(p.name for p in directory.iterdir())
        raise FileExistsError(
            f"{directory} already holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''}; export "
            "to a new directory, or pass overwrite=True (--overwrite) to replace it (the earlier "
            "folder is kept beside it as DIR-previous-TIME)"
        )

    def write(folder: Path) -> None:
        save_weights(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    previous = write_folder(directory, write, overwrite=True, what="adapter folder")
    if previous and log:
        log(f"moved the earlier contents of {directory} to {previous}")
    return [directory / name for name in names]
