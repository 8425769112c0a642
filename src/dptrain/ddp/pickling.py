"""Saving a wrapped model whole and copying it: ``torch.save(ddp_model)``, ``copy.deepcopy(ddp_model)``.

torch's DDP defines ``__getstate__``/``__setstate__`` so that a wrapped model can be pickled:
the state leaves out what belongs to the running job (the process group, the reducer and
its hooks, the logger), and loading rebuilds them on the *default* process group with the
same options. People rely on it for EMA and evaluation copies (``copy.deepcopy``) and for
``torch.save(model)``. dptrain follows the same rule, leaving out the process group, the
reducer (whose hooks live on the original parameters, not on the copies) and the
collective check (a prefix of the job's store); the buffers broadcast each forward are
listed again from the copied module.

What cannot be carried is refused by name, with a ``RuntimeError`` as torch's (never a
pickling traceback about a ``ProcessGroup`` or a ``PrefixStore``):

- a process group other than the default one: the loaded copy could not know which group
  to rebuild on (torch refuses it too);
- a communication hook from ``register_comm_hook``: torch drops it silently, so a copy
  would reduce with a plain all-reduce where the original compressed;
- a ``traffic=`` counter: it counts this rank's bytes for the original model.

Loading needs ``torch.distributed`` initialised, as torch's does. Rebuilding makes no
collective call, so copying on some ranks only does not hang; but, as with torch, the copy
must then not be trained or run forward with ``broadcast_buffers`` there alone.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from dptrain.comm.fingerprint import collective_check
from dptrain.ddp.errors import NotInitialisedError

__all__ = ["pickled_state", "restore"]

# What belongs to the running job: rebuilt by restore(), never pickled.
_JOB_STATE = ("process_group", "reducer", "collective_check", "_synced_buffers")

_INSTEAD = ("save or copy model.module (or its state_dict) and wrap the copy in a new DistributedDataParallel "
            "on every rank")


def pickled_state(ddp: Any) -> dict[str, Any]:
    """``ddp.__dict__`` without the job's state, after refusing what a copy could not rebuild."""
    _refuse_unpicklable(ddp)
    state = dict(ddp.__dict__)
    for key in _JOB_STATE:
        state.pop(key, None)
    return state


def restore(ddp: Any, state: dict[str, Any]) -> None:
    """Rebuild a loaded or copied wrapper on the default process group, with its saved options."""
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitialisedError("loading a pickled DistributedDataParallel rebuilds it on the default process group, and "
                           "torch.distributed is not initialised: call init_process_group before torch.load, or "
                           f"{_INSTEAD}")
    state = dict(state)
    if "broadcast_buffers" in state:  # pickled before broadcast_buffers became torch's alias of forward_sync_buffers
        state["forward_sync_buffers"] = state.pop("broadcast_buffers")
    state.setdefault("parameters_to_ignore", set())
    nn.Module.__setstate__(ddp, state)
    ddp.process_group = dist.group.WORLD
    ddp._synced_buffers = ddp._managed("buffers")
    ddp._forward_calls, ddp._comm_hook_registered = 0, False  # a fresh reducer: a hook may be registered again
    ddp.collective_check = collective_check(ddp.check_collectives, ddp.check_timeout_s, None)
    named = ddp._reducer_parameters()
    ddp._param_names = [name for name, _ in named]
    ddp.reducer = ddp._build_reducer(named, ddp.collective_check)


def _refuse_unpicklable(ddp: Any) -> None:
    what = "pickle or deepcopy dptrain's DistributedDataParallel"
    if not dist.is_initialized() or ddp.process_group not in (dist.group.WORLD, None):
        raise RuntimeError(f"cannot {what}: it was built on a process group other than the default one, and a "
                           "loaded copy is rebuilt on the default group (as torch's DDP, which refuses it too); "
                           f"{_INSTEAD}, passing process_group= again")
    if ddp._comm_hook_registered:
        hook = getattr(ddp.reducer.comm_hook, "__qualname__", type(ddp.reducer.comm_hook).__name__)
        raise RuntimeError(f"cannot {what}: it has a communication hook ({hook}) registered, and a hook and its "
                           "state are not pickled (torch's DDP drops them silently, so the copy would all-reduce "
                           f"uncompressed); {_INSTEAD} and call register_comm_hook on the copy")
    if ddp.traffic is not None:
        raise RuntimeError(f"cannot {what}: its traffic= counter counts this rank's bytes for the original model; "
                           f"{_INSTEAD}, passing a new traffic= counter if the copy's bytes should be counted")
