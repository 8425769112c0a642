"""Uneven inputs: ranks that run out of data shadow the collectives of those that have not.

Synchronous data parallelism deadlocks when one rank has fewer batches than another:
the rank with more data waits in an all-reduce that the finished rank never joins.
torch's ``Join`` context manager solves this generically; a ``Joinable`` supplies the
hooks. While any rank still has data, a joined rank runs :meth:`DDPJoinHook.main_hook`
once per iteration of the others, issuing the same collectives in the same order as a
training iteration does (see ``DistributedDataParallel._pre_forward``):

1. Join's own "still active?" all-reduce (issued by the ``Join`` manager);
2. if buffers are synchronised: agree on a source rank with data, broadcast buffers;
3. agree on whether this iteration's backward communicates (``no_sync`` or not);
4. if it does: one all-reduce per bucket, in bucket order, contributing zeros, then
   the unused-parameter map if one is exchanged.

When every rank has joined, :meth:`post_hook` broadcasts the model from a rank that
was last to join, so the replicas leave the context identical.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.algorithms.join import JoinHook

__all__ = ["DDPJoinHook", "JoinableDDP"]


class JoinableDDP(Protocol):
    """What the hook needs of the DDP module (``module.py``, which imports this file: no way back up)."""

    require_forward_param_sync: bool
    _divide_by_initial_world_size: bool
    reducer: Any  # the module's Reducer: reduce_zeros() shadows a synced backward

    def _will_sync_buffers(self) -> bool: ...

    def _sync_buffers(self, is_active: bool) -> tuple[int, int]: ...

    def _agree_on_grad_sync(self, is_joined: bool) -> bool: ...

    def _sync_final_model(self, is_last_joiner: bool) -> None: ...


class DDPJoinHook(JoinHook):
    def __init__(self, ddp: JoinableDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._will_sync_buffers():
            ddp._sync_buffers(is_active=False)
        should_sync = ddp._agree_on_grad_sync(is_joined=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.reduce_zeros()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
