"""Logit fusion: several causal LMs decode one sequence; their next-token logits are merged per step."""

__version__ = "0.1.0"
