"""What a replica holds under live recovery, as a heal sends it and a hash confirms it: its engine's state, the data
position, the learning-rate scale of its round, and its slice of a step's samples."""

from __future__ import annotations

import torch

from dptrain.api.engine import Engine
from dptrain.data.stream import SampleStream
from dptrain.live.heal import state_hash
from dptrain.live.quorum import Quorum
from dptrain.runner.divergence import replica_tensors

__all__ = ["ReplicaState", "held_tensors", "step_seed"]


def step_seed(seed: int, replica: int, step: int) -> int:
    """The seed of ``replica``'s generators at ``step``: a function of the three, so a healed worker needs none sent."""
    return (seed * 1_000_003 + replica * 7_919 + step * 104_729) % (2**31 - 1)


def held_tensors(engine: Engine, position: int) -> list[torch.Tensor]:
    """Everything a replica holds that must be equal on every survivor: parameters, buffers and the optimizer's
    state (the divergence monitor's list), the step counts and the data position."""
    tensors = [t for _, t in replica_tensors(engine.model.module, engine.optimizer)]
    return tensors + [torch.tensor([engine.step_count, engine.skipped_steps, position], dtype=torch.int64)]


class ReplicaState:
    """The engine and the committed data position of one replica (see the module docstring).

    ``replicas``: the job's workers; ``linear``: ``live.lr_scaling = "linear"`` (a round of k takes the learning
    rate times k / replicas); ``constant``: ``live.global_batch = "constant"`` (a round of k takes the whole global
    batch, each member more micro-steps: :meth:`enter`).
    """

    def __init__(self, engine: Engine, stream: SampleStream, position: int, replicas: int, linear: bool,
                 constant: bool = False):
        self.engine, self.stream, self.position = engine, stream, position
        self.replicas, self.linear, self.constant = replicas, linear, constant
        self.scale = 1.0
        schedule = engine.lr_at
        engine.lr_at = lambda s: schedule(s) * self.scale

    def held(self) -> dict:
        """The state a heal sends: the engine's (model, optimizer, step counts), the position, the strategy's own."""
        engine = self.engine
        return {"engine": engine.state_dict(), "position": self.position,
                "strategy": engine.model.checkpoint_state(engine.optimizer)}

    def load(self, received: dict) -> bytes:
        """Take a healed state; the hash of what is now held."""
        self.engine.load_state_dict(received["engine"])
        self.engine.model.load_checkpoint_state(received["strategy"], self.engine.optimizer)
        self.position = received["position"]
        return self.hash()

    def hash(self) -> bytes:
        return state_hash(held_tensors(self.engine, self.position))

    def enter(self, quorum: Quorum) -> list:
        """This member's micro-batches of the round's step, the learning rate scaled for the round's size.

        Shrinking (the default): member ``i`` of ``k`` takes the ``i``-th ``micro x accum`` samples, so the step's
        batch is ``k / replicas`` of the global one. Constant: the round takes the whole global batch ``B``, member
        ``i`` its ``i``-th share (``B / k``, near-equal) in ``c = ceil(replicas x accum / k)`` micro-batches of at
        most ``micro`` samples, each ``(micro-batch, weight)`` with ``weight = k c s / (accum B)`` for ``s``
        samples: the engine scales a loss by ``weight x accum`` and the step divides by ``c``, the same on every
        member, and the round's hook sums and divides by ``k``, so each sample counts ``1 / B``, as in a step of
        every replica (the members' gradients bitwise equal; with ``k = replicas`` the weights are ``1 / accum``
        and the step is the shrinking one's)."""
        self.scale = quorum.size / self.replicas if self.linear else 1.0
        plan = self.engine.plan
        per = plan.micro_batch_size * plan.grad_accum_steps
        if not self.constant:
            return self.stream.micro_batches(self.position + quorum.index * per, plan.micro_batch_size,
                                             plan.grad_accum_steps)
        k, i, total = quorum.size, quorum.index, self.replicas * per
        count = min(-(-self.replicas * plan.grad_accum_steps // k), total // k)  # every member's, none empty
        start = self.position + i * (total // k) + min(i, total % k)
        share = total // k + (i < total % k)
        sizes = [share // count + (j < share % count) for j in range(count)]  # near-equal, the first ones larger
        batches = self.stream.consecutive(start, sizes)
        return [[(b, k * count * s / (plan.grad_accum_steps * total)) for b, s in zip(batches, sizes, strict=True)]]

    def committed(self, quorum: Quorum) -> int:
        """The round's step applied: the position moves past every member's samples; the step's global batch."""
        plan = self.engine.plan
        batch = (self.replicas if self.constant else quorum.size) * plan.micro_batch_size * plan.grad_accum_steps
        self.position += batch
        return batch
