"""A user's callable named in the config, ``"package.module:factory"`` (``task.model``, ``data.factory``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dptrain.config.loader import ConfigError

__all__ = ["load_factory"]


def load_factory(spec: str, key: str = "task.model") -> Callable[..., Any]:
    """``"package.module:factory"`` -> the callable, or a ConfigError (naming the config ``key``) saying what failed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} {spec!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import can fail in any way; report it as bad input
        raise ConfigError(f"{key} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}. "
                          "Is the package installed, or the module on PYTHONPATH (the working "
                          "directory is not searched by default)?") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{key} {spec!r}: {module_name!r} has no callable {attr!r}")
    return factory
