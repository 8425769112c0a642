"""Live recovery for your own training loop: :class:`Live`, the rounds a loop steps in.

The algorithm is ``dptrain run``'s live recovery (:mod:`dptrain.live`; torchft's ``Manager``
with ``should_commit`` is the same idea). Each worker is a process group of its own
(``dptrain.init_distributed()`` under ``dptrain launch --live-restarts N``), so no death
breaks a collective that spans the job; the workers meet in *rounds* instead, one per
attempt at a step:

1. **quorum and heal** (iterating :class:`Live`): the round's members, a process group of
   them, and a worker that is behind (restarted by its launcher) healed from an up-to-date
   peer: the model, the optimizer, the step, the data position and whatever ``state`` names
   (an LR scheduler...), confirmed by a hash;
2. **your forward and backward** on :meth:`Round.batches`, member ``i`` of ``k`` taking the
   ``i``-th share of the step's samples from one stream (:class:`~dptrain.data.stream.SampleStream`),
   the gradients averaged over the round's members by the wrapper's comm hook;
3. **the vote** (:meth:`Round.commit`): every member steps the optimizer, or none does (a
   member died after its all-reduce) and the step is attempted again, on the same samples.

A worker lost between rounds costs the step being attempted, never a restart of the
others; restarted, it joins a later round. A step with ``k`` of ``N`` workers takes
``k/N`` of the global batch (scale the learning rate by ``r.size / r.replicas`` if you
want the linear rule). The records are ``dptrain run``'s: ``logs/live<r>.jsonl`` in the
launch's run directory, totalled by :meth:`Live.totals`. ::

    device = dptrain.init_distributed()
    model, optimizer = dptrain.prepare(model, optimizer)
    live = dptrain.Live(model, optimizer, steps=1000, dataset=train_set, batch_size=32)
    for r in live:                       # step r.step, by r.size of the job's workers
        for x, y in r.batches():         # this member's share of the step's samples
            loss = F.cross_entropy(model(x), y)
            loss.backward()              # averaged over the round
        r.commit()                       # the vote; the optimizer steps on every member or none

Strategies whose ranks hold the same state and take a comm hook (the registry's ``live =
"step"``: DDP) are served; the others are refused with the reason. docs/api.md, "Live
recovery in your own loop".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from dptrain.api.engine import Engine
from dptrain.api.prepare import PreparedOptimizer
from dptrain.api.prepared_model import PreparedModel
from dptrain.checkpoint.replicated import replica_tensors, replicated_state, set_replicated_state
from dptrain.data.stream import SampleStream
from dptrain.launch.heartbeat import mark_progress
from dptrain.launch.rendezvous import detect_worker_env, replica_env, restart_count
from dptrain.live import LiveManager, LiveSettings, connect_store
from dptrain.live.finish import DONE_KEY, mark_final, serve_until_final
from dptrain.live.heal import state_hash
from dptrain.live.log import LiveLog
from dptrain.live.manager import Attempt
from dptrain.live.records import live_totals, read_live_logs
from dptrain.live.rounds import close_round
from dptrain.live.store import store_address
from dptrain.live.trust import identity_record
from dptrain.strategies import strategy_names
from dptrain.utils.tensors import map_tensors

__all__ = ["Live", "Round"]


class Round:
    """One attempt at step :attr:`step` (1-based) by :attr:`size` of the job's :attr:`replicas` workers, this one
    member :attr:`index`; end it with :meth:`commit`."""

    def __init__(self, live: Live, attempt: Attempt):
        quorum = attempt.quorum
        self.step, self.index, self.size = quorum.step + 1, quorum.index, quorum.size
        self.replicas = live.replicas
        self.members = tuple(quorum.replicas)  # the workers (replica ids) in this round
        self.committed: bool | None = None     # the vote's result, once :meth:`commit` is called
        self._live, self._attempt = live, attempt

    @property
    def samples(self) -> range:
        """This member's positions in the sample stream for the step (its ``micro x accum`` of them)."""
        per = self._live.per_member
        start = self._live.position + self.index * per
        return range(start, start + per)

    def batches(self) -> list[Any]:
        """This member's micro-batches of the step, on the model's device: ``grad_accum_steps`` of ``batch_size``
        samples each (needs ``dataset``)."""
        live = self._live
        if live.stream is None:
            raise ValueError("Round.batches() reads Live(..., dataset=...): pass the training set, or read your own "
                             "samples at the stream positions Round.samples")
        return [map_tensors(b, lambda t: t.to(live.device)) for b in live.stream.micro_batches(self.samples.start, live.micro,
                                                                            live.accum)]

    def commit(self, ok: bool = True) -> bool:
        """The round's vote, after this member's backward (``ok=False``: this member's step went wrong, e.g. a
        non-finite loss, and it votes no). True when every member voted yes: each has stepped its optimizer;
        False: none has, the gradients are dropped and the step is attempted again in the next round."""
        if self.committed is not None:
            raise RuntimeError(f"round of step {self.step} already decided (committed: {self.committed}): call "
                               "commit() once per round")
        self.committed = self._live._decide(self, ok)
        return self.committed


class Live:
    """Live recovery for a loop over :func:`dptrain.prepare`'s model and optimizer, or an :class:`Engine` (see the
    module docstring).

    ``steps``: optimizer steps in the run; ``dataset``, ``batch_size`` (samples per micro-batch; an Engine's plan
    gives it), ``collate_fn``, ``seed``: the sample stream :meth:`Round.batches` reads (epoch ``e`` shuffled by
    ``seed + e``); ``state``: more to heal a joining worker with, by name (objects with ``state_dict`` and
    ``load_state_dict``: an LR scheduler, a loss scaler); ``step``: steps already taken (a loop resumed from its
    own checkpoint; the position then starts at ``step`` full steps; an Engine's ``step_count`` by default). The rest are the ``[live]`` section's keys
    of ``dptrain run`` (docs/run.md). ``run_dir``: where ``logs/live<r>.jsonl`` goes (default: the launch's,
    ``$DPTRAIN_RUN_DIR``; none: no log).
    """

    def __init__(self, model: PreparedModel | Engine, optimizer: PreparedOptimizer | None = None, *, steps: int,
                 dataset: Dataset | None = None, batch_size: int = 1, collate_fn: Callable | None = None,
                 seed: int = 0, state: Mapping[str, Any] | None = None, step: int = 0,
                 heartbeat_timeout_s: float = 5.0, join_timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                 min_workers: int = 1, on_too_few: str = "stop", wait_timeout_s: float = 600.0,
                 check_every: int = 0, run_dir: str | Path | None = None):
        self.engine = model if isinstance(model, Engine) else None
        self.prepared = optimizer  # prepare()'s: its step averages the window, clips and skips a non-finite one
        wrapper, self.module, self.optimizer, strategy, self.device, accum = _parts(model, optimizer)
        if not strategy.live == "step" or strategy.live_group is not None:
            able = ", ".join(strategy_names(lambda s: s.live == "step" and s.live_group is None))
            raise ValueError(f"dptrain.Live averages each step's gradients over its round and heals a joining worker "
                             f"with a peer's state; strategy {strategy.name!r} cannot in your own loop (its ranks "
                             f"hold shards, or step alone between meetings: dptrain run serves those it can, hybrid ZeRO "
                             f"among them, whose shard groups it forms before the model is built): "
                             f"prepare the model with strategy {able}")
        if steps < 1 or batch_size < 1 or step < 0 or check_every < 0:
            raise ValueError(f"Live needs steps >= 1, batch_size >= 1, step >= 0 and check_every >= 0 (got steps "
                             f"{steps}, batch_size {batch_size}, step {step}, check_every {check_every})")
        if self.engine is not None and not step:  # an Engine knows the steps it has taken (a resumed one)
            step = self.engine.step_count
        self.steps, self.check_every, self.state = steps, check_every, dict(state or {})
        self.micro = self.engine.plan.micro_batch_size if self.engine is not None else batch_size
        self.accum = accum
        self.stream = SampleStream(dataset, seed=seed, collate_fn=collate_fn) if dataset is not None else None
        env = replica_env(detect_worker_env())
        self.replica, self.replicas = env.rank, env.world_size
        try:
            address = store_address()
        except ValueError:
            raise ValueError("dptrain.Live meets the job's other workers at its live store, which DPTRAIN_LIVE_STORE "
                             "names: run the script under dptrain launch --live-restarts N (it serves the store), "
                             "or start python -m dptrain.live.store and set the variable on every worker") from None
        settings = LiveSettings(heartbeat_timeout_s=heartbeat_timeout_s, join_timeout_s=join_timeout_s,
                                start_timeout_s=start_timeout_s, min_workers=min_workers, on_too_few=on_too_few,
                                wait_timeout_s=wait_timeout_s)
        parameters = [(name, tuple(p.shape)) for name, p in self.module.named_parameters()]
        job = {"script": Path(sys.argv[0]).name, "steps": steps, "micro_batch_size": self.micro,
               "grad_accum_steps": accum, "seed": seed}
        self.manager = manager = LiveManager(
            lambda: connect_store(address, heartbeat_timeout_s * 4 + 30), self.replica, self.replicas, settings, -1,
            progress=lambda: mark_progress(max(manager.step, 0) + 1, "quorum"),
            identity=identity_record(job, parameters, self.replicas))
        wrapper.register_comm_hook(None, manager.hook)
        joining = restart_count() > 0 or manager.round > 0  # restarted, or the others are under way: to be healed
        manager.step = -1 if joining else step
        self.position = 0 if joining else step * self.replicas * self.per_member
        run_dir = run_dir if run_dir is not None else os.environ.get("DPTRAIN_RUN_DIR")
        self.run_dir = Path(run_dir) if run_dir else None
        self.log = None
        if self.run_dir is not None:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.log = LiveLog(self.run_dir / "logs" / f"live{self.replica}.jsonl")
            self.log.start(self.replica, restart_count(), manager.step)
        self.over = manager.store.check([DONE_KEY])  # the job finished before this worker started: nothing to do

    @property
    def per_member(self) -> int:
        """Samples one member takes in a step: ``micro x accum``."""
        return self.micro * self.accum

    @property
    def step(self) -> int:
        """Steps committed so far (-1 while a joining worker waits to be healed)."""
        return self.manager.step

    def __iter__(self) -> Iterator[Round]:
        """Rounds until the last step is committed; then, on every worker but replica 0, stay to heal it if it is
        away, and close the connection to the store."""
        manager = self.manager
        try:
            while not self.over and manager.step < self.steps:
                attempt = manager.begin(self._held, self._hash, self._load)
                for note in attempt.notes:
                    print(f"live recovery: {note}", file=sys.stderr)
                if attempt.quorum.step >= self.steps:  # joined after the last step: healed to the end
                    manager.end(attempt, False, counted=False)
                    if self.log is not None:
                        self.log.healed_at_end(attempt)
                    continue
                if not attempt.ok:  # the heal or the group failed: the round aborts without a step
                    self._end(attempt, attempt.quorum.step + 1, manager.vote(attempt, False))
                    continue
                r = Round(self, attempt)
                yield r
                if r.committed is None:
                    raise RuntimeError(f"the round of step {r.step} ended without its vote: call r.commit() after "
                                       "the backward of every round")
            if not self.over:
                self._finish()
        finally:
            self.close()

    def totals(self) -> dict:
        """The run's live totals from every worker's log (``dptrain run``'s summary ``live``): attempts, commits,
        the recovery times, heal bytes."""
        return live_totals(read_live_logs(self.run_dir)) if self.run_dir else {}

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
        self.manager.close()

    # --------------------------------------------------------------- a round

    def _decide(self, r: Round, ok: bool) -> bool:
        attempt = r._attempt
        committed = self.manager.vote(attempt, ok)
        if committed:
            if self.engine is not None:
                self.engine.step()
            else:
                self.prepared.step()
                self.prepared.zero_grad(set_to_none=True)
            self.position += r.size * self.per_member
        elif self.engine is not None:
            self.engine.drop_window()
        else:
            self.prepared.zero_grad(set_to_none=True)
        self._end(attempt, r.step, committed)
        return committed

    def _end(self, attempt: Attempt, step: int, committed: bool) -> None:
        due = self.check_every and step % self.check_every == 0
        close_round(self.manager, self.log, attempt, step, committed, last=self.replica == 0 and step == self.steps,
                    held_hash=self._hash if due else None)

    def _finish(self) -> None:
        if self.replica == 0:
            mark_final(self.manager)
            self.manager.store.set(DONE_KEY, "1")
        else:
            serve_until_final(self.manager, self._held, self._hash, self._load)

    # ------------------------------------------------------- what a heal sends

    def _held(self) -> dict:
        model_state, optim_state = replicated_state(self.module, self.optimizer)
        held = {"model": model_state, "optimizer": optim_state, "step": self.manager.step,
                "position": self.position, "state": {k: v.state_dict() for k, v in self.state.items()}}
        if self.engine is not None:
            held["skipped_steps"] = self.engine.skipped_steps
        return held

    def _load(self, received: dict) -> bytes:
        set_replicated_state(self.module, self.optimizer, received["model"], received["optimizer"])
        for name, value in received["state"].items():
            self.state[name].load_state_dict(value)
        if self.engine is not None:
            self.engine.step_count, self.engine.skipped_steps = received["step"], received["skipped_steps"]
        self.position = received["position"]
        return self._hash(received["step"])

    def _hash(self, step: int | None = None) -> bytes:
        """The hash of what every member holds alike: parameters, buffers, optimizer state, the step, the position."""
        step = self.manager.step if step is None else step
        tensors = [t for _, t in replica_tensors(self.module, self.optimizer)]
        return state_hash(tensors + [torch.tensor([step, self.position], dtype=torch.int64)])


def _parts(model, optimizer) -> tuple:
    """(the strategy's wrapper, the user's module, the torch optimizer, the strategy's entry, the device, the
    accumulation's micro-steps) of a prepared model and optimizer, or of an Engine."""
    if isinstance(model, Engine):
        return (model.model, model.model.module, model.optimizer, model.strategy, model.device,
                model.plan.grad_accum_steps)
    if isinstance(model, PreparedModel) and isinstance(optimizer, PreparedOptimizer):
        return (model.wrapper, model.module, optimizer.optimizer, model.strategy, model.device,
                model.accumulation.grad_accum_steps)
    raise TypeError(f"Live takes dptrain.prepare()'s model and optimizer, or an Engine (got "
                    f"{type(model).__name__} and {type(optimizer).__name__})")
