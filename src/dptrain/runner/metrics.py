"""Per-step measurements: where a data-parallel step's time goes, and what it moved.

For each optimizer step every rank records wall-clock spans (forward, backward, the
optimizer) and the engine's communication statistics for the step (``last_step_comm``: the
DDP engine's buckets; ZeRO's all-gathers and reduce-scatters, :mod:`dptrain.zero.timing`):

- **compute ms**: forward + backward + optimizer time, less the communication that was
  left exposed (the end-of-backward wait is inside ``loss.backward()``);
- **exposed comm ms**: the part of communication that overlap did not hide: DDP's wait for
  gradients after the last one was computed; ZeRO's waits for its collectives, in forward
  and backward alike; and all of what an optimizer communicates inside its own step
  (``optimizer.step_comm``, an :class:`~dptrain.comm.step_stats.InStepComm`: 1-bit Adam's
  momentum all-reduce with its encoding and decoding, after backward, so nothing hides it);
- **tail comm ms** (DDP): the cost model's floor on the exposed time: the bytes of the reductions
  launched after backward ended, at the step's measured rate (bytes over busy time); exposed
  time beyond it could have been hidden behind backward;
- **comm busy ms**: the time at least one collective was in flight;
- **overlap %**: the fraction of that busy time that computation hid (DDP: that ran while
  backward was still computing);
- **comm bytes**: bytes this rank put into all-reduces for the step, and the bytes it
  sent for them (by the cost model of the collective it ran: ``comm.sent_bytes``); with
  compression, the payload it encoded and the bytes sent as the compressor counts them (a
  hook's or the optimizer's: 1-bit Adam's fp32 all-reduces in its warm-up, payload 0, then
  its momentum in 1 bit).

At logging steps the ranks exchange one small vector (an ``all_gather``), so rank 0 can
report the loss averaged over all ranks, the slowest rank's timings, and each rank's peak
memory, two ways: the process's peak resident set (``peak_rss_mb``: libraries and the
allocator's cache included) and the peak of live tensor bytes (``peak_tensor_mb``, what
``dptrain plan`` predicts: ``max_memory_allocated`` on CUDA; on CPU one step measured by
:class:`~dptrain.runner.tensor_peak.TensorPeak`, null until then). Between logging steps
nothing extra is communicated. A record's means are over the steps since the previous record.

A strategy that meets every few steps instead of every step (local SGD's averages,
DiLoCo's outer steps) reports what it sent in its wrapper's ``step_metrics()``, per step
over the record's steps (so a line without a meeting says 0, the next one H times the
average), and describes its meetings in fields every such strategy shares, so that the
lines and the report say what it did without asking which strategy ran:

- ``sync_name``: what one meeting is called ("outer step", "averaging round");
- ``sync_period``: H, the steps from one to the next; ``syncs``: how many the run has taken
  so far; ``steps_since_sync``: the steps since the last; where the model meets a fragment
  at a time (Streaming DiLoCo), ``sync_fragments`` (P: a fragment every ``sync_period``
  steps) and ``sync_peak_sent_bytes`` (the most one meeting sent);
- ``gradient_bytes``: what DDP's all-reduce of the gradients would reduce every step (the
  trainable parameters' bytes), and ``gradient_sent_bytes``: what a rank would send for it.

:func:`run_comm_per_step` is the run's bytes per step (each record standing for the steps
since the previous one), :func:`run_sync_steps` the steps its meetings were at.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dptrain.comm.step_stats import InStepComm, StepCommStats
from dptrain.utils.process import peak_rss_mb

__all__ = ["StepTimes", "StepRecorder", "peak_rss_mb", "peak_tensor_mb", "format_line", "run_comm_per_step",
           "sync_steps", "run_sync_steps"]

COMM_KEYS = ("comm_bytes_per_step", "comm_compressed_bytes_per_step", "comm_sent_bytes_per_step")

# Per-rank values exchanged at a logging step, in this order.
_GATHERED = ("loss", "step_ms", "compute_ms", "exposed_comm_ms", "tail_comm_ms", "comm_busy_ms", "overlap",
             "comm_bytes", "comm_payload_bytes", "comm_wire_bytes", "peak_rss_mb", "peak_tensor_mb")


@dataclass
class StepTimes:
    """One rank's spans for one optimizer step, in ``time.perf_counter()`` seconds.

    Its communication is the engine's (``comm``: the buckets reduced in backward) and, for an
    optimizer that averages something inside its own step (1-bit Adam's momentum after the
    freeze), that optimizer's ``in_step_comm``: it runs after backward, so all of it is exposed.
    """

    start: float = 0.0
    end: float = 0.0
    forward: list[tuple[float, float]] = field(default_factory=list)   # one per micro-step
    backward: list[tuple[float, float]] = field(default_factory=list)
    optimizer: tuple[float, float] = (0.0, 0.0)
    comm: StepCommStats | None = None  # the synced backward's statistics
    in_step_comm: InStepComm | None = None  # what optimizer.step() communicated itself (its ``step_comm``)
    compressed: dict | None = None  # the compression's bytes of the step (dptrain.compress: hook or optimizer)

    @property
    def communicated(self) -> bool:
        """Whether the step communicated at all (a step without, e.g. gossip's, is left out of the means)."""
        return bool(self.comm and self.comm.calls) or self.in_step_comm is not None

    @property
    def exposed_comm_s(self) -> float:
        engine = max(0.0, self.comm.exposed_comm_s) if self.comm and self.comm.calls else 0.0
        return engine + self._in_step_s

    @property
    def tail_comm_s(self) -> float:
        """The engine's floor on its exposed time, plus the optimizer's own communication (all of it is)."""
        return (self.comm.tail_comm_s if self.comm else 0.0) + self._in_step_s

    @property
    def comm_busy_s(self) -> float:
        return (self.comm.comm_busy_s if self.comm else 0.0) + self._in_step_s

    @property
    def overlap(self) -> float:
        """The engine's hidden share of the step's busy communication time (the optimizer's own hides nothing)."""
        busy = self.comm_busy_s
        return self.comm.overlap * self.comm.comm_busy_s / busy if self.comm and busy > 0 else 0.0

    @property
    def _in_step_s(self) -> float:
        return self.in_step_comm.seconds if self.in_step_comm is not None else 0.0

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sent for the step's gradient reduction: the compression's count, else the engine's."""
        if self.compressed:
            return self.compressed["sent_bytes"]
        return self.comm.sent_bytes if self.comm is not None else 0

    @property
    def compute_s(self) -> float:
        spans = self.forward + self.backward + [self.optimizer]
        return sum(e - s for s, e in spans) - self.exposed_comm_s


def peak_tensor_mb(device: torch.device, measured_bytes: int | None) -> float | None:
    """Peak live tensor MiB: CUDA's allocator count, else what a :class:`TensorPeak` measured (None: not yet)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None if measured_bytes is None else measured_bytes / 2**20


class StepRecorder:
    """Accumulates steps between logging points and turns them into one metrics record."""

    def __init__(self, device: torch.device, global_batch_size: int, tokens_per_sample: int):
        self.device = device
        self.global_batch_size = global_batch_size
        self.tokens_per_sample = tokens_per_sample
        self._times: list[StepTimes] = []
        self.tensor_peak_bytes: int | None = None  # set by the trainer once a step was measured (CPU)

    def add(self, times: StepTimes) -> None:
        self._times.append(times)

    def record(self, step: int, loss: float, lr: float, grad_norm: float, skipped: int) -> dict:
        """Collective: every rank calls it at the same step. Returns the record (rank 0's is complete)."""
        times, self._times = self._times, []
        mean = (lambda xs: statistics.fmean(xs) if xs else 0.0)
        comms = [t for t in times if t.communicated]
        local = {
            "loss": loss,
            "step_ms": 1e3 * mean([t.end - t.start for t in times]),
            "compute_ms": 1e3 * mean([t.compute_s for t in times]),
            "exposed_comm_ms": 1e3 * mean([t.exposed_comm_s for t in times]),
            "tail_comm_ms": 1e3 * mean([t.tail_comm_s for t in comms]),
            "comm_busy_ms": 1e3 * mean([t.comm_busy_s for t in comms]),
            "overlap": mean([t.overlap for t in comms]),
            "comm_bytes": mean([t.comm.bytes for t in comms if t.comm is not None and t.comm.calls]),
            "comm_payload_bytes": mean([t.compressed["payload_bytes"] for t in times if t.compressed]),
            "comm_wire_bytes": mean([t.sent_bytes for t in times]),
            "peak_rss_mb": peak_rss_mb(),
            "peak_tensor_mb": _nan_if_none(peak_tensor_mb(self.device, self.tensor_peak_bytes)),
        }
        per_rank = _gather([local[k] for k in _GATHERED], self.device)
        column = {k: [row[i] for row in per_rank] for i, k in enumerate(_GATHERED)}
        step_s = max(column["step_ms"]) / 1e3  # the slowest rank sets the pace
        samples_per_s = self.global_batch_size / step_s if step_s > 0 else 0.0
        return {
            "kind": "train",
            "step": step,
            "loss": statistics.fmean(column["loss"]),
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped_steps": skipped,
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * self.tokens_per_sample,
            "step_ms": max(column["step_ms"]),
            "compute_ms": max(column["compute_ms"]),
            "exposed_comm_ms": max(column["exposed_comm_ms"]),
            # the cost model's floor on exposed_comm_ms: the reductions started after backward, at the step's rate
            "tail_comm_ms": max(column["tail_comm_ms"]),
            "comm_busy_ms": max(column["comm_busy_ms"]),
            "overlap_pct": 100 * statistics.fmean(column["overlap"]),
            "comm_bytes_per_step": column["comm_bytes"][0],
            # with compression: the payload a rank encodes (0 without); with or without: the bytes it sends
            "comm_compressed_bytes_per_step": column["comm_payload_bytes"][0],
            "comm_sent_bytes_per_step": column["comm_wire_bytes"][0],
            "peak_rss_mb": column["peak_rss_mb"],
            "peak_tensor_mb": [None if math.isnan(m) else m for m in column["peak_tensor_mb"]],
            # measured before the collective: a straggler shows here, not in step_ms (every rank waits for it)
            "compute_ms_per_rank": column["compute_ms"],
            "time": time.time(),
        }


def _nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


def _gather(values: list[float], device: torch.device) -> list[list[float]]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if world == 1:
        return [mine.tolist()]
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def has_tokens(tokens_per_s: float | None, samples_per_s: float | None) -> bool:
    """Whether a rate is worth showing in tokens: the task's samples are sequences of several tokens.

    Records keep ``tokens_per_s`` for every task (samples/s x the task's tokens_per_sample);
    a task without tokens (a classifier, a user dataset without ``tokens_per_sample``)
    counts one per sample, so its tokens/s equals its samples/s and is not shown.
    """
    return tokens_per_s is not None and samples_per_s is not None and tokens_per_s != samples_per_s


def run_comm_per_step(records: list[dict]) -> dict[str, float | None]:
    """Bytes per step over the run's steps up to its last record (:data:`COMM_KEYS`; None where no record has one),
    and ``steps``: each record's per-step mean stands for the steps since the previous record, so that a strategy
    that sends once every H steps is counted at what it sent over the run, not at its last record's share. (Steps
    no record measured, a crashed session's after its checkpoint, count at the next record's mean.)"""
    steps, previous = 0, 0
    totals: dict[str, float | None] = dict.fromkeys(COMM_KEYS)
    for rec in records:
        n = max(1, rec["step"] - previous)
        for key in COMM_KEYS:
            if rec.get(key) is not None:
                totals[key] = (totals[key] or 0.0) + n * rec[key]
        steps, previous = steps + n, rec["step"]
    return {"steps": steps, **{k: None if v is None else v / steps for k, v in totals.items()}}


def sync_steps(rec: dict, previous_step: int) -> list[int]:
    """The steps after ``previous_step`` (the previous record's) up to a record's at which its strategy met (the
    module docstring's ``sync_`` fields; none for a strategy that has none), earliest first: the last at ``step -
    steps_since_sync``, the others every ``sync_period`` before it, at most ``syncs`` (none before a warm-up's end)."""
    if "sync_period" not in rec or not rec["syncs"]:
        return []
    period, since, span = rec["sync_period"], rec["steps_since_sync"], rec["step"] - previous_step
    if since >= span:
        return []
    count = min(rec["syncs"], -(-(span - since) // period))
    return [rec["step"] - since - k * period for k in reversed(range(count))]


def run_sync_steps(records: list[dict]) -> list[int]:
    """Every step at which the run's strategy met, from its train records (:func:`sync_steps`)."""
    return [s for i, rec in enumerate(records) for s in sync_steps(rec, records[i - 1]["step"] if i else 0)]


def format_line(rec: dict, total_steps: int, previous_step: int | None = None) -> str:
    """One human-readable line for a train record (tokens/s only for a task with tokens); ``previous_step``: the
    previous record's (or where the session started), for a strategy that meets every few steps: which steps its
    bytes per step are the mean of, and its meetings among them."""
    mem = "/".join(f"{m:.0f}" for m in rec["peak_rss_mb"]) + " MiB resident"
    if all(m is not None for m in rec["peak_tensor_mb"]):
        mem += ", " + "/".join(f"{m:.1f}" for m in rec["peak_tensor_mb"]) + " MiB tensors"
    tokens = f"{_si(rec['tokens_per_s'])} tok/s " if has_tokens(rec.get("tokens_per_s"), rec["samples_per_s"]) else ""
    return (f"step {rec['step']:>{len(str(total_steps))}}/{total_steps} | loss {rec['loss']:.4f} | "
            f"lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f} | {tokens}"
            f"{rec['samples_per_s']:.0f} samples/s | compute {rec['compute_ms']:.1f} ms | comm "
            f"{rec['exposed_comm_ms']:.1f} ms exposed, {rec['overlap_pct']:.0f}% overlapped | "
            f"{rec['comm_bytes_per_step'] / 2**20:.2f} MiB/step{_sync(rec, previous_step)} | peak mem {mem}")


def _sync(rec: dict, previous_step: int | None) -> str:
    """The bytes sent; for a strategy that meets every few steps, which steps the bytes per step are the mean of,
    the meetings among them and how often it meets."""
    if "sync_period" not in rec or previous_step is None:
        return _sent(rec)
    period, name, steps = rec["sync_period"], rec["sync_name"], sync_steps(rec, previous_step)
    over = f", mean of steps {previous_step + 1}-{rec['step']}" if previous_step + 1 < rec["step"] else ""
    every = "every step" if period == 1 else f"every {period} steps"
    if not steps:
        since = f" since step {rec['step'] - rec['steps_since_sync']}" if rec["syncs"] else " yet"
        return f"{over}{_sent(rec)} | no {name}{since} ({every})"
    first = rec["syncs"] - len(steps) + 1
    numbers = f"{name} {first}" if len(steps) == 1 else f"{name}s {first}-{rec['syncs']}"
    at = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, ..., {steps[-1]}"
    return f"{over}{_sent(rec)} | {numbers} at step{'s' if len(steps) > 1 else ''} {at} ({every})"


def _sent(rec: dict) -> str:
    payload, sent = rec.get("comm_compressed_bytes_per_step", 0), rec.get("comm_sent_bytes_per_step", 0)
    if payload:
        return f" ({payload / 2**20:.2f} MiB compressed, {sent / 2**20:.2f} MiB sent)"
    return f" ({sent / 2**20:.2f} MiB sent)" if sent else ""


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"
