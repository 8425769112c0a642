"""Optional dependencies: imported where a config needs them, with the install command when they are missing.

The Hugging Face libraries (``transformers``, ``tokenizers``, ``datasets``) are the
``hf`` extra: ``pip install -e ".[hf]"`` in a checkout, ``pip install "dptrain[hf]"``
otherwise. Everything else in dptrain works without them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dptrain.config import ConfigError

__all__ = ["require"]

EXTRA = {"transformers": "hf", "tokenizers": "hf", "datasets": "hf"}


def require(module: str, needed_for: str) -> ModuleType:
    """Import ``module``, or raise a ConfigError that says what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRA.get(module.split(".")[0], "hf")
        raise ConfigError(f"{needed_for} needs the {module.split('.')[0]} package, which is not installed "
                          f"({type(e).__name__}: {e}): install the {extra!r} extra, pip install -e \".[{extra}]\" "
                          f"in a dptrain checkout or pip install \"dptrain[{extra}]\"") from None
