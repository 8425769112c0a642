"""dptrain's DDP is a subclass of torch's without torch's reducer: what it inherits from torch's class, what it refuses.

[Note: a subclass of torch's DDP that never runs torch's __init__]
Code around DDP asks whether a model *is* one: ``isinstance(m, torch.nn.parallel.DistributedDataParallel)``
decides whether Hugging Face's and Accelerate's unwrap helpers and Lightning look inside ``.module``,
whether ``torch.distributed.checkpoint.state_dict`` strips the ``module.`` prefix, and whether dynamo
treats the module as DDP. dptrain's class is therefore a real subclass of torch's whose ``__init__``
calls ``nn.Module.__init__`` instead of torch's: torch's C++ reducer, logger and hooks are never built.

What that costs: every method torch's class defines reaches, through ``self``, state that
only torch's ``__init__`` creates (``self.reducer`` as torch's C++ reducer, ``self.logger``,
``self._use_python_reducer``, ...). Each name of torch's class is therefore, by name, either

- overridden by dptrain's class (``forward``, ``no_sync``, ``register_comm_hook``, ``join``, ...);
- inherited because it reads nothing torch's ``__init__`` made (:data:`INHERITED`: the static ignore-list
  helper, the active-module hook dynamo reads, ``train``, the ``broadcast_buffers`` alias, ...); or
- refused: reading it raises ``AttributeError`` saying what to use instead (:data:`REFUSED`), so
  ``hasattr`` is False as before. A name a later torch adds is refused until reviewed
  (:func:`refuse_the_rest`: default deny), never silently inherited.

Code that calls torch's methods unbound (``torch.nn.parallel.DistributedDataParallel.forward(model, x)``)
or reaches into torch's reducer (``torch.distributed.pipelining``'s stage calls
``submod.reducer.prepare_for_backward``; the ZeRO overlap hooks read ``_has_rebuilt_buckets``) gets torch's
internals, which are not there: not supported. ``type(model) is torch...DistributedDataParallel`` is False,
as for any subclass.

Torch's constructor arguments that dptrain does not implement are refused here too, by name, with what to
use instead (:func:`check_arguments`).
"""

from __future__ import annotations

import torch.distributed as dist

from dptrain.ddp.buckets import DEFAULT_BUCKET_CAP_MB
from dptrain.ddp.compiled import TorchDDP
from dptrain.ddp.errors import NotInitialisedError
from dptrain.utils.subclass import Refused, own_names, refuse_unreviewed
from dptrain.utils.subclass import overridden as overridden_before

__all__ = ["INHERITED", "REFUSED", "refuse_the_rest", "refusal", "torch_names", "overridden", "check_arguments"]

# Kept from torch's class: they read only what dptrain's class sets too (module, process_group, forward_sync_buffers).
INHERITED = {
    "_active_ddp_module": "class attribute: the DDP whose forward is running (dynamo's DDPOptimizer reads it)",
    "_get_active_ddp_module": "classmethod returning it",
    "_inside_ddp_forward": "torch's context manager setting it (dptrain's forward uses compiled.run_module)",
    "_set_params_and_buffers_to_ignore_for_model": "static: marks names on the bare module, read at construction",
    "_get_data_parallel_params": "static: the module's parameters not marked ignored",
    "broadcast_buffers": "property: an alias of forward_sync_buffers",
    "train": "nn.Module.train, returning self",
    "_distributed_rank": "property: dist.get_rank(self.process_group)",
}

_NO_REDUCER = "it drives torch's C++ reducer, which dptrain's class does not build (dptrain's reducer is Python)"
# Refused with what to do instead; any other name of torch's class not overridden gets _NO_REDUCER.
REFUSED = {
    "_set_static_graph": "pass static_graph=True to the constructor",
    "_get_ddp_logging_data": "read model.last_step_comm (calls, bytes and timing of the last synced step)",
    "_set_ddp_runtime_logging_sample_rate": "read model.last_step_comm",
    "_register_builtin_comm_hook": "register torch's hook function itself: model.register_comm_hook(state, "
                                   "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook)",
    "_register_fused_optim": "use model.optimizer_in_backward(optimizer)",
    "_update_process_group": "wrap model.module again with process_group=",
    "_set_sparse_metadata": "dptrain's DDP reduces dense gradients only",
    "_set_ddp_sink_clone": "dptrain's forward returns the module's outputs untouched (no _DDPSink)",
    "_register_buffer_comm_hook": "buffers are broadcast from rank 0 before a synced forward (forward_sync_buffers)",
    "_check_reducer_finalized": "dptrain's reducer finalizes at the end of every backward itself",
    "_remove_autograd_hooks": "delete the wrapper: its hooks hold it only weakly",
}

# Arguments of torch's DDP that dptrain does not implement, with what to do instead.
_UNSUPPORTED = {
    "mixed_precision": "use torch.autocast around the forward (see dptrain's mixed-precision docs)",
    "device_mesh": "pass process_group= (a 1-D data-parallel group) instead",
    "delay_all_reduce_named_params": "not supported; all parameters are reduced in buckets",
    "param_to_hook_all_reduce": "not supported",
    "skip_all_reduce_unused_params": "not supported; unused parameters are reduced as zeros",
    "bucket_cap_mb_list": "pass a single bucket_cap_mb",
}
# Accepted only with the value dptrain implements (docs/ddp.md: torch's arguments and methods).
_ONLY_VALUE = {
    "batched_grad_copy": (True, "dptrain always copies a bucket's gradients in one batched op (torch._foreach_copy_)"),
}


_OWNER, _BASE = "dptrain's DistributedDataParallel", "torch"


def refusal_message(name: str, instead: str) -> str:
    return Refused(_OWNER, _BASE, name, instead).message


def torch_names() -> list[str]:
    """Every name torch's class defines itself, less class plumbing."""
    return own_names(TorchDDP)


def refuse_the_rest(cls: type) -> type:
    """Class decorator: every name of torch's class that ``cls`` neither overrides nor inherits on purpose
    (:data:`INHERITED`) is refused (:data:`REFUSED`, else as driving torch's reducer)."""
    return refuse_unreviewed(cls, TorchDDP, owner=_OWNER, base_name=_BASE, inherited=INHERITED, refused=REFUSED,
                             default=_NO_REDUCER)


def overridden(cls: type) -> set[str]:
    """The names ``cls`` or a class before torch's in its MRO (a mixin such as ``GradSyncSwitch``) defines."""
    return overridden_before(cls, TorchDDP)


def refusal(cls: type, name: str) -> str | None:
    """The message for a refused name of ``cls`` (nn.Module's ``__getattr__`` would replace it with its own)."""
    found = getattr(cls, name, None)
    return found.message if isinstance(found, Refused) else None


def check_arguments(unsupported: dict, bucket_cap_mb: float | None, device_ids) -> None:
    """Refuse by name the arguments of torch's DDP that dptrain does not implement, then check the values."""
    for name, (value, why) in _ONLY_VALUE.items():
        if name in unsupported and unsupported.pop(name) != value:
            raise TypeError(f"dptrain's DistributedDataParallel supports torch's {name!r} only as {value}: {why}")
    for name in unsupported:
        hint = _UNSUPPORTED.get(name)
        if hint is None:
            raise TypeError(f"DistributedDataParallel() got an unexpected keyword argument {name!r}")
        raise TypeError(f"dptrain's DistributedDataParallel does not support torch's {name!r}: {hint}")
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitialisedError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group("
            "backend='gloo' or 'nccl') on every rank before wrapping the model (torchrun and "
            "dptrain's launcher set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it).")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}; "
                         f"use None for the default ({DEFAULT_BUCKET_CAP_MB:g} MiB)")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids={list(device_ids)}: one device per process is supported; "
                         "launch one process per device (torchrun --nproc-per-node N)")
