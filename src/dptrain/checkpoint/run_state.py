"""A run's state beyond its engine, as one list of named parts: what a checkpoint saves and a resume loads, what a
live heal sends.

A run holds its engine's state (the model, the optimizer, the step counts, the loss scaler:
``Engine.state_dict()``, saved under the strategy's layout by
:func:`~dptrain.checkpoint.save.save_run_checkpoint`) and, beside it, the state of the
pieces around it: the strategy's own (DiLoCo's global weights and outer momentum, local SGD's
last average...), compression's error-feedback residuals. Each such piece is a :class:`Part`:
a name (its directory in a checkpoint), ``state_dict()`` returning ``{"shared": ...,
"rank": ...}`` (the same on every rank, saved once as ``<name>/shared.pt``; this rank's own,
saved as ``<name>/rank<r>.pt``; either may be None), and ``load_state_dict(state)``, which
takes the same shape (a part the checkpoint cannot give, None) and returns a note on what
starts afresh. :func:`run_state` lists a run's parts; checkpoint save, resume
(:func:`resume_parts`) and live recovery's heal (the parts with ``heal``) all iterate that
one list, so a new stateful piece is one more entry (torchtitan's ``states`` dict and
torchft's ``register_state_dict_fn`` are the same idea).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Part", "run_state", "resume_parts", "COMPRESSION", "SHARED"]

COMPRESSION = "compression"  # a checkpoint's per-rank error-feedback residuals
SHARED = "shared.pt"  # a part's state that is the same on every rank, saved once


@dataclass(frozen=True)
class Part:
    """One named piece of a run's state (see the module docstring).

    ``heal``: live recovery sends it whole to a joining worker (its ``rank`` half too: the
    peer's replica is what the joiner continues from); else the joiner's own starts afresh.
    ``same_strategy``: its ``rank`` half fits only a run of the strategy that saved it.
    ``fresh``: the note when its ``rank`` half starts afresh (``{why}`` filled in), for a part
    whose ``load_state_dict`` says nothing itself. ``heal_state``: what a heal sends of it, where
    less than ``state_dict()`` (what the receiver would drop anyway); None: all of it.
    """

    name: str
    state_dict: Callable[[], dict]
    load_state_dict: Callable[[dict], str | None]
    heal: bool = True
    same_strategy: bool = False
    fresh: str = ""
    heal_state: Callable[[], dict] | None = None


def run_state(engine: Any, compressor: Any, strategy: str) -> list[Part]:
    """The parts of a run beside its ``engine`` (its ``model`` wrapper and ``optimizer``): the strategy's own state
    (the wrapper's ``checkpoint_state`` / ``load_checkpoint_state``, under the strategy's name), and ``compressor``'s
    residuals (each rank's own; a healed worker's start at zero)."""
    model, optimizer = engine.model, engine.optimizer
    heal = getattr(model, "heal_state", None)  # a MeetingWrapper's: DiLoCo's residual is not sent
    parts = [Part(strategy, lambda: model.checkpoint_state(optimizer),
                  lambda state: model.load_checkpoint_state(state, optimizer),
                  heal_state=(lambda: heal(optimizer)) if heal is not None else None)]
    if compressor is not None:
        parts.append(Part(COMPRESSION, lambda: {"shared": None, "rank": compressor.state_dict()},
                          lambda state: _load_rank(compressor, state), heal=False, same_strategy=True,
                          fresh="compression residuals start from zero: {why}"))
    return parts


def _load_rank(compressor: Any, state: dict) -> None:
    if state.get("rank") is not None:
        compressor.load_state_dict(state["rank"])


def resume_parts(parts: list[Part], path: Path, rank: int, world_size: int, strategy: str,
                 device: torch.device | str = "cpu") -> list[str]:
    """Each part's state from the checkpoint at ``path`` into the part: its shared half, and this rank's own where the
    checkpoint was saved on as many ranks (and, for a ``same_strategy`` part, by this strategy). Returns the notes on
    what starts afresh."""
    meta = json.loads((path / "meta.json").read_text())
    saved_world, saved_by = meta.get("world_size"), meta.get("strategy")
    notes = []
    for part in parts:
        where = path / part.name
        mine = where / f"rank{rank}.pt"
        why = (f"the checkpoint was saved on {saved_world} ranks, this run has {world_size}"
               if saved_world != world_size else
               f"the checkpoint was saved by strategy {saved_by}, this run is {strategy}"
               if part.same_strategy and saved_by not in (None, strategy) else
               "" if mine.is_file() else "the checkpoint has none")
        state = {"shared": _load(where / SHARED, device), "rank": None if why else _load(mine, device)}
        note = part.load_state_dict(state)
        if note is None and why and part.fresh:
            note = part.fresh.format(why=why)
        if note:
            notes.append(note)
    return notes


def _load(path: Path, device: torch.device | str) -> Any:
    return torch.load(path, map_location=device, weights_only=True) if path.is_file() else None
