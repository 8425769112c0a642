"""ZeRO data parallelism: optimizer state, gradients and parameters sharded across ranks (stages 1-3)."""

from dptrain.zero.module import ZeRO
from dptrain.zero.policy import CheckPolicy, CommPolicy, InitPolicy, ShardingPolicy, UnitPolicy
from dptrain.zero.precision import MixedPrecision
from dptrain.zero.unit import FlatUnit

__all__ = ["ZeRO", "MixedPrecision", "UnitPolicy", "ShardingPolicy", "CommPolicy", "CheckPolicy", "InitPolicy",
           "FlatUnit"]
