"""A run's checkpoint, taken by every rank together and published whole by rank 0.

One collective, whatever the strategy: the ranks gather their RNG states; every rank
writes what only it holds into the staging directory (a sharding wrapper's shards through
its own ``save_sharded``; each part of the run's state (:mod:`dptrain.checkpoint.run_state`:
the strategy's own, compression's residuals) that has a ``rank`` half, as
``<part>/rank<r>.pt``); rank 0 writes the rest (``trainer.pt``; ``model.pt`` and
``optimizer.pt`` under the replicated layout; each part's ``shared`` half) and publishes the directory with one rename (:func:`~dptrain.checkpoint.files.save_checkpoint`),
so a crash never leaves a half-written checkpoint. Rotation follows
(:func:`~dptrain.checkpoint.files.prune_checkpoints`), never deleting what was just written.
Every file marks progress (``progress``): a long save is not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.checkpoint.files import fresh_dir, prune_checkpoints, rng_state, save_checkpoint, staging_dir
from dptrain.checkpoint.replicated import replicated_state
from dptrain.checkpoint.run_state import SHARED, Part
from dptrain.checkpoint.sharded import SHARDED
from dptrain.utils.files import open_file

__all__ = ["save_run_checkpoint"]


def save_run_checkpoint(run_dir: Path, step: int, engine: Any, *, strategy: str, meta: dict, keep_last: int,
                        parts: list[Part] = (), progress: Callable[[], None] = lambda: None,
                        ) -> tuple[Path, list[Path]] | None:
    """Collective: checkpoint ``engine`` (its ``model`` wrapper, ``optimizer``, step counts, loss scaler and
    layout, ``engine.sharded``) and the run's other ``parts`` (:func:`~dptrain.checkpoint.run_state.run_state`) at
    ``step``.

    ``strategy``: its name, recorded in ``meta.json``; ``meta``: what ``meta.json`` records
    beside the step and the checksums. Rank 0 returns the checkpoint and the ones rotation
    deleted; the others None.
    """
    progress()
    sharded = engine.sharded
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states: list = [None] * world_size
    dist.all_gather_object(states, rng_state(engine.device))
    halves = {part.name: part.state_dict() for part in parts}
    own = {name: half["rank"] for name, half in halves.items() if half.get("rank")}
    shared = {name: half["shared"] for name, half in halves.items() if half.get("shared")}
    # the model as the strategy defines it (the replicas' mean, DiLoCo's global weights): a collective
    model_state = None if sharded else engine.model.full_state_dict()
    staged = sharded or bool(own) or bool(shared)
    if staged:
        _stage(staging_dir(run_dir, step), engine, rank, sharded, own, progress)
    result = None
    if rank == 0:
        files = _rank0_files(engine, states, world_size, model_state)
        files.update({f"{name}/{SHARED}": state for name, state in shared.items()})
        path = save_checkpoint(run_dir, step, files, dict(meta, world_size=world_size,
                                                           format="sharded" if sharded else "replicated",
                                                           strategy=strategy), staged=staged, progress=progress)
        result = path, prune_checkpoints(run_dir, keep_last, saved=path)
    dist.barrier()  # a rank that fails after this point finds the checkpoint complete
    return result


def _stage(staged: Path, engine: Any, rank: int, sharded: bool, parts: dict[str, Any],
           progress: Callable[[], None]) -> None:
    """Every rank's own files into the staging directory, which rank 0's rename publishes with the rest."""
    if rank == 0:
        fresh_dir(staged)
    dist.barrier()
    if sharded:
        engine.model.save_sharded(staged / SHARDED, engine.optimizer)
        progress()
    for name, state in parts.items():
        (staged / name).mkdir(exist_ok=True)
        with open_file(staged / name / f"rank{rank}.pt", "xb") as f:
            torch.save(state, f)
        progress()
    dist.barrier()


def _rank0_files(engine: Any, states: list, world_size: int, model_state: dict | None) -> dict[str, Any]:
    """trainer.pt (step, skips, every rank's RNG, the loss scaler) and, when replicated, model.pt (``model_state``:
    the wrapper's ``full_state_dict()``, so a checkpoint's model is the model, not one replica) and optimizer.pt."""
    trainer = {"step": engine.step_count, "skipped_steps": engine.skipped_steps, "rng": states,
               "world_size": world_size}
    if engine.scaler is not None:
        trainer["scaler"] = engine.scaler.state_dict()
    if model_state is None:  # sharded: every rank wrote its shards
        return {"trainer.pt": trainer}
    _, optim_state = replicated_state(engine.model.module, engine.optimizer)
    return {"model.pt": model_state, "optimizer.pt": optim_state, "trainer.pt": trainer}
