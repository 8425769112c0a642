"""A run's random streams, and where a resumed run picks them up: the newest checkpoint's model, optimizer,
loss scaler, step and each rank's RNG states, plus the parts saved per rank (compression's residuals,
gossip's own replicas), whichever strategy wrote it (:mod:`dptrain.strategies.state`).

The per-rank parts live in subdirectories of the checkpoint, one ``rank<r>.pt`` per rank
(:data:`COMPRESSION`, :data:`REPLICAS`); a run resumed on another world size cannot use them,
starts those parts afresh, and says so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from dptrain.api.engine import Engine
from dptrain.compress.base import Compressor
from dptrain.runner.checkpoint import set_rng_state
from dptrain.strategies.state import load_model_and_optimizer

__all__ = ["seed_everything", "resume", "resume_compression", "resume_replicas", "COMPRESSION", "REPLICAS"]

COMPRESSION = "compression"  # a checkpoint's per-rank error-feedback residuals
REPLICAS = "gossip"  # a gossip checkpoint's per-rank replicas and optimizer states (the name on disk)


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators, from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resume(engine: Engine, path: Path, rank: int, device: torch.device) -> int:
    """Model, optimizer, step and RNG states from ``path``; returns the step it was saved at."""
    trainer = torch.load(path / "trainer.pt", map_location=device, weights_only=True)
    load_model_and_optimizer(path, engine, device)  # collective when both are sharded (DCP reshards)
    engine.step_count, engine.skipped_steps = trainer["step"], trainer.get("skipped_steps", 0)
    if engine.scaler is not None and "scaler" in trainer:
        engine.scaler.load_state_dict(trainer["scaler"])
    rngs = trainer["rng"]
    if rank < len(rngs):
        set_rng_state(rngs[rank], device)
    else:  # resumed on more ranks than saved: new ranks get fresh streams
        seed_everything(engine.plan.world_size * 7919 + rank + trainer["step"])
    return trainer["step"]


def resume_compression(hook: Compressor, path: Path, rank: int, world_size: int, strategy: str) -> str | None:
    """Load this rank's error-feedback residuals when the checkpoint has them for this world size and strategy.

    Returns what to tell the user when they start from zero instead.
    """
    saved = path / COMPRESSION / f"rank{rank}.pt"
    meta = json.loads((path / "meta.json").read_text())
    meta_world, saved_by = meta.get("world_size"), meta.get("strategy")
    if meta_world == world_size and saved.exists() and saved_by in (None, strategy):
        hook.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))
        return None
    reason = (f"the checkpoint was saved on {meta_world} ranks, this run has {world_size}"
              if meta_world != world_size else f"the checkpoint was saved by strategy {saved_by}, this run is "
              f"{strategy}" if saved.exists() else "the checkpoint has none")
    return f"compression residuals start from zero: {reason}"


def replica_state(engine: Engine) -> dict:
    """This rank's own replica (gossip's differ), its optimizer state and its mixing step: what it saves."""
    return {"model": engine.model.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
            "mix_steps": engine.model.steps}


def resume_replicas(engine: Engine, path: Path, rank: int, world_size: int) -> str | None:
    """Load this rank's own replica and optimizer state (a gossip checkpoint saved on as many ranks).

    On another world size every replica starts from rank 0's copy (already loaded); returns what to say.
    """
    saved = path / REPLICAS / f"rank{rank}.pt"
    meta_world = json.loads((path / "meta.json").read_text()).get("world_size")
    if meta_world != world_size or not saved.exists():
        return (f"gossip replicas start from rank 0's copy: the checkpoint was saved on {meta_world} ranks, this "
                f"run has {world_size}")
    state = torch.load(saved, map_location=engine.device, weights_only=True)
    engine.model.module.load_state_dict(state["model"])  # copies into the flat buffer's views
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.model.steps = state["mix_steps"]
    return None
