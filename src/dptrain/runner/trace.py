"""A Chrome-trace timeline of a few training steps on every rank, merged into one file.

The file is the Trace Event Format (``{"traceEvents": [...]}``) that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open. Each rank is a process (``pid`` = rank);
on its ``compute`` track are the step, and inside it each micro-step's forward and
backward, the wait for gradients after backward (exposed communication) and the
optimizer step; each gradient bucket's all-reduce is a span on a track of its own
(``bucket k``), from launch to completion. Overlap is then visible at a glance: bucket
spans that lie under the backward span were hidden; the ``wait for gradients`` span is
what was not. Under ZeRO each unit has a track (``unit k``) with its all-gathers and
reduce-scatters, and every wait of the training thread for one is a ``wait for ...`` span
on the compute track, inside the forward or backward that waited: those are its exposed
communication.

Clocks (``trace_zero``): on one machine every process reads the same monotonic clock
(``time.perf_counter``), so all ranks take rank 0's zero and line up exactly. Across
machines each rank takes its own zero on leaving a barrier, so ranks line up to within
the barrier's exit skew (between local processes, 2 ranks on 2 cores: 0.1-0.2 ms median,
2-3 ms worst of 50, ``docs/repro/barrier_skew.py``; expect more over a network). Recording costs a list
append per span; only steps ``[trace_start, trace_start + trace_steps)`` are recorded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.runner.metrics import StepTimes
from dptrain.utils.atomic import write_text_atomic

__all__ = ["TraceRecorder", "trace_zero"]

_COMPUTE_TID = 0
_BUCKET_TID0 = 10


def trace_zero(single_host: bool, device: torch.device) -> float:
    """Collective: this rank's ``perf_counter`` reading that the trace calls time zero."""
    dist.barrier()
    zero = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
    if single_host:  # one clock for all: rank 0's zero is everyone's
        dist.broadcast(zero, src=0)
    return float(zero.item())


class TraceRecorder:
    def __init__(self, rank: int, t0: float, first_step: int, num_steps: int):
        self.rank, self.t0 = rank, t0
        self.steps = range(first_step, first_step + num_steps)
        self.events: list[dict] = []
        self._tracks: dict[int, str] = {}  # a collective track's tid -> its name

    def wants(self, step: int) -> bool:
        return step in self.steps

    def add_step(self, step: int, times: StepTimes) -> None:
        """Record optimizer step ``step`` (1-based) from its measured spans."""
        self._span(f"step {step}", "step", times.start, times.end, _COMPUTE_TID)
        for k, (fwd, bwd) in enumerate(zip(times.forward, times.backward, strict=True)):
            self._span("forward", "compute", *fwd, _COMPUTE_TID, micro_step=k)
            comm = times.comm if k == len(times.backward) - 1 else None
            if comm is not None and comm.calls and comm.backward_end > 0:
                self._span("backward", "compute", bwd[0], comm.backward_end, _COMPUTE_TID, micro_step=k)
                self._span("wait for gradients", "comm", comm.backward_end, bwd[1], _COMPUTE_TID,
                           exposed_ms=round(1e3 * (bwd[1] - comm.backward_end), 3))
                self._collectives(comm, bwd[1])
            else:
                self._span("backward (no sync)" if comm is None else "backward", "compute", *bwd,
                           _COMPUTE_TID, micro_step=k)
        self._span("optimizer", "compute", *times.optimizer, _COMPUTE_TID)

    def _collectives(self, comm, end: float) -> None:
        """Each collective of the step on its track; ZeRO's waits for them on the compute track."""
        sharded = hasattr(comm, "span_name")  # zero.timing.ShardedStepComm: every unit's collectives
        names = {}
        for i, ((index, launch, done), nbytes) in enumerate(zip(comm.bucket_spans, comm.bucket_bytes, strict=True)):
            name = comm.span_name(i) if sharded else f"all-reduce bucket {index}"
            names[id(comm.bucket_spans[i])] = name
            tid = _BUCKET_TID0 + index
            self._tracks[tid] = f"unit {index}" if sharded else f"bucket {index} ({nbytes / 2**20:.2f} MiB)"
            self._span(name, "comm", launch, done if done else end, tid, bytes=nbytes)
        for span, start, stop in getattr(comm, "waits", ()):
            self._span(f"wait for {names.get(id(span), 'a collective')}", "comm", start, stop, _COMPUTE_TID)

    def add_ps_step(self, step: int, start: float, micro: list[tuple[float, float, float]], end: float) -> None:
        """A parameter-server worker's step: each micro-step's forward and backward, then push and wait."""
        self._span(f"step {step}", "step", start, end, _COMPUTE_TID)
        for k, (f0, b0, b1) in enumerate(micro):
            self._span("forward", "compute", f0, b0, _COMPUTE_TID, micro_step=k)
            self._span("backward", "compute", b0, b1, _COMPUTE_TID, micro_step=k)
        self._span("push gradient, wait for parameters", "comm", micro[-1][2], end, _COMPUTE_TID)

    def write_local(self, path: Path) -> None:
        """This rank's events alone (no collective: under the parameter server ranks do not meet)."""
        write_text_atomic(path, json.dumps({"traceEvents": self._metadata() + self.events, "displayTimeUnit": "ms"}))

    def _span(self, name: str, cat: str, start: float, end: float, tid: int, **args) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": round(1e6 * (start - self.t0), 3), "dur": round(1e6 * max(0.0, end - start), 3),
                            "args": args})

    def _metadata(self) -> list[dict]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": _COMPUTE_TID,
                 "args": {"name": "compute"}}]
        for tid, name in sorted(self._tracks.items()):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
        return meta

    def write_merged(self, path: Path) -> bool:
        """Collective: gather every rank's events; rank 0 writes ``path``. True on rank 0."""
        mine = self._metadata() + self.events
        world = dist.get_world_size() if dist.is_initialized() else 1
        gathered: list = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if self.rank != 0:
            return False
        events = [e for rank_events in gathered for e in rank_events]
        write_text_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return True
