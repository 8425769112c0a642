"""``dptrain run`` with ``distributed.strategy = "ps"``: the parameter-server job on every rank.

Servers (the last ``ps.servers`` ranks) serve until every worker has left. Workers
(ranks ``0 .. W-1``) each draw their own shard of the data and loop: micro-steps of
forward and backward, push the gradient, receive the new parameters; in the async modes
a fast worker simply takes more steps. The run ends when the servers' budget is spent:
``train.steps`` rounds (sync, backup) or ``train.steps x W`` gradients (async, ssp), the
same number of samples as ``train.steps`` synchronous steps.

Rank 0 (worker 0) logs its own steps (there is no collective between workers: in async
mode they are at different steps), evaluates the final parameters alone, writes the
weights, and returns the run's facts with every server's report; the caller (``dptrain.run``)
writes the summary and the pages from them and the run directory's files, as for every strategy.

Why this is not :mod:`dptrain.runner.loop` with another strategy: that loop is one SPMD
program, every rank stepping in lockstep through ``train.steps`` steps of an
:class:`~dptrain.api.engine.Engine`, and half its step hooks are collectives that every rank
must enter at the same step (the metrics record's all-gather, evaluation, checkpoints, the
divergence check). Here the ranks run two programs (servers serve, workers push and pull),
a worker's number of steps is not known in advance (the servers' budget decides, and in the
async modes a fast worker takes more), no two workers share a collective, and a worker may
die without stopping the run (``expendable_workers``). What carries over is what the hooks
wrap, per rank: the heartbeat, fault and straggler injection, the tensor-peak count, the
trace recorder, the log and metrics backends, and the outputs: the runner hands them to this
program in a :class:`~dptrain.runner.lifecycle.ProgramContext` (the run's lifecycle, shared with
the SPMD loop), so this package imports nothing above itself.

Checkpoints (every ``checkpoint.every`` steps, and at the end) are cuts of
:mod:`dptrain.ps.snapshot`, taken while training goes on; the servers write their files and
rank 0 publishes each cut once every server reports it complete
(:mod:`dptrain.ps.checkpoint`). A run started again in the same directory, by hand or
by ``--max-restarts``, resumes from the newest: servers from their shards and the gradients
they recorded in flight, workers from their clocks (so their data positions) and random streams.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from dptrain.checkpoint.files import rng_state, set_rng_state
from dptrain.checkpoint.resume import seed_everything
from dptrain.ps.checkpoint import CutFiles, Publisher, load_server_cut, load_worker_cut
from dptrain.ps.consistency import Consistency
from dptrain.ps.job import build_parameter_server
from dptrain.ps.layout import Roles
from dptrain.ps.server import ShardServer
from dptrain.ps.snapshot import CutPolicy, CutSchedule
from dptrain.ps.wire import pack
from dptrain.ps.worker import PSWorker

__all__ = ["train_ps"]


def train_ps(ctx: Any) -> Any:
    """This rank's part: a server serves, a worker trains; the heartbeat's watchdog sees each step, and a server's
    every update. ``ctx``: the runner's :class:`~dptrain.runner.lifecycle.ProgramContext`. Rank 0 returns the run's
    facts (the summary's input)."""
    rp, env, device, beat = ctx.rp, ctx.env, ctx.device, ctx.beat
    cfg, rank, plan = rp.cfg, env.rank, rp.plan
    t, p = cfg.train, cfg.ps
    wall0 = time.perf_counter()
    seed_everything(t.seed)
    task = rp.task
    model = task.build_model().to(device)
    consistency = Consistency(p.mode, staleness=p.staleness, backups=p.backups)
    start_step = rp.resume_meta["step"] if rp.resume_from is not None else 0
    cuts, worker_state = _cut_policy(rp, env, model, device, start_step)
    role = build_parameter_server(
        model, ctx.optimizer, num_servers=p.servers, consistency=consistency, steps=t.steps, lr_at=ctx.lr_at,
        grad_clip=t.grad_clip, lookahead=p.lookahead, before_server_step=_server_step(ctx, rank), cuts=cuts,
        timeout=timedelta(seconds=cfg.distributed.timeout_s))
    log = ctx.open_log(start_step)
    workers = plan.world_size
    log.info(f"dptrain run: task {task.name}, {sum(x.numel() for x in model.parameters()):,} parameters, "
             f"parameter server ({p.mode}{_mode_detail(p)}): {workers} worker(s), {p.servers} server(s) "
             f"(ranks {workers}-{env.world_size - 1}); global batch {plan.global_batch_size} = micro "
             f"{plan.micro_batch_size} x {workers} workers x {plan.grad_accum_steps} accum")
    if start_step:
        log.info(f"resumed from {rp.resume_from} at step {start_step}")
    if isinstance(role, ShardServer):
        if rp.resume_from is not None:
            role.restore(*load_server_cut(rp.resume_from, rank - workers))
        beat.mark(start_step, "serve")
        report = role.serve()
        log.info(f"server rank {rank}: {report['updates']} updates from {report['gradients']} gradients, "
                 f"{report['dropped']} dropped, lost workers: {report['lost_workers'] or 'none'}")
        log.close()
        return None
    if worker_state is None:
        seed_everything(t.seed + 1 + rank)  # workers draw different dropout masks
        if rp.resume_from is not None:
            log.info(f"rank {rank} had died before the cut it resumes from: its random streams start afresh")
    else:
        _load_worker_state(worker_state, model, device)
    sink = ctx.open_sink(start_step, log)  # rank 0's metrics.jsonl and log.backends
    beat.mark(start_step)
    loop = _WorkerLoop(
        role, task, ctx.batches(rank, role.clock), plan.grad_accum_steps, log, rank, every=cfg.log.every,
        straggler=ctx.straggler, tracer=ctx.tracer(role.clock),
        samples_per_update=plan.micro_batch_size * plan.grad_accum_steps * (
            workers if p.mode == "sync" else workers - p.backups if p.mode == "backup" else 1),
        step_of=lambda version: version if consistency.rounds else version // workers,
        lr_scale=1.0 if consistency.rounds else 1.0 / workers, ctx=ctx,
        publisher=Publisher(rp, cuts.schedule, env.world_size, log, start_step) if rank == 0 else None)
    try:
        records = loop.run(sink)
        reports = role.leave()
        beat.disarm()
        facts = None
        if rank == 0:
            loop.publisher.advance(min(role.saved))  # the last cut, complete once every worker has left
            if loop.tracer is not None and loop.tracer.events:
                loop.tracer.write_local(rp.run_dir / "trace.json")
                log.info(f"trace of rank 0's steps {loop.tracer.steps.start}-{loop.tracer.steps.stop - 1}: "
                         f"{rp.run_dir / 'trace.json'} (open in https://ui.perfetto.dev)")
            report = _report(cfg, workers, reports, records, loop.publisher.labels)
            facts = ctx.finish(model, start_step, wall0, sink, log, data_ranks=workers,
                               layout=f"parameter server ({p.mode}), {workers} workers", strategy_rows=ps_rows(report),
                               strategy_report=report)
    finally:
        if sink is not None:
            sink.close()
    log.close()
    return facts


def _cut_policy(rp: Any, env: Any, model, device: torch.device,
                start_step: int) -> tuple[CutPolicy, dict | None]:
    """This rank's part in checkpoints, and (a resumed worker) its state in the cut resumed from."""
    roles = Roles(env.world_size, rp.cfg.ps.servers)
    schedule = CutSchedule(rp.cfg.checkpoint.every, rp.cfg.train.steps)
    if roles.is_server(env.rank):
        index = roles.servers.index(env.rank)
        return CutPolicy(schedule, writer=CutFiles(rp.run_dir, index, leader=index == 0), label=start_step), None
    clock, state = load_worker_cut(rp.resume_from, env.rank) if rp.resume_from is not None else (0, None)
    return CutPolicy(schedule, worker_state=lambda: pack(_worker_state(model, device)), label=start_step,
                     clock=clock), state


def _worker_state(model, device: torch.device) -> dict:
    """What a worker's MARK carries: its random streams (dropout) and its persistent buffers (running statistics;
    the servers hold the parameters, and a non-persistent buffer, such as a causal mask, is a constant)."""
    names = {name for name, _ in model.named_buffers()}
    return {"rng": rng_state(device),
            "buffers": {name: b.detach().cpu() for name, b in model.state_dict().items() if name in names}}


def _load_worker_state(state: dict, model, device: torch.device) -> None:
    """A resumed worker's random streams and buffers, as its MARK recorded them."""
    set_rng_state(state["rng"], device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in state["buffers"]:
                buffer.copy_(state["buffers"][name])


def _server_step(ctx: Any, rank: int):
    """Before a server's update: mark progress; DPTRAIN_FAULT for a server rank fires once, before the server
    applies its first update of that step.

    A server's step is the logged one: rounds in sync and backup, gradients applied / workers in async and ssp."""
    fired = []
    fault = ctx.fault

    def before_step(step: int) -> None:
        ctx.beat.mark(step, "serve")
        if fault and fault[0] == rank and step == fault[1] and not fired:
            fired.append(step)
            ctx.inject_fault(fault[2], rank, step)
    return before_step


def _mode_detail(p) -> str:
    return f", staleness {p.staleness}" if p.mode == "ssp" else f", {p.backups} backup(s)" if p.mode == "backup" else ""


@dataclass
class _WorkerLoop:
    """A worker's steps until the servers say stop; rank 0 writes a metrics record every ``every`` steps."""

    role: PSWorker
    task: Any
    batches: Iterator
    accum: int
    log: Any  # this rank's RunLog
    rank: int
    every: int
    straggler: Any  # this rank's Straggler, or None
    tracer: Any  # rank 0's TraceRecorder, or None
    samples_per_update: int  # samples in one server update: micro x accum x gradients per update
    step_of: Callable[[int], int]  # a server version in synchronous steps
    lr_scale: float
    ctx: Any  # the runner's ProgramContext: the schedule, faults, the heartbeat, the tensor peak, memory
    publisher: Publisher | None  # rank 0's: publishes the checkpoints the servers complete
    tensor_peak_bytes: int | None = None  # its second step's live tensors (CPU), once measured

    def run(self, out: Any) -> list[dict]:
        """Steps until the servers stop; each record to ``out`` (rank 0's backends, which the caller closes)."""
        fault, ctx = self.ctx.fault, self.ctx
        records, window, step = [], [], self.role.clock  # a worker's steps go on from its clock in a resumed run
        peak_step = step + 2  # the session's second step: its live tensors are measured
        last = (time.perf_counter(), min(self.role.version))
        while not self.role.stopped:  # stopped at once: resumed from the last step's checkpoint
            step += 1
            ctx.beat.mark(step)  # the watchdog's view of this worker
            if fault and fault[:2] == (self.rank, step):
                ctx.inject_fault(fault[2], self.rank, step, self.role.model)
            peak = ctx.tensor_peak(self.role.model) if step == peak_step else None  # its second step's live tensors
            with peak or contextlib.nullcontext():
                t0 = time.perf_counter()
                loss, micro = self._compute()
                t1 = time.perf_counter()
                stop = self.role.step(loss)
                t2 = time.perf_counter()
            if peak is not None:
                self.tensor_peak_bytes = getattr(peak, "peak_bytes", None)
            if self.tracer is not None and self.tracer.wants(step):
                self.tracer.add_ps_step(step, t0, micro, t2)
            window.append((loss, t1 - t0, t2 - t1, t2 - t0))
            self.log.step_done()
            if self.publisher is not None:
                self.publisher.advance(min(self.role.saved))
            if out is not None and (step % self.every == 0 or stop):
                # the servers' progress as this worker last heard it; at the end, the budget a server said it spent
                # (with several servers one may answer a step before the others' last update reaches it: every
                # server gets the same pushes, so each ends at the budget)
                now, version = time.perf_counter(), max(self.role.version) if stop else min(self.role.version)
                rec = self._record(version, step, window,
                                   (version - last[1]) * self.samples_per_update / (now - last[0]))
                out.log(rec, rec["step"])
                self.log.train_record(rec)
                records.append(rec)
                window, last = [], (now, version)
            if stop:
                break
        return records

    def _compute(self) -> tuple[float, list[tuple[float, float, float]]]:
        """Forward and backward of every micro-step; the mean loss and each micro-step's (forward, backward, end)."""
        loss_sum, micro = 0.0, []
        for k in range(self.accum):
            f0 = time.perf_counter()
            loss = self.task.loss(self.role.model, next(self.batches)) / self.accum
            if self.straggler and k == 0:
                self.straggler.delay()
            b0 = time.perf_counter()
            loss.backward()
            loss_sum += float(loss.detach())
            micro.append((f0, b0, time.perf_counter()))
        if self.straggler:
            self.straggler.step_done(micro[-1][2] - micro[0][0])
        return loss_sum, micro

    def _record(self, version: int, worker_step: int, window: list[tuple], samples_per_s: float) -> dict:
        """Rank 0's metrics record. ``step``, the learning rate and the speed follow the servers' progress
        (their versions, in synchronous steps), not rank 0's own steps, which run ahead or behind in async.
        ``loss`` is the servers' last step's: the mean over the workers' gradients it applied (in sync, every
        worker's loss of the step, as DDP logs it), not rank 0's own."""
        mean = (lambda i: sum(w[i] for w in window) / len(window))
        pushed = self.role.flat.numel() * 4  # the gradient, to the servers; the parameters come back
        rss, tensors = self.ctx.memory(self.tensor_peak_bytes)
        step = self.step_of(version)
        return {"kind": "train", "step": step, "worker_step": worker_step, "loss": self.role.step_loss,
                "lr": self.ctx.lr_at(step) * self.lr_scale, "grad_norm": self.role.grad_norm, "skipped_steps": 0,
                "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * self.task.tokens_per_sample,
                "step_ms": 1e3 * mean(3), "compute_ms": 1e3 * mean(1), "exposed_comm_ms": 1e3 * mean(2),
                "comm_busy_ms": 1e3 * mean(2), "overlap_pct": 0.0, "comm_bytes_per_step": 2 * pushed,
                "comm_compressed_bytes_per_step": 0, "comm_sent_bytes_per_step": pushed, "version": version,
                "peak_rss_mb": [rss], "peak_tensor_mb": [tensors], "time": time.time()}


def _report(cfg: Any, workers: int, reports: dict, records: list[dict], checkpoints: list[int]) -> dict[str, Any]:
    """The parameter server's report for the summary (kept in summary.json under "ps")."""
    return {"mode": cfg.ps.mode, "servers": cfg.ps.servers, "workers": workers,
            "staleness_bound": cfg.ps.staleness if cfg.ps.mode == "ssp" else None,
            "backups": cfg.ps.backups if cfg.ps.mode == "backup" else None,
            "rank0_steps": records[-1]["worker_step"] if records else 0, "servers_report": reports,
            "checkpoints": checkpoints,
            "straggler": None if cfg.straggler.rank < 0 else {"rank": cfg.straggler.rank, "factor": cfg.straggler.factor}}


def ps_rows(ps: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The parameter server's lines of the summary: per server, updates, staleness, dropped and lost workers."""
    detail = (f", staleness bound {ps['staleness_bound']}" if ps.get("staleness_bound") is not None else
              f", {ps['backups']} backup(s)" if ps.get("backups") is not None else "")
    rows = [("parameter server", f"{ps['mode']}, {ps['servers']} server(s), {ps['workers']} worker(s){detail}")]
    for name, rep in ps["servers_report"].items():
        rows.append((name.replace("_", " "), f"{rep['updates']} updates from {rep['gradients']} gradients, "
                                             f"{rep['dropped']} dropped; per worker {rep['applied_per_worker']}"))
        rows.append(("  staleness (steps)", _hist(rep["staleness"])))
        rows.append(("  delay (updates)", _hist(rep["delay"])))
        if rep["lost_workers"]:
            rows.append(("  lost workers", "; ".join(f"rank {w}: {why}" for w, why in rep["lost_workers"].items())))
    if ps.get("straggler"):
        rows.append(("straggler", f"rank {ps['straggler']['rank']} made {ps['straggler']['factor']:g}x slower"))
    return tuple(rows)


def _hist(counts: dict[str, int]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{k}: {v} ({100 * v / total:.0f}%)" for k, v in counts.items()) or "none"
