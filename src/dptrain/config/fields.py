"""A config field, and the bound check the sections share."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from dptrain.config.errors import ConfigError

__all__ = ["opt", "at_least"]


def at_least(section: str, values: object, lows: dict[str, float]) -> None:
    """Each named field of ``values`` at least its low bound, else a ConfigError naming ``section.field``."""
    for name, low in lows.items():
        value = getattr(values, name)
        if value < low:
            raise ConfigError(f"{section}.{name} must be at least {low}, got {value}")


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field: its default, what it means, and (optionally) its allowed values."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)
