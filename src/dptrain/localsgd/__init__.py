"""Local SGD and post-local SGD (Lin et al. 2020): ranks step alone and average their models every few steps.

:class:`LocalSGD` wraps a model: the DDP engine for a warm-up of synchronous steps, then
each rank steps on its own gradients and the replicas are averaged every ``period`` steps
(:mod:`dptrain.localsgd.average`, with its naive per-tensor oracle beside it).
"""

from dptrain.localsgd.average import average_parameters, average_parameters_naive
from dptrain.localsgd.module import LocalSGD
from dptrain.localsgd.options import LocalSGDOptions

__all__ = ["LocalSGD", "LocalSGDOptions", "average_parameters", "average_parameters_naive"]
