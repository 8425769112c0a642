"""Live recovery for a strategy whose replicas step alone and meet every few steps (local SGD, DiLoCo): a round only
at a meeting.

torchft runs its LocalSGD and DiLoCo the same way: its quorum is formed only at the sync,
not at every step. Here (:class:`MeetingGate`, the one training loop's gate where the
registry says ``live = "meeting"``):

1. the steps between two meetings are each worker's own: no round, no vote, no
   collective; each takes its slice of the step's samples by the last committed meeting's
   member ``index`` of ``size`` (:class:`~dptrain.runner.live_state.ReplicaState`);
2. after a step the wrapper's schedule meets at (``meeting_due``), and after the last step
   whatever it has not met, the worker forms a round of those alive
   (:meth:`~dptrain.live.LiveManager.begin`: a restarted worker, or one that missed the last
   meeting, is healed there from an up-to-date member); the members that took the steps
   since the last meeting reduce over the round's group, a healed one adding zeros (it holds
   a peer's steps, not its own) and the average taken over the others
   (``reduce_meeting``); then the vote: on commit every member applies the result
   (``apply_meeting``: DiLoCo's outer step, local SGD's average); on abort nothing is
   applied and the meeting is held again in a new round, without the member that failed.

So a worker lost between meetings costs its own steps (and their samples), not the others':
they meet without it. One lost during a meeting's all-reduce or before its vote aborts that
round only; the steps are kept and met again. After every committed meeting the members
hold the same weights, global weights and outer momentum (the wrapper's ``met_tensors``);
each keeps its own optimizer state, as without live recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dptrain.checkpoint.resume import seed_everything
from dptrain.runner.gate import Turn
from dptrain.runner.live_gate import LiveGate, fault_before_vote
from dptrain.runner.live_state import step_seed
from dptrain.runner.metrics import StepTimes

__all__ = ["MeetingGate"]


class MeetingGate(LiveGate):
    """A round at each meeting of the replicas, none between (see the module docstring)."""

    meeting = True
    say: Callable[[str], None] | None = None  # a line for the log (turns() is given it)

    def _join_rounds(self, model) -> None:
        """The wrapper's meetings are this gate's to hold (the meeting protocol); its steps take no hook."""
        model.meets_itself = False

    def turns(self, say: Callable[[str], None]) -> Iterator[Turn]:
        """A first round (the slices; a restarted worker healed), then every step up to the last, each this worker's
        own; :meth:`settle` holds the meetings."""
        self.say = say
        if not self._meet():
            return
        manager, replica, steps = self.manager, self.replica, self.rp.cfg.train.steps
        while manager.step + replica.since < steps:
            step = manager.step + replica.since + 1
            seed_everything(step_seed(self.rp.cfg.train.seed, self.env.rank, step))
            yield Turn(step, iter(replica.next_step()), weighted=replica.constant)

    def decide(self, turn: Turn, times: StepTimes | None) -> bool:
        """A step between meetings is this worker's own: always taken."""
        return True

    def settle(self, turn: Turn, committed: bool) -> None:
        """The step counted; a meeting where the wrapper's schedule holds one, and after the last step."""
        self.replica.stepped()
        if self.engine.model.meeting_due or turn.step == self.rp.cfg.train.steps:
            self._meet()

    def _meet(self) -> bool:
        """Rounds until one commits a meeting; False when this worker joined after the others' last (healed to the
        end: nothing is left to do)."""
        manager, replica, model, steps = self.manager, self.replica, self.engine.model, self.rp.cfg.train.steps
        while True:
            before = manager.step
            attempt = manager.begin(replica.held, replica.hash, replica.load)
            quorum = attempt.quorum
            for note in attempt.notes if self.say is not None else ():
                self.say(f"live recovery: {note}")
            if quorum.step >= steps and before < quorum.step:  # the others met after the last step: healed to it
                manager.end(attempt, False, counted=False)
                self.live_log.healed_at_end(attempt)
                return False
            step = quorum.step + replica.since  # the meeting's: the steps its members have taken
            ok, reduced = attempt.ok, None
            if ok and model.unmet_steps:
                participants = sum(m.step == quorum.step for m in quorum.members)
                try:
                    reduced = model.reduce_meeting(manager.group.pg, participants, before == quorum.step)
                except RuntimeError as e:  # a member gone during the reduction
                    manager.group.fail(e)
                    ok = False
                fault_before_vote(self.env.rank, step)
            committed = manager.vote(attempt, ok)
            if reduced is not None:
                (model.apply_meeting if committed else model.discard_meeting)(reduced)
            advance = replica.since
            if committed:
                manager.global_batch = replica.met(quorum)
            self.close_round(attempt, step, committed, advance=advance, check=bool(self.rp.cfg.live.check_every))
            if committed:
                return True
