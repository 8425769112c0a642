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
   (:meth:`~dptrain.live.LiveManager.begin`); the members that took the steps since the last
   meeting reduce over the round's group, every other member (restarted, or one that missed
   the last meeting or sat its steps out) adding zeros, the average taken over the takers
   (``launch_meeting``, waited for); then the vote: on commit every member that held the state the
   meeting started from applies the result (``apply_meeting``: DiLoCo's outer step, local
   SGD's average); on abort nothing is applied and the meeting is held again in a new round,
   without the member that failed;
3. a member behind is healed *after* the vote, with the state the meeting committed
   (:meth:`~dptrain.live.LiveManager.heal_after`): its sender starts the sends and goes on to
   its next steps while the bytes travel, so no survivor waits for a heal; the healed member
   sits out the steps to the next meeting (``skip_steps``: counted, not taken; the meeting's
   takers share their samples) and adds zeros there. torchft heals a DiLoCo replica the same
   way, during the others' inner steps, its first round's steps discarded.

With a warm-up (``warmup_steps``: the first steps synchronous, every replica's gradients
averaged), each of those steps is a round of its own, as under the DDP engine
(:class:`~dptrain.runner.live_gate.LiveGate`): the wrapper's warm-up engine takes the round's
comm hook. A round's kind follows from its step, which every member agrees on: below the
warm-up's end, a step; from it on, a meeting. So a worker restarted in either phase joins
the round the others hold.

Streaming DiLoCo meets one fragment every H / P steps (the wrapper says which from the
meeting's step, so a restarted member reduces the same one), and after the last step every
fragment at once. With its overlap of tau steps (``meeting_overlap``), a meeting's round opens
and launches its collective after the step where it starts (``meeting_starts``), the members
take their next tau steps while it runs, and wait for it and vote after the step it lands at;
a round that aborts is held again at the landing, unoverlapped. A restarted member joining
such a round adds its zeros at once and waits in the vote for the others. No heal happens
with a collective in flight (heals follow the vote), and a checkpoint written between a
launch and its landing holds none: a run resumed from it meets that fragment at its landing.

So a worker lost between meetings costs its own steps (and their samples), not the others':
they meet without it. One lost during a meeting's all-reduce or before its vote aborts that
round only; the steps are kept and met again. After every committed meeting the members
hold the same global weights and outer momentum, and the same weights where every replica
restarts from the global ones (the wrapper's ``met_tensors``); each keeps its own optimizer
state, as without live recovery (a healed member its sender's; its replica too, as torchft's
heal sends it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dptrain.checkpoint.resume import seed_everything
from dptrain.live.manager import Attempt
from dptrain.runner.gate import Turn
from dptrain.runner.live_gate import LiveGate, fault_before_vote
from dptrain.runner.live_state import step_seed
from dptrain.runner.metrics import StepTimes

__all__ = ["MeetingGate"]


@dataclass
class _Meeting:
    """A meeting's round between its launch and its vote: the members holding what it starts from (``current``),
    this worker's record, the steps it completes and the step it lands at, whether it may commit, and its launched
    collective (None: nothing to reduce, or it failed to launch)."""

    attempt: Attempt
    before: int  # this worker's committed step when the round began
    current: list
    mine: object
    advance: int
    step: int
    ok: bool
    overlapped: bool = False  # its collective runs beside the steps to its landing
    wait: Callable[[], object] | None = None


class MeetingGate(LiveGate):
    """A round at each meeting of the replicas, none between; one per step of a warm-up (see the module
    docstring)."""

    meeting = True
    say: Callable[[str], None] | None = None  # a line for the log (turns() is given it)
    pending: _Meeting | None = None  # a meeting whose collective runs beside the steps to its landing

    def _join_rounds(self, model) -> None:
        """The wrapper's meetings are this gate's to hold (the meeting protocol); a warm-up's steps average over
        their round (its engine takes the round's hook), the steps after it take none."""
        model.hold_meetings(self.env.world_size)
        if model.warmup_steps:
            model.register_comm_hook(None, self.manager.hook)

    def _warmup_steps(self) -> int:
        return self.engine.model.warmup_steps

    def turns(self, say: Callable[[str], None]) -> Iterator[Turn]:
        """Rounds until one is a meeting that commits (the slices; a restarted worker healed), each a step of its own
        while the round's step is in the warm-up; then every step up to the last, each this worker's own;
        :meth:`settle` holds the meetings."""
        self.say = say
        manager, replica, steps = self.manager, self.replica, self.rp.cfg.train.steps
        warmup = self.engine.model.warmup_steps
        sliced = False  # a committed meeting has given this worker its slice of the steps between meetings
        while manager.step + replica.since < steps:
            if not sliced:
                before = manager.step
                # a worker with no steps to meet (restarted, healed after a meeting, left out of one): the round is
                # the others' to open when they reach their meeting, so its join timeout counts from their arrival
                attempt = self._begin(say, follow=True)
                if self._healed_to_end(attempt, before):
                    return
                if attempt.quorum.step < warmup:  # a synchronous step of the warm-up: a round of its own
                    yield self._step_turn(attempt)
                    continue
                sliced = self._meeting(attempt, before)
                continue
            step = manager.step + replica.since + 1
            seed_everything(step_seed(self.rp.cfg.train.seed, self.env.rank, step))
            yield Turn(step, iter(replica.next_step()), weighted=replica.constant)

    def decide(self, turn: Turn, times: StepTimes | None) -> bool:
        """A warm-up step: the round's vote; a step between meetings is this worker's own: always taken."""
        return super().decide(turn, times) if turn.attempt is not None else True

    def settle(self, turn: Turn, committed: bool) -> None:
        """A warm-up step: the round's end. Else the step counted; a meeting where the wrapper's schedule holds one,
        and after the last step. With an overlap, the meeting's round opens and launches its collective after the
        step where it starts (:meth:`_open`), and waits and votes after the step where it lands (:meth:`_close`)."""
        if turn.attempt is not None:
            super().settle(turn, committed)
            return
        self.replica.stepped()
        model, steps = self.engine.model, self.rp.cfg.train.steps
        if self.pending is not None:
            if turn.step < self.pending.step:  # the steps the launched collective runs beside
                return
            committed, self.pending = self._close(self.pending), None
            if committed:
                return
        elif model.meeting_overlap and model.meeting_starts(turn.step) and turn.step + model.meeting_overlap < steps:
            before = self.manager.step
            attempt = self._begin(self.say)
            if not self._healed_to_end(attempt, before):
                self.pending = self._open(attempt, before)
            return
        elif not (model.meeting_due or turn.step == steps):
            return
        committed = False
        while not committed:  # rounds until one commits the meeting (one whose overlap aborted: at its landing)
            before = self.manager.step
            attempt = self._begin(self.say)
            if self._healed_to_end(attempt, before):
                return
            committed = self._meeting(attempt, before)

    def _healed_to_end(self, attempt: Attempt, before: int) -> bool:
        """Whether this worker joined the others after their last step (``before``: its committed step when the
        round began): healed to the end, the round closed with nothing attempted, nothing left to do."""
        if not (attempt.quorum.step >= self.rp.cfg.train.steps and before < attempt.quorum.step):
            return False
        self.manager.end(attempt, False, counted=False)
        self.live_log.healed_at_end(attempt)
        return True

    def _heals_after(self, quorum) -> bool:
        """A meeting's members behind are healed after its vote, with the state it commits: they add nothing to it,
        and their senders step on while the bytes travel (as torchft heals a DiLoCo replica during the others' inner
        steps). A warm-up's step heals before (the member steps with the state), as does a round after the last step."""
        return self._warmup_steps() <= quorum.step < self.rp.cfg.train.steps

    def _meeting(self, attempt: Attempt, before: int) -> bool:
        """The meeting in ``attempt``'s round (``before``: this worker's committed step when it began); whether this
        worker takes the steps to the next meeting: the meeting committed, and this worker held what it started from
        (a member healed after it sits those steps out: the others took its share of the samples). A member that
        joins a round whose collective overlaps steps waits in the vote for the others to take them."""
        return self._close(self._open(attempt, before))

    def _open(self, attempt: Attempt, before: int) -> _Meeting:
        """The meeting's round opened: its participants found and its collective launched over the round's group,
        for the meeting that lands at the round's step, or ``meeting_overlap`` steps on where it starts there (not
        past the last step: the last meeting closes every part of the model at once, unoverlapped)."""
        manager, model, steps = self.manager, self.engine.model, self.rp.cfg.train.steps
        quorum = attempt.quorum
        current = [m for m in quorum.members if m.step == quorum.step]  # those holding what the meeting starts from
        advance = max(m.since for m in current)  # the steps since the last meeting
        took = [m for m in current if m.since == advance]  # the members who took them: the meeting's participants
        mine = quorum.members[quorum.index]
        step = quorum.step + advance  # the round's
        # overlapped where the schedule starts a reduction here, after steps taken (not right after a resume, where
        # no member has taken any: the meeting is then held at its landing)
        overlap = model.meeting_overlap if advance and model.meeting_overlap and model.meeting_starts(step) and \
            step + model.meeting_overlap < steps else 0
        meeting = _Meeting(attempt, before, current, mine, advance + overlap, step + overlap, attempt.ok,
                           overlapped=bool(overlap))
        if meeting.ok and advance:  # every member takes part (one behind, or that sat the steps out, adding zeros)
            try:
                meeting.wait = model.launch_meeting(manager.group.pg, len(took), mine in took, meeting.step,
                                                    meeting.step == steps)
            except RuntimeError as e:  # a member gone as it launched
                manager.group.fail(e)
                meeting.ok = False
        return meeting

    def _close(self, meeting: _Meeting) -> bool:
        """The meeting's collective waited for, the vote, its result applied or discarded, members behind healed;
        whether this worker takes the steps to the next meeting (:meth:`_meeting`)."""
        manager, replica, model = self.manager, self.replica, self.engine.model
        attempt, current, mine, step, advance = meeting.attempt, meeting.current, meeting.mine, meeting.step, \
            meeting.advance
        ok, reduced = meeting.ok, None
        if ok and meeting.wait is not None:
            try:
                reduced = meeting.wait()
            except RuntimeError as e:  # a member gone during the reduction
                manager.group.fail(e)
                ok = False
            fault_before_vote(self.env.rank, step)
        committed = manager.vote(attempt, ok, meeting.overlapped)
        holds = mine in current  # this worker applies the result (a member behind is healed to it after)
        if committed and holds and replica.since < advance:  # healed after the last meeting: the others took its
            self._skip(advance - replica.since)  # steps (on commit only: an aborted meeting may be met by fewer)
        if reduced is not None:
            (model.apply_meeting if committed and holds else model.discard_meeting)(reduced)
        if committed and holds:
            manager.global_batch = replica.met(current.index(mine), len(current))
        if committed and attempt.heal_after:
            holds = manager.heal_after(attempt, replica.held, replica.hash, replica.load, step)
        self.close_round(attempt, step, committed, advance=advance, check=bool(self.rp.cfg.live.check_every),
                         meeting=True, holds=holds)
        if committed and not holds:  # its heal failed: it holds nothing the round committed, and is healed again
            manager.step = meeting.before
        return committed and mine in current

    def _skip(self, steps: int) -> None:
        """``steps`` steps counted, not taken: this worker was healed after the last meeting, and the others took
        the steps since (and its share of their samples); it meets with the global weights, adding nothing."""
        self.engine.step_count += steps
        self.engine.model.skip_steps(steps)
        self.replica.since += steps
        self.replica.sat_out += steps
