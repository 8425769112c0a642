"""What a checked run is: :class:`RunPlan`, the output of the run's validation (``runner.validate``) and the input
of everything that runs it (the loop, its hooks, the builders, a strategy's own program)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.batching import BatchPlan
from dptrain.config import RunConfig
from dptrain.tasks import Task

__all__ = ["RunPlan"]


@dataclass
class RunPlan:
    cfg: RunConfig
    run_dir: Path
    plan: BatchPlan
    task: Task
    identity: dict[str, Any]
    identity_hash: str
    resume_from: Path | None
    resume_meta: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)  # for the launcher to print once, before launch
    data_identity: dict[str, Any] = field(default_factory=dict)  # the data files' fingerprints, for meta.json
