"""Inference: the decode loop (`generate`), beam search (`beam`), the KV caches (`kvcache`), sampling controls
(`sampling`), weight-only quantization (`quantize`), conversations held in one cache (`conversation`) and the CPU
backend with its compiled kernels (`cpu`)."""
