"""Optimizers: LARS and LAMB (a learning rate per layer, whose layers may be split across ZeRO shards), and
1-bit Adam (Adam whose momentum is averaged in 1 bit per element after a warm-up, on the DDP engine)."""

from dptrain.optim.layerwise import LAMB, LARS
from dptrain.optim.onebit_adam import OneBitAdam

__all__ = ["LARS", "LAMB", "OneBitAdam"]
