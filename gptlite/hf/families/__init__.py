"""The registry of the transformers families gptlite's model maps onto, weight for weight: one instance of each
family's class (a file each, beside this one; gptlite.hf.families.base.Family says what a family file provides),
and the model types people ask for that gptlite refuses, with what it lacks for them.

Adding a family is its file, its line in FAMILIES, and its tests. The order of FAMILIES is that of the "gptlite
loads ..." refusal, and within a layout the first family is the layout's default (Llama for Llama's layout)."""

from __future__ import annotations

from gptlite.hf.families.base import Family
from gptlite.hf.families.gemma3 import GEMMA3
from gptlite.hf.families.gpt2 import GPT2
from gptlite.hf.families.granite import GRANITE
from gptlite.hf.families.granite4 import GRANITE4
from gptlite.hf.families.granitemoe import GRANITE_MOE
from gptlite.hf.families.lfm2 import LFM2
from gptlite.hf.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3
from gptlite.hf.families.ministral3 import MINISTRAL3, MISTRAL3_VISION
from gptlite.hf.families.nanochat import NANOCHAT
from gptlite.hf.families.olmo2 import OLMO2
from gptlite.hf.families.olmo3 import OLMO3
from gptlite.hf.families.olmoe import OLMOE
from gptlite.hf.families.phi3 import PHI3
from gptlite.hf.families.qwen3_moe import QWEN3_MOE
from gptlite.hf.families.qwen35 import QWEN35, QWEN35_VL

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        GPT2,
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        GRANITE,
        SMOLLM3,
        PHI3,
        OLMO2,
        NANOCHAT,
        GEMMA3,
        GRANITE4,
        OLMO3,
        MINISTRAL3,
        MISTRAL3_VISION,
        LFM2,
        QWEN35,
        QWEN35_VL,
        GRANITE_MOE,  # the first of the experts' layout: a model of it with no family's own switches is a Granite MoE
        OLMOE,
        QWEN3_MOE,
    )
}
UNSUPPORTED = {  # model types people ask for, and what gptlite lacks for them
    "gemma": "Gemma's scaled embeddings and GeGLU feed-forward",
    "gemma2": "Gemma 2's soft-capped logits",
    "gemma3": "Gemma 3's vision tower with its text model (Gemma3ForConditionalGeneration)",
    "mixtral": "Mixtral's mixture of experts",
    "qwen2_moe": "a mixture of experts",
}
# the switches of one family each, with the value a model of the others has
OWN_SWITCHES = {name: value for family in FAMILIES.values() for name, value in family.own_switches.items()}
