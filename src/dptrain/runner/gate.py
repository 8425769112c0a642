"""The step gate: what the one training loop (:mod:`dptrain.runner.loop`) asks before and after every step.

The loop is the same whatever keeps the job together. Before each attempt at a step it asks
the gate for a :class:`Turn` (the step, and this rank's micro-batches for it, or None when
this rank sits the attempt out); after the backward it asks whether to **commit** (step the
optimizer) or **drop** the window; then it tells the gate what was decided. The gate also
says how the run starts (resumed, seeded, or joined) and which ranks take part in its
outputs (metrics, evaluation, checkpoints, final weights).

:class:`StaticGate` is the job as torch.distributed makes it: every rank in one process
group, every step taken by all, always committed, the data each rank's shard of the
sampler's order. Its cost is nothing: no call it makes communicates. Live recovery's gate
(:class:`dptrain.runner.live_gate.LiveGate`) forms a quorum per attempt, heals the members
behind, hands each member its slice of one sample stream, and commits by vote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dptrain.api.engine import Engine
from dptrain.checkpoint.resume import resume, seed_everything
from dptrain.checkpoint.run_state import Part, resume_parts, run_state
from dptrain.data.balance import DynamicBatcher
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv
from dptrain.runner.build import build_batches
from dptrain.runner.facts import RunFacts
from dptrain.runner.metrics import StepTimes
from dptrain.runner.plan import RunPlan
from dptrain.runner.roll_call import is_collective_failure, roll_call

__all__ = ["Turn", "Start", "StaticGate", "resume_or_seed"]


@dataclass
class Turn:
    """One attempt at ``step`` (1-based): this rank's micro-batches for it, or None to sit it out and vote no."""

    step: int
    batches: Iterator[Any] | None
    weighted: bool = False  # each item a step's [(micro-batch, loss weight)] (dynamic batching)
    attempt: Any = None     # the gate's own record of the attempt (live recovery's round)


@dataclass
class Start:
    """How the run starts on this rank: the steps already done, what to say about it, and from which step the
    metrics records are kept (records after it are written again)."""

    step: int
    note: str | None = None
    records_from: int = 0
    lines: list[str] = field(default_factory=list)  # more for the log's head
    over: str | None = None  # the run ended before this rank started (said, then nothing is done)


class StaticGate:
    """Every rank, every step, always committed (see the module docstring)."""

    replica_local = False  # the ranks share one process group: every rank's hooks meet in its collectives
    checkpoint_meta: Callable[[], dict] | None = None  # more for a checkpoint's meta.json
    record: Callable[[], dict] | None = None  # more for each metrics record

    def __init__(self, rp: RunPlan, env: WorkerEnv, engine: Engine, compression, beat: Heartbeat,
                 prepared: object = None):
        self.rp, self.env, self.engine, self.compression = rp, env, engine, compression
        self.parts = run_state(engine, compression, rp.cfg.distributed.strategy)  # checkpoints, resume, the heal
        self.batches: Iterator[Any] | None = None
        self.batcher: DynamicBatcher | None = None
        self.start_step = 0

    @classmethod
    def prepare(cls, rp: RunPlan, env: WorkerEnv) -> object:
        """Before the engine is built: what the gate must set up first, given to its constructor (nothing here)."""
        return None

    @classmethod
    def guard(cls, rp: RunPlan) -> contextlib.AbstractContextManager:
        """Around the whole run: what the gate's failures mean (nothing to add here)."""
        return contextlib.nullcontext()

    @property
    def outputs(self) -> bool:
        """Whether this rank takes part in the run's outputs: every rank (they are collectives)."""
        return True

    def start(self) -> Start:
        """Resume from the run's checkpoint or seed this rank; the data from the step it starts at."""
        step, note = resume_or_seed(self.rp, self.env, self.engine, self.parts)
        self.start_step = step
        self.batches, self.batcher = build_batches(self.rp, self.env.rank, self.engine, step)
        return Start(step, note, records_from=step)

    def turns(self, say: Callable[[str], None]) -> Iterator[Turn]:
        """Every step from the start on, each by the whole job (``say``: a line for the log, unused here)."""
        weighted = self.batcher is not None
        for step in range(self.start_step + 1, self.rp.cfg.train.steps + 1):
            yield Turn(step, self.batches, weighted)

    def decide(self, turn: Turn, times: StepTimes | None) -> bool:
        return True

    def settle(self, turn: Turn, committed: bool) -> None:
        pass

    def failed(self, error: Exception, step: int) -> None:
        """After a failed collective, ask which ranks still answer: the error's note names the silent ones."""
        if self.env.world_size > 1 and is_collective_failure(error):
            call = roll_call(step, self.rp.cfg.distributed.roll_call_s)
            error.add_note(call.note)
            error.silent_ranks = call.silent  # recorded for the local launcher, which then stops them at once

    def finish(self) -> None:
        """After the last step, before the hooks' end."""

    def stop(self) -> None:
        """Always, after the hooks are closed."""

    def done(self, facts: RunFacts | None) -> RunFacts | None:
        """After the final weights: the run's facts, with what the gate adds."""
        return facts


def resume_or_seed(rp: RunPlan, env: WorkerEnv, engine: Engine, parts: list[Part]) -> tuple[int, str | None]:
    """The step to start from, and what to say about the parts of the checkpoint this run cannot use.

    Ranks draw different dropout masks; a resumed run continues its saved RNG streams.
    """
    if rp.resume_from is None:
        seed_everything(rp.cfg.train.seed + 1 + env.rank)
        return 0, None
    path, strategy = rp.resume_from, rp.cfg.distributed.strategy
    start_step = resume(engine, path, env.rank, engine.device)
    notes = resume_parts(parts, path, env.rank, env.world_size, strategy, engine.device)
    return start_step, "; ".join(notes) or None

