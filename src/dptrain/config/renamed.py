"""Config keys that moved, and the one-line deprecation each old key gets.

The strategy and the job's distributed settings once lived under ``[ddp]`` with the DDP engine's options and the
gradient compression keys; they now have sections of their own (``[distributed]``, ``[compression]``). A config
file, a ``--set`` or a run directory's ``config.toml`` written with an old key still works: the key is moved to its
new place before the config is built, and the caller is handed a line naming the new key.
"""

from __future__ import annotations

from typing import Any

from dptrain.config.errors import ConfigError

__all__ = ["RENAMED", "renamed_key", "move_renamed"]

_COMPRESSION = ("error_feedback", "topk_fraction", "powersgd_rank", "momentum_correction", "momentum_masking",
                "local_clip", "topk_warmup_steps", "powersgd_uncompressed_steps", "powersgd_warmup_rank",
                "powersgd_warmup_steps")
RENAMED = {**{f"ddp.{k}": f"distributed.{k}" for k in ("strategy", "backend", "timeout_s", "roll_call_s",
                                                         "check_collectives")},
           "ddp.compression": "compression.method",
           **{f"ddp.{k}": f"compression.{k}" for k in _COMPRESSION}}


def renamed_key(key: str, source: str) -> tuple[str, str | None]:
    """``key`` where it lives now, and the deprecation line for ``source`` if it moved (else None)."""
    new = RENAMED.get(key)
    if new is None:
        return key, None
    how = " (or dptrain run --strategy NAME)" if new == "distributed.strategy" else ""
    return new, f"deprecated: {source}: {key} is now {new}{how}; the old key still works"


def move_renamed(data: dict[str, Any], source: str) -> list[str]:
    """Move every old key of the nested ``data`` (a TOML file's tables) to its new place; the deprecation lines.

    A key given both ways in one file is an error naming both, unless the two agree."""
    lines = []
    for old, new in RENAMED.items():
        section, key = old.split(".")
        table = data.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table.pop(key)
        new_section, new_key = new.split(".")
        target = data.setdefault(new_section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{new_section!r} in {source} must be a section ([{new_section}]), got {target!r}")
        if new_key in target and target[new_key] != value:
            raise ConfigError(f"{source} sets both {old} = {value!r} and {new} = {target[new_key]!r}; {old} is the "
                              f"old name of {new}: keep {new} only")
        target[new_key] = value
        lines.append(renamed_key(old, source)[1])
    return lines
