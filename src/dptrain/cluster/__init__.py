"""``dptrain cluster``: an emulated multi-host cluster on one Linux machine, to measure real multi-node runs.

Hosts are network namespaces on a bridge, each link limited by ``tc``'s token bucket
(:mod:`~dptrain.cluster.netns`); each host runs a torchrun agent with a real c10d
rendezvous (:mod:`~dptrain.cluster.launch`). Requires root.
"""

from dptrain.cluster.launch import run_on_cluster
from dptrain.cluster.netns import Network, NetworkError, check_root, cleanup_stale

__all__ = ["Network", "NetworkError", "check_root", "cleanup_stale", "run_on_cluster"]
