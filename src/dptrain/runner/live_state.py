"""What a replica holds under live recovery, as a heal sends it and a hash confirms it: its engine's state, the data
position, the learning-rate scale of its round, and its slice of a step's samples."""

from __future__ import annotations

import torch

from dptrain.api.engine import Engine
from dptrain.checkpoint.replicated import replica_tensors
from dptrain.checkpoint.run_state import Part
from dptrain.data.stream import SampleStream
from dptrain.live.heal import state_hash
from dptrain.live.quorum import Quorum

__all__ = ["ReplicaState", "held_tensors", "step_seed"]


def step_seed(seed: int, replica: int, step: int) -> int:
    """The seed of ``replica``'s generators at ``step``: a function of the three, so a healed worker needs none sent."""
    return (seed * 1_000_003 + replica * 7_919 + step * 104_729) % (2**31 - 1)


def held_tensors(engine: Engine, position: int) -> list[torch.Tensor]:
    """Everything a replica holds that must be equal on every survivor: parameters, buffers and the optimizer's
    state (the divergence monitor's list), the step counts and the data position."""
    model = engine.model if engine.sharded else engine.model.module  # sharded: its shards (this position's part)
    tensors = [t for _, t in replica_tensors(model, engine.optimizer)]
    return tensors + [torch.tensor([engine.step_count, engine.skipped_steps, position], dtype=torch.int64)]


class ReplicaState:
    """The engine and the committed data position of one replica (see the module docstring).

    ``replicas``: the job's workers; ``linear``: ``live.lr_scaling = "linear"`` (a round of k takes the learning
    rate times k / replicas); ``constant``: ``live.global_batch = "constant"`` (a round of k takes the whole global
    batch, each member more micro-steps: :meth:`enter`).

    Under a strategy whose replicas meet every few steps (``meeting``), a round is held only at a
    meeting, and the steps between two take their slices by the last committed round's member
    ``index`` of ``size``: the ``j``-th step since it reads from ``position + j x`` (the samples a
    step of ``size`` members takes); the position moves past them all when the next meeting
    commits (a member lost in between loses its steps' samples with its steps). The state hash
    then covers only what the replicas hold alike after a meeting (the wrapper's
    ``met_tensors()``): their optimizer states are their own. ``warmup``: the steps at the start the
    replicas take together, a round each, as without meetings.
    """

    def __init__(self, engine: Engine, stream: SampleStream, position: int, replicas: int, linear: bool,
                 constant: bool = False, meeting: bool = False, warmup: int = 0, parts: list[Part] = ()):
        self.engine, self.stream, self.position, self.parts = engine, stream, position, list(parts)
        self.replicas, self.linear, self.constant, self.meeting = replicas, linear, constant, meeting
        self.warmup = warmup  # meeting: the first steps, taken together (a round each), before they step alone
        self.index, self.size, self.since = 0, replicas, 0  # the last committed meeting's slice; steps since it
        self.sat_out = 0  # of ``since``, the steps counted but not taken (healed after the meeting: MeetingGate)
        self.scale = 1.0
        schedule = engine.lr_at
        engine.lr_at = lambda s: schedule(s) * self.scale

    def held(self) -> dict:
        """The state a heal sends: the engine's (model, optimizer, step counts), the position, and the run's parts
        that a heal sends (``parts``, :mod:`dptrain.checkpoint.run_state`: the strategy's own)."""
        return {"engine": self.engine.local_state_dict(), "position": self.position, "size": self.size,
                "since": self.since, "sat_out": self.sat_out,
                "parts": {part.name: (part.heal_state or part.state_dict)() for part in self.parts if part.heal}}

    def load(self, received: dict) -> bytes:
        """Take a healed state; the hash of what is now held. The parts a heal does not send (a worker's own, such as
        compression's residuals) start afresh, as the run's other code that holds them says (the live hook)."""
        self.engine.load_local_state_dict(received["engine"])
        for part in self.parts:
            if part.heal:
                part.load_state_dict(received["parts"][part.name])
        self.position, self.size, self.since = received["position"], received["size"], received["since"]
        self.sat_out = received.get("sat_out", 0)
        return self.hash()

    def hash(self) -> bytes:
        """The hash of what the replicas hold alike: everything (``held_tensors``) while they step together,
        the wrapper's ``met_tensors()`` and the counts once they step alone between meetings (the step count
        says which, so a sender and a healed receiver agree)."""
        if not self.meeting or self.engine.step_count < self.warmup:
            return state_hash(held_tensors(self.engine, self.position))
        counts = torch.tensor([self.engine.step_count, self.position, self.size, self.since], dtype=torch.int64)
        return state_hash([*self.engine.model.met_tensors(), counts])

    @property
    def own_steps(self) -> int:
        """The steps this replica took since the last meeting (``since`` less those it sat out)."""
        return self.since - self.sat_out

    @property
    def read_to(self) -> int:
        """The data position after the steps taken (a checkpoint's): past the meeting's, the steps' since."""
        return self.position + self.since * self.taken(self.size)

    def taken(self, size: int) -> int:
        """The samples a step of a round of ``size`` members takes."""
        plan = self.engine.plan
        return (self.replicas if self.constant else size) * plan.micro_batch_size * plan.grad_accum_steps

    def enter(self, quorum: Quorum) -> list:
        """This member's micro-batches of the round's step, the learning rate scaled for the round's size."""
        self.scale = quorum.size / self.replicas if self.linear else 1.0
        return self._slice(self.position, quorum.index, quorum.size)

    def next_step(self) -> list:
        """Between meetings: this member's micro-batches of the next step, by the last meeting's slice."""
        return self._slice(self.read_to, self.index, self.size)

    def stepped(self) -> None:
        """Between meetings: a step taken."""
        self.since += 1

    def _slice(self, at: int, i: int, k: int) -> list:
        """Member ``i`` of ``k``'s micro-batches of a step whose samples start at ``at``.

        Shrinking (the default): member ``i`` of ``k`` takes the ``i``-th ``micro x accum`` samples, so the step's
        batch is ``k / replicas`` of the global one. Constant: the round takes the whole global batch ``B``, member
        ``i`` its ``i``-th share (``B / k``, near-equal) in ``c = ceil(replicas x accum / k)`` micro-batches of at
        most ``micro`` samples, each ``(micro-batch, weight)`` with ``weight = k c s / (accum B)`` for ``s``
        samples: the engine scales a loss by ``weight x accum`` and the step divides by ``c``, the same on every
        member, and the round's hook sums and divides by ``k``, so each sample counts ``1 / B``, as in a step of
        every replica (the members' gradients bitwise equal; with ``k = replicas`` the weights are ``1 / accum``
        and the step is the shrinking one's)."""
        plan = self.engine.plan
        per = plan.micro_batch_size * plan.grad_accum_steps
        if not self.constant:
            return self.stream.micro_batches(at + i * per, plan.micro_batch_size, plan.grad_accum_steps)
        total = self.replicas * per
        count = min(-(-self.replicas * plan.grad_accum_steps // k), total // k)  # every member's, none empty
        start = at + i * (total // k) + min(i, total % k)
        share = total // k + (i < total % k)
        sizes = [share // count + (j < share % count) for j in range(count)]  # near-equal, the first ones larger
        batches = self.stream.consecutive(start, sizes)
        return [[(b, k * count * s / (plan.grad_accum_steps * total)) for b, s in zip(batches, sizes, strict=True)]]

    def committed(self, quorum: Quorum) -> int:
        """The round's step applied: the position moves past every member's samples; the step's global batch."""
        batch = self.taken(quorum.size)
        self.position += batch
        return batch

    def met(self, index: int, size: int) -> int:
        """A meeting committed: the position past the steps since the last; the next steps sliced over the ``size``
        members who take them, this one ``index``-th (the learning rate scaled for their number); the global batch
        of each."""
        self.position, self.since, self.sat_out = self.read_to, 0, 0
        self.index, self.size = index, size
        self.scale = size / self.replicas if self.linear else 1.0
        return self.taken(self.size)
