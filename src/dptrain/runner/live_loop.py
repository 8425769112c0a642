"""The training loop under live recovery (``live.enabled``): survivors go on, a restarted worker is healed.

Each worker's default process group is itself alone (``dptrain.run``): nothing in the job
spans a fixed set of processes, so no death can break it. The replicas meet in rounds
instead (:mod:`dptrain.live`). For every attempt at a step:

1. the round's quorum, its process group, and a heal of the members behind
   (:meth:`~dptrain.live.LiveManager.begin`);
2. this member's slice of the step's samples: the data is one stream
   (:class:`~dptrain.data.stream.SampleStream`), member ``i`` of ``k`` takes the ``i``-th
   ``micro x accum`` samples from the committed position; the random generators are
   seeded from (seed, replica, step), so a healed worker draws what it would have drawn;
3. forward and backward, the wrapper's comm hook averaging each bucket over the round
   (gradients divided by ``k``, the participants); the learning rate scaled by ``k / N``
   under ``live.lr_scaling = "linear"``;
4. the commit vote: on commit every member steps the optimizer and the position moves on
   by ``k x micro x accum``; on abort every member drops the window and the step is tried
   again in the next round, on the same samples.

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
import time

import torch

from dptrain.api.engine import Engine
from dptrain.checkpoint.resume import seed_everything
from dptrain.config import ConfigError
from dptrain.data.stream import SampleStream
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.live import JobMismatch, LiveManager, LiveSettings, TooFewWorkers, connect_store
from dptrain.live.quorum import StoreGone
from dptrain.live.records import live_totals, read_live_logs
from dptrain.live.store import store_address, unreachable
from dptrain.live.trust import identity_record
from dptrain.runner.build import build_engine
from dptrain.runner.facts import RunFacts
from dptrain.runner.hooks import Hooks, RunContext, StepHook
from dptrain.runner.hooks.checkpoint import EvalCheckpointHook
from dptrain.runner.hooks.guard import FaultHook, HeartbeatHook, SkipHook
from dptrain.runner.hooks.metrics import MetricsHook, TraceHook, strategy_record
from dptrain.runner.lifecycle import open_sink, run_fault
from dptrain.runner.live_log import LiveLog
from dptrain.runner.live_state import ReplicaState, step_seed
from dptrain.runner.loop import _open_log, _resume_or_seed, _save_final_weights, timed_backward
from dptrain.runner.plan import RunPlan
from dptrain.tasks import collate

__all__ = ["train_live", "live_settings"]

FINISH_POLL_S = 0.1
GONE_PROBE_S = 1.0  # how long a worker whose store call failed looks for the store before it says it is gone
FINAL_KEY, DONE_KEY = "final/0", "done"  # replica 0 holds the final state; it has written it


def live_settings(cfg) -> LiveSettings:
    v = cfg.live
    return LiveSettings(heartbeat_timeout_s=v.heartbeat_timeout_s, join_timeout_s=v.join_timeout_s,
                        start_timeout_s=v.start_timeout_s, min_workers=v.min_workers, on_too_few=v.on_too_few,
                        wait_timeout_s=v.wait_timeout_s)


def train_live(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> RunFacts | None:
    """This worker's run under live recovery (see the module docstring); replica 0 returns the run's facts.

    Raises ConfigError (exit 2) when the others run another job (``dptrain.live.trust``), and StoreGone (exit 3)
    when the live store cannot be reached within ``live.heartbeat_timeout_s``: at the start, or once a store call
    failed during the run."""
    address, patience = store_address(), rp.cfg.live.heartbeat_timeout_s
    _store_reachable(address, patience)  # before building anything: a restart into a store that is gone ends here
    try:
        return _train_live(rp, env, device, beat, address)
    except JobMismatch as e:
        raise ConfigError(str(e)) from None
    except (TooFewWorkers, ConfigError):
        raise
    except Exception:
        # a store call failed: if the store is gone, say that in one line. One short look, not the start's patience:
        # a store that died took the job's rounds with it, so one that answers again later is of no use to this job
        _store_reachable(address, min(patience, GONE_PROBE_S))
        raise


def _store_reachable(address: tuple[str, int], timeout_s: float) -> None:
    why = unreachable(address, timeout_s)
    if why:
        raise StoreGone(f"the live store at {address[0]}:{address[1]} cannot be reached ({why}, {timeout_s:g} s): it "
                        "is gone, and the job's rounds with it; start it again, then every worker: the run resumes "
                        "from its last checkpoint")


def _train_live(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat,
                address: tuple[str, int]) -> RunFacts | None:
    wall0 = time.perf_counter()
    cfg = rp.cfg
    seed_everything(cfg.train.seed)
    engine, _, n_params = build_engine(rp, env, device)
    parameters = [(name, tuple(p.shape)) for name, p in engine.model.module.named_parameters()]
    manager = LiveManager(lambda: connect_store(address, cfg.live.heartbeat_timeout_s * 4 + 30), env.rank,
                          env.world_size, live_settings(cfg), -1,
                          progress=lambda: beat.mark(max(manager.step, 0) + 1, "quorum"),
                          identity=identity_record(rp.identity, parameters, env.world_size))
    # restarted by its launcher, or started once rounds were under way (added, or back under torchrun or Slurm):
    # healed by a peer, not resumed
    joining = restart_count() > 0 or manager.round > 0
    start_step, position, note = (-1, 0, None) if joining else _resume(rp, env, engine)
    manager.step = start_step
    engine.model.register_comm_hook(None, manager.hook)  # the registry's comm_hooks: checked by validate
    log = _open_log(rp, env, device, n_params, max(start_step, 0), note)
    log.info(_live_line(cfg, env, joining))
    writer = env.rank == 0
    # a restarted replica 0 keeps every record (none past the step it is healed to exists); a torn last line goes
    sink = open_sink(rp, env.rank, cfg.train.steps if joining else start_step, log) if writer else None
    run = RunContext(rp, env, device, engine, log, beat, sink, None, max(start_step, 0), n_params)
    replica = ReplicaState(engine, SampleStream(rp.task.train_set, seed=cfg.train.seed, collate_fn=collate(rp.task)),
                           position, env.world_size, cfg.live.lr_scaling == "linear")
    run.checkpoint_meta = lambda: {"live_position": replica.position}
    hooks = _hooks(run, manager)
    live_log = LiveLog(rp.run_dir / "logs" / f"live{env.rank}.jsonl")
    live_log.start(env.rank, restart_count(), start_step)
    try:
        if manager.store.check([DONE_KEY]):  # restarted after the run finished (it was stopped near the end)
            log.info("live recovery: the run has finished; nothing to join")
            return None
        took_last = _rounds(run, manager, replica, hooks, live_log)
        if writer:
            manager.store.set(FINAL_KEY, "1")
            if not took_last:  # healed past the last step: its checkpoint and evaluation, which its hooks would make
                for hook in hooks.hooks:
                    if isinstance(hook, EvalCheckpointHook):
                        hook.after_step(cfg.train.steps, None, None)
        hooks.at_end(cfg.train.steps)
        if not writer:
            _serve_until_writer_done(manager, replica, cfg.live)
    finally:
        hooks.close()
        live_log.close()
        manager.liveness.stop()
    facts = None
    if writer:
        logs = read_live_logs(rp.run_dir)
        live = {**live_totals(logs), "peak_rss_mb_by_replica": _peak_rss(logs, env.world_size)}
        facts = dataclasses.replace(_save_final_weights(run, wall0), live=live)
        manager.store.set(DONE_KEY, "1")
    manager.close()
    log.close()
    return facts


def _rounds(run: RunContext, manager: LiveManager, replica: ReplicaState, hooks: Hooks, live_log: LiveLog) -> bool:
    """Attempt steps, round after round, until the last is committed; whether this worker took part in it."""
    cfg, engine, writer = run.rp.cfg, run.engine, run.env.rank == 0
    took_last = False
    while manager.step < cfg.train.steps:
        attempt = manager.begin(replica.held, replica.hash, replica.load)
        quorum = attempt.quorum
        for note in attempt.notes:  # a member of another job refused, or one whose state diverged left out
            run.log.info(f"live recovery: {note}")
        if quorum.step >= cfg.train.steps:  # joined the others after their last step: healed to the end
            manager.end(attempt, False, counted=False)
            live_log.healed_at_end(attempt)
            continue
        step, times = quorum.step + 1, None
        with contextlib.ExitStack() as measuring:  # the step's backward and optimizer (replica 0's tensor peak)
            if attempt.ok:
                seed_everything(step_seed(cfg.train.seed, run.env.rank, step))
                batches = replica.enter(quorum)
                hooks.begin_step(step)
                measuring.enter_context(hooks.measuring(step))
                times = timed_backward(engine, run.rp.task, iter(batches))
                if times.comm is not None:  # a ring all-reduce's share: each member sends 2 (k - 1) / k of a bucket
                    times.comm.sent_bytes = manager.hook.bytes * 2 * (quorum.size - 1) // quorum.size
                _fault_before_vote(run, step)
            committed = manager.vote(attempt, attempt.ok)
            info = _apply(engine, times) if committed else engine.drop_window()
        if committed:
            manager.global_batch = replica.committed(quorum)
            took_last = step == cfg.train.steps
            if took_last and writer:  # the final state is here: the others need not stay to heal it
                manager.store.set(FINAL_KEY, "1")
        recovery = manager.end(attempt, committed)
        check = committed and cfg.live.check_every and step % cfg.live.check_every == 0
        held_hash = replica.hash() if check else None
        if held_hash is not None:  # compared with the others' in the next round (dptrain.live.trust)
            manager.check = f"{step}:{held_hash.hex()}"
        live_log.attempt(attempt, step, committed, recovery, manager, held_hash)
        if committed:
            hooks.after_step(step, info, times)
    return took_last


def _live_line(cfg, env: WorkerEnv, joining: bool) -> str:
    """The log's line on live recovery: this replica, and the rule for a round of fewer workers."""
    n = env.world_size
    rule = ("learning rate scaled by k/N (live.lr_scaling = linear)" if cfg.live.lr_scaling == "linear" else
            "learning rate kept (live.lr_scaling = none)")
    restarted = f", restarted ({restart_count()}): to be healed by a peer" if joining else ""
    return f"live recovery: replica {env.rank} of {n}{restarted}; a step with k of {n} workers takes k/{n} of the " \
           f"global batch, its {rule}"


def _apply(engine: Engine, times):
    """The committed step: the optimizer's (clip, step, zero), timed into ``times``."""
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info


def _hooks(run: RunContext, manager: LiveManager) -> Hooks:
    """The loop's hooks: the watchdog's marks, the injected fault, the skipped-steps bound on every worker; on
    replica 0 also the trace of its own steps (the replicas share no process group to merge theirs in), the
    metrics (with the live counts: round size, attempts, commits, heal bytes, the step's global batch),
    evaluation and checkpoints."""
    fault = run_fault()
    hooks: list[StepHook | None] = [
        HeartbeatHook(run.beat),
        FaultHook(fault, run.env.rank, run.engine.model) if fault else None,
        SkipHook(run.rp.cfg.train.max_skipped_steps, run.engine, run.start_step),
    ]
    if run.env.rank == 0:
        def live_record() -> dict:
            return {**manager.stats.record(manager.group.size), "live_global_batch": manager.global_batch}
        hooks += [TraceHook.from_config(run),  # "collective" over this worker's own group: no other waits
                  MetricsHook.from_config(run, [strategy_record(run.engine), live_record]), EvalCheckpointHook(run)]
    return Hooks([h for h in hooks if h is not None])


def _peak_rss(logs: dict[int, list[dict]], replicas: int) -> list[float | None]:
    """Each replica's peak resident MiB so far, from its live log's attempts (None: it logged none)."""
    return [max((r["peak_rss_mb"] for r in logs.get(i, []) if "peak_rss_mb" in r), default=None)
            for i in range(replicas)]


def _fault_before_vote(run: RunContext, step: int) -> None:
    """The injected ``kill-before-vote`` fault: this rank dies after its all-reduce, before voting."""
    fault = run_fault()
    if fault is not None and fault[0] == run.env.rank and fault[1] == step and fault[2] == "kill-before-vote":
        os.kill(os.getpid(), signal.SIGKILL)


def _resume(rp: RunPlan, env: WorkerEnv, engine: Engine) -> tuple[int, int, str | None]:
    """Steps done, data position and a note, from the run's checkpoint (the position its meta recorded, or the
    step's share of a full-size run's samples for a checkpoint written without live recovery)."""
    start_step, note = _resume_or_seed(rp, env, engine, None)
    position = int((rp.resume_meta or {}).get("live_position", start_step * rp.plan.global_batch_size))
    return start_step, position, note


def _serve_until_writer_done(manager: LiveManager, replica: ReplicaState, live) -> None:
    """Stay, with nothing to step, until replica 0 has the final state: it marks it at once when it took the last
    step; otherwise (it is away, or restarting) the others answer rounds, so that it is healed when it joins. They
    leave once it has, or when it has been stale for ``live.join_timeout_s``."""
    store, t0 = manager.store, time.monotonic()
    finished = lambda: store.check([FINAL_KEY]) or store.check([DONE_KEY])  # noqa: E731
    while not finished() and time.monotonic() - t0 < live.heartbeat_timeout_s:  # it took the last step with us
        time.sleep(FINISH_POLL_S / 10)
    gone_since = None
    while not finished():
        if manager.liveness.stale(0):
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > live.join_timeout_s:
                return
        else:
            gone_since = None
        attempt = manager.begin(replica.held, replica.hash, replica.load, abandon=finished)
        if attempt is not None:
            manager.end(attempt, False, counted=False)
        time.sleep(FINISH_POLL_S)
