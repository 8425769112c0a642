"""Live recovery: survivors go on without a restart (a quorum each step, a commit vote, a joiner healed from a peer).

The modules, from the bottom: :mod:`~dptrain.live.store` (the job's store, which outlives any
worker), :mod:`~dptrain.live.liveness` (heartbeats through it), :mod:`~dptrain.live.quorum`
(who takes part in a step), :mod:`~dptrain.live.group` (a gloo process group per quorum, the
gradients averaged over its members), :mod:`~dptrain.live.vote` (a step applied by all
survivors or by none), :mod:`~dptrain.live.heal` (a behind worker's state sent by an up-to-date
peer, confirmed by a hash), :mod:`~dptrain.live.trust` (a replica of another job refused, a diverged
one healed), :mod:`~dptrain.live.stats` (what was lost, counted) and
:mod:`~dptrain.live.manager`, which runs them in a step's order. docs/reliability.md, "Live
recovery", tells the whole story and the runner's step gate (``dptrain.runner.live_gate``) uses it.
"""

from dptrain.live.manager import JobMismatch, LiveManager, LiveSettings, TooFewWorkers
from dptrain.live.quorum import GIVE_UP_EXIT
from dptrain.live.store import LIVE_STORE_ENV, connect_store, serve_store

__all__ = ["LiveManager", "LiveSettings", "TooFewWorkers", "JobMismatch", "GIVE_UP_EXIT", "LIVE_STORE_ENV", "connect_store", "serve_store"]
