"""The merge: fusion rules over the experts' logits (training-free and the learned router), the
batched sampler, and the grammars that mask the fused distribution (structured output, tool calls)."""
