"""Evaluation and checkpoints as a step hook: every ``log.eval_every`` and ``checkpoint.every`` steps, and
both at the last step.

A checkpoint is a collective (:mod:`dptrain.checkpoint.save`): the ranks gather their RNG
states, every rank writes what only it holds (a sharding wrapper's shards, compression's
residuals, the strategy's own per-rank state) into the staging directory, and rank 0
writes the rest and publishes the directory with one rename, so a crash never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dptrain.api.engine import StepInfo
from dptrain.checkpoint.save import save_run_checkpoint
from dptrain.runner.hooks import RunContext, StepHook
from dptrain.runner.metrics import StepTimes
from dptrain.runner.outputs import evaluate

__all__ = ["EvalCheckpointHook", "checkpoint"]


class EvalCheckpointHook(StepHook):
    """Evaluate, then save, at the steps the config asks; at the last step, save, end the strategy's run (its
    wrapper's ``finish()``: replicas that differ by design made one model), then evaluate (all collectives).

    The last checkpoint comes before ``finish()``, so that a longer run resumed from it
    continues exactly (gossip's replicas, a local SGD or DiLoCo round in progress); what is
    evaluated and kept as the run's weights is the model after it.
    """

    def __init__(self, run: RunContext):
        self.run = run
        cfg = run.rp.cfg
        self.last, self.eval_every, self.save_every = cfg.train.steps, cfg.log.eval_every, cfg.checkpoint.every
        self.took_last = False

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        if step == self.last:
            self._last()
            return
        if self.eval_every and step % self.eval_every == 0:
            self._evaluate(step)
        if self.save_every and step % self.save_every == 0:
            checkpoint(self.run, step)

    def at_end(self, step: int) -> None:
        """The last step's outputs where this rank did not take that step but holds its state: a live recovery
        worker healed past it (a run resumed at its end has them already)."""
        if not self.took_last and self.run.start_step < self.last:
            self._last()

    def _last(self) -> None:
        step, self.took_last = self.last, True
        checkpoint(self.run, step)
        self.run.beat.mark(step, "finish")
        note = self.run.engine.model.finish()
        if note:  # what finishing changed that the last checkpoint does not hold
            self.run.log.info(f"end of training: {note}")
        self._evaluate(step)

    def _evaluate(self, step: int) -> None:
        self.run.beat.mark(step, "eval")
        # the samples every data rank of the plan would take, whatever the process group (live recovery: one each)
        batches = self.run.rp.cfg.log.eval_batches * max(1, self.run.rp.plan.world_size // dist.get_world_size())
        ev = evaluate(self.run.engine, self.run.rp.task, batches,
                      progress=lambda: self.run.beat.mark(step, "eval"))  # each batch: a long evaluation is no hang
        ev = {"kind": "eval", "step": step, **ev, "time": time.time()}
        if self.run.sink is not None:
            self.run.sink.log(ev, step)
        self.run.log.info(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                                                                if k.startswith("val_")))


def checkpoint(run: RunContext, step: int) -> None:
    """Collective: the run's checkpoint at ``step`` (:func:`~dptrain.checkpoint.save.save_run_checkpoint`), each file
    marking progress on the heartbeat (a long save is not a hang); rank 0 logs it."""
    rp = run.rp
    meta = {"identity": rp.identity, "identity_hash": rp.identity_hash, "global_batch_size": rp.plan.global_batch_size,
            "torch_version": torch.__version__, "data": rp.data_identity,
            **(run.checkpoint_meta() if run.checkpoint_meta is not None else {})}
    saved = save_run_checkpoint(rp.run_dir, step, run.engine, strategy=rp.cfg.distributed.strategy, meta=meta,
                                keep_last=rp.cfg.checkpoint.keep_last, parts=run.parts,
                                progress=lambda: run.beat.mark(step, "checkpoint"))
    if saved is not None:
        path, deleted = saved
        run.log.info(f"checkpoint {path.name} saved" + (f" ({len(deleted)} older deleted)" if deleted else ""),
                     console=False)
