"""A run's random streams, and where a resumed run picks them up: the newest checkpoint's model, optimizer,
loss scaler, step and each rank's RNG states, whichever layout wrote it (:mod:`dptrain.checkpoint.state`). The
parts saved apart (the strategy's own state, compression's residuals) are the run's state list's
(:func:`dptrain.checkpoint.run_state.resume_parts`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.checkpoint.files import set_rng_state
from dptrain.checkpoint.state import load_model_and_optimizer

__all__ = ["seed_everything", "resume"]


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
