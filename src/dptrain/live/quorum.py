"""Who takes part in a step: a quorum, agreed through the live store without a leader.

Every attempt at a step is a *round* ``q`` (0, 1, 2, ...; each round's members go on to
``q + 1``, whether their step committed or not). In round ``q`` each worker writes what it
is under ``q/<q>/r/<replica>`` (a :class:`Member`: its committed step, the process group it
holds, whether its last attempt saw an error) and then watches who else has arrived. The
round is *ready* when

- round 0 (the job's start): every replica has arrived, or ``start_timeout_s`` has passed;
- later rounds: every fresh replica (:mod:`~dptrain.live.liveness`) has arrived, except
  those a previous round already left out for not arriving while fresh (a worker alive
  but not stepping: a hang, a long stall) until they arrive again; or ``join_timeout_s``
  has passed since this worker arrived.

The first worker to see its round ready *closes* it: one ``compare_set`` on
``q/<q>/members`` from empty to the members it saw, so exactly one list wins and every
worker reads that one. A worker not on it (it arrived after the close) takes the next
round. Below ``min_workers`` a ready round is not closed: the workers wait (``wait``, up to
``wait_timeout_s``) or stop (``stop``, once the missing replicas are stale) with
:class:`TooFewWorkers`. A worker that starts late (restarted by its launcher) reads
``q/latest`` and joins the round after it.

Whether the round needs a new process group follows from the members' records alone, so
every member decides the same: the group is kept when all of them hold the same one, of
their number, and none saw an error in it; otherwise round ``q`` makes one (``pg/<q>/``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dptrain.live.liveness import Liveness

__all__ = ["Member", "Quorum", "TooFewWorkers", "StoreGone", "GIVE_UP_EXIT", "form_quorum", "latest_round"]

POLL_S = 0.002  # between two looks at the store while a round is open


class TooFewWorkers(RuntimeError):
    """Fewer workers than ``live.min_workers`` remain, and the policy says stop (or the wait ran out); or no member
    holds the state. The worker exits with :data:`GIVE_UP_EXIT`, which its launcher does not restart."""


class StoreGone(TooFewWorkers):
    """The job's live store cannot be reached: its rounds are gone with it, so no worker can go on (exit
    :data:`GIVE_UP_EXIT` too: a restart would meet the same dead address)."""


GIVE_UP_EXIT = 3  # live recovery cannot go on: a launcher that restarts failed workers ends the job instead


@dataclass(frozen=True)
class Member:
    replica: int
    step: int         # steps committed; -1: a worker that holds no state yet (restarted, to be healed)
    group: int = -1   # the round whose process group it holds (-1: none)
    group_size: int = 0
    ok: bool = True   # its last attempt saw no error in that group
    incarnation: int = 0  # which start of this replica (dptrain.live.liveness)
    check: str = ""   # "<step>:<state hash>" after a live.check_every step, compared in the next round (live.trust)
    since: int = 0    # steps taken since its last committed meeting (strategies that meet every few steps)


@dataclass(frozen=True)
class Quorum:
    """A closed round: its members (by replica id), this worker's place among them, and what the round must do."""

    round: int
    members: tuple[Member, ...]
    index: int         # this worker's position in ``members``: its rank in the round's process group
    absent: tuple[int, ...] = ()  # fresh replicas left out for not arriving

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(m.replica for m in self.members)

    @property
    def step(self) -> int:
        """The most steps any member has committed: what the round's step follows."""
        return max(m.step for m in self.members)

    @property
    def new_group(self) -> bool:
        """Whether the members must make a process group for this round (see the module docstring)."""
        first = self.members[0]
        return not all(m.group == first.group and m.group_size == self.size and m.ok and m.group >= 0
                       for m in self.members)

    def heal_plan(self) -> list[tuple[int, int]]:
        """(source index, behind index) pairs: each member behind the round's step and the up-to-date member that
        sends it the state, taken round robin (torchft's rule: the load spread over the up-to-date peers)."""
        top = self.step
        sources = [i for i, m in enumerate(self.members) if m.step == top]
        behind = [i for i, m in enumerate(self.members) if m.step != top]
        return [(sources[n % len(sources)], i) for n, i in enumerate(behind)]


def latest_round(store) -> int:
    """The last round closed in this job (-1: none yet), where a late worker starts looking."""
    return int(store.add("q/latest", 0)) - 1


def form_quorum(store, liveness: Liveness, me: Member, round_: int, replicas: int, *, min_workers: int,
                on_too_few: str, start_timeout_s: float, join_timeout_s: float, wait_timeout_s: float,
                absent: set[int], progress: Callable[[], None] = lambda: None,
                abandon: Callable[[], bool] | None = None, follow: bool = False) -> Quorum | None:
    """Take part in round ``round_``: the closed quorum, or None when it closed without this worker.

    ``absent``: replicas earlier rounds left out while fresh; updated in place (see the module
    docstring). ``progress`` is called while waiting (the watchdog's mark: waiting here is not a hang);
    ``abandon()``, when given, too: True leaves the round unclosed (None). ``follow``: the round is the others' to
    open (this worker took no steps to meet): while another replica is fresh and none has arrived, wait, the join
    timeout counting from the first arrival (else a healed member waiting out the others' steps would close a round
    alone).
    """
    prefix = f"q/{round_}"
    store.set(f"{prefix}/r/{me.replica}", json.dumps(asdict(me)))
    t0 = time.monotonic()
    while True:
        if store.check([f"{prefix}/members"]):
            return _read(store, prefix, round_, me.replica, absent)
        arrived = [r for r in range(replicas) if store.check([f"{prefix}/r/{r}"])]
        if follow and arrived == [me.replica] and liveness.fresh() - {me.replica}:
            t0 = time.monotonic()  # none of the others here yet, and one is alive: theirs to open
            progress()
            if abandon is not None and abandon():
                return None
            time.sleep(POLL_S * 25)
            continue
        absent.difference_update(arrived)
        waited = time.monotonic() - t0
        if round_ == 0:
            ready = len(arrived) == replicas or waited >= start_timeout_s
        else:
            ready = set(arrived) >= liveness.fresh() - absent or waited >= join_timeout_s
        if ready and len(arrived) >= min_workers:
            missing = sorted(liveness.fresh() - set(arrived))
            infos = [json.loads(v) for v in store.multi_get([f"{prefix}/r/{r}" for r in arrived])]
            value = json.dumps({"members": infos, "absent": missing, "closer": me.replica})  # unique: one winner
            if store.compare_set(f"{prefix}/members", "", value) == value.encode():  # this worker closed it
                _advance_latest(store, round_)
            return _read(store, prefix, round_, me.replica, absent)
        if ready:
            _too_few(arrived, replicas, min_workers, on_too_few, waited, liveness, join_timeout_s, wait_timeout_s)
        progress()
        if abandon is not None and abandon():
            return None
        time.sleep(POLL_S)


def _advance_latest(store, round_: int) -> None:
    """``q/latest`` to ``round_`` + 1 if it is below (a counter: rounds close in order, each once)."""
    current = latest_round(store)
    if current < round_:
        store.add("q/latest", round_ - current)


def _read(store, prefix: str, round_: int, replica: int, absent: set[int]) -> Quorum | None:
    closed = json.loads(store.get(f"{prefix}/members"))
    members = tuple(sorted((Member(**m) for m in closed["members"]), key=lambda m: m.replica))
    absent.update(closed["absent"])
    for i, m in enumerate(members):
        if m.replica == replica:
            return Quorum(round_, members, i, tuple(closed["absent"]))
    return None


def _too_few(arrived: list[int], replicas: int, min_workers: int, on_too_few: str, waited: float,
             liveness: Liveness, join_timeout_s: float, wait_timeout_s: float) -> None:
    """Raise :class:`TooFewWorkers` once the policy's patience is spent."""
    gone = [r for r in range(replicas) if r not in arrived]
    limit = wait_timeout_s if on_too_few == "wait" else join_timeout_s
    if on_too_few == "stop" and all(liveness.stale(r) for r in gone):
        limit = 0.0
    if waited >= limit:
        raise TooFewWorkers(f"{len(arrived)} of {replicas} workers remain (replicas {arrived}; gone: {gone}), fewer "
                            f"than live.min_workers = {min_workers}"
                            + (f", after waiting {waited:.0f} s (live.wait_timeout_s)" if on_too_few == "wait" else "")
                            + ": restart the missing workers, or lower live.min_workers; the last checkpoint "
                            "resumes the run")
