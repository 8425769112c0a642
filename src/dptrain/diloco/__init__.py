"""DiLoCo (Douillard et al. 2023): H local steps of the run's optimizer, then one outer step on the average of
the ranks' pseudo-gradients (global weights minus local weights) by SGD with Nesterov momentum.

:class:`DiLoCo` wraps a model; :mod:`dptrain.diloco.outer` holds the outer step, with its
naive per-tensor oracle beside it.
"""

from dptrain.diloco.module import DiLoCo
from dptrain.diloco.options import DiLoCoOptions, sync_schedule
from dptrain.diloco.outer import OuterStep, outer_step_naive

__all__ = ["DiLoCo", "DiLoCoOptions", "OuterStep", "outer_step_naive", "sync_schedule"]
