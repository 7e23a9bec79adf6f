"""The model: the network (`network`: positions, norms, attention, feed-forwards, blocks, the whole GPT), what it reads
from a KV cache while generating (`attention_cache`), and its output head's chunked loss (`loss`). Its configuration,
GPTConfig, is in gptlite.config, shared with the command lines."""
