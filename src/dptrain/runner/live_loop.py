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

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch

from dptrain.api.engine import Engine
from dptrain.checkpoint.resume import seed_everything
from dptrain.data.stream import SampleStream
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.live import LiveManager, LiveSettings, connect_store
from dptrain.live.heal import state_hash
from dptrain.live.records import live_totals, read_live_logs
from dptrain.live.store import store_address
from dptrain.runner.build import build_engine
from dptrain.runner.facts import RunFacts
from dptrain.runner.hooks import Hooks, RunContext, StepHook
from dptrain.runner.hooks.checkpoint import EvalCheckpointHook
from dptrain.runner.hooks.guard import FaultHook, HeartbeatHook, SkipHook
from dptrain.runner.hooks.metrics import MetricsHook, strategy_record
from dptrain.runner.lifecycle import open_sink, run_fault
from dptrain.runner.loop import _open_log, _resume_or_seed, _save_final_weights, timed_backward
from dptrain.runner.plan import RunPlan
from dptrain.tasks import collate
from dptrain.utils.files import open_file

__all__ = ["train_live", "live_settings", "step_seed", "replica_tensors"]

FINISH_POLL_S = 0.1
FINAL_KEY, DONE_KEY = "final/0", "done"  # replica 0 holds the final state; it has written it


def live_settings(cfg) -> LiveSettings:
    v = cfg.live
    return LiveSettings(heartbeat_timeout_s=v.heartbeat_timeout_s, join_timeout_s=v.join_timeout_s,
                        start_timeout_s=v.start_timeout_s, min_workers=v.min_workers, on_too_few=v.on_too_few,
                        wait_timeout_s=v.wait_timeout_s)


def step_seed(seed: int, replica: int, step: int) -> int:
    """The seed of ``replica``'s generators at ``step``: a function of the three, so a healed worker needs none sent."""
    return (seed * 1_000_003 + replica * 7_919 + step * 104_729) % (2**31 - 1)


def replica_tensors(engine: Engine, position: int) -> list[torch.Tensor]:
    """Everything a replica holds that must be equal on every survivor: the model's state, the optimizer's state
    (parameter by parameter, key by key), the step count and the data position."""
    tensors = list(engine.model.module.state_dict().values())
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            for _, value in sorted(engine.optimizer.state.get(p, {}).items(), key=lambda kv: kv[0]):
                tensors.append(value if torch.is_tensor(value) else torch.tensor(float(value)))
    tensors.append(torch.tensor([engine.step_count, engine.skipped_steps, position], dtype=torch.int64))
    return tensors


def train_live(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> RunFacts | None:
    """This worker's run under live recovery (see the module docstring); replica 0 returns the run's facts."""
    wall0 = time.perf_counter()
    cfg, plan = rp.cfg, rp.plan
    seed_everything(cfg.train.seed)
    engine, _, n_params = build_engine(rp, env, device)
    address = store_address()
    manager = LiveManager(lambda: connect_store(address, cfg.live.heartbeat_timeout_s * 4 + 30), env.rank,
                          env.world_size, live_settings(cfg), -1,
                          progress=lambda: beat.mark(max(manager.step, 0) + 1, "quorum"))
    # restarted by its launcher, or started once rounds were under way (added, or back under torchrun or Slurm):
    # healed by a peer, not resumed
    joining = restart_count() > 0 or manager.round > 0
    start_step, position, note = (-1, 0, None) if joining else _resume(rp, env, engine)
    manager.step = start_step
    engine.model.register_comm_hook(None, manager.hook)  # the registry's comm_hooks: checked by validate
    log = _open_log(rp, env, device, n_params, max(start_step, 0), note)
    log.info(f"live recovery: replica {env.rank} of {env.world_size}"
             + (f", restarted ({restart_count()}): to be healed by a peer" if joining else "")
             + f"; a step with k of {env.world_size} workers takes k/{env.world_size} of the global batch, its "
             + ("learning rate scaled by k/N (live.lr_scaling = linear)" if cfg.live.lr_scaling == "linear" else
                "learning rate kept (live.lr_scaling = none)"))
    writer = env.rank == 0
    # a restarted replica 0 keeps every record (none past the step it is healed to exists); a torn last line goes
    sink = open_sink(rp, env.rank, cfg.train.steps if joining else start_step, log) if writer else None
    run = RunContext(rp, env, device, engine, log, beat, sink, None, max(start_step, 0), n_params)
    hooks = _hooks(run, manager)
    stream = SampleStream(rp.task.train_set, seed=cfg.train.seed, collate_fn=collate(rp.task))
    per = plan.micro_batch_size * plan.grad_accum_steps
    scale = [1.0]
    base_lr = engine.lr_at
    engine.lr_at = lambda s: base_lr(s) * scale[0]
    state = {"position": position}
    run.checkpoint_meta = lambda: {"live_position": state["position"]}
    check_every = cfg.live.check_every

    def held() -> dict:
        return {"engine": engine.state_dict(), "position": state["position"],
                "strategy": engine.model.checkpoint_state(engine.optimizer)}

    def load(received: dict) -> bytes:
        engine.load_state_dict(received["engine"])
        engine.model.load_checkpoint_state(received["strategy"], engine.optimizer)
        state["position"] = received["position"]
        return state_hash(replica_tensors(engine, state["position"]))

    live_log = _open_live_log(rp.run_dir / "logs" / f"live{env.rank}.jsonl")
    _write(live_log, {"event": "start", "replica": env.rank, "restart": restart_count(), "step": start_step,
                      "time": time.time(), "process_start": _process_start()})
    held_hash = lambda: state_hash(replica_tensors(engine, state["position"]))  # noqa: E731
    took_last = False
    if manager.store.check([DONE_KEY]):  # restarted after the run finished (it was stopped near the end)
        log.info("live recovery: the run has finished; nothing to join")
        live_log.close()
        manager.close()
        log.close()
        return None
    try:
        while manager.step < cfg.train.steps:
            attempt = manager.begin(held, held_hash, load)
            quorum = attempt.quorum
            if quorum.step >= cfg.train.steps:  # joined the others after their last step: healed to the end
                manager.end(attempt, False, counted=False)
                _write(live_log, {"event": "healed at the end", "members": list(quorum.replicas), "step": quorum.step,
                                  "heal_received": attempt.heal_received, "heal_s": round(attempt.heal_s, 4),
                                  "time": time.time()})
                continue
            step = quorum.step + 1
            ok, times = attempt.ok, None
            if ok:
                seed_everything(step_seed(cfg.train.seed, env.rank, step))
                scale[0] = quorum.size / env.world_size if cfg.live.lr_scaling == "linear" else 1.0
                hooks.begin_step(step)
                start = state["position"] + quorum.index * per
                batches = iter(stream.micro_batches(start, plan.micro_batch_size, plan.grad_accum_steps))
                times = timed_backward(engine, rp.task, batches)
                if times.comm is not None:  # a ring all-reduce's share: each member sends 2 (k - 1) / k of a bucket
                    times.comm.sent_bytes = manager.hook.bytes * 2 * (quorum.size - 1) // quorum.size
                _before_vote(run, step)
            committed = manager.vote(attempt, ok)
            info = _apply(engine, times) if committed else engine.drop_window()
            if committed:
                state["position"] += quorum.size * per
                manager.global_batch = quorum.size * per
                took_last = step == cfg.train.steps
                if took_last and writer:  # the final state is here: the others need not stay to heal it
                    manager.store.set(FINAL_KEY, "1")
            recovery = manager.end(attempt, committed)
            _write(live_log, _attempt_record(attempt, step, committed, recovery, manager,
                                             held_hash if committed and check_every and step % check_every == 0
                                             else None))
            if committed:
                hooks.after_step(step, info, times)
        if writer:
            manager.store.set(FINAL_KEY, "1")
            if not took_last:  # healed past the last step: its checkpoint and evaluation, which its hooks would make
                for hook in hooks.hooks:
                    if isinstance(hook, EvalCheckpointHook):
                        hook.after_step(cfg.train.steps, None, None)
        hooks.at_end(cfg.train.steps)
        if not writer:
            _serve_until_writer_done(manager, held, held_hash, load, cfg.live)
    finally:
        hooks.close()
        live_log.close()
        manager.liveness.stop()
    facts = _save_final_weights(run, wall0) if writer else None
    if facts is not None:
        facts = dataclasses.replace(facts, live=live_totals(read_live_logs(rp.run_dir)))
    if writer:
        manager.store.set(DONE_KEY, "1")
    manager.close()
    log.close()
    return facts


def _apply(engine: Engine, times):
    """The committed step: the optimizer's (clip, step, zero), timed into ``times``."""
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info


def _attempt_record(attempt, step: int, committed: bool, recovery: float | None, manager: LiveManager,
                    held_hash) -> dict:
    """One line of ``logs/live<r>.jsonl``: the attempt, its round and decision, a heal's bytes and seconds, the error
    that aborted it, the recovery it ended, and (every ``live.check_every`` steps) the state's hash."""
    quorum = attempt.quorum
    record = {"round": quorum.round, "step": step, "members": list(quorum.replicas), "commit": committed,
              "time": time.time()}
    if attempt.heal_sent or attempt.heal_received:
        record.update(heal_sent=attempt.heal_sent, heal_received=attempt.heal_received, heal_s=round(attempt.heal_s, 4))
    error = attempt.error or (f"{type(manager.group.error).__name__}: {manager.group.error}"
                              if manager.group.error is not None else "")
    if error:
        record["error"] = error[:300]
    if recovery is not None:
        record["recovery_s"] = round(recovery, 4)
    if held_hash is not None:
        record["hash"] = held_hash().hex()
    return record


class LiveRecordHook(StepHook):
    """The live counts into each metrics record (replica 0's view): round size, attempts, commits, heal bytes."""

    def __init__(self, manager: LiveManager):
        self.manager = manager

    def record(self) -> dict:
        return {**self.manager.stats.record(self.manager.group.size),
                "live_global_batch": getattr(self.manager, "global_batch", 0)}


def _hooks(run: RunContext, manager: LiveManager) -> Hooks:
    """The loop's hooks: the watchdog's marks, the injected fault, the skipped-steps bound on every worker; on
    replica 0 also the metrics (with the live counts), evaluation and checkpoints."""
    fault = run_fault()
    hooks: list[StepHook | None] = [
        HeartbeatHook(run.beat),
        FaultHook(fault, run.env.rank, run.engine.model) if fault else None,
        SkipHook(run.rp.cfg.train.max_skipped_steps, run.engine, run.start_step),
    ]
    if run.env.rank == 0:
        hooks += [MetricsHook.from_config(run, [strategy_record(run.engine), LiveRecordHook(manager).record]),
                  EvalCheckpointHook(run)]
    return Hooks([h for h in hooks if h is not None])


def _before_vote(run: RunContext, step: int) -> bool:
    """The injected ``kill-before-vote`` fault (this rank dies after its all-reduce, before voting); True: vote 1."""
    fault = run_fault()
    if fault is not None and fault[0] == run.env.rank and fault[1] == step and fault[2] == "kill-before-vote":
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _resume(rp: RunPlan, env: WorkerEnv, engine: Engine) -> tuple[int, int, str | None]:
    """Steps done, data position and a note, from the run's checkpoint (the position its meta recorded, or the
    step's share of a full-size run's samples for a checkpoint written without live recovery)."""
    start_step, note = _resume_or_seed(rp, env, engine, None)
    position = int((rp.resume_meta or {}).get("live_position", start_step * rp.plan.global_batch_size))
    return start_step, position, note


def _serve_until_writer_done(manager: LiveManager, held, held_hash, load, live) -> None:
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
        attempt = manager.begin(held, held_hash, load, abandon=finished)
        if attempt is not None:
            manager.end(attempt, False, counted=False)
        time.sleep(FINISH_POLL_S)


def _open_live_log(path: Path):
    """This worker's ``live<r>.jsonl``, appended to; an earlier life's torn last line (it was killed while writing) is
    ended first, so that it does not swallow this life's first line."""
    f = open_file(path, "a")
    if f.tell() > 0:
        with open_file(path, "rb") as previous:
            previous.seek(-1, 2)
            if previous.read(1) != b"\n":
                f.write("\n")
    return f


def _process_start() -> float | None:
    """When this process started (wall clock), from /proc: a restarted worker's rejoin is timed from it."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _write(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


