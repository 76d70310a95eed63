"""One model's decode step, one implementation per device class behind `LocalExpert`'s forward: the
C step on CPU (native_step over native_kernels and quantized weights), the static-shape step in torch
operators (llama, gemma) for CUDA, and transformers' forward as the reference and fallback; the KV
caches they append to."""
