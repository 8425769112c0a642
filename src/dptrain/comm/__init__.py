"""Collectives: the backend's, and dptrain's own ring, tree, naive and hierarchical algorithms.

The bottom layer of dptrain. The strategies (DDP, ZeRO) call these free functions;
the cost model in :mod:`dptrain.comm.cost` predicts what each algorithm costs, and
``dptrain bench comm`` measures it. See docs/collectives.md.
"""

from dptrain.comm.collectives import (
    ALGORITHMS,
    CollectiveMismatchError,
    all_gather,
    all_reduce,
    broadcast,
    check_algorithm,
    reduce_scatter,
    sent_bytes,
)
from dptrain.comm.persistent import PersistentAllReduce
from dptrain.comm.progress import stop_progress_threads
from dptrain.comm.topology import node_groups, shard_bounds, shard_range
from dptrain.comm.wire import Traffic
from dptrain.comm.work import Work

__all__ = ["ALGORITHMS", "CollectiveMismatchError", "PersistentAllReduce", "Traffic", "Work", "all_gather", "all_reduce",
           "broadcast", "check_algorithm", "node_groups", "reduce_scatter", "sent_bytes", "shard_bounds",
           "shard_range", "stop_progress_threads"]
