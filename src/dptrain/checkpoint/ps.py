"""The parameter server's checkpoint layout, as a format: ``ps/`` (each server's shard, the cut's messages in flight,
the workers' clocks) under the run's usual checkpoint directory, ``"format": "ps"`` in ``meta.json``.

A ps checkpoint resumes only on the layout it was saved with: a shard is one server's run
of whole tensors, each worker's data position is its own, and a server's version counts
rounds in sync and backup but gradients in async and ssp. What the servers write, and how
a cut is taken while training goes on, is the parameter-server program's
(:mod:`dptrain.ps.snapshot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptrain.checkpoint.files import CheckpointError

__all__ = ["check_ps_resume"]


def check_ps_resume(path: Path, meta: dict[str, Any], servers: int, mode: str, world_size: int) -> None:
    """A CheckpointError naming the values unless the checkpoint at ``path`` was saved on this job's layout."""
    saved = meta.get("ps", {})
    now = (world_size, servers, mode)
    then = (meta.get("world_size"), saved.get("servers"), saved.get("mode"))
    if now == then:
        return
    raise CheckpointError(
        f"checkpoint {path} was saved by a parameter-server job of {then[0]} ranks with ps.servers={then[1]} and "
        f"ps.mode={then[2]!r}; this run has {world_size} ranks with ps.servers={servers} and ps.mode={mode!r}. A ps "
        "checkpoint resumes only on the layout it was saved with (a shard is one server's tensors, each worker's "
        f"data position is its own): run with --nproc {then[0]} --set ps.servers={then[1]} --set "
        f"ps.mode={then[2]}, or start afresh with another run_dir")
