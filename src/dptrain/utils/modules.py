"""Walking a model's module tree."""

from __future__ import annotations

from torch import nn

__all__ = ["outermost"]


def outermost(root: nn.Module, classes: tuple) -> list[nn.Module]:
    """The instances of ``classes`` under ``root`` (not ``root`` itself) that no other instance contains, in
    registration order: ZeRO-3's unit modules, and the planner's checkpointed modules (one inside another is
    recomputed with it, not on its own)."""
    found, inside = [], set()
    for module in root.modules():
        if id(module) in inside or module is root:
            continue
        if isinstance(module, classes):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found
