"""An expert: one causal LM behind the `Expert` interface (local, or remote over gRPC in services/),
its loading, per-session KV caches with prefix reuse, and adapters over a shared base."""
