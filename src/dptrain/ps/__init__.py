"""The parameter-server strategy: server ranks own parameter shards, worker ranks push gradients and pull.

Layers: :mod:`~dptrain.ps.wire` (messages over point-to-point send/recv), :mod:`~dptrain.ps.layout`
(roles, shards), :mod:`~dptrain.ps.consistency` (sync, async, ssp, backup),
:mod:`~dptrain.ps.server` and :mod:`~dptrain.ps.worker`, :mod:`~dptrain.ps.job` (setup),
:mod:`~dptrain.ps.snapshot` (consistent checkpoints while training goes on).
"""

from dptrain.ps.consistency import MODES, Consistency
from dptrain.ps.job import build_parameter_server
from dptrain.ps.layout import PSLayoutError, Roles, partition
from dptrain.ps.lookahead import Lookahead
from dptrain.ps.server import Applied, ShardServer
from dptrain.ps.snapshot import CutPolicy, CutSchedule
from dptrain.ps.wire import PSError
from dptrain.ps.worker import PSWorker

__all__ = ["Applied", "Consistency", "CutPolicy", "CutSchedule", "Lookahead", "MODES", "PSError", "PSLayoutError",
           "PSWorker", "Roles", "ShardServer", "build_parameter_server", "partition"]
