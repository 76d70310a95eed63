"""Train small specialist experts on an existing model's tokenizer (see `train_expert`)."""

from fusion.tools.training.experts import RECIPES, train_expert

__all__ = ["RECIPES", "train_expert"]
