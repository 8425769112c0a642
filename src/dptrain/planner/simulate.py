"""Step time of data-parallel training, simulated bucket by bucket on a network.

The simulator replays one optimizer step on a timeline with two resources: the
device, which computes forward, backward and the optimizer step in order, and the
link, which runs one collective at a time in the order they were launched (one
process group, one communication stream). Each collective's duration is the α-β(-γ)
cost of its algorithm (:func:`dptrain.comm.cost.collective_cost`, the model the
collectives' benchmark checks) on the network's links: inside one host the ``node``
link, across hosts the ``net`` link (or both tiers for ``hierarchical``).

- **DDP**: a bucket's all-reduce is launched when the last of its parameters'
  gradients is ready during backward (the compute profile says when), and starts when
  the link is free. What runs past the end of backward is *exposed*; the optimizer
  steps after the last bucket. A bucket larger than the model launches only at the end
  of backward: nothing overlaps.
- **ZeRO-1/2**: the same with reduce-scatters, and every unit's all-gather at the start
  of the next forward, before it (dptrain does not overlap those).
- **ZeRO-3**: the root unit and the first unit are gathered before forward starts;
  each unit's all-gather is launched when the previous unit starts computing
  (prefetch), in forward and, for units that reshard, again in backward; each unit's
  reduce-scatter is launched when its backward ends.
- Every ZeRO stage keeps one reduce-scatter in flight (``ReductionQueue(1)``): before
  launching one it waits for the previous, holding compute back; except ZeRO-1 without
  hybrid sharding that accumulates in its own buffer (``Setup.accumulates_in_place``),
  whose reduce-scatters all queue on the link as they are launched. The optimizer steps
  only this rank's shard (the profile's optimizer time over the shard group's size).
- **Hybrid sharding** (``Setup.shard_size``): gathers and reduce-scatters run over the
  shard group, on the link inside a host while the group fits in one; when a unit's
  reduce-scatter has been waited for, its shard's all-reduce over the replicate group
  starts on a second link (that group's own process group and thread), across hosts.
  Where a host's ranks share one link to the others (``Network.shared_net``), their
  concurrent all-reduces divide its bandwidth. Where the shard group spans hosts, both
  groups' collectives leave a rank over its host's one link: the step is also replayed
  with one clock for both, and a fitted share of what it gains is added
  (``Overheads.shared_wire``).

- **Gradient accumulation** (``accum``): the micro-steps before the last compute without
  reducing (``no_sync``); ZeRO-3 still gathers its units in each of them; ZeRO-1/2
  gather once, before the first.
- **What the link's α-β cost leaves out** (:class:`Overheads`, fitted on the machine at
  hand by :func:`dptrain.planner.calibration.fit_overheads`): a fixed time per step (the
  end-of-backward bookkeeping), per DDP bucket, per ZeRO-1/2 bucket and per ZeRO-3 unit
  collective (the work on the compute thread around each collective: launch, wait,
  copies), per micro-step that accumulates without reducing (and per byte it adds into
  a buffer of the engine's own), per bucket a gradient codec reduces (and per byte it
  encodes), per byte on the network (that crosses hosts; on one host, every collective's),
  and the computation slowed by the bytes communicated beside it (gloo's TCP copies take
  the cores compute runs on). Added to the step after the timeline; zero by default.

Compute comes from a :class:`ComputeProfile`: measured on the real model
(:func:`measure_profile`: forward, backward and optimizer times, and when each
parameter's gradient is ready) or derived from FLOPs and a device throughput
(:func:`flops_profile`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from dptrain.comm.collectives import native_scatter_is_all_reduce
from dptrain.comm.cost import Link, collective_cost
from dptrain.planner.layout import Setup, Unit, units
from dptrain.planner.network import Network
from dptrain.planner.timeline import Collective, LinkClock, replay

__all__ = ["ComputeProfile", "measure_profile", "flops_profile", "Collective", "StepPrediction", "Overheads",
           "simulate_step"]


@dataclass(frozen=True)
class ComputeProfile:
    """One micro-batch's compute on one device: seconds, and when each gradient is ready.

    ``ready[name]``: the fraction of backward's time at which parameter ``name``'s
    gradient is complete (0 = backward's start, 1 = its end).
    """

    forward_s: float
    backward_s: float
    optimizer_s: float
    ready: dict[str, float]
    source: str


def measure_profile(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                    optimizer: torch.optim.Optimizer, steps: int = 6, warmup: int = 2) -> ComputeProfile:
    """Time ``steps`` single-device steps of the real model (medians), after ``warmup``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    arrived: dict[str, float] = {}
    handles = [p.register_post_accumulate_grad_hook(lambda _, name=n: arrived.__setitem__(name, time.perf_counter()))
               for n, p in named]
    fwd, bwd, opt, ready = [], [], [], {n: [] for n, _ in named}
    try:
        for step in range(warmup + steps):
            optimizer.zero_grad(set_to_none=True)
            arrived.clear()
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            if step >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt.append(t3 - t2)
                for name in ready:
                    if name in arrived:
                        ready[name].append((arrived[name] - t1) / (t2 - t1))
    finally:
        for h in handles:
            h.remove()
    return ComputeProfile(statistics.median(fwd), statistics.median(bwd), statistics.median(opt),
                          {n: statistics.median(v) if v else 1.0 for n, v in ready.items()},
                          f"measured: median of {steps} steps on this machine")


def flops_profile(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                  flops_per_s: float, optimizer_s: float = 0.0) -> ComputeProfile:
    """Forward from counted FLOPs at ``flops_per_s``, backward twice that; gradients ready in reverse order.

    Works on fake or meta tensors. A parameter's gradient is taken as ready when the
    backward has covered the parameters registered after it, in proportion to their
    element counts (for layers whose FLOPs follow their weights, as linear layers do).
    """
    from torch.utils.flop_counter import FlopCounterMode

    if not flops_per_s > 0:
        raise ValueError(f"device throughput must be > 0 FLOP/s, got {flops_per_s}")
    with FlopCounterMode(display=False) as counter:
        loss_fn(model, batch)
    forward = counter.get_total_flops() / flops_per_s
    named = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    total, done, ready = sum(k for _, k in named) or 1, 0, {}
    for name, k in reversed(named):
        done += k
        ready[name] = done / total
    return ComputeProfile(forward, 2 * forward, optimizer_s, ready,
                          f"FLOPs: {counter.get_total_flops():.3g} per forward at {flops_per_s:.3g} FLOP/s")


@dataclass(frozen=True)
class Overheads:
    """The step's time the link's α-β cost does not account for, on the compute thread (seconds).

    ``per_step_s``: once per optimizer step (the end-of-backward callback, the engine's
    bookkeeping); ``per_bucket_s``: per DDP all-reduce (its hook's launch, the wait and
    the copy back into the gradients); ``per_zero_bucket_s``: per ZeRO-1/2 collective (a
    bucket's gather or reduce-scatter: the shard copies, the hooks, the wait that holds
    compute back); ``per_zero_unit_s``: per ZeRO-3 collective (a unit's flattening,
    gather into the full buffer and release, its reduce-scatter), apart from ZeRO-1/2's
    because a unit's life is not a bucket's (docs/tune.md measured one shared term 1.12-1.17
    over at 25 MiB and 0.75-0.85 under at 1 MiB); ``contention_s_per_byte``:
    compute delayed per byte of a collective that runs while the device computes (a
    CPU backend's copies share the cores with compute; near zero where a NIC and NCCL's
    kernels do the work); ``comm_s_per_byte``: per byte of the collectives that cross
    hosts, or on one host of every collective (what the network's link costs a training
    run beyond what its probe's timed collectives cost: the copies into and out of the
    buckets and flat buffers, a CPU backend's own work, the link's rate under a run's
    traffic); ``state_s_per_byte``: per
    byte of the parameters the rank steps (the step's passes over every gradient that a
    bare forward-backward-step does not make: the gradient norm for clipping and the
    divergence checks, zeroing, the engine's copies); ``compute_slowdown``: the share by
    which a training run's compute exceeds the profile's bare forward, backward and step
    (the trainer's per-step work, the data, the network stack's interrupts on a host
    whose cores compute: 1-49% in docs/tune.md's probe runs); ``per_micro_step_s``: per
    micro-step that accumulates without reducing (``no_sync``: the loader, the engine's
    and the hooks' work a micro-step repeats); ``micro_step_s_per_byte``: per byte of the
    gradients an engine accumulates in such a micro-step into a buffer of its own (ZeRO-2/3
    add each micro-step's full local gradients into one, and ZeRO-1 when it reduces in
    another dtype than it computes in: a pass over the model's bytes a bare backward does
    not make; DDP and fp32 ZeRO-1 let autograd accumulate in place, as the bare model
    does); ``per_coded_bucket_s``: per DDP bucket a gradient codec reduces (its hand-off to
    the codec's own process group and thread, the copy of the result back into the bucket),
    beside ``per_bucket_s``; ``coded_s_per_byte``: per byte of those buckets before encoding
    (the passes a codec makes over each bucket: the division, the cast, error feedback's
    residual; docs/tune.md measured DDP with bf16 at 1 MiB buckets 0.69-0.83 of its
    measured step with neither); ``shared_wire``: the share of the seconds hybrid sharding's step would gain
    if its replica all-reduces and its shard group's collectives took turns on one link, where the shard group
    spans hosts and both leave a rank over its host's one link (the timeline gives each group a link of its own;
    1 where the wire paces both, 0 where neither waits for the other: on 4 emulated hosts of 1 rank hybrid
    ZeRO-1/2 at 100 Mbit/s stepped in the time of plain ZeRO's, the same bytes on each host's link, and one
    calibration predicted 0.83-1.02 of it with this term at zero, 0.93-0.97 with it fitted at 0.96; at 1 Gbit/s
    the two groups overlapped and it was fitted at 0.41: docs/tune.md, the thirteenth pass). The per-collective
    terms count the shard group's collectives (a group inside one host smaller than the world's each by its ring
    rounds' share, ``_rounds_share``); hybrid sharding's
    replica all-reduces, launched on a thread of their own, count by their bytes. Fitted by
    :func:`dptrain.planner.calibration.fit_overheads`.
    """

    per_step_s: float = 0.0
    per_bucket_s: float = 0.0
    per_zero_bucket_s: float = 0.0
    per_zero_unit_s: float = 0.0
    contention_s_per_byte: float = 0.0
    comm_s_per_byte: float = 0.0
    state_s_per_byte: float = 0.0
    compute_slowdown: float = 0.0
    per_micro_step_s: float = 0.0
    micro_step_s_per_byte: float = 0.0
    per_coded_bucket_s: float = 0.0
    coded_s_per_byte: float = 0.0
    shared_wire: float = 0.0

    def terms(self) -> tuple[float, ...]:
        """The terms' values, in the fields' order (what :attr:`StepPrediction.features` multiplies)."""
        return tuple(getattr(self, name) for name in self.names())

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The terms' field names, in :meth:`terms`' order."""
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class StepPrediction:
    """One step's predicted timeline (seconds from the start of forward)."""

    strategy: str
    world_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float
    comm_s: float  # the link's busy time
    exposed_s: float  # step time beyond compute alone
    collectives: list[Collective] = field(repr=False)
    accum: int = 1  # micro-steps per step: forward_s and backward_s are per micro-step
    features: tuple[float, ...] = (0.0,) * 13  # what Overheads' terms multiply
    overhead_s: float = 0.0  # the Overheads' share of step_s

    @property
    def compute_s(self) -> float:
        return self.accum * (self.forward_s + self.backward_s) + self.optimizer_s


def simulate_step(model: nn.Module, setup: Setup, profile: ComputeProfile, network: Network,
                  algorithm: str = "ring", overlap: bool = True, compression: int = 1, accum: int = 1,
                  overheads: Overheads | None = None) -> StepPrediction:
    """Predict one optimizer step of ``model`` (``accum`` micro-batches per rank) under ``setup`` on ``network``.

    ``overlap=False`` (DDP): every bucket is launched when backward ends, as an engine
    without gradient hooks would. ``compression``: gradients cross the link ``compression``
    times smaller (DDP: each bucket's all-reduce carries ceil(numel / compression)
    elements); encoding and decoding are charged by the overheads' codec terms. ``overheads``: the calibrated
    terms added to the timeline's step (:class:`Overheads`).
    """
    if not isinstance(compression, int) or compression < 1:
        raise ValueError(f"compression must be a positive integer ratio, got {compression!r}")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum must be a positive number of micro-steps, got {accum!r}")
    if setup.stage and (compression != 1 or not overlap):
        raise ValueError("overlap=False and compression apply to DDP (strategy 'ddp'); ZeRO's schedule is fixed")
    shapes = units(model, setup)
    F, B = profile.forward_s, profile.backward_s
    O = profile.optimizer_s / (setup.shards if setup.stage else 1)  # ZeRO steps this rank's shard

    def ready(unit: Unit) -> float:
        return max((profile.ready.get(name, 1.0) for name in unit.names), default=1.0)

    def links(one_wire: bool) -> tuple[LinkClock, LinkClock | None]:
        shard = LinkClock(_durations(setup, network, algorithm, setup.shards, shard=True, compression=compression))
        return shard, LinkClock(_durations(setup, network, algorithm, setup.replicas, shard=False),
                                wire=shard if one_wire else None) if setup.replicas > 1 else None

    def step_end(t: float, *clocks: LinkClock | None) -> float:
        return max(t, *(c.free for c in clocks if c is not None)) + O

    shard_link, replica_link = links(one_wire=False)
    t, windows = replay(shapes, setup, F, B, ready, shard_link, replica_link, accum, overlap)
    step, turns = step_end(t, shard_link, replica_link), 0.0
    if replica_link is not None and network.hosts(setup.shards) > 1:  # both groups leave a rank over one link
        shared = links(one_wire=True)
        turns = step_end(replay(shapes, setup, F, B, ready, *shared, accum, overlap)[0], *shared) - step
    log = sorted((c for link in (shard_link, replica_link) if link is not None for c in link.log),
                 key=lambda c: c.start_s)
    comm = sum(c.end_s - c.start_s for c in log)
    full = sum(u.numel * u.dtype.itemsize for u in shapes)
    own_buffer = setup.stage >= 2 or (setup.stage == 1 and not setup.accumulates_in_place)
    features = _features(log, len(shard_link.log) * _rounds_share(setup, network), windows, setup.stage,
                         full / (setup.shards if setup.stage else 1),
                         accum * (F + B) + O, accum, full if own_buffer else 0.0,
                         full if compression > 1 else 0.0,  # a codec encodes and decodes even alone
                         network_bytes=_network_bytes(setup, network, shard_link, replica_link), turns=turns)
    overhead = sum(k * x for k, x in zip((overheads or Overheads()).terms(), features, strict=True))
    return StepPrediction(setup.strategy, setup.world_size, F, B, O, step + overhead, comm,
                          step + overhead - (accum * (F + B) + O), log, accum, features, overhead)


def _rounds_share(setup: Setup, network: Network) -> float:
    """What one of the shard group's collectives counts for in the per-collective terms: 1, or where a smaller
    group than the world's is inside one host (hybrid sharding's pairs on 2 hosts x 2 ranks), its ring rounds
    against the world's, ``(g - 1) / (N - 1)``.

    The per-collective terms are fitted to probes whose collectives mostly span the world. On the emulated
    2 x 2 cluster hybrid sharding's groups were over-predicted (by up to 19% at 10 Gbit/s, 43% at 1) while
    charged a whole world's collective each; charged their rounds' share, the mean error of each of ten calibrations over three link
    rates fell (docs/tune.md, the tenth pass). A group of 2 spanning two hosts (4 x 1) is
    charged in full: scaled there too, the predictions got worse (the sixth pass), so the share follows
    where the group runs, not only its size.
    """
    g, n = setup.shards, setup.world_size
    if g < n and network.hosts(g) == 1:
        return (g - 1) / (n - 1)
    return 1.0


def _network_bytes(setup: Setup, network: Network, shard_link: LinkClock, replica_link: LinkClock | None) -> float:
    """The bytes of this rank's collectives that cross hosts: the shard group's where it spans several hosts,
    hybrid sharding's replica all-reduces (their ranks a shard group apart, spanning the hosts); on one host,
    every collective's (its one link is the job's network). Bytes as :class:`Collective` counts them: the rank's
    buffer, not what the wire carries.

    What ``comm_s_per_byte`` multiplies. Charged per byte of every collective, hybrid sharding on the emulated
    2 x 2 cluster at 100 Mbit/s was over-predicted in every row (1.02-1.27 in six calibrations), plain ZeRO under:
    the fitted term (3 ns a byte) was mostly the cross-host link's rate in training runs below the link probe's
    fit (0.90-0.97 of the line against 0.995, ``docs/repro/cross_host_flows.py``), and hybrid sharding's buffers
    inside a host, four times its buffer across, paid it too. Charged so, the six calibrations' mean errors fell
    from 3.7-8.0% to 1.6-2.0% (docs/tune.md, the twelfth pass).
    """
    one_host = network.hosts(setup.world_size) == 1
    links = [replica_link] + ([shard_link] if one_host or network.hosts(setup.shards) > 1 else [])
    return float(sum(c.nbytes for link in links if link is not None for c in link.log))


def _features(log: list[Collective], calls: float, windows: list[tuple[float, float]], stage: int,
              stepped_bytes: float, compute_s: float, accum: int = 1,
              accumulated_bytes: float = 0.0, coded_bytes: float = 0.0, *, network_bytes: float,
              turns: float = 0.0) -> tuple[float, ...]:
    """What :class:`Overheads`' terms multiply: 1 step; ``calls``, the collectives of the shard group (DDP's
    all-reduces, ZeRO-1/2's or ZeRO-3's gathers and reduce-scatters, each counted by :func:`_rounds_share`; hybrid
    sharding's replica all-reduces run on a thread of their own and count only by their bytes); the bytes of collectives while the device computes (each
    collective's bytes times the share of its time inside a window); the bytes that cross hosts (``network_bytes``,
    :func:`_network_bytes`); the bytes of the
    parameters this rank steps; the profile's compute seconds; the micro-steps that accumulate without reducing,
    and the bytes an engine accumulates in them into a buffer of its own (``accumulated_bytes`` each); the buckets a
    codec reduces and their bytes before encoding (``coded_bytes``: none without a codec); ``turns``, the seconds
    the step would gain if hybrid sharding's two groups took turns on one link (none but where the shard group
    spans hosts)."""
    overlapped = 0.0
    for c in log:
        span = c.end_s - c.start_s
        if span > 0:
            inside = sum(max(0.0, min(c.end_s, hi) - max(c.start_s, lo)) for lo, hi in windows)
            overlapped += c.nbytes * inside / span
    count = float(calls)
    return (1.0, count if stage == 0 else 0.0, count if stage in (1, 2) else 0.0, count if stage == 3 else 0.0,
            overlapped, float(network_bytes), float(stepped_bytes), float(compute_s),
            float(accum - 1), float((accum - 1) * accumulated_bytes),
            count if coded_bytes else 0.0, float(coded_bytes), float(turns))


def _durations(setup: Setup, network: Network, algorithm: str, ranks: int, shard: bool,
               compression: int = 1) -> Callable[[str, Unit], float]:
    """A collective's duration on one group: the shard group (ZeRO's gathers and reduce-scatters, DDP's
    all-reduces) or, with hybrid sharding, the replicate group (each unit's largest shard all-reduced).

    The shard group's ranks are consecutive: inside one host while it fits there. The
    replicate group's ranks are a shard group apart, on different hosts; every rank of a
    host runs its own replica all-reduce at once, so where the hosts' devices share one
    ``net`` link (``network.shared_net``) they divide its bandwidth.
    """
    hosts = network.hosts(ranks * (1 if shard else setup.shards))
    if not shard and network.shared_net:
        flows = min(setup.shards, network.per_node)
        net = Link(network.net.alpha, network.net.beta / flows, network.net.gamma, duplex=network.net.duplex)
    else:
        net = network.net
    if algorithm == "hierarchical" and shard:
        links, nodes = {"node": network.node, "net": net}, min(ranks, network.per_node)
    else:
        links, nodes = {"net": net if hosts > 1 else network.node}, None
        algorithm = "ring" if algorithm == "hierarchical" else algorithm

    mixed = setup.compute_dtype is not None

    def duration(kind: str, unit: Unit) -> tuple[float, int]:
        if ranks == 1:
            return 0.0, 0
        dtype, numel = unit.dtype, -(-unit.numel // compression)
        if kind == "all_gather" and mixed:
            dtype = setup.compute_dtype
        elif kind == "reduce_scatter":
            dtype = setup.reduce_dtype if mixed else dtype
            if algorithm == "native" and native_scatter_is_all_reduce(network.backend, numel, ranks):
                kind = "all_reduce"  # gloo's, and any with uneven shards (ZeRO consumes its input)
        if not shard:  # the reduced shard: the largest of the shard group's
            dtype, numel = setup.reduce_dtype if mixed else dtype, -(-unit.numel // setup.shards)
        seconds = collective_cost(kind, algorithm, numel, dtype.itemsize, ranks, nodes=nodes).predict(links)
        return seconds, numel * dtype.itemsize

    return duration
