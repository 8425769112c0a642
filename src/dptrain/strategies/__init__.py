"""The data-parallel strategies, looked up by name in one place.

Every strategy dptrain runs (``ddp``, ``zero1``-``zero3``, ``gossip``, ``ps``) is one
:class:`Strategy` entry in :data:`REGISTRY`: what it is (its ZeRO stage, whether it shards
parameters, how its checkpoints are laid out, which options apply to it) and how it wraps a
model. Code above this package asks the entry, never the name: a new strategy is one new
package below (its module wrapper) plus one entry here. See docs/architecture.md.
"""

from dptrain.strategies.registry import REGISTRY, Strategy, get_strategy, strategy_names

__all__ = ["Strategy", "REGISTRY", "get_strategy", "strategy_names"]
