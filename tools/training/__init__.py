"""Train the builtin specialists as LoRA adapters over SmolLM2-135M-Instruct (see `train_expert`)."""

from fusion.tools.training.experts import ADAPTER_NAMES, RECIPES, train_expert

__all__ = ["ADAPTER_NAMES", "RECIPES", "train_expert"]
