"""ZeRO with units that some ranks or steps skip (``ZeRO(find_unused_parameters=True)``).

[Note: units some ranks skip]
Collectives pair up by order: every rank must issue the same all-gathers and
reduce-scatters in the same order. A unit that some ranks skip in a step (a branch
taken on some ranks, routed experts, a modality absent from one rank's batch) breaks
that, in forward (stage 3's gathers) and in backward (every stage's reductions). With
``find_unused_parameters=True`` the collectives stop following the computation:

- stage 3 gathers its unit modules in index order, each rank every unit once per
  forward (a unit's pre-hook first gathers the units before it; the end of forward
  gathers the rest and drops those this rank skipped). Units stay gathered until the
  end of backward, so backward gathers nothing (``reshard_after_forward`` and
  ``prefetch`` are off);
- every reduction waits for the end of backward. There one all-reduce of a flag per
  unit tells which units any rank used, and every rank reduce-scatters each of those
  in index order, with zeros for a unit it did not use. A unit no rank used keeps its
  gradient untouched, as DDP's ``find_unused_parameters`` leaves ``.grad``.

The price is DDP's memory during the step (full parameters and full gradients until the
end of backward) and no overlap of reductions with backward: between steps the shards
are as small as ever. FSDP2 instead runs a missing post-backward for groups that did not
run at all, which keeps ranks in step only when every rank skipped the same groups.
Without the flag, a synchronising backward that reached some units but not others
raises on the rank that skipped (the others' collective then fails instead of hanging).

The forward half lives in ``ZeRO._gather_in_order`` (module.py); the backward half is
here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dptrain.comm.step_stats import StepCommStats
from dptrain.zero.unit import FlatUnit

__all__ = ["reduce_in_order", "check_every_unit_reduced"]


def reduce_in_order(units: list[FlatUnit], group: dist.ProcessGroup | None, step_comm: StepCommStats) -> None:
    """End of a synchronising backward: one reduce-scatter per unit some rank used, in index order, on every rank.

    A rank that did not use a unit contributes zeros. Which units any rank used is
    agreed with one all-reduce of a flag per unit over ``group`` (every rank, replicas
    included); a unit no rank used is not reduced and keeps its gradient untouched, so
    the optimizer skips it (as DDP leaves ``.grad`` of parameters no rank used).
    """
    grads = [unit.take_unreduced() for unit in units]
    used = torch.tensor([g is not None for g in grads], dtype=torch.int32, device=units[0].device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
        step_comm.calls += 1
        step_comm.bytes += used.numel() * used.element_size()
    for unit, grad, anyone in zip(units, grads, used.tolist(), strict=True):
        if anyone:
            unit.launch(grad if grad is not None else
                        torch.zeros(unit.numel, dtype=unit.reduce_dtype, device=unit.device))


def check_every_unit_reduced(units: list[FlatUnit], group: dist.ProcessGroup | None) -> None:
    """Without ``find_unused_parameters``: a unit this synchronising backward did not reach is an error.

    The other ranks are waiting in its reduce-scatter (or were paired with another
    unit's); raising here ends this rank, and their collective fails instead of waiting
    for the timeout. A backward that reached no unit (``torch.autograd.grad`` for a
    gradient penalty) is not a step and passes.
    """
    missing = [u for u in units if not u.reduced]
    if missing and len(missing) < len(units):
        names = ", ".join(f"unit {u.index} ({u.refs[0].name}{', ...' if len(u.refs) > 1 else ''})"
                          for u in missing[:4])
        raise RuntimeError(
            f"ZeRO rank {dist.get_rank(group)}: {len(missing)} unit(s) received no gradient in this "
            f"backward: {names}. Every rank must reduce every unit, so the other ranks' collectives cannot "
            "complete. If some ranks or steps skip part of the model (a branch, routed experts), wrap with "
            "ZeRO(..., find_unused_parameters=True) (dptrain run: --set ddp.find_unused_parameters=true)")
