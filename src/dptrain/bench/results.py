"""Where a benchmark's raw numbers go: one JSON file, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from dptrain.utils.atomic import write_text_atomic

__all__ = ["save_result"]


def save_result(path: Path, result: dict) -> None:
    """Write ``result`` as JSON to ``path`` (its directory created) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2))
    print(f"raw numbers: {path}")
