"""Evaluation and checkpoints as a step hook: every ``log.eval_every`` and ``checkpoint.every`` steps, and
both at the last step.

A checkpoint is a collective: the ranks gather their RNG states, every rank writes what
only it holds (ZeRO's shards, compression's residuals, gossip's own replica) into the
staging directory, and rank 0 writes the rest and publishes the directory with one rename
(:mod:`dptrain.runner.checkpoint`), so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dptrain.api.engine import StepInfo
from dptrain.runner.checkpoint import (
    SHARDED,
    fresh_dir,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    staging_dir,
)
from dptrain.runner.hooks import RunContext, StepHook
from dptrain.runner.metrics import StepTimes
from dptrain.runner.outputs import evaluate
from dptrain.runner.resume import COMPRESSION, REPLICAS, replica_state
from dptrain.strategies.state import replicated_state
from dptrain.utils.files import open_file
from dptrain.zero.checkpoint import save_sharded

__all__ = ["EvalCheckpointHook", "save_run_checkpoint"]


class EvalCheckpointHook(StepHook):
    """Evaluate, then save, at the steps the config asks and at the last (both collectives).

    Where the replicas differ by design (gossip), the last checkpoint keeps each rank's own
    replica, so that a longer run resumed from it continues exactly; after it the replicas are
    averaged, and the average is what is evaluated and kept as the run's weights.
    """

    def __init__(self, run: RunContext):
        self.run = run
        cfg = run.rp.cfg
        self.last, self.eval_every, self.save_every = cfg.train.steps, cfg.log.eval_every, cfg.checkpoint.every
        self.average: Callable[[], None] | None = run.engine.model.average_ if run.engine.gossip else None

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        saved = step == self.last and self.average is not None
        if saved:
            save_run_checkpoint(self.run, step)
            self.average()
        if (self.eval_every and step % self.eval_every == 0) or step == self.last:
            self._evaluate(step)
        if not saved and ((self.save_every and step % self.save_every == 0) or step == self.last):
            save_run_checkpoint(self.run, step)

    def _evaluate(self, step: int) -> None:
        self.run.beat.mark(step, "eval")
        ev = evaluate(self.run.engine, self.run.rp.task, self.run.rp.cfg.log.eval_batches,
                      progress=lambda: self.run.beat.mark(step, "eval"))  # each batch: a long evaluation is no hang
        ev = {"kind": "eval", "step": step, **ev, "time": time.time()}
        if self.run.sink is not None:
            self.run.sink.log(ev, step)
        self.run.log.info(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                                                                if k.startswith("val_")))


def _per_rank_parts(run: RunContext) -> dict[str, Callable[[], dict]]:
    """The parts of a checkpoint that differ between ranks, by subdirectory: each rank saves its own."""
    parts: dict[str, Callable[[], dict]] = {}
    if run.compression is not None:
        parts[COMPRESSION] = run.compression.state_dict
    if run.engine.gossip:  # the replicas differ: each rank's own, with its optimizer state and mixing step
        parts[REPLICAS] = lambda: replica_state(run.engine)
    return parts


def save_run_checkpoint(run: RunContext, step: int) -> None:
    """Collective: gather every rank's RNG state; every rank stages its own files; rank 0 writes and publishes.

    Each part and file marks progress on the heartbeat: a long save is not a hang.
    """
    engine, env = run.engine, run.env
    progress = (lambda: run.beat.mark(step, "checkpoint"))
    progress()
    states: list = [None] * env.world_size
    dist.all_gather_object(states, rng_state(run.device))
    parts = _per_rank_parts(run)
    staged = engine.sharded or bool(parts)
    if staged:
        _stage(run, step, parts, progress)
    if env.rank == 0:
        path = save_checkpoint(run.rp.run_dir, step, _rank0_files(run, states), _meta(run), staged=staged,
                               progress=progress)
        deleted = prune_checkpoints(run.rp.run_dir, run.rp.cfg.checkpoint.keep_last, saved=path)
        run.log.info(f"checkpoint {path.name} saved" + (f" ({len(deleted)} older deleted)" if deleted else ""),
                     console=False)
    dist.barrier()  # a rank that fails after this point finds the checkpoint complete


def _stage(run: RunContext, step: int, parts: dict[str, Callable[[], dict]], progress: Callable[[], None]) -> None:
    """Every rank's own files into the staging directory, which rank 0's rename publishes with the rest."""
    staged = staging_dir(run.rp.run_dir, step)
    if run.env.rank == 0:
        fresh_dir(staged)
    dist.barrier()
    if run.engine.sharded:
        save_sharded(staged / SHARDED, run.engine.model, run.engine.optimizer)
        progress()
    for name, state in parts.items():
        (staged / name).mkdir(exist_ok=True)
        with open_file(staged / name / f"rank{run.env.rank}.pt", "xb") as f:
            torch.save(state(), f)
        progress()
    if parts:
        dist.barrier()


def _rank0_files(run: RunContext, states: list) -> dict[str, dict]:
    """trainer.pt (step, skips, every rank's RNG, the loss scaler) and, when replicated, model.pt and optimizer.pt."""
    engine = run.engine
    trainer = {"step": engine.step_count, "skipped_steps": engine.skipped_steps, "rng": states,
               "world_size": run.env.world_size}
    if engine.scaler is not None:
        trainer["scaler"] = engine.scaler.state_dict()
    if engine.sharded:
        return {"trainer.pt": trainer}
    model_state, optim_state = replicated_state(engine.model.module, engine.optimizer)  # strategies/state.py
    return {"model.pt": model_state, "optimizer.pt": optim_state, "trainer.pt": trainer}


def _meta(run: RunContext) -> dict:
    """meta.json: what a resumed run checks (identity, batch, world size) and how the files are laid out."""
    rp = run.rp
    return {"identity": rp.identity, "identity_hash": rp.identity_hash,
            "global_batch_size": rp.plan.global_batch_size, "world_size": run.env.world_size,
            "torch_version": torch.__version__, "format": "sharded" if run.engine.sharded else "replicated",
            "strategy": rp.cfg.ddp.strategy, "data": rp.data_identity}
