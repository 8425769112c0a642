"""The space ``dptrain tune`` searches: strategy and its options, micro-batch x accumulation, bucket size, codec.

At a fixed global batch B on N ranks, each rank processes B / N samples per step as
m samples per micro-step and B / (N m) micro-steps (every divisor m of B / N is a
candidate, or those given). For each:

- the strategies the planner and the simulator model (the registry's ``planned``
  entries: ``ddp``, ``zero1``-``zero3`` today), each with the options that change its
  step, as its entry's facts say: the bucket size where it has buckets (``buckets``);
  hybrid sharding over groups of k ranks where it shards (``shards_parameters``), for
  each proper divisor k of N (k = a host's ranks is the usual choice, docs/zero.md);
- where it all-reduces whole gradients (it does not shard) and takes the codec, the
  gradient codecs given (``none`` by default): the codecs whose convergence study kept
  the loss are ``fp16`` and ``bf16`` (docs/compression.md), whose all-reduce is the
  uncompressed one at half the bytes (the simulator models a codec that way only).

Strategies whose replicas step alone and meet every few steps (the registry's
``sync_schedule``: local SGD, DiLoCo) are candidates only where asked for by name, each
with its micro-batch x accumulation (its schedule is the config's): the simulator models
their step (:mod:`dptrain.planner.periodic`), but their loss at equal steps differs from
synchronous training (docs/localsgd.md), so the tuner predicts and measures them *apart*
(:func:`apart`) and never chooses one. The parameter server and gossip are not
candidates, and lossy codecs (int8, top-k, PowerSGD) are left out for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.strategies import get_strategy

__all__ = ["Candidate", "candidates", "LOSS_KEEPING_CODECS", "CODEC_RATIO", "divisors", "apart"]

LOSS_KEEPING_CODECS = ("none", "fp16", "bf16")
CODEC_RATIO = {"none": 1, "fp16": 2, "bf16": 2}  # bytes on the wire, fp32 over the codec's


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``strategy``, ``micro_batch`` x ``accum`` per rank, ``bucket_mb`` (None: the engine's
    default), ``shard_size`` (hybrid ZeRO; None: plain), ``codec`` (DDP's gradient compression)."""

    strategy: str
    micro_batch: int
    accum: int
    bucket_mb: float | None = None
    shard_size: int | None = None
    codec: str = "none"

    @property
    def label(self) -> str:
        parts = [self.strategy if self.shard_size is None else f"{self.strategy}/hybrid{self.shard_size}",
                 f"{self.micro_batch}x{self.accum}"]
        if self.bucket_mb is not None:
            parts.append(f"{self.bucket_mb:g}MiB")
        if self.codec != "none":
            parts.append(self.codec)
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The candidate as ``--set`` overrides of the run config (the global batch stays the config's)."""
        out = [f'distributed.strategy="{self.strategy}"', f"train.micro_batch_size={self.micro_batch}",
               f"train.grad_accum_steps={self.accum}"]
        if self.bucket_mb is not None:
            out.append(f"ddp.bucket_cap_mb={self.bucket_mb:g}")
        if self.shard_size is not None:
            out.append(f"zero.shard_size={self.shard_size}")
        if self.codec != "none":
            out.append(f'compression.method="{self.codec}"')
        return out


def apart(candidate: Candidate) -> bool:
    """Whether ``candidate``'s strategy meets every few steps (its loss differs: predicted and measured apart, never
    chosen)."""
    return get_strategy(candidate.strategy).sync_schedule is not None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, global_batch: int, strategies: list[str], micro_batches: list[int] | None = None,
               buckets: list[float | None] = (None,), shard_sizes: list[int] | None = None,
               codecs: list[str] = ("none",)) -> list[Candidate]:
    """Every :class:`Candidate` of the space (the module's docstring), in a fixed order.

    ``strategies``: registered names; what varies with each is its entry's facts. ``shard_sizes``:
    the hybrid shard sizes to try (None: every proper divisor of ``world_size`` above 1).
    A ValueError names what cannot be split.
    """
    if global_batch % world_size:
        raise ValueError(f"the global batch {global_batch} cannot be split over {world_size} ranks: give a "
                         f"multiple of {world_size} (--global-batch)")
    per_rank = global_batch // world_size
    micros = divisors(per_rank) if micro_batches is None else micro_batches
    bad = [m for m in micros if m < 1 or per_rank % m]
    if bad:
        raise ValueError(f"micro-batches {bad} do not divide the {per_rank} samples per rank "
                         f"({global_batch} over {world_size} ranks); choose among {divisors(per_rank)}")
    unknown = [c for c in codecs if c not in LOSS_KEEPING_CODECS]
    if unknown:
        raise ValueError(f"codecs {unknown} are not among those that keep the loss: {', '.join(LOSS_KEEPING_CODECS)}")
    hybrid = [k for k in divisors(world_size) if 1 < k < world_size] if shard_sizes is None else shard_sizes
    out: list[Candidate] = []
    for m in sorted(micros, reverse=True):
        for strategy in strategies:
            entry = get_strategy(strategy)
            if entry.sync_schedule is not None:  # its schedule's own: no bucket, codec or shard to vary
                out.append(Candidate(strategy, m, per_rank // m))
                continue
            coded = ("none",) if entry.shards_parameters else [c for c in codecs if entry.accepts_codec(c)]
            for bucket in (buckets if entry.buckets else (None,)):
                for codec in coded:
                    out.append(Candidate(strategy, m, per_rank // m, bucket, None, codec))
                for k in (hybrid if entry.shards_parameters else ()):
                    out.append(Candidate(strategy, m, per_rank // m, bucket, k))
    return list(dict.fromkeys(out))
