"""A worker's live recovery, step by step: quorum, process group, heal, (the step), vote.

Live recovery's step gate in the runner (``dptrain.runner.live_gate``) calls, for every attempt at a step:

1. :meth:`LiveManager.begin` -- form the round's quorum (:mod:`~dptrain.live.quorum`), make
   its process group if the members changed (:mod:`~dptrain.live.group`), and heal the
   members behind the round's step from up-to-date ones (:mod:`~dptrain.live.heal`);
2. forward and backward, the gradients averaged over the round by :attr:`LiveManager.hook`
   (the DDP engine's comm hook);
3. :meth:`LiveManager.vote` -- the commit vote (:mod:`~dptrain.live.vote`); then the runner
   steps the optimizer on commit, or drops the window on abort, and calls :meth:`end`.

Every member of a round therefore holds the same state before its step (healed where it
was behind), averages the same gradients, and applies the step or not together: after each
round the survivors are bitwise identical, which ``tests/test_live.py`` checks by hash.
What the state is, the runner says (``held``, ``held_hash``, ``load``): this package knows
no model, optimizer or strategy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dptrain.live.group import AveragingHook, RoundGroup
from dptrain.live.heal import HealError, Sending, pack, recv_state, start_send, unpack
from dptrain.live.layout import WholeReplicas
from dptrain.live.liveness import Liveness
from dptrain.live.quorum import Member, Quorum, TooFewWorkers, form_quorum, latest_round
from dptrain.live.stats import LiveStats
from dptrain.live.trust import JobMismatch, publish, vet
from dptrain.live.vote import commit_vote

__all__ = ["LiveSettings", "LiveManager", "TooFewWorkers", "JobMismatch", "Attempt"]


@dataclass(frozen=True)
class LiveSettings:
    """The ``[live]`` section's values (see its help in the config reference)."""

    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 30.0
    start_timeout_s: float = 120.0
    min_workers: int = 1
    on_too_few: str = "stop"
    wait_timeout_s: float = 600.0

    @property
    def heartbeat_interval_s(self) -> float:
        return max(0.05, self.heartbeat_timeout_s / 25)


@dataclass
class Attempt:
    """One attempt at a step, as the live log records it."""

    quorum: Quorum                    # the round's workers: the vote, the data, the records
    peers: Quorum                     # those this worker averages with and heals (live.layout)
    ok: bool = True                   # the group was made and the heal done: the step may run
    error: str = ""
    heal_sent: int = 0
    heal_received: int = 0
    heal_s: float = 0.0
    began: float = 0.0
    notes: tuple[str, ...] = ()       # members left out of the round when it was vetted, and why (live.trust)
    heal_after: bool = False          # the members behind are healed after the vote (LiveManager.heal_after)


class LiveManager:
    """This worker's side of live recovery (see the module docstring).

    ``connect()``: a new client of the job's live store; ``replica``: this worker's id (its
    launch rank); ``replicas``: how many the job has; ``step``: steps this worker has
    committed (-1: none known, it must be healed: a restarted worker). ``layout``: how the workers hold the model
    (:mod:`~dptrain.live.layout`: each a whole replica, or groups sharding one); ``incarnation``: this start's,
    where the layout took it already (a shard group is formed before the model is built); ``heal_progress``: called
    as a heal arrives (default ``progress``; the runner's injected fault too).
    """

    def __init__(self, connect: Callable[[], object], replica: int, replicas: int, settings: LiveSettings,
                 step: int, progress: Callable[[], None] = lambda: None, identity: dict | None = None,
                 layout=None, incarnation: int = 0, heal_progress: Callable[[], None] | None = None):
        self.replica, self.replicas, self.settings, self.progress = replica, replicas, settings, progress
        self.heal_progress = heal_progress or progress  # called as a heal arrives, piece by piece
        self.layout = layout if layout is not None else WholeReplicas()
        self.store = connect()
        self.liveness = Liveness(connect, replica, replicas, settings.heartbeat_interval_s,
                                 settings.heartbeat_timeout_s, incarnation=incarnation)
        self.group = RoundGroup(self.store, settings.heartbeat_timeout_s)
        self.hook = AveragingHook(self.group)
        self.step = step
        self.stats = LiveStats()
        self.round = latest_round(self.store) + 1
        self.absent: set[int] = set()
        self._group_ok = True
        self.global_batch = 0  # samples in the last committed step (the round's share of the global batch)
        self.identity = identity  # what job this worker runs (live.trust.identity_record); None: not checked
        self.check = ""  # the state hash after the last live.check_every step, for the next round (live.trust)
        self._published = False
        self._vetted: set[tuple[int, int]] = set()
        self._job: list = []  # the job's identity, once read
        self._sending: list[Sending] = []  # heals this worker sent after a vote, still under way

    def close(self) -> None:
        self.liveness.stop()
        self._sent()
        self.group.close(self.settings.heartbeat_timeout_s + 1.0)

    def begin(self, held: Callable[[], dict], held_hash: Callable[[], bytes],
              load: Callable[[dict], bytes], abandon: Callable[[], bool] | None = None, since: int = 0,
              defer_heal: Callable[[Quorum], bool] | None = None, follow: bool = False) -> Attempt | None:
        """Form the next round this worker is a member of, its group, and heal; the attempt (``ok``: step it).

        ``held()``: this worker's state to send; ``held_hash()``: its hash; ``load(state)``:
        take a received state and return the hash of what is now held. ``abandon()``: checked
        while the round is open; True leaves it (None returned: the end of a run). ``since``: steps this worker has
        taken since its last committed meeting (the meeting gate's; the others see it in its record).
        ``defer_heal(quorum)``: True where the round's members behind are healed after its vote, with the state it
        commits (:meth:`heal_after`), not before its step: a meeting, to which they add nothing anyway. ``follow``:
        this worker took no steps since the last meeting, so the round is the others' to open: it waits for another
        member to arrive (while one is fresh) before the join timeout counts (:func:`~dptrain.live.quorum.form_quorum`).
        """
        self.liveness.start()
        if not self._published and self.identity is not None:  # once per start, before its first round
            publish(self.store, self.replica, self.liveness.incarnation, self.identity, self.step,
                    held_hash() if self.step >= 0 else None, self.layout.part)
            self._published = True
        self._sent()
        began = time.monotonic()
        notes: list[str] = []
        while True:
            me = Member(self.replica, self.step, self.group.round if self.group.pg is not None or
                        self.group.size == 1 else -1, self.group.size, self._group_ok, self.liveness.incarnation,
                        self.check, since)
            s = self.settings
            quorum = form_quorum(self.store, self.liveness, me, self.round, self.replicas,
                                 min_workers=s.min_workers, on_too_few=s.on_too_few,
                                 start_timeout_s=s.start_timeout_s, join_timeout_s=s.join_timeout_s,
                                 wait_timeout_s=s.wait_timeout_s, absent=self.absent, progress=self.progress,
                                 abandon=abandon, follow=follow)
            if abandon is not None and abandon():
                return None
            if quorum is not None and self.identity is not None:
                quorum = self._vet(quorum, notes)
            split = self.layout.split(quorum, self.liveness) if quorum is not None else None
            if split is not None:  # None: not in the round, or (shard groups) its group is not whole in it
                break
            self.round += 1
            follow = True  # left out: the others went on, and the next round is theirs to open
        quorum = split.voters
        if quorum.step < 0:  # raised here, not in the try below: a round cannot heal it, so it must not be retried
            raise TooFewWorkers(f"no member of round {quorum.round} (replicas {list(quorum.replicas)}) holds the "
                                "training state (every one was restarted): resume the run from its last checkpoint")
        attempt = Attempt(quorum, split.peers, began=began, notes=tuple(notes))
        self.group.begin_step(quorum.round)
        try:
            if split.peers.new_group:
                self.group.configure(quorum.round, split.peers.index, split.peers.size,
                                     self.layout.group_prefix(quorum.round))
            attempt.heal_after = defer_heal is not None and defer_heal(quorum) and bool(split.peers.heal_plan())
            if not attempt.heal_after:
                self._heal(attempt, held, held_hash, load)
        except (RuntimeError, HealError) as e:  # a member gone while connecting or healing: this round aborts
            self.group.fail(e)
            attempt.ok, attempt.error = False, f"{type(e).__name__}: {e}"
        if not self.layout.agree(attempt.ok) and attempt.ok:  # (shard groups: another position's heal failed)
            attempt.ok, attempt.error = False, "a worker of this worker's shard group could not take the round"
            self.group.fail(RuntimeError(attempt.error))
        return attempt

    def _vet(self, quorum: Quorum, notes: list[str]) -> Quorum | None:
        """The round without the members :func:`~dptrain.live.trust.vet` leaves out; None when this worker is one of
        them and is to be healed (its state diverged); JobMismatch when it runs another job."""
        verdict = vet(self.store, quorum, self._vetted, self._job)
        self.check = ""  # compared: the next round need not see it again
        if self.replica in verdict.refused:
            raise JobMismatch(f"{verdict.refused[self.replica]}: this worker may not join the job; start it with the "
                              "others' config (their config.toml)")
        self.absent.update(verdict.refused)  # not waited for in later rounds until it arrives again
        notes += [f"{why}: refused" for why in verdict.refused.values()]
        notes += [f"{why}: left out, to be healed" for why in verdict.diverged.values()]
        if verdict.quorum is None:  # diverged: drop the state; the next round heals it
            self.step = -1
            self.group.drop()
        return verdict.quorum

    def _heal(self, attempt: Attempt, held, held_hash, load, wait: bool = True, step: int | None = None) -> None:
        """Heal the round's members behind from up-to-date ones (``attempt.peers.heal_plan()``); a sender waits for
        its sends unless ``wait`` is False (they end while it steps on: :meth:`_sent`). ``step``: the committed step a
        healed member holds (default the round's)."""
        quorum = attempt.peers
        plan = quorum.heal_plan()
        t0 = time.monotonic()
        for src, dst in plan:
            if quorum.index == src:
                sending = start_send(self.group.pg, dst, pack(held()), held_hash())
                attempt.heal_sent += sending.wait(self.progress) if wait else sending.nbytes
                if not wait:
                    self._sending.append(sending)
            elif quorum.index == dst:
                payload, expected = recv_state(self.group.pg, src, self.heal_progress)
                attempt.heal_received += len(payload)
                got = load(unpack(payload))
                self.hook.reset()  # a compressing hook's residual is the worker's own: none yet
                if got != expected:
                    raise HealError(f"after healing from replica {quorum.members[src].replica} the state's hash "
                                    f"differs from the sender's ({got.hex()[:12]} vs {expected.hex()[:12]})")
                self.step = quorum.step if step is None else step
        if attempt.heal_sent or attempt.heal_received:
            attempt.heal_s = time.monotonic() - t0
            self.stats.heal_bytes_sent += attempt.heal_sent
            self.stats.heal_bytes_received += attempt.heal_received
            self.stats.heal_s += attempt.heal_s

    def heal_after(self, attempt: Attempt, held, held_hash, load, step: int) -> bool:
        """After a committed vote in a round begun with ``defer_heal``: each member behind gets the state the round
        committed (``step``: its committed step), from an up-to-date member that sends it without waiting (it goes
        on to its next steps while the bytes travel). Whether this worker holds the round's state: False where its
        own heal failed (it is healed again in a later round)."""
        try:
            self._heal(attempt, held, held_hash, load, wait=False, step=step)
            return True
        except (RuntimeError, HealError) as e:  # the sender gone: this worker holds nothing the round committed
            self.group.fail(e)
            attempt.ok, attempt.error = False, f"{type(e).__name__}: {e}"
            return attempt.peers.members[attempt.peers.index].step == attempt.peers.step

    def _sent(self) -> None:
        """The heals sent without waiting, waited for: a receiver gone meanwhile leaves the group broken (the next
        round makes a new one)."""
        sending, self._sending = self._sending, []
        for s in sending:
            try:
                s.wait(self.progress)
            except RuntimeError:
                self._group_ok = False
                self.group.drop()

    def vote(self, attempt: Attempt, ok: bool, overlapped: bool = False) -> bool:
        """The round's decision: True when every member's step went well (this one's: ``ok``). A member that votes
        waits for the others' votes up to ``live.heartbeat_timeout_s``, or, in a round whose collective runs beside
        steps (``overlapped``: the others may vote those steps later, a member with no steps to take at once), up to
        ``live.join_timeout_s``; a member gone is seen by its heartbeat either way."""
        ok = ok and attempt.ok and self.group.error is None
        quorum = attempt.quorum
        limit = self.settings.join_timeout_s if overlapped else self.settings.heartbeat_timeout_s
        return commit_vote(self.store, quorum.round, quorum.index, quorum.members, ok, self.liveness, limit,
                           self.progress)

    def end(self, attempt: Attempt, committed: bool, counted: bool = True, advance: int = 1) -> float | None:
        """After the decision (and the optimizer step on commit): on to the next round; a recovery's seconds, if this
        commit ends one. ``counted``: False for a round with no step in it (the end of a run). ``advance``: the
        steps a commit completes (a round of the steps' own: 1; a meeting: the steps since the last)."""
        self._group_ok = self.group.error is None
        if self.group.error is not None:
            self.group.drop()  # broken: the next round makes a new one
        if committed:
            self.step = attempt.quorum.step + advance
        self.round = attempt.quorum.round + 1
        self.hook.settle(committed)
        return self.stats.attempt(committed, attempt.quorum.size, attempt.began) if counted else None
