"""The wrapper protocol: everything a data-parallel wrapper offers the layers above it, and everything in which the
strategies differ.

A strategy's ``wrap`` (:class:`~dptrain.strategies.registry.Strategy`) returns an
``nn.Module`` that also satisfies :class:`DataParallelWrapper`. The user API (``Engine``,
``prepare()``), the job runner and the checkpoints talk to the wrapper through these
members only, never through its type, its internals or its strategy's name, so a new
strategy needs no change above its package: local SGD and DiLoCo were added as one
package and one registry entry each. What each member means, and what the wrappers do:

==========================  ===============  ==================  ===============  ================  ================
member                      DDP engine       ZeRO                gossip (D-PSGD)  local SGD         DiLoCo
==========================  ===============  ==================  ===============  ================  ================
``set_requires_gradient_    flag read at     flag read at the    no-op            the DDP engine's  no-op
sync`` / ``no_sync()``      forward          end of backward                      in the warm-up
``last_step_comm``          bucket stats     unit stats, spans   None             DDP's, warm-up    None
``record_comm_spans(on)``   per bucket       no-op (timed)       no-op            DDP's             no-op
``before_optimizer_step``   no-op            no-op               mix              no-op             no-op
``after_optimizer_step``    no-op            no-op               no-op            count; average    count; outer
                                                                                  every H           step every H
``step_metrics()``          {}               {}                  consensus        bytes of the      bytes of the
                                                                 distance, mix    averages, local   outer steps,
                                                                                  steps             steps since
``finish()``                no-op            no-op               average          average           last outer step
``checkpoint_state`` /      {} / nothing     {} / nothing        rank: replica,   shared: step      shared: global
``load_checkpoint_state``                                        optimizer, mix   count; rank:      weights, outer
                                                                 steps            replica, optim.   momentum; rank:
                                                                                                    replica, inner
                                                                                                    optimizer
``evaluating()``            ``module``       the wrapper         ``module``       ``module``        ``module`` with
                                                                                                    global weights
``export_weights(path)``    rank 0 writes    gathered, rank 0    rank 0 writes    rank 0 writes     rank 0 writes
``full_state_dict()``       ``module``'s     gathered (all-      replicas' mean   replicas' mean    global weights
                            (no comm)        gather per unit)    (all-reduce)     (all-reduce)
==========================  ===============  ==================  ===============  ================  ================

- ``after_optimizer_step()`` is called by every rank after every optimizer step, skipped
  ones included (the step count is then the same on every rank): torchft's LocalSGD and
  DiLoCo hang on the same point (the optimizer's post-step hook).
- ``step_metrics()`` is called by every rank at a logging step (it may be a collective);
  its fields go into the metrics record, replacing the engine's where they name the same
  thing (the bytes a step sent).
- ``full_state_dict()`` is *the* model, whatever the strategy holds where: under the bare
  model's key names (what ``model.state_dict()`` gave before wrapping), full tensors, the
  same on every rank; every rank calls it (ZeRO gathers its shards; the strategies whose
  replicas differ by design answer with the parameters' mean, or DiLoCo's global weights,
  and rank 0's buffers, computed on a copy). ``dptrain.get_state_dict`` returns it.
- ``finish()``: every rank, after the last step's checkpoint (whose model is ``full_state_dict()``:
  where ``finish()`` changes more than that, it says so, and the run logs it) and before the final
  evaluation and weights: the replicas made one model where they differ by design.
- ``checkpoint_state(optimizer)`` returns ``{"shared": ..., "rank": ...}`` (either part may
  be missing): what the strategy keeps beyond the model and the optimizer under its layout,
  saved once (``shared``) or by every rank (``rank``); ``load_checkpoint_state`` gets the
  same back, with ``None`` for a part the checkpoint lacks (another number of ranks, another
  strategy), and returns what to tell the user about what starts afresh.

A strategy whose registry entry keeps the ``sharded`` checkpoint layout also offers
:class:`ShardedWrapper`'s members: it saves and loads its own shards (DCP, resharded on
any world size), loads full tensors from a replicated checkpoint, and names the shards an
optimizer steps (``prepare()`` moves a user's optimizer onto them).

Gradient clipping is not in the protocol: the norm must cover every parameter the
optimizer steps, which the wrapper does not know (``prepare()`` accepts optimizers over
parameters outside the model); the step core (:mod:`dptrain.api.step`) calls the
wrapper's own ``clip_grad_norm_`` where the entry says the parameters are sharded.

A strategy whose replicas step alone and meet every few steps (local SGD's averages,
DiLoCo's outer steps; registry ``live = "meeting"``) also offers :class:`MeetingWrapper`'s
members, through which live recovery holds its meetings: each over the round's group of
the workers alive then, its result applied only once the round's vote commits it.

The wrappers live below this package and do not import it (the layers point down): they
satisfy the protocol by their shape, and ``tests/test_strategies.py`` checks each one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dptrain.comm.step_stats import StepCommStats

__all__ = ["DataParallelWrapper", "ShardedWrapper", "MeetingWrapper"]


@runtime_checkable
class DataParallelWrapper(Protocol):
    """A module wrapped for data parallelism; see the module docstring.

    ``module``: the model as the user built it (under ZeRO its parameters live in the shards).
    ``device``: where the model computes.
    """

    module: nn.Module
    device: torch.device

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward reduces gradients (False: they add up locally, for accumulation)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``set_requires_gradient_sync(False)`` for the block, as torch DDP's context manager."""

    @property
    def last_step_comm(self) -> StepCommStats | None:
        """Calls, bytes and spans of the most recent synchronising backward on this rank; None if not measured."""

    def record_comm_spans(self, on: bool) -> None:
        """Record each reduction's exact completion time (a callback per reduction) for traces and overlap."""

    def before_optimizer_step(self) -> None:
        """Collective where the strategy needs one between backward and the optimizer step (gossip's mix)."""

    def after_optimizer_step(self) -> None:
        """After every optimizer step, skipped ones included (local SGD's averages, DiLoCo's outer steps)."""

    def step_metrics(self) -> dict[str, float]:
        """This strategy's fields for a metrics record; every rank calls it at a logging step."""

    def finish(self) -> str | None:
        """Collective, after the last step: make the replicas one model where they differ by design; returns what
        it changed that the last checkpoint does not hold (a sentence), or None."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """The strategy's own state beyond the model and optimizer: ``{"shared": ..., "rank": ...}``."""

    def load_checkpoint_state(self, state: dict[str, dict | None], optimizer: torch.optim.Optimizer) -> str | None:
        """Load what :meth:`checkpoint_state` saved (None for a part the checkpoint lacks); a note, or None."""

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """For a ``with`` block: the module an evaluation runs forward through (no gradient synchronisation),
        holding the weights the strategy calls the model where a replica's differ from them (DiLoCo's global
        weights); training's own are back when the block ends. Not a collective."""

    def export_weights(self, path: Path) -> Path | None:
        """Collective: the trained model's state dict as one safetensors file, written by rank 0 (its path there)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the model's whole state dict under the bare model's names, the same on every rank."""

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank: load a whole state dict under the bare model's names (as :meth:`full_state_dict` gives)."""


@runtime_checkable
class ShardedWrapper(DataParallelWrapper, Protocol):
    """A wrapper whose parameters are shards (the ``sharded`` layout): it saves, loads and names them itself."""

    def save_sharded(self, path: Path, optimizer: torch.optim.Optimizer) -> Any:
        """Collective: this rank's shards of the model and the optimizer state, as DCP files under ``path``."""

    def load_sharded(self, path: Path, optimizer: torch.optim.Optimizer) -> Any:
        """Collective: a sharded checkpoint, saved on any number of ranks, into the shards."""

    def load_full_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                        source: str) -> None:
        """Every rank, no collective: the shards cut from full tensors (a replicated checkpoint)."""

    def sharded_parameters(self, key: Any) -> list[torch.Tensor]:
        """The flat shards holding the parameters its ``split_by`` mapped to ``key``."""


@runtime_checkable
class MeetingWrapper(DataParallelWrapper, Protocol):
    """A wrapper whose replicas meet every few steps, its meetings held by live recovery (see the module docstring).

    After ``hold_meetings``, ``after_optimizer_step`` only counts; the caller, after a step
    with ``meeting_due`` (or after the last, with ``unmet_steps``), forms a round and calls
    ``launch_meeting`` on every member and waits for it, then ``apply_meeting`` where the round
    commits or ``discard_meeting`` where it aborts (the meeting is then held again, in the next
    round). With a ``meeting_overlap``, the round opens and launches after the step where
    ``meeting_starts``, and waits and votes after the step it lands at, the steps between taken.
    The first ``warmup_steps`` steps are synchronous: every replica's gradients averaged by its
    warm-up engine, whose comm hook ``register_comm_hook`` replaces (live recovery's round hook).
    """

    meets_itself: bool

    def hold_meetings(self, replicas: int) -> None:
        """From now the caller holds the meetings (``meets_itself`` False), over a job of ``replicas`` workers (what
        a rule that counts the replicas counts: each live worker's own process group is itself alone)."""

    @property
    def warmup_steps(self) -> int:
        """Steps at the start with the gradients averaged every step, before the replicas step alone."""

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """The warm-up engine's comm hook (the DDP engine's protocol); only with ``warmup_steps``."""

    def skip_steps(self, steps: int) -> None:
        """``steps`` steps counted as taken without taking them (a member healed after a meeting sits out the steps
        to the next; it adds nothing there)."""

    @property
    def meeting_due(self) -> bool:
        """Whether the schedule meets after the step just taken."""

    @property
    def unmet_steps(self) -> int:
        """Steps since the replicas last met."""

    @property
    def meeting_overlap(self) -> int:
        """Steps a meeting's collective runs beside before the meeting lands (0: it runs at the meeting)."""

    def meeting_starts(self, step: int) -> bool:
        """Whether, with an overlap, a meeting's collective starts after step count ``step``, to land
        ``meeting_overlap`` steps on (from the step alone: the same on every member)."""

    def launch_meeting(self, group: Any, participants: int, participating: bool, step: int,
                       last: bool) -> Callable[[], Any]:
        """The meeting's collective over ``group`` (a round's process group; None: a round of one), averaged over
        its ``participants``; a member healed in this round does not participate (it adds zeros). ``step``: the
        step count the meeting lands at, ``last``: after the run's last step (which part of the model meets may
        follow from them: the same on every member, a restarted one included). Launched; the function returned
        waits for it and gives what :meth:`apply_meeting` takes. Nothing applied."""

    def apply_meeting(self, reduced: Any) -> None:
        """The round committed: the meeting's result applied."""

    def discard_meeting(self, reduced: Any) -> None:
        """The round aborted: what the reduction changed undone."""

    def met_tensors(self) -> list[torch.Tensor]:
        """What every replica holds alike right after a meeting (live recovery's state hash)."""

    def heal_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """What live recovery's heal sends a joining worker of :meth:`checkpoint_state`: all of it but what is each
        rank's own and would be dropped at the meeting it joins."""
