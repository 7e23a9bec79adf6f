"""Hugging Face's layout: checkpoints in (`load_pretrained`), gptlite models out (`export_hf`).

Everything that speaks transformers' names lives here, so the model never learns them. These architectures map
onto gptlite's switches, weight for weight:
    GPT2LMHeadModel     pos_emb="learned", norm="layernorm", ffn="gelu" (GPT-2 has biases everywhere; a model with
                        bias=False exports zeros for them)
    LlamaForCausalLM    pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, with grouped-query attention
                        (n_kv_head), its own head width (head_dim), a tied or untied head, Llama 3's RoPE scaling:
                        Llama 2/3.x, SmolLM2, TinyLlama
    MistralForCausalLM  the same layout (the context at most its sliding window)
    Qwen2ForCausalLM    the same, with biases on q, k and v (qkv_bias)
    Qwen3ForCausalLM    the same, with RMSNorm on each head's q and k (qk_norm)
    GraniteForCausalLM  Llama's layout with multipliers on the embeddings, the residual branches, attention's scores
                        and the logits (embed_scale, residual_scale, attn_scale, logits_scaling)
    SmolLM3ForCausalLM  Llama's layout with layers whose attention has no positions (nope_layers)
    Phi3ForCausalLM     Llama's switches, q/k/v and the gate/value stored fused (as gptlite holds them); Phi-4-mini's
                        RoPE on part of each head (rope_dims) and LongRoPE within its original context (longrope)
    Olmo2ForCausalLM    Llama's layout with each norm on its branch's output (norm_position="post") and RMSNorm over
                        all of q and all of k (qk_norm, qk_norm_scope="all")
    NanoChatForCausalLM ffn="relu2", parameter-free RMSNorms (norm_weight=False; per-head q/k norms, qk_norm, and
                        one on the embeddings, embed_norm), RoPE the other way round (rope_reverse), an untied head,
                        its final logits soft-capped (logit_softcap)
    Gemma3ForCausalLM   ffn="geglu", norms before and after each branch (norm_position="both") scaling by 1 + weight
                        (norm_unit_offset), per-head q/k norms, embeddings times sqrt(n_embd) (embed_scale), its own
                        attention scale (attn_scale), local layers attending to a sliding window (sliding_window,
                        window_layers) with a RoPE base of their own (rope_local_theta), an optional final soft cap
    GraniteMoeHybridForCausalLM  Granite 4 with every layer attention and no experts: Granite's switches, its shared
                        MLP the feed-forward, RoPE or no positions in any layer (nope_layers)
    Olmo3ForCausalLM    OLMo 2's switches with local layers attending to a sliding window (sliding_window,
                        window_layers), the global layers' RoPE scaled by YaRN (rope_scaling="yarn") where it is
    Ministral3ForCausalLM  Mistral's layout with YaRN and q multiplied by a factor growing with its position
                        (query_scale_beta); Mistral3ForConditionalGeneration: its text model, the vision tower left out
    Lfm2ForCausalLM     LFM2 and LFM2.5: gated short-convolution layers among grouped-query attention ones (layer_types,
                        conv_kernel, conv_bias), per-head q/k norms, the feed-forward's width as transformers adjusts it
    Qwen3_5ForCausalLM  Qwen3.5: Gated DeltaNet layers among attention ones (layer_types, linear_*), the attention gated
                        on its output (attn_output_gate) with per-head q/k norms and RoPE on part of each head
                        (rope_dims), norms scaling by 1 + weight; also the text tower of its vision-language checkpoints
                        (Qwen3_5ForConditionalGeneration), the vision tower left out
    OlmoeForCausalLM    Llama's layout with a mixture of experts in every block (n_experts, experts_per_token,
                        experts_renorm, router_aux_loss_coef) and RMSNorm over all of q and all of k
    Qwen3MoeForCausalLM Qwen3's switches with a mixture of experts in every block
    GraniteMoeForCausalLM  Granite's switches with a mixture of experts in every block (experts_renorm)
A checkpoint directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json,
or pytorch_model.bin). The names "gpt2", "gpt2-medium", "gpt2-large" and "gpt2-xl" are downloaded from the Hub.
This package turns a checkpoint into a GPTConfig and a state dict, tensor by tensor (GPT.from_pretrained builds
the model from them, holding one copy of the weights), and a model back into files; it never imports
gptlite.model.network.

    python -m gptlite.hf export --model=RUN --out=DIR [--overwrite]   # a run's checkpoint -> DIR

The modules: families/ (a file per family, each holding its rules in both directions side by side: what its
config.json means as gptlite's switches, what the switches mean as its config.json, its weights' names both ways
and its GGUF form; families/__init__.py registers them), matching.py (the family a model's switches export as),
pretrained.py (in), export.py (out), gguf.py (GGUF out) and adapter.py (PEFT adapters), which ask the family what
to do; weights.py (safetensors and .bin files), tokenizer_files.py (a tokenizer's files).
"""

from gptlite.hf.export import export_hf
from gptlite.hf.matching import family_of
from gptlite.hf.pretrained import GPT2_NAMES, check_model_name, fingerprint, load_pretrained, pretrained_config
from gptlite.hf.tokenizer_files import gpt2_tokenizer_problem, hf_tokenizer_files
from gptlite.hf.weights import read_json, save_weights

__all__ = [
    "GPT2_NAMES",
    "check_model_name",
    "export_hf",
    "family_of",
    "fingerprint",
    "gpt2_tokenizer_problem",
    "hf_tokenizer_files",
    "load_pretrained",
    "pretrained_config",
    "read_json",
    "save_weights",
]
