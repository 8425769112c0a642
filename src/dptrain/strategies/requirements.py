"""What each feature asks of the run's strategy and of the other config sections: one rule per feature.

A section checks its own values (``RunConfig.check``, in ``config/schema.py``), a strategy
its own section (its registry entry's ``check``). What is left crosses sections: 1-bit Adam
needs the DDP engine's comm hook and no codec of its own, a codec needs a strategy whose
collectives take it, momentum correction needs SGD, and so on. Each such rule is stated
here against the registry's facts (``comm_hooks``, ``codecs``, ``optimizer_in_backward``,
``dynamic_batching``, ``replicated_state``, ``shards_parameters``), never against a
strategy's name, so a new strategy is checked by the facts of its entry. The features
themselves (optimizers, codecs, the balancer, the divergence monitor) live in layers below
the registry and cannot read its facts; their rules live here, one function each, and the
run's validation (``runner/validate.py``) calls :func:`check_features` once.
"""

from __future__ import annotations

from dptrain.config import ConfigError, RunConfig
from dptrain.strategies.options import compression_remedies
from dptrain.strategies.registry import Strategy, get_strategy, strategy_names

__all__ = ["check_features", "listed"]


def check_features(cfg: RunConfig, entry: Strategy, world_size: int, data_ranks: int) -> None:
    """Every feature's rule against the run's strategy (``entry``) and its other sections, before anything starts."""
    check_compression(cfg, entry)
    check_onebit_adam(cfg, entry)
    check_dynamic_batching(cfg, entry)
    check_divergence(cfg, entry)
    check_hybrid_sharding(cfg, entry)
    check_straggler(cfg, world_size, data_ranks)
    check_live(cfg, entry, world_size)


def check_compression(cfg: RunConfig, entry: Strategy) -> None:
    """``compression.method`` against what the strategy's collectives can compress (its entry's ``codecs``), the
    all-reduce algorithm, and the remedies against the codec and the optimizer."""
    d = cfg.compression
    codec = d.method
    if codec != "none" and cfg.ddp.algorithm != "native":
        raise ConfigError(f"ddp.algorithm {cfg.ddp.algorithm!r} chooses how uncompressed buckets are all-reduced; "
                          f"with compression.method {codec!r} the codec decides the collectives: set "
                          "ddp.algorithm = \"native\"")
    if not entry.accepts_codec(codec):
        takers = listed(strategy_names(lambda s: codec in s.codecs), "or")
        if not entry.codecs:
            raise ConfigError(f"compression.method {codec!r} compresses the gradient collectives of strategy "
                              f"{takers}; strategy {entry.name} {entry.uncompressed}: set compression.method = "
                              "\"none\"")
        by_codecs: dict[tuple[str, ...], list[str]] = {}
        for name in strategy_names(lambda s: bool(s.codecs)):
            by_codecs.setdefault(get_strategy(name).codecs, []).append(name)
        supported = ", and ".join(
            f"strategy {names[0]} with {listed(codecs, 'or')}" if len(names) == 1 else
            f"strategies {listed(names, 'and')} with {', '.join(codecs)}"
            + (" (their reduce-scatter, compressed shard by shard)" if get_strategy(names[0]).shards_parameters
               else "")
            for codecs, names in by_codecs.items())
        raise ConfigError(f"compression.method {codec!r} works with strategy {takers} only, not {entry.name!r}; "
                          f"supported: {supported}")
    try:
        compression_remedies(cfg).check(codec)
    except ValueError as e:
        raise ConfigError(f"compression: {e}") from None
    if d.momentum_correction and cfg.train.optimizer != "sgd":
        raise ConfigError(f"compression.momentum_correction moves SGD's momentum (train.momentum) onto each rank, before "
                          f"compression: it needs train.optimizer = \"sgd\", got {cfg.train.optimizer!r}")


def check_onebit_adam(cfg: RunConfig, entry: Strategy) -> None:
    """1-bit Adam replaces the DDP engine's gradient all-reduce with its own comm hook: nothing else may claim it."""
    t, d = cfg.train, cfg.ddp
    if t.optimizer != "onebit_adam":
        return
    if not entry.comm_hooks:
        hooked = listed([f'"{n}"' for n in strategy_names(lambda s: s.comm_hooks)], "or")
        raise ConfigError(f"train.optimizer onebit_adam averages the momentum through the DDP engine's comm hook; "
                          f"strategy {entry.name!r} has none: set distributed.strategy = {hooked} or "
                          "train.optimizer = \"adamw\"")
    if cfg.compression.method != "none" or d.algorithm != "native":
        raise ConfigError(f"train.optimizer onebit_adam compresses the momentum itself (1 bit per element after the "
                          f"warm-up) and all-reduces the warm-up's gradients natively; compression.method "
                          f"{cfg.compression.method!r} and ddp.algorithm {d.algorithm!r} would claim the same "
                          "gradients: set compression.method = \"none\" and ddp.algorithm = \"native\"")


def check_optimizer_in_backward(cfg: RunConfig, entry: Strategy, grad_accum_steps: int) -> None:
    """``ddp.optimizer_in_backward`` steps each bucket inside backward: nothing may need every gradient first."""
    t, d = cfg.train, cfg.ddp
    if not d.optimizer_in_backward:
        return
    needs = {"train.grad_clip = 0 (a clip by the global norm needs every gradient first)": t.grad_clip == 0,
             f"one micro-step per step (the window is averaged at the step; this run has {grad_accum_steps}: "
             "set train.grad_accum_steps = 1 or a micro_batch_size of global_batch_size / ranks)":
                 grad_accum_steps == 1,
             "train.precision other than fp16 (its loss scaler unscales and checks every gradient first)":
                 t.precision != "fp16",
             "an optimizer other than onebit_adam (it communicates in its own step)": t.optimizer != "onebit_adam",
             "distributed.strategy " + listed([f"{n} ({get_strategy(n).summary})" for n in
                                        strategy_names(lambda s: s.optimizer_in_backward)], "or"):
                 entry.optimizer_in_backward}
    missing = [what for what, ok in needs.items() if not ok]
    if missing:
        raise ConfigError(f"ddp.optimizer_in_backward steps each bucket's parameters inside backward, which needs "
                          f"{'; '.join(missing)}; or set ddp.optimizer_in_backward = false")


def check_dynamic_batching(cfg: RunConfig, entry: Strategy) -> None:
    """``balance.dynamic_batching`` shares the global batch by speed: the strategy must take uneven shares."""
    if cfg.balance.dynamic_batching and not entry.dynamic_batching:
        able = listed(strategy_names(lambda s: s.dynamic_batching), "or")
        raise ConfigError(f"balance.dynamic_batching works with strategy {able}, not {entry.name!r} "
                          f"({entry.summary}); set balance.dynamic_batching = false")


def check_divergence(cfg: RunConfig, entry: Strategy) -> None:
    """``divergence.every`` compares replicas: the strategy must keep every rank's state the same."""
    if cfg.divergence.every and not entry.replicated_state:
        able = listed(strategy_names(lambda s: s.replicated_state), "or")
        raise ConfigError(f"divergence.every compares replicated state, which strategy {entry.name!r} does not "
                          f"keep ({entry.summary}: its ranks' parameters or optimizer state differ by design); use "
                          f"strategy {able}, or divergence.every = 0")


def check_hybrid_sharding(cfg: RunConfig, entry: Strategy) -> None:
    """``zero.shard_size`` shards over groups of ranks: the strategy must shard."""
    shard_size = cfg.zero.shard_size
    if shard_size and not entry.shards_parameters:
        sharding = listed(strategy_names(lambda s: s.shards_parameters), "or")
        raise ConfigError(f"zero.shard_size={shard_size} (hybrid sharding) needs strategy {sharding}, "
                          f"not {entry.name!r}")


def check_straggler(cfg: RunConfig, world_size: int, data_ranks: int) -> None:
    """``straggler.rank`` must be a rank that computes (a strategy's own ranks, such as servers, take no data)."""
    s = cfg.straggler
    if not -1 <= s.rank < world_size:
        raise ConfigError(f"straggler.rank must be -1 (none) or a rank in [0, {world_size - 1}], got {s.rank}")
    if s.rank >= data_ranks:
        raise ConfigError(f"straggler.rank {s.rank} takes no data (strategy {cfg.distributed.strategy}: ranks "
                          f"{data_ranks}-{world_size - 1} are its own, such as parameter servers); a straggler must "
                          f"compute, a rank below {data_ranks}")


def check_live(cfg: RunConfig, entry: Strategy, world_size: int) -> None:
    """Live recovery holds rounds: every step for a strategy whose ranks hold the same state and take a comm hook
    (``live = "step"``: the gradients averaged over each round's members), only where the replicas meet for one
    whose replicas step alone (``live = "meeting"``); a joiner is healed with a peer's state. Nothing else may claim
    the round's all-reduce or step inside backward."""
    live, d, t = cfg.live, cfg.ddp, cfg.train
    if not live.enabled:
        return
    able = listed([f'"{n}"' for n in strategy_names(lambda s: bool(s.live))], "or")
    if not entry.live:
        raise ConfigError(f"live.enabled averages each round over its members and heals a joining worker with a "
                          f"peer's state; strategy {entry.name!r} cannot (its ranks hold shards, or run programs of "
                          f"their own): set distributed.strategy = {able}, or live.enabled = false")
    if entry.check_live is not None:
        try:
            entry.check_live(cfg, world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_live_compression(cfg)
    claims = [name for name, on in (("train.optimizer onebit_adam", t.optimizer == "onebit_adam"),
                                    ("ddp.optimizer_in_backward", d.optimizer_in_backward),
                                    ("balance.dynamic_batching", cfg.balance.dynamic_batching),
                                    ("ddp.algorithm " + repr(d.algorithm), d.algorithm != "native")) if on]
    if claims:
        raise ConfigError(f"live.enabled averages over each round's members itself; {claims[0]} would claim the "
                          "same all-reduce: turn it off, or live.enabled = false")
    if live.min_workers > world_size:
        raise ConfigError(f"live.min_workers = {live.min_workers} is more than the job's {world_size} worker(s): "
                          f"lower it to at most {world_size}")


LIVE_CODECS = ("fp16", "bf16", "int8", "topk")  # compress.round_hook: encoded, all-gathered over the round, averaged


def check_live_compression(cfg: RunConfig) -> None:
    """``compression.method`` under live recovery: a codec whose state is each member's own residual (kept on an
    abort, dropped on a heal: ``dptrain.compress.round_hook``). (Only the DDP engine takes the method and live
    recovery both: the strategies' own checks refuse the others first.)"""
    c = cfg.compression
    if c.method == "none":
        return
    if c.method not in LIVE_CODECS:
        raise ConfigError(f"live.enabled with compression.method = {c.method!r}: PowerSGD's Q is a warm start shared "
                          "by a fixed set of ranks, which a round of changing members does not keep; use "
                          f"{listed(LIVE_CODECS, 'or')}, or live.enabled = false")
    remedies = [name for name, on in (("compression.momentum_correction", c.momentum_correction),
                                      ("compression.local_clip", bool(c.local_clip)),
                                      ("compression.topk_warmup_steps", bool(c.topk_warmup_steps))) if on]
    if remedies:
        raise ConfigError(f"live.enabled with {remedies[0]}: deep gradient compression's remedies are not applied "
                          "over live recovery's rounds; turn it off, or live.enabled = false")


def listed(items, conjunction: str) -> str:
    """``a, b or c``."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"
