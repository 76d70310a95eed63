"""The fused decode engine in token ids: continuous batching, the scheduler and its fair share between
tenants, every admission check, and the threads tensor work runs on."""
