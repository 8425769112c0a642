"""A run's random streams, and where a resumed run picks them up: the newest checkpoint's model, optimizer,
loss scaler, step and each rank's RNG states, whichever layout wrote it (:mod:`dptrain.checkpoint.state`), then
the parts saved apart: compression's residuals, and the strategy's own state through its wrapper
(``checkpoint_state`` / ``load_checkpoint_state``, the strategies' protocol).

Parts saved per rank live in subdirectories of the checkpoint, one ``rank<r>.pt`` per rank
(compression's in :data:`COMPRESSION`, a strategy's in the subdirectory named after it, its
shared part in ``shared.pt`` there); a run resumed on another world size cannot use the
per-rank ones, starts those parts afresh, and says so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.checkpoint.files import set_rng_state
from dptrain.checkpoint.state import load_model_and_optimizer

__all__ = ["seed_everything", "resume", "resume_compression", "resume_strategy_state", "COMPRESSION", "SHARED"]

COMPRESSION = "compression"  # a checkpoint's per-rank error-feedback residuals
SHARED = "shared.pt"  # a strategy's state that is the same on every rank, saved once


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators, from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resume(engine: Any, path: Path, rank: int, device: torch.device) -> int:
    """Model, optimizer, step and RNG states from ``path`` into ``engine`` (an :class:`~dptrain.api.engine.Engine`:
    its ``model``, ``optimizer``, step counts, loss scaler and layout); returns the step it was saved at."""
    trainer = torch.load(path / "trainer.pt", map_location=device, weights_only=True)
    load_model_and_optimizer(path, engine, device)  # collective when sharded
    engine.step_count, engine.skipped_steps = trainer["step"], trainer.get("skipped_steps", 0)
    if engine.scaler is not None and "scaler" in trainer:
        engine.scaler.load_state_dict(trainer["scaler"])
    rngs = trainer["rng"]
    if rank < len(rngs):
        set_rng_state(rngs[rank], device)
    else:  # resumed on more ranks than saved: new ranks get fresh streams
        seed_everything(engine.plan.world_size * 7919 + rank + trainer["step"])
    return trainer["step"]


def _saved_world(path: Path) -> int | None:
    return json.loads((path / "meta.json").read_text()).get("world_size")


def resume_compression(compressor: Any, path: Path, rank: int, world_size: int, strategy: str) -> str | None:
    """Load this rank's error-feedback residuals into ``compressor`` when the checkpoint has them for this world size
    and strategy. Returns what to tell the user when they start from zero instead."""
    saved = path / COMPRESSION / f"rank{rank}.pt"
    meta = json.loads((path / "meta.json").read_text())
    meta_world, saved_by = meta.get("world_size"), meta.get("strategy")
    if meta_world == world_size and saved.exists() and saved_by in (None, strategy):
        compressor.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))
        return None
    reason = (f"the checkpoint was saved on {meta_world} ranks, this run has {world_size}"
              if meta_world != world_size else f"the checkpoint was saved by strategy {saved_by}, this run is "
              f"{strategy}" if saved.exists() else "the checkpoint has none")
    return f"compression residuals start from zero: {reason}"


def resume_strategy_state(wrapper: Any, optimizer: torch.optim.Optimizer, path: Path, name: str, rank: int,
                          world_size: int, device: torch.device) -> str | None:
    """The strategy's own state (what its wrapper's ``checkpoint_state`` saved under ``<path>/<name>/``) handed to
    ``load_checkpoint_state``: the shared part, and this rank's own part where the checkpoint was saved on as many
    ranks; None for a part the checkpoint lacks (one written by another strategy has neither). Returns the
    wrapper's note on what starts afresh, if anything does."""
    where = path / name
    load = (lambda f: torch.load(f, map_location=device, weights_only=True) if f.is_file() else None)
    mine = load(where / f"rank{rank}.pt") if _saved_world(path) == world_size else None
    return wrapper.load_checkpoint_state({"shared": load(where / SHARED), "rank": mine}, optimizer)
