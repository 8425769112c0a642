"""ZeRO's options as small frozen policies, one per concern, as FSDP2 groups its own.

FSDP2's ``fully_shard`` takes a ``MixedPrecisionPolicy`` and an ``OffloadPolicy``
rather than a keyword argument per knob: each policy is a frozen dataclass that checks
itself when built, so a bad value is named where it is written, and a wrapper's
signature shows its concerns rather than twenty knobs. dptrain's ZeRO has five:

- :class:`UnitPolicy`: which parameters share a flat unit (stage 3's unit modules,
  stages 1-2's bucket size, ``split_by``);
- :class:`ShardingPolicy`: over whom a unit is sharded and when it is whole
  (hybrid ``shard_size``, ``reshard_after_forward``, ``prefetch``, units some ranks skip);
- :class:`CommPolicy`: how the collectives run (algorithm, nodes, byte counting,
  gradient compression, buffer broadcast);
- :class:`CheckPolicy`: whether collectives are compared across ranks first;
- :class:`InitPolicy`: meta-device construction (device, ``init_fn``);

plus :class:`~dptrain.zero.precision.MixedPrecision`, which already is one. Every
keyword argument ``ZeRO`` documented before the policies (``prefetch=False``,
``check_collectives="every"``, ...) still works: :func:`resolve_policies` files it
under its policy, so ``ZeRO(m, stage=3, prefetch=False)`` and
``ZeRO(m, stage=3, sharding=ShardingPolicy(prefetch=False))`` are the same wrapper.
Checks that involve the process group (the algorithm for this world size, hybrid
sharding's divisors) stay with ``ZeRO``, which has the group.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from dptrain import comm
from dptrain.comm.fingerprint import CHECK_MODES
from dptrain.compress.zero import ShardedCompression
from dptrain.zero.precision import MixedPrecision

__all__ = ["UnitPolicy", "ShardingPolicy", "CommPolicy", "CheckPolicy", "InitPolicy", "ZeROPolicies",
           "resolve_policies"]


@dataclass(frozen=True)
class UnitPolicy:
    """Which parameters are flattened together into one unit, the grain of every collective.

    Stages 1-2 cut the parameters, in gradient-ready order, into buckets of about
    ``bucket_cap_mb`` (smaller buckets lower the peak: a reduction in flight holds its
    unit-sized input). Stage 3 makes a unit of each outermost instance of
    ``unit_classes`` (a transformer block), or of each module reaching ``min_unit_numel``
    parameters, plus a root unit with the rest. ``split_by(name, parameter) -> key``:
    parameters with different keys never share a unit (the trainer keeps decayed
    matrices apart from biases and norms).
    """

    unit_classes: Sequence[type[nn.Module]] = ()
    min_unit_numel: int | None = None
    bucket_cap_mb: float = 4.0
    split_by: Callable[[str, torch.Tensor], Hashable] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_classes", tuple(self.unit_classes))  # a list works too, stored hashable
        bad = [c for c in self.unit_classes if not isinstance(c, type)]
        if bad:
            raise TypeError(f"unit_classes must be module classes, got {bad!r}; e.g. unit_classes=(Block,)")
        if self.min_unit_numel is not None and self.min_unit_numel < 0:
            raise ValueError(f"min_unit_numel must be a positive parameter count or None, got {self.min_unit_numel}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be above 0, got {self.bucket_cap_mb!r}; the default is 4")

    def check_stage(self, stage: int) -> None:
        """Unit modules are stage 3's; stages 1-2 shard buckets."""
        if stage < 3 and (self.unit_classes or self.min_unit_numel):
            raise ValueError(f"unit_classes / min_unit_numel choose stage 3's unit modules; stage {stage} "
                             "shards buckets (bucket_cap_mb) instead")


@dataclass(frozen=True)
class ShardingPolicy:
    """Over which ranks a unit is sharded, and when its parameters are whole.

    ``shard_size``: hybrid sharding (``zero/hybrid.py``): shard over groups of that many
    consecutive ranks, replicate across them; None shards over the whole group.
    ``reshard_after_forward`` (stage 3): free a unit's parameters after its forward and
    gather them again in backward (False keeps them to the end of backward: one
    all-gather fewer per unit, the full parameters held meanwhile). ``prefetch``: start
    the next unit's all-gather while the current one computes. ``find_unused_parameters``:
    units some ranks or steps skip; it turns the other two off
    ([Note: units some ranks skip] in skipped.py).
    """

    shard_size: int | None = None
    reshard_after_forward: bool = True
    prefetch: bool = True
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be a rank count of at least 1 or None (no hybrid sharding), "
                             f"got {self.shard_size}")

    @property
    def reshards(self) -> bool:
        """Whether stage 3 frees a unit after its forward ([Note: units some ranks skip]: not when skipping)."""
        return self.reshard_after_forward and not self.find_unused_parameters

    @property
    def prefetches(self) -> bool:
        """Whether the next unit's all-gather starts early ([Note: units some ranks skip]: not when skipping)."""
        return self.prefetch and not self.find_unused_parameters


@dataclass(frozen=True)
class CommPolicy:
    """How ZeRO's collectives run.

    ``algorithm`` / ``nodes``: :mod:`dptrain.comm`'s algorithm (``native``, ``ring``,
    ``tree``, ``naive``, ``hierarchical`` with ``nodes``). ``traffic``: a
    :class:`dptrain.comm.Traffic` counting the bytes this rank sends (dptrain's algorithms
    only). ``compression``: a :class:`~dptrain.compress.zero.ShardedCompression` that
    sends every gradient reduce-scatter compressed (its codec's exchange replaces the
    algorithm). ``broadcast_buffers``: rank 0's buffers to every rank before each forward.
    """

    algorithm: str = "native"
    nodes: Any = None
    traffic: comm.Traffic | None = None
    compression: ShardedCompression | None = None
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        c = self.compression
        if c is not None and not isinstance(c, ShardedCompression):
            raise TypeError("compression must be a dptrain.compress.zero.ShardedCompression (fp16, bf16 or int8), "
                            f"got {c!r}")
        if c is not None and self.algorithm != "native":
            raise ValueError(f"algorithm {self.algorithm!r} chooses how uncompressed gradients are reduced; with "
                             "compression the codec's exchange does it: leave algorithm native")


@dataclass(frozen=True)
class CheckPolicy:
    """Whether each unit's all-gather and reduce-scatter are compared across ranks before they run.

    ``collectives``: on their first use (``"first"``), on every use (``"every"``) or not
    (``"off"``), through the job's store (:mod:`dptrain.comm.fingerprint`), so a mismatch
    is named instead of hanging or aborting. ``timeout_s``: how long a check waits for the
    other ranks before naming the missing ones.
    """

    collectives: str = "first"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.collectives not in CHECK_MODES:
            raise ValueError(f"check_collectives={self.collectives!r}: expected one of {', '.join(CHECK_MODES)}")
        if not self.timeout_s > 0:
            raise ValueError(f"check_timeout_s must be above 0 seconds, got {self.timeout_s!r}")


@dataclass(frozen=True)
class InitPolicy:
    """Where units are built: ``device`` (default: the model's, else the current GPU, else CPU).

    A model built on the meta device is allocated one unit at a time there and
    initialised by ``init_fn(module)`` for each module of the unit (default: the module's
    ``reset_parameters``), so the full model never exists on one rank.
    """

    device: torch.device | str | None = None
    init_fn: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class ZeROPolicies:
    """Every policy of one ``ZeRO`` wrapper (``mixed_precision`` None: compute in the model's dtype)."""

    units: UnitPolicy = field(default_factory=UnitPolicy)
    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    communication: CommPolicy = field(default_factory=CommPolicy)
    checks: CheckPolicy = field(default_factory=CheckPolicy)
    init: InitPolicy = field(default_factory=InitPolicy)
    mixed_precision: MixedPrecision | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kind = getattr(self, f.name), _POLICY_TYPES[f.name]
            if not isinstance(value, kind) and not (value is None and f.name == "mixed_precision"):
                raise TypeError(f"{f.name} must be a dptrain.zero.{kind.__name__}, got {value!r}")


_POLICY_TYPES = {"units": UnitPolicy, "sharding": ShardingPolicy, "communication": CommPolicy,
                 "checks": CheckPolicy, "init": InitPolicy, "mixed_precision": MixedPrecision}

# ZeRO's keyword arguments from before the policies: (policy, field) each one sets
KEYWORDS: dict[str, tuple[str, str]] = {
    "unit_classes": ("units", "unit_classes"), "min_unit_numel": ("units", "min_unit_numel"),
    "bucket_cap_mb": ("units", "bucket_cap_mb"), "split_by": ("units", "split_by"),
    "shard_size": ("sharding", "shard_size"), "reshard_after_forward": ("sharding", "reshard_after_forward"),
    "prefetch": ("sharding", "prefetch"), "find_unused_parameters": ("sharding", "find_unused_parameters"),
    "algorithm": ("communication", "algorithm"), "nodes": ("communication", "nodes"),
    "traffic": ("communication", "traffic"), "compression": ("communication", "compression"),
    "broadcast_buffers": ("communication", "broadcast_buffers"),
    "check_collectives": ("checks", "collectives"), "check_timeout_s": ("checks", "timeout_s"),
    "device": ("init", "device"), "init_fn": ("init", "init_fn"),
}


def resolve_policies(policies: dict[str, Any], keywords: dict[str, Any]) -> ZeROPolicies:
    """``ZeRO``'s policies: those passed (None: the default), each updated by the keyword arguments it owns.

    ``keywords`` are the documented per-knob arguments (``prefetch=False``); one that
    names no knob is a TypeError with the closest names, as Python's own would be.
    """
    unknown = [k for k in keywords if k not in KEYWORDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*KEYWORDS, *_POLICY_TYPES], n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; ZeRO takes {sorted(KEYWORDS)}"
        raise TypeError(f"ZeRO() got an unexpected keyword argument {unknown[0]!r}{hint}")
    built = {name: value for name, value in policies.items() if value is not None}
    for name in ("units", "sharding", "communication", "checks", "init"):
        updates = {f: keywords[k] for k, (policy, f) in KEYWORDS.items() if policy == name and k in keywords}
        if updates:
            base = built.get(name, _POLICY_TYPES[name]())
            if not isinstance(base, _POLICY_TYPES[name]):
                raise TypeError(f"{name} must be a dptrain.zero.{_POLICY_TYPES[name].__name__}, got {base!r}")
            built[name] = replace(base, **updates)
    return ZeROPolicies(**built)
