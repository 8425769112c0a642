"""Live recovery's step gate (``live.enabled``): survivors go on, a restarted worker is healed.

Each worker's default process group is itself alone (``dptrain.run``): nothing in the job
spans a fixed set of processes, so no death can break it. The replicas meet in rounds
instead (:mod:`dptrain.live`), and the one training loop (:mod:`dptrain.runner.loop`) asks
this gate, for every attempt at a step:

1. :meth:`LiveGate.turns`: the round's quorum, its process group, and a heal of the members
   behind (:meth:`~dptrain.live.LiveManager.begin`); then this member's slice of the step's
   samples: the data is one stream (:class:`~dptrain.data.stream.SampleStream`), member
   ``i`` of ``k`` takes the ``i``-th ``micro x accum`` samples from the committed position;
   the random generators are seeded from (seed, replica, step), so a healed worker draws
   what it would have drawn;
2. the loop's forward and backward, the wrapper's comm hook averaging each bucket over the
   round (gradients divided by ``k``, the participants); the learning rate scaled by
   ``k / N`` under ``live.lr_scaling = "linear"``;
3. :meth:`LiveGate.decide`: the commit vote; on commit every member steps the optimizer and
   (:meth:`settle`) the position moves on by ``k x micro x accum``; on abort every member
   drops the window and the step is tried again in the next round, on the same samples.

Replica 0 keeps the run's records: the metrics, evaluations, checkpoints (the replicated
layout: every survivor holds the same state) and the final weights. When it is gone the
others train on; restarted, it is healed and writes again (a gap in ``metrics.jsonl``
says when it was away). At the end the others stay, answering rounds, until replica 0
has the final state (or is gone past ``live.join_timeout_s``). Every worker writes
``logs/live<r>.jsonl``, one line per attempt: the round, its members, the decision, the
bytes and seconds of a heal, the seconds from a failure to the next commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable, Iterator

from dptrain.api.engine import Engine
from dptrain.checkpoint.resume import seed_everything
from dptrain.compress.round_hook import RoundCompression
from dptrain.config import ConfigError
from dptrain.data.stream import SampleStream
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.live import JobMismatch, LiveManager, LiveSettings, TooFewWorkers, connect_store
from dptrain.live.finish import DONE_KEY, mark_final, serve_until_final
from dptrain.live.layout import ShardGroupLost, ShardGroups, WholeReplicas
from dptrain.live.log import LiveLog
from dptrain.live.quorum import StoreGone
from dptrain.live.records import live_totals, read_live_logs
from dptrain.live.rounds import close_round
from dptrain.live.shard_group import join_shard_group
from dptrain.live.store import store_address, unreachable
from dptrain.live.trust import identity_record
from dptrain.runner.facts import RunFacts
from dptrain.runner.gate import Start, StaticGate, Turn, resume_or_seed
from dptrain.runner.lifecycle import run_fault
from dptrain.runner.live_state import ReplicaState, step_seed
from dptrain.runner.metrics import StepTimes
from dptrain.runner.plan import RunPlan
from dptrain.runner.roll_call import is_collective_failure
from dptrain.strategies import get_strategy
from dptrain.tasks import collate

__all__ = ["LiveGate", "live_settings", "fault_before_vote"]

GONE_PROBE_S = 1.0  # how long a worker whose store call failed looks for the store before it says it is gone


def live_settings(cfg) -> LiveSettings:
    v = cfg.live
    return LiveSettings(heartbeat_timeout_s=v.heartbeat_timeout_s, join_timeout_s=v.join_timeout_s,
                        start_timeout_s=v.start_timeout_s, min_workers=v.min_workers, on_too_few=v.on_too_few,
                        wait_timeout_s=v.wait_timeout_s)


class LiveGate(StaticGate):
    """A quorum, a heal and a vote around every step (see the module docstring)."""

    replica_local = True  # each worker is a process group of its own: no hook may wait on another rank
    meeting = False  # a round every step (MeetingGate: only where the replicas meet)

    def __init__(self, rp: RunPlan, env: WorkerEnv, engine: Engine, compression, beat: Heartbeat,
                 prepared: tuple[ShardGroups, int] | None = None):
        super().__init__(rp, env, engine, compression, beat)
        cfg = rp.cfg
        parameters = [(name, tuple(p.shape)) for name, p in engine.model.module.named_parameters()]
        layout, incarnation = prepared if prepared is not None else (WholeReplicas(), 0)
        self.manager = manager = LiveManager(
            _connect(cfg), env.rank, env.world_size,
            live_settings(cfg), -1, progress=lambda: beat.mark(max(manager.step, 0) + 1, "quorum"),
            identity=identity_record(rp.identity, parameters, env.world_size), layout=layout,
            incarnation=incarnation, heal_progress=lambda: (manager.progress(), fault_in_heal(env.rank)))
        self._join_rounds(engine.model)
        self.writer = env.rank == 0  # the records, the final mark
        # the run's outputs are collectives of the writer's shard group (its evaluation, its sharded checkpoint)
        self.output_group = env.rank // layout.group_size == 0
        self._round_size = env.world_size
        self.replica: ReplicaState | None = None
        self.live_log = LiveLog(rp.run_dir / "logs" / f"live{env.rank}.jsonl")

    def _join_rounds(self, model) -> None:
        """Every step's gradients averaged over its round: the round's comm hook on the wrapper (registry ``live``
        ``step``: it takes one)."""
        if isinstance(self.compression, RoundCompression):  # compression.method: the round's compressed mean
            self.manager.hook = self.compression.attach(self.manager.group)
        model.register_comm_hook(None, self.manager.hook)

    @classmethod
    def prepare(cls, rp: RunPlan, env: WorkerEnv) -> tuple[ShardGroups, int] | None:
        """Where workers hold a replica between them (hybrid sharding: the strategy's ``live_group``), this worker's
        shard group, formed over the live store and made its default process group (:mod:`dptrain.live.shard_group`);
        the layout and this worker's incarnation. None: each worker a whole replica."""
        cfg = rp.cfg
        group = get_strategy(cfg.distributed.strategy).live_group
        size = group(cfg) if group is not None else 1
        if size <= 1:
            return None
        return join_shard_group(_connect(cfg)(), env.rank, size, start_timeout_s=cfg.live.start_timeout_s,
                                timeout_s=cfg.live.join_timeout_s)

    @classmethod
    @contextlib.contextmanager
    def guard(cls, rp: RunPlan):
        """Raises ConfigError (exit 2) when the others run another job (``dptrain.live.trust``), and StoreGone (exit 3)
        when the live store cannot be reached within ``live.heartbeat_timeout_s``: at the start, or once a store
        call failed during the run."""
        address, patience = store_address(), rp.cfg.live.heartbeat_timeout_s
        _store_reachable(address, patience)  # before building anything: a restart into a store that is gone ends here
        try:
            yield
        except JobMismatch as e:
            raise ConfigError(str(e)) from None
        except (TooFewWorkers, ConfigError):
            raise
        except Exception:
            # a store call failed: if the store is gone, say that in one line. One short look, not the start's
            # patience: a store that died took the job's rounds with it, so one that answers again later is of no
            # use to this job
            _store_reachable(address, min(patience, GONE_PROBE_S))
            raise

    @property
    def outputs(self) -> bool:
        return self.output_group

    def _warmup_steps(self) -> int:
        """Steps at the start taken by every replica together (a round each), before they step alone: none here."""
        return 0

    def checkpoint_meta(self) -> dict:
        return {"live_position": self.replica.read_to}

    def record(self) -> dict:
        """The live counts of a metrics record: round size, attempts, commits, heal bytes, the step's global batch."""
        return {**self.manager.stats.record(self._round_size), "live_global_batch": self.manager.global_batch}

    def start(self) -> Start:
        """Restarted by its launcher, or started once rounds were under way (added, or back under torchrun or Slurm):
        healed by a peer, not resumed; else resumed from the run's checkpoint (the position its meta recorded, or the
        step's share of a full-size run's samples for a checkpoint written without live recovery)."""
        rp, env, cfg = self.rp, self.env, self.rp.cfg
        self.joining = restart_count() > 0 or self.manager.round > 0
        if self.joining:
            step, position, note = -1, 0, None
        else:
            # each worker's own parts (compression's residuals: replica 0's in its checkpoint) start afresh
            step, note = resume_or_seed(rp, env, self.engine, [p for p in self.parts if p.heal])
            position = int((rp.resume_meta or {}).get("live_position", step * rp.plan.global_batch_size))
        self.manager.step = self.start_step = step
        self.replica = ReplicaState(self.engine, SampleStream(rp.task.train_set, seed=cfg.train.seed,
                                                             collate_fn=collate(rp.task)),
                                    position, env.world_size, cfg.live.lr_scaling == "linear",
                                    cfg.live.global_batch == "constant", meeting=self.meeting,
                                    warmup=self._warmup_steps(), parts=self.parts)
        self.live_log.start(env.rank, restart_count(), step)
        over = "live recovery: the run has finished; nothing to join" if self.manager.store.check([DONE_KEY]) else None
        # a restarted replica 0 keeps every record (none past the step it is healed to exists); a torn last line goes
        return Start(max(step, 0), note, records_from=cfg.train.steps if self.joining else step,
                     lines=[self._line()], over=over)

    def turns(self, say: Callable[[str], None]) -> Iterator[Turn]:
        """Attempt steps, round after round, until the last is committed."""
        manager, steps = self.manager, self.rp.cfg.train.steps
        while manager.step < steps:
            attempt = self._begin(say)
            if attempt.quorum.step >= steps:  # joined the others after their last step: healed to the end
                manager.end(attempt, False, counted=False)
                self.live_log.healed_at_end(attempt)
                continue
            yield self._step_turn(attempt)

    def _begin(self, say: Callable[[str], None] | None, follow: bool = False):
        """The next round (its quorum, group and heal), its notes said: a member of another job refused, or one
        whose state diverged left out. ``follow``: this worker has no steps to meet (restarted, healed after a
        meeting, or left out of one): the round is the others' to open (``LiveManager.begin``)."""
        replica = self.replica
        attempt = self.manager.begin(replica.held, replica.hash, replica.load, since=replica.own_steps,
                                     defer_heal=self._heals_after, follow=follow)
        for note in attempt.notes if say is not None else ():
            say(f"live recovery: {note}")
        return attempt

    def _heals_after(self, quorum) -> bool:
        """Whether the round's members behind are healed after its vote rather than before its step: never here (a
        member steps with the state it is healed to)."""
        return False

    def _step_turn(self, attempt) -> Turn:
        """A round's step: this member's slice of its samples, its generators seeded (None when the round failed
        to form: the member sits it out and votes no)."""
        quorum, replica = attempt.quorum, self.replica
        step = quorum.step + 1
        batches = None
        if attempt.ok:
            seed_everything(step_seed(self.rp.cfg.train.seed, self.env.rank, step))
            batches = iter(replica.enter(quorum))
        return Turn(step, batches, weighted=replica.constant, attempt=attempt)

    def decide(self, turn: Turn, times: StepTimes | None) -> bool:
        """The commit vote, after this member's backward (a member that sat the attempt out votes no)."""
        attempt = turn.attempt
        self._round_size = attempt.quorum.size
        if times is not None and times.comm is not None:  # the round's hook counts what it sent
            times.comm.sent_bytes += self.manager.hook.sent_bytes(attempt.peers.size)
        if times is not None:
            fault_before_vote(self.env.rank, turn.step)
        return self.manager.vote(attempt, attempt.ok)

    def settle(self, turn: Turn, committed: bool) -> None:
        """The round's end: the position on (:meth:`close_round` does the rest)."""
        if committed:
            self.manager.global_batch = self.replica.committed(turn.attempt.quorum)
        every = self.rp.cfg.live.check_every
        self.close_round(turn.attempt, turn.step, committed, check=bool(every) and turn.step % every == 0)

    def close_round(self, attempt, step: int, committed: bool, advance: int = 1, check: bool = False,
                    meeting: bool = False, holds: bool = True) -> None:
        """After a round's decision, its result applied (:func:`dptrain.live.rounds.close_round`; ``advance``: the
        steps a commit completes; ``check``: the state's hash kept for the next round's check; ``holds``: False where
        this worker's heal after the vote failed, so it cannot mark the final state)."""
        close_round(self.manager, self.live_log, attempt, step, committed, advance=advance, meeting=meeting,
                    last=self.writer and step == self.rp.cfg.train.steps and holds,
                    held_hash=self.replica.hash if check else None)

    def finish(self) -> None:
        """Replica 0 marks the final state; the others stay, answering rounds, until it has it."""
        if self.writer:
            mark_final(self.manager)
        elif not self.output_group:  # (the writer's shard group ends with it: its shards are the final state)
            try:
                serve_until_final(self.manager, self.replica.held, self.replica.hash, self.replica.load)
            except ShardGroupLost:  # a worker of this group finished or is gone: its shards can heal no one
                pass

    def stop(self) -> None:
        self.live_log.close()
        self.manager.liveness.stop()

    def done(self, facts: RunFacts | None) -> RunFacts | None:
        """Replica 0's facts get the live totals; the run is marked done; the store connection closed."""
        if facts is not None:
            logs = read_live_logs(self.rp.run_dir)
            facts = dataclasses.replace(facts, live={**live_totals(logs),
                                                     "peak_rss_mb_by_replica": _peak_rss(logs, self.env.world_size)})
        if self.writer:
            self.manager.store.set(DONE_KEY, "1")
        self.manager.close()
        return facts

    def failed(self, error: Exception, step: int) -> None:
        """No group spans the job: the quorum names who is gone. A shard group's collective that failed (a worker of
        it died) leaves this worker's shards with no group: it ends, to be started again (ShardGroupLost)."""
        layout = self.manager.layout
        if layout.group_size > 1 and is_collective_failure(error):
            raise ShardGroupLost(f"a collective of shard group {layout.group} (workers {layout.siblings()}) failed at "
                                 f"step {step}: a worker of it is gone, so this worker ends to be started again and "
                                 f"healed ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None

    def _line(self) -> str:
        """The log's line on live recovery: this replica, and the rule for a round of fewer workers."""
        n, cfg = self.env.world_size, self.rp.cfg
        restarted = f", restarted ({restart_count()}): to be healed by a peer" if self.joining else ""
        if cfg.live.global_batch == "constant":
            return f"live recovery: replica {self.env.rank} of {n}{restarted}; a step with k of {n} workers takes the " \
                   f"whole global batch, each of the k {n}/k times the micro-steps (global batch kept: " \
                   "live.global_batch = constant)"
        rule = ("learning rate scaled by k/N (live.lr_scaling = linear)" if cfg.live.lr_scaling == "linear" else
                "learning rate kept (live.lr_scaling = none)")
        return f"live recovery: replica {self.env.rank} of {n}{restarted}; a step with k of {n} workers takes " \
               f"k/{n} of the global batch, its {rule}"


def _connect(cfg) -> Callable[[], object]:
    """A new client of the job's live store, each time called."""
    address = store_address()
    return lambda: connect_store(address, cfg.live.heartbeat_timeout_s * 4 + 30)


def _store_reachable(address: tuple[str, int], timeout_s: float) -> None:
    why = unreachable(address, timeout_s)
    if why:
        raise StoreGone(f"the live store at {address[0]}:{address[1]} cannot be reached ({why}, {timeout_s:g} s): it "
                        "is gone, and the job's rounds with it; start it again, then every worker: the run resumes "
                        "from its last checkpoint")


def _peak_rss(logs: dict[int, list[dict]], replicas: int) -> list[float | None]:
    """Each replica's peak resident MiB so far, from its live log's attempts (None: it logged none)."""
    return [max((r["peak_rss_mb"] for r in logs.get(i, []) if "peak_rss_mb" in r), default=None)
            for i in range(replicas)]


def fault_in_heal(rank: int) -> None:
    """The injected ``kill-in-heal`` fault's second part: this rank, restarted, dies as its heal arrives."""
    fault = run_fault()
    if fault is not None and fault[0] == rank and fault[2] == "kill-in-heal" and restart_count() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_before_vote(rank: int, step: int) -> None:
    """The injected ``kill-before-vote`` fault: this rank dies after its all-reduce, before voting."""
    fault = run_fault()
    if fault is not None and fault[0] == rank and fault[1] == step and fault[2] == "kill-before-vote":
        os.kill(os.getpid(), signal.SIGKILL)
