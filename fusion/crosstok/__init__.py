"""Experts of different tokenizers fused over text pieces: how each tokenizer spells text, the fused
step over pieces, and its request loop."""
