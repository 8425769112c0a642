"""Optimizers with a learning rate per layer (LARS, LAMB) whose layers may be split across ZeRO shards."""

from dptrain.optim.layerwise import LAMB, LARS

__all__ = ["LARS", "LAMB"]
