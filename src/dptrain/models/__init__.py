"""Models for the built-in tasks. They know nothing of parallelism."""

from dptrain.models.gpt import GPT
from dptrain.models.mlp import MLPClassifier

__all__ = ["GPT", "MLPClassifier"]
