"""The model ``prepare()`` returns: the strategy's wrapper, seen from outside as torch's DDP sees a model.

Code around a data-parallel model decides by ``isinstance(model,
torch.nn.parallel.DistributedDataParallel)``: torch's state-dict helpers
(``torch.distributed.checkpoint.state_dict``) strip the ``module.`` prefix only then, and
Hugging Face's and Accelerate's ``unwrap_model`` return ``model.module`` only then. So a
:class:`PreparedModel` is an instance of torch's class, whatever the strategy, and keeps
that class's contract where a caller can see it: the user's model is the one registered
submodule, ``module``, so ``named_parameters()`` and ``state_dict()`` are keyed
``module.<name>`` (torch's helpers give and take the bare names); ``state_dict()`` is the
full model under every strategy (:meth:`~dptrain.strategies.protocol.DataParallelWrapper.full_state_dict`:
ZeRO gathers its shards, so every rank calls it, as with FSDP's full state dict);
``no_sync()``, ``register_comm_hook()`` and ``join()`` are the strategy's (or refused by its
name). torch's ``__init__`` is not run (the strategy's wrapper is the engine, ``.wrapper``), so
every other name of torch's class is refused by name, default deny, as dptrain's own DDP class
does ([Note: a subclass of torch's DDP that never runs torch's __init__],
``dptrain/utils/subclass.py``). To ask which strategy runs, read ``model.strategy`` (its registry
entry), never the class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from dptrain.api.accumulation import AccumulationState
from dptrain.api.loss_check import check_loss_not_divided
from dptrain.strategies.registry import Strategy
from dptrain.utils.subclass import refuse_unreviewed
from dptrain.utils.tensors import map_tensors

__all__ = ["PreparedModel"]

_PREFIX = "module."
# torch's names kept: they read only what this class sets (the dynamo hook reads a class attribute)
_INHERITED = {"_active_ddp_module": "class attribute, never set here", "_get_active_ddp_module": "classmethod",
              "_set_params_and_buffers_to_ignore_for_model": "static: marks names on a bare module",
              "_get_data_parallel_params": "static: a module's parameters not marked ignored"}
_INSTEAD = "the strategy's wrapper does the work (model.wrapper); ask its registry entry, model.strategy"


class PreparedModel(nn.parallel.DistributedDataParallel):
    """The strategy's wrapper (``.wrapper``), with the accumulation's sync switch and autocast around its forward.

    A forward with autograd on is one micro-step (:meth:`AccumulationState.begin_micro_step`);
    it sets the wrapper's ``set_requires_gradient_sync`` to whether it closes its window, and
    the switch stays so through its backward (ZeRO reads it during backward, DDP at forward)
    until the next forward. Forwards under ``torch.no_grad()`` (evaluation) are not counted.
    ``.module`` (and ``unwrap()``) is the model as it was passed, as torch DDP's ``.module``
    and Accelerate's ``unwrap_model`` give it; under ZeRO its parameters stay visible there
    with their shapes and no values (``dptrain/zero/visible.py``). The full weights under any
    strategy: ``dptrain.get_state_dict(model)`` on every rank (or ``model.state_dict()``,
    keyed ``module.<name>``). The loss is not to be divided by ``grad_accum_steps``:
    ``optimizer.step()`` divides the window's summed gradients (:func:`check_loss_not_divided`).
    """

    def __init__(self, wrapped: nn.Module, strategy: Strategy, state: AccumulationState,
                 autocast_dtype: torch.dtype | None, device: torch.device):
        nn.Module.__init__(self)  # not torch DDP's: the strategy's wrapper does the work (module docstring)
        object.__setattr__(self, "wrapper", wrapped)  # not a submodule: the user's model is the one registered
        self.module = wrapped.module
        self.strategy, self.accumulation, self.device = strategy, state, device
        self._autocast_dtype = autocast_dtype
        self._loss_checked = state.grad_accum_steps == 1  # nothing to check without accumulation

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.wrapper.set_requires_gradient_sync(self.accumulation.begin_micro_step())
        if self._autocast_dtype is None:
            out = self.wrapper(*args, **kwargs)
        else:
            with torch.autocast(self.device.type, dtype=self._autocast_dtype):
                out = self.wrapper(*args, **kwargs)
            # the loss is computed outside, after the forward: in fp32, as Accelerate's convert_outputs_to_fp32
            out = map_tensors(out, lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)
        if not self._loss_checked and torch.is_grad_enabled():
            self._loss_checked = True  # the first micro-step: a loop divides every micro-step's loss alike
            check_loss_not_divided(out, self.accumulation)
        return out

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[PreparedModel]:
        """For a ``with`` block around an evaluation: this model, holding the weights the strategy calls the model
        (DiLoCo's global weights between its outer steps, as ``dptrain.get_state_dict`` gives them; every other
        strategy's replica as it trains), training's own back after the block. Not a collective."""
        with self.wrapper.evaluating():
            yield self

    def unwrap(self) -> nn.Module:
        """The model as it was passed to ``prepare()`` (on the device): ``.module``."""
        return self.module

    # ------------------------------------------------------------------ torch DDP's surface, by the strategy

    def train(self, mode: bool = True) -> PreparedModel:
        self.training = mode
        self.wrapper.train(mode)  # and the user's model, inside it
        return self

    def no_sync(self) -> contextlib.AbstractContextManager:
        """The strategy's ``no_sync()``; ``prepare()`` already accumulates by itself (``grad_accum_steps``)."""
        return self.wrapper.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapper.zero_grad(set_to_none=set_to_none)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        if not self.strategy.comm_hooks:
            raise TypeError(f"strategy {self.strategy.name!r} takes no communication hook; the strategies that do: "
                            "those whose registry entry has comm_hooks (dptrain.strategies.strategy_names)")
        self.wrapper.register_comm_hook(state, hook)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self.wrapper, "join"):
            raise TypeError(f"strategy {self.strategy.name!r} has no join() for uneven inputs; prepare() pads every "
                            "rank's shard to the same number of batches")
        return self.wrapper.join(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return nn.Module.__getstate__(self) if hasattr(nn.Module, "__getstate__") else self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)

    # ------------------------------------------------------------------ the full model, keyed module.<name>

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """Collective under a strategy that shards or lets replicas differ: the full model, keyed ``module.<name>``."""
        if args:  # nn.Module's old positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        out = destination if destination is not None else {}
        out.update({f"{prefix}{_PREFIX}{k}": v for k, v in self.wrapper.full_state_dict().items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Every rank: the full model, keyed ``module.<name>`` (as :meth:`state_dict` gives) or by the bare names."""
        bare = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in state_dict.items()}
        self.wrapper.load_full_state_dict(bare)
        return _IncompatibleKeys([], [])


refuse_unreviewed(PreparedModel, nn.parallel.DistributedDataParallel, owner="dptrain's prepared model",
                  base_name="torch's DistributedDataParallel", inherited=_INHERITED, refused={}, default=_INSTEAD)
