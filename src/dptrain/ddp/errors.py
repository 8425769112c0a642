"""Errors of the DDP wrapper that torch's DDP raises under another type in the same situation.

dptrain's messages name the values and the fix; code written against torch catches torch's
type. Each class derives from both, so ``except RuntimeError`` (torch's) and
``except ValueError`` (dptrain's) both hold. The table is in docs/ddp.md ("Errors").
"""

from __future__ import annotations

__all__ = ["NotInitialisedError", "NothingToTrainError"]


class NotInitialisedError(RuntimeError, ValueError):
    """``torch.distributed`` is not initialised (torch: ``ValueError`` from ``_get_default_group``)."""


class NothingToTrainError(ValueError, RuntimeError):
    """No parameter of the module requires a gradient (torch: ``RuntimeError``)."""
