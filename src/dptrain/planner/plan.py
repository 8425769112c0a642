"""A plan: per-rank memory and communication for each strategy x world size x precision.

Each :class:`Row` adds up what one rank holds at the peak of a step:

- model states (:func:`~dptrain.planner.states.model_states`, exact) and the module's buffers;
- activations of one micro-batch (:func:`~dptrain.planner.activations.trace_activations`),
  without and with activation checkpointing;
- communication buffers alive during backward besides those: ZeRO stage 2 holds the
  gradient of the unit being assembled and the reduction in flight (2 units);
  stage 3 also the current and the prefetched unit's gathered parameters, and the root
  unit's for the whole step. The DDP engine's bucket buffers are persistent and are in
  the gradients already, and stage 1 accumulates in its persistent gradient buffer
  (unless it reduces in another dtype than it computes in: then as stage 2).

The model-state columns are exact; activations are exact for what autograd saves;
the total is an estimate of the peak (allocator slack, temporaries inside a kernel
and the framework's own memory are not in it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from dptrain.planner.activations import Activations
from dptrain.planner.layout import Setup, Unit, units
from dptrain.planner.states import OptimizerFactory, States, adam, model_states
from dptrain.planner.traffic import Traffic, step_traffic

__all__ = ["Row", "plan_row", "comm_buffer_bytes"]


@dataclass(frozen=True)
class Row:
    """One strategy x world size x precision: rank 0's bytes (it holds the largest shards)."""

    strategy: str
    world_size: int
    precision: str
    micro_batch: int | None
    states: States
    activations: Activations | None
    comm_buffers: int | None  # None: not estimated (a bare parameter count has no layers)
    traffic: Traffic

    def total(self, checkpointed: bool = False) -> int | None:
        """Estimated peak bytes per rank (None when activations could not be traced)."""
        if self.activations is None:
            return None
        acts = self.activations.checkpointed if checkpointed else self.activations.saved
        if acts is None or self.comm_buffers is None:
            return None
        return self.states.total + self.states.buffers + acts + self.comm_buffers

    def to_dict(self) -> dict:
        out = dict(strategy=self.strategy, world_size=self.world_size, precision=self.precision,
                   micro_batch=self.micro_batch, **{f"{k}_bytes": v for k, v in asdict(self.states).items()},
                   model_state_bytes=self.states.total, comm_buffer_bytes=self.comm_buffers,
                   activation_bytes=self.activations.saved if self.activations else None,
                   checkpointed_activation_bytes=self.activations.checkpointed if self.activations else None,
                   total_bytes=self.total(), total_checkpointed_bytes=self.total(checkpointed=True),
                   sent_bytes_per_step=self.traffic.total, **{f"sent_{k}_bytes": v for k, v in
                                                             asdict(self.traffic).items()})
        return out


def comm_buffer_bytes(model: nn.Module, setup: Setup, shapes: list[Unit] | None = None) -> int:
    """Unit-sized buffers alive during backward beyond the model states (see the module docstring).

    ``shapes``: ``units(model, setup)`` when the caller has them (they do not depend on the world size).
    """
    compute = setup.compute_dtype
    reduce = setup.reduce_dtype if compute is not None else None
    in_place = setup.stage == 1 and (compute is None or reduce == compute)
    if setup.stage == 0 or in_place:
        return 0
    shapes = shapes if shapes is not None else units(model, setup)

    def nbytes(unit, dtype):
        return unit.numel * (dtype or unit.dtype).itemsize

    grads = 2 * max(nbytes(u, reduce) for u in shapes)
    if setup.stage < 3:
        return grads
    resharded = [u for u in shapes if u.resharded]
    kept = sum(nbytes(u, compute) for u in shapes if not u.resharded)
    gathered = 2 * max((nbytes(u, compute) for u in resharded), default=0)
    return grads + gathered + kept


def plan_row(model: nn.Module, setup: Setup, activations: Activations | None, micro_batch: int | None = None,
             optimizer: OptimizerFactory = adam, micro_steps: int = 1, layered: bool = True,
             shapes: list[Unit] | None = None) -> Row:
    """Rank 0's plan for ``model`` (built on the meta device or under a fake tensor mode) under ``setup``.

    ``layered=False``: ``model`` stands for a parameter count only, so the
    communication buffers, which depend on the sizes of layers, are not estimated.
    ``shapes``: ``units(model, setup)``, computed once by a caller planning many world sizes.
    """
    shapes = shapes if shapes is not None else units(model, setup)
    with torch.device("cpu"):
        states = model_states(model, setup, 0, optimizer, shapes)
    return Row(setup.strategy, setup.world_size, setup.precision, micro_batch, states, activations,
               comm_buffer_bytes(model, setup, shapes) if layered else None,
               step_traffic(model, setup, 0, micro_steps=micro_steps, shapes=shapes))
