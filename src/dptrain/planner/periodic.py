"""Step time of the strategies whose replicas step alone and meet every few steps (local SGD, DiLoCo, Streaming
DiLoCo): compute alone between two sync points, then one reduction, exposed beyond the steps it overlaps.

With the strategy's :class:`~dptrain.strategies.options.SyncSchedule` (a sync point every S
steps, each reducing the next of its P parts: the whole model, or Streaming DiLoCo's
fragments in turn) and the profile's compute:

    t_inner   = accum (F + B) + O                       (no gradient collective: each replica's own step)
    t_sync(f) = the all-reduce of part f's payload      (alpha-beta, ring, on the link between the ranks)
    exposed_f = max(0, t_sync(f) - tau t_inner)         (tau: the steps the reduction runs beside)
    step      = t_inner + mean_f(exposed_f) / S         (each sync point's wait spread over its S steps)

A payload is the part's values as the wire carries them (fp32, or the codec's bytes). The
4-bit and int8 reductions (an all-gather of encodings on 2 ranks, an all-to-all then an
all-gather beyond) send what a ring all-reduce of the payload sends, 2 (M - 1) / M of it a
rank, so the ring's cost stands for them all. The outer optimizer's step (two passes over
the part's fp32 values) and the encoding are not charged: every S steps they are small
beside an inner step. The calibrated :class:`~dptrain.planner.simulate.Overheads` are added
as for DDP, with this step's features: no buckets, the payload's bytes per step, the
parameters stepped every step, the compute.

This is the steady state after the schedule's synchronous warm-up; it is what the step
costs, not what it buys: the loss per step differs from synchronous training
(docs/localsgd.md), which no step time says.
"""

from __future__ import annotations

from torch import nn

from dptrain.comm.cost import collective_cost
from dptrain.planner.network import Network
from dptrain.planner.simulate import Collective, ComputeProfile, Overheads, StepPrediction
from dptrain.strategies.options import SyncSchedule

__all__ = ["simulate_periodic", "sync_seconds"]


def sync_seconds(schedule: SyncSchedule, world_size: int, network: Network) -> list[float]:
    """Each part's reduction time on ``network``: its payload's ring all-reduce over ``world_size`` ranks, on the link
    between hosts where the ranks span more than one (``network.per_node`` a host), else the one inside."""
    if world_size == 1:
        return [0.0] * len(schedule.parts)
    link = network.net if network.hosts(world_size) > 1 else network.node
    return [collective_cost("all_reduce", "ring", schedule.wire_bytes(n), 1, world_size).predict({"net": link})
            for n in schedule.parts]


def simulate_periodic(model: nn.Module, strategy: str, schedule: SyncSchedule, world_size: int,
                      profile: ComputeProfile, network: Network, accum: int = 1,
                      overheads: Overheads | None = None) -> StepPrediction:
    """The mean step of ``strategy`` (its ``schedule``) over one round of its parts, after its warm-up (see the module
    docstring); ``collectives`` holds one round's reductions, each launched at its sync point."""
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum must be a positive number of micro-steps, got {accum!r}")
    if schedule.every < 1 or schedule.overlap >= schedule.every or schedule.overlap < 0:
        raise ValueError(f"a sync point every {schedule.every} step(s) with {schedule.overlap} of overlap: the "
                         "overlap must be at least 0 and below the steps between two sync points")
    F, B, O = profile.forward_s, profile.backward_s, profile.optimizer_s
    inner = accum * (F + B) + O
    round_steps = schedule.every * len(schedule.parts)
    log, exposed, overlapped = [], 0.0, 0.0
    for f, seconds in enumerate(sync_seconds(schedule, world_size, network)):
        payload = schedule.wire_bytes(schedule.parts[f])
        launched = ((f + 1) * schedule.every - schedule.overlap) * inner  # after its pseudo-gradient's step
        log.append(Collective(f"{schedule.name} {f}", launched, launched, launched + seconds, payload))
        beside = min(seconds, schedule.overlap * inner)
        exposed += seconds - beside
        overlapped += payload * (beside / seconds if seconds else 0.0)
    step = inner + exposed / round_steps
    stepped = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    counted = {"per_step_s": 1.0, "contention_s_per_byte": overlapped / round_steps,
               "comm_s_per_byte": sum(c.nbytes for c in log) / round_steps, "state_s_per_byte": float(stepped),
               "compute_slowdown": inner, "per_micro_step_s": float(accum - 1)}  # every other term: none
    features = tuple(counted.get(name, 0.0) for name in Overheads.names())
    overhead = sum(k * x for k, x in zip((overheads or Overheads()).terms(), features, strict=True))
    comm = sum(c.end_s - c.start_s for c in log) / round_steps
    return StepPrediction(strategy, world_size, F, B, O, step + overhead, comm, step + overhead - inner, log, accum,
                          features, overhead)
