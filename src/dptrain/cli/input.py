"""What the ``dptrain`` commands share about their input: the errors that mean bad input, the run config, integer
lists."""

from __future__ import annotations

import click

__all__ = ["bad_input", "int_list", "read_config"]


def bad_input() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (one line, exit 2): imported on demand, since they pull in torch."""
    from dptrain.batching import BatchSizeError
    from dptrain.checkpoint.files import CheckpointError
    from dptrain.config import ConfigError

    return ConfigError, BatchSizeError, CheckpointError


def read_config(path, overrides):
    """The run config of ``--config`` and ``--set`` (``dptrain.config.load_config``), each old key's deprecation line
    printed once, to stderr."""
    from dptrain.config import load_config

    notes: list[str] = []
    cfg = load_config(path, list(overrides), notes)
    for line in notes:
        click.echo(line, err=True)
    return cfg


def int_list(text: str, what: str) -> list[int]:
    """``"1,2,4"`` as positive integers, or a usage error naming ``what``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{what} must be positive integers, got {text!r}")
    return values
