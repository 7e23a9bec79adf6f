"""The model class users build and load: `GPT`, the network of gptlite.model.network (`Transformer`) with what users
call on it besides: `GPT.from_pretrained`, `model.generate`, `model.quantize`.

Why two classes: those three methods reach the model's consumers (gptlite.hf reads pretrained weights,
gptlite.inference.generate decodes, gptlite.inference.quantize swaps its layers), and each of those imports the
network to build, read or wrap it. Were the methods on the network, its file would import them back (lazily, inside
the methods, at best): a circle through every stage. Here the network knows no consumer, and this class, above them
all, composes them as Hugging Face's model classes compose `GenerationMixin`. Code that builds a model for a user
builds this class; code that only needs the network (type hints, FLOP counts, decoding's internals) names
`Transformer`.
"""

from __future__ import annotations

import torch

from gptlite.hf import load_pretrained
from gptlite.inference.generate import generate
from gptlite.inference.quantize import quantize
from gptlite.model.network import Transformer, positions


class GPT(Transformer):
    """A decoder-only Transformer language model (gptlite.model.network.Transformer: `GPT(config)` builds one), with
    pretrained weights to read, text to generate and weights to quantize."""

    @classmethod
    def from_pretrained(cls, name_or_dir: str, dtype: torch.dtype | None = None, **overrides) -> GPT:
        """GPT-2's weights ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", downloaded from the Hub) or a local
        directory holding a transformers GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
        MistralForCausalLM, GraniteForCausalLM, SmolLM3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM,
        NanoChatForCausalLM, Gemma3ForCausalLM, Olmo3ForCausalLM, Ministral3ForCausalLM (or the text model of a
        Mistral3ForConditionalGeneration), Lfm2ForCausalLM or Qwen3_5ForCausalLM (or
        Qwen3_5ForConditionalGeneration's text tower), in eval mode; `block_size` (smaller) and `dropout` may be
        overridden. See gptlite.hf, which reads the checkpoint. `dtype=None` keeps the checkpoint's dtype. One copy of
        the weights is held: the model is built on the meta device and takes the tensors as they are read, one by
        one."""
        config, state, architecture = load_pretrained(name_or_dir, dtype, **overrides)
        with torch.device("meta"):
            model = cls(config)
        model.pos_emb = positions(config)  # its buffers are computed, not loaded
        model.check_state(state, name_or_dir)
        model.load_state_dict(state, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        model.source_architecture = architecture  # how it exports back (gptlite.hf.export_hf)
        return model.eval()

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Prompt idx (B, T) -> (B, T + max_new_tokens), decoding against a KV cache. Keyword arguments: the fields
        of gptlite.inference.sampling.GenerationOptions (seed, num_samples, stop_tokens, penalties, extend_context,
        compile, num_beams and beam search's); see gptlite.inference.generate."""
        return generate(self, idx, max_new_tokens, temperature, top_k, top_p, generator, **kwargs)

    def quantize(self, mode: str = "int8", group_size: int = 32) -> GPT:
        """Weight-only quantization for generation and evaluation, in place: mode "int8" (a scale per output row)
        or "int4" (a scale per `group_size` weights of a row, q4_0's rule); returns the model (see
        gptlite.inference.quantize)."""
        return quantize(self, mode, group_size)
