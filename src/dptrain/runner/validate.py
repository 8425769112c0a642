"""Everything about a run that can be wrong, checked before anything is written.

``validate_run`` resolves the run directory and the batch plan, imports the model
factory, builds the task's datasets far enough to know they fit one global batch, and
verifies the checkpoint a resumption would start from (its config, and its data: the
fingerprints of the data files it was trained on, ``data/identity.py``). It raises
:class:`~dptrain.config.ConfigError`, :class:`~dptrain.batching.BatchSizeError` or
:class:`~dptrain.runner.checkpoint.CheckpointError` (exit code 2 from the CLI) and has no
side effects, so ``dptrain run`` calls it before spawning workers or creating the run
directory, and each worker calls it again (under torchrun there is no ``dptrain run``).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dptrain.batching import BatchPlan, BatchSizeError
from dptrain.compress.remedies import Remedies
from dptrain.config import ConfigError, RunConfig, identity, identity_hash
from dptrain.config.loader import unused_settings
from dptrain.data.identity import data_changes, data_identity
from dptrain.data.loader import steps_per_epoch
from dptrain.optim.onebit_freeze import FreezeRule
from dptrain.ps.consistency import Consistency
from dptrain.ps.layout import PSLayoutError, Roles, partition
from dptrain.runner.checkpoint import CheckpointError, find_latest, verify_checkpoint
from dptrain.runner.ps_checkpoint import check_ps_resume
from dptrain.strategies import get_strategy, strategy_names
from dptrain.tasks import Task, architecture, build_task, run_name
from dptrain.zero.hybrid import check_shard_size

__all__ = ["RunPlan", "validate_run", "default_run_dir", "DEFAULT_GLOBAL_BATCH"]

DEFAULT_GLOBAL_BATCH = 32


@dataclass
class RunPlan:
    cfg: RunConfig
    run_dir: Path
    plan: BatchPlan
    task: Task
    identity: dict[str, Any]
    identity_hash: str
    resume_from: Path | None
    resume_meta: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)  # for the launcher to print once, before launch
    data_identity: dict[str, Any] = field(default_factory=dict)  # the data files' fingerprints, for meta.json


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / run_name(cfg)


def validate_run(cfg: RunConfig, world_size: int, check_forward: bool = True) -> RunPlan:
    """The checked plan of a run; ``check_forward``: trace the model's forward and loss on fake tensors
    (:func:`_check_forward`; a launcher that already did may skip it in the workers)."""
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, got {world_size}")
    _check_ranges(cfg)
    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps)
    if all(v is None for v in sizes):
        sizes = (DEFAULT_GLOBAL_BATCH, None, None)
    _check_straggler(cfg, world_size)
    _check_balance(cfg)
    _check_divergence(cfg)
    _check_log_backends(cfg)
    check_own = _STRATEGY_CHECKS.get(cfg.ddp.strategy)  # a strategy's own settings ([ps]); returns its data ranks
    data_ranks = check_own(cfg, world_size) if check_own else world_size
    try:
        plan = BatchPlan.resolve(data_ranks, *sizes)
    except BatchSizeError as e:
        if data_ranks == world_size:
            raise
        raise BatchSizeError(f"{e} (strategy {cfg.ddp.strategy}: the world here is the {data_ranks} workers; the "
                             f"{world_size - data_ranks} server rank(s) take no data)") from None
    _check_nodes(cfg, world_size)
    _check_optimizer_in_backward(cfg, plan.grad_accum_steps)
    try:
        task = build_task(cfg)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"task {run_name(cfg)!r}: {e}") from None
    try:
        steps_per_epoch(len(task.train_set), plan)
    except BatchSizeError as e:
        about = getattr(task, "about", "")
        raise BatchSizeError(f"{e}" + (f" (samples: {about})" if about else "")) from None
    n_params = _check_model_builds(task, cfg)
    if check_forward:
        _check_forward(task, cfg, plan.micro_batch_size)
    run_dir = default_run_dir(cfg).resolve()
    _check_run_dir(run_dir, n_params, cfg)
    ident = identity(cfg)
    ident["train.global_batch_size"] = plan.global_batch_size  # resolved, whichever two were given
    ident_hash = identity_hash(ident)
    resume_from, meta = None, None
    latest = find_latest(run_dir)
    if latest is not None and cfg.checkpoint.resume:
        resume_from = latest
        layout = get_strategy(cfg.ddp.strategy).checkpoint_layout
        meta = verify_checkpoint(resume_from, ident, ident_hash, plan.global_batch_size, layout)
        if layout == "ps":
            check_ps_resume(resume_from, meta, cfg.ps.servers, cfg.ps.mode, world_size)
        else:  # older formats, named before launch (ddp <-> zero otherwise resume either way)
            from dptrain.strategies.state import check_strategy_resume  # DCP: only when resuming

            try:
                check_strategy_resume(resume_from, meta.get("format", "replicated"), layout)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
    elif latest is not None:
        raise ConfigError(f"checkpoint.resume is false but {run_dir} already has checkpoints (newest: "
                          f"{latest.name}); a new run there would mix its checkpoints with the old ones. "
                          f"Use another run_dir, or delete {latest.parent}")
    notes = [f"warning: {line}" for line in [unused_settings(cfg)] if line] + list(getattr(task, "notes", []))
    notes += onebit_notes(cfg)
    data = data_identity(getattr(task, "data_files", {}))
    if meta is not None:
        notes += check_data_identity(meta.get("data"), data, resume_from, cfg.data.allow_changed)
    return RunPlan(cfg, run_dir, plan, task, ident, ident_hash, resume_from, meta, notes, data)


def check_data_identity(before: dict | None, now: dict, checkpoint: Path, allow_changed: bool) -> list[str]:
    """Refuse to resume ``checkpoint`` on data other than its own (:func:`~dptrain.data.identity.data_changes`).

    Returns the lines to print: a note for a checkpoint that recorded no data (written
    before checkpoints did), a warning for changed data under ``data.allow_changed``.
    """
    if before is None:
        return [f"note: checkpoint {checkpoint.name} does not record its data (written by an older dptrain): the "
                "data is not checked against it"] if now else []
    changes = data_changes(before, now)
    if not changes:
        return []
    what = "; ".join(changes)
    if allow_changed:
        return [f"warning: the data changed since checkpoint {checkpoint.name} ({what}); resuming on it anyway "
                "(data.allow_changed)"]
    raise CheckpointError(f"the data changed since checkpoint {checkpoint} was written: {what}. Resume on the data it "
                          "was trained on, or resume on this data anyway with --set data.allow_changed=true (the "
                          "rest of the run then differs from an uninterrupted one), or start afresh with another "
                          "run_dir")


def _check_ranges(cfg: RunConfig) -> None:
    checks = [
        ("train.steps", cfg.train.steps, 1), ("train.base_batch_size", cfg.train.base_batch_size, 1),
        ("train.warmup_steps", cfg.train.warmup_steps, 0), ("log.every", cfg.log.every, 1),
        ("log.eval_every", cfg.log.eval_every, 0), ("log.eval_batches", cfg.log.eval_batches, 1),
        ("log.trace_start", cfg.log.trace_start, 1), ("log.trace_steps", cfg.log.trace_steps, 0),
        ("checkpoint.every", cfg.checkpoint.every, 0), ("checkpoint.keep_last", cfg.checkpoint.keep_last, 1),
        ("train.grad_clip", cfg.train.grad_clip, 0.0), ("train.weight_decay", cfg.train.weight_decay, 0.0),
        ("train.momentum", cfg.train.momentum, 0.0),
        ("ddp.timeout_s", cfg.ddp.timeout_s, 1.0), ("ddp.roll_call_s", cfg.ddp.roll_call_s, 0.0),
    ]
    for name, value, low in checks:
        if value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}")
    for name, value in (("ddp.bucket_cap_mb", cfg.ddp.bucket_cap_mb), ("ddp.last_bucket_cap_mb", cfg.ddp.last_bucket_cap_mb)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be a positive size in MiB, got {value}; leave it unset for the default")
    if not cfg.train.lr > 0:  # the loader refuses nan and inf already
        raise ConfigError(f"train.lr must be a positive learning rate, got {cfg.train.lr}; e.g. --set train.lr=3e-4")
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision fp16 needs CUDA (it relies on a loss scaler); use bf16 on CPU")
    if cfg.ddp.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError('ddp.backend nccl needs CUDA devices; use "gloo" (or "auto") on CPU')
    d = cfg.ddp
    _check_codec(get_strategy(d.strategy), d.compression)
    if d.compression != "none" and d.algorithm != "native":
        raise ConfigError(f"ddp.algorithm {d.algorithm!r} chooses how uncompressed buckets are all-reduced; with "
                          f"ddp.compression {d.compression!r} the codec decides the collectives: leave algorithm "
                          "native")
    if d.powersgd_rank < 1:
        raise ConfigError(f"ddp.powersgd_rank must be at least 1, got {d.powersgd_rank}")
    if not 0.0 < d.topk_fraction <= 1.0:
        raise ConfigError(f"ddp.topk_fraction must be in (0, 1], got {d.topk_fraction}")
    try:
        compression_remedies(cfg).check(d.compression)
    except ValueError as e:
        raise ConfigError(f"ddp: {e}") from None
    _check_onebit(cfg)
    if d.momentum_correction and cfg.train.optimizer != "sgd":
        raise ConfigError(f"ddp.momentum_correction moves SGD's momentum (train.momentum) onto each rank, before "
                          f"compression: it needs train.optimizer = \"sgd\", got {cfg.train.optimizer!r}")
    if d.momentum_correction and not d.error_feedback:
        raise ConfigError("ddp.momentum_correction accumulates the velocity that was not sent, which is error "
                          "feedback: set ddp.error_feedback = true")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must be within [0, 1], got {cfg.train.min_lr_ratio}")
    if len(cfg.train.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.train.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {cfg.train.betas}")


def onebit_freeze(cfg: RunConfig) -> tuple[int | None, FreezeRule]:
    """1-bit Adam's ``freeze_step`` and ``freeze_rule``: ``train.onebit_freeze_step`` where set (> 0), else None, v
    freezing when the rule finds it settled; the rule never before the LR warm-up's end."""
    t = cfg.train
    return t.onebit_freeze_step or None, FreezeRule(earliest=t.warmup_steps)


def onebit_notes(cfg: RunConfig) -> list[str]:
    """What to know before a 1-bit Adam run starts: a freeze_step earlier than the rule can ever freeze (the
    LR warm-up), or a run too short for the rule to freeze at all (then it is AdamW throughout)."""
    t = cfg.train
    if t.optimizer != "onebit_adam":
        return []
    step, rule = onebit_freeze(cfg)
    if step is not None and step < rule.first_check:
        return [f"warning: train.onebit_freeze_step {step} freezes 1-bit Adam's second moment before step "
                f"{rule.first_check}, the first the rule can freeze at (after the {t.warmup_steps}-step LR warm-up); "
                "frozen that early, v is stale for the rest of the run (docs/compression.md: up to 1.5x AdamW's "
                "loss at 1,000 steps). Leave it 0 to freeze when v settles"]
    if step is None and t.steps <= rule.first_check:
        return [f"note: 1-bit Adam freezes v once it settles, at step {rule.first_check} at the earliest; this run "
                f"has {t.steps} steps, so it runs uncompressed AdamW throughout"]
    return []


def _check_onebit(cfg: RunConfig) -> None:
    """1-bit Adam replaces the DDP engine's gradient all-reduce with its own comm hook: nothing else may claim it."""
    t, d = cfg.train, cfg.ddp
    if t.optimizer != "onebit_adam":
        return
    if not get_strategy(d.strategy).comm_hooks:
        raise ConfigError(f"train.optimizer onebit_adam averages the momentum through the DDP engine's comm hook; "
                          f"strategy {d.strategy!r} has none: set ddp.strategy = \"ddp\" "
                          f"({_listed(strategy_names(lambda s: s.comm_hooks), 'or')}) or train.optimizer = \"adamw\"")
    if d.compression != "none" or d.algorithm != "native":
        raise ConfigError(f"train.optimizer onebit_adam compresses the momentum itself (1 bit per element after the "
                          f"warm-up) and all-reduces the warm-up's gradients natively; ddp.compression "
                          f"{d.compression!r} and ddp.algorithm {d.algorithm!r} would claim the same gradients: set "
                          "compression = \"none\" and algorithm = \"native\"")
    if t.onebit_freeze_step < 0:
        raise ConfigError(f"train.onebit_freeze_step {t.onebit_freeze_step}: 1-bit Adam needs at least one "
                          "uncompressed step to estimate the second moment it freezes; set 0 (freeze when it "
                          "settles) or a step >= 1")


def _check_optimizer_in_backward(cfg: RunConfig, grad_accum_steps: int) -> None:
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
             "the DDP engine, ddp.strategy = \"ddp\"": get_strategy(d.strategy).comm_hooks and not
                 get_strategy(d.strategy).shards_parameters}
    missing = [what for what, ok in needs.items() if not ok]
    if missing:
        raise ConfigError(f"ddp.optimizer_in_backward steps each bucket's parameters inside backward, which needs "
                          f"{'; '.join(missing)}; or set ddp.optimizer_in_backward = false")


def _check_codec(strategy, codec: str) -> None:
    """``ddp.compression`` against what the strategy's collectives can compress (its registry entry's codecs)."""
    if strategy.accepts_codec(codec):
        return
    takers = _listed(strategy_names(lambda s: codec in s.codecs), "or")
    if not strategy.codecs:
        raise ConfigError(f"ddp.compression {codec!r} compresses the gradient collectives of strategy {takers}; "
                          f"strategy {strategy.name} {strategy.uncompressed}: set compression = \"none\"")
    by_codecs: dict[tuple[str, ...], list[str]] = {}
    for name in strategy_names(lambda s: bool(s.codecs)):
        by_codecs.setdefault(get_strategy(name).codecs, []).append(name)
    supported = ", and ".join(
        f"strategy {names[0]} with {_listed(codecs, 'or')}" if len(names) == 1 else
        f"strategies {_listed(names, 'and')} with {', '.join(codecs)}"
        + (" (their reduce-scatter, compressed shard by shard)" if get_strategy(names[0]).shards_parameters else "")
        for codecs, names in by_codecs.items())
    raise ConfigError(f"ddp.compression {codec!r} works with strategy {takers} only, not {strategy.name!r}; "
                      f"supported: {supported}")


def _listed(items, conjunction: str) -> str:
    """``a, b or c``."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def compression_remedies(cfg: RunConfig) -> Remedies:
    """``[ddp]``'s corrections and schedules for top-k and PowerSGD (:mod:`dptrain.compress.remedies`)."""
    d = cfg.ddp
    try:
        return Remedies(momentum=cfg.train.momentum if d.momentum_correction else None, masking=d.momentum_masking,
                        local_clip=d.local_clip, topk_warmup_steps=d.topk_warmup_steps,
                        powersgd_uncompressed_steps=d.powersgd_uncompressed_steps,
                        powersgd_warmup_rank=d.powersgd_warmup_rank, powersgd_warmup_steps=d.powersgd_warmup_steps)
    except ValueError as e:
        raise ConfigError(f"ddp: {e}") from None


def _check_ps(cfg: RunConfig, world_size: int) -> int:
    """The parameter-server settings; returns the number of workers (the ranks that take data)."""
    p, d = cfg.ps, cfg.ddp
    try:
        roles = Roles(world_size, p.servers)
        Consistency(p.mode, staleness=p.staleness, backups=p.backups).check_workers(roles.num_workers)
    except ValueError as e:
        raise ConfigError(f"[ps] servers={p.servers}, mode={p.mode!r}: {e}") from None
    _check_codec(get_strategy("ps"), d.compression)
    if cfg.train.precision == "fp16":
        raise ConfigError("train.precision fp16 is not supported with strategy ps (it needs a loss scaler); use bf16")
    if p.lookahead and p.mode not in ("async", "ssp"):
        raise ConfigError(f"ps.lookahead is for modes async and ssp; in mode {p.mode!r} every applied gradient is "
                          "fresh, so there is nothing to look ahead for: set lookahead = false")
    if p.lookahead and cfg.train.optimizer not in ("adamw", "adam", "sgd"):
        raise ConfigError(f"ps.lookahead predicts the optimizer's next step, which dptrain does for adamw, adam and "
                          f"sgd, not {cfg.train.optimizer!r}: change train.optimizer or set lookahead = false")
    return roles.num_workers


def _check_balance(cfg: RunConfig) -> None:
    b = cfg.balance
    if not b.dynamic_batching:
        return
    if not get_strategy(cfg.ddp.strategy).dynamic_batching:
        able = " or ".join(strategy_names(lambda s: s.dynamic_batching))
        raise ConfigError(f"balance.dynamic_batching works with strategy {able}, not {cfg.ddp.strategy!r} (ps workers "
                          "already go at their own pace in modes async, ssp and backup)")
    if b.every < 1:
        raise ConfigError(f"balance.every must be at least 1, got {b.every}")
    if not 0.0 <= b.smoothing < 1.0:
        raise ConfigError(f"balance.smoothing must be in [0, 1), got {b.smoothing}")


def _check_divergence(cfg: RunConfig) -> None:
    d = cfg.divergence
    if d.every < 0:
        raise ConfigError(f"divergence.every must be >= 0 (0: off), got {d.every}")
    if d.every and not get_strategy(cfg.ddp.strategy).replicated_state:
        able = strategy_names(lambda s: s.replicated_state)
        raise ConfigError(f"divergence.every compares replicated state, which strategy {cfg.ddp.strategy!r} does not "
                          "keep (zero3 shards the parameters, gossip replicas differ by design, ps workers hold "
                          f"copies); use strategy {_listed(able, 'or')}, or divergence.every = 0")


def _check_log_backends(cfg: RunConfig) -> None:
    """``log.backends``: known names, with metrics.jsonl, and each one's library installed (nothing imported)."""
    from dptrain.runner.log_backends import check_backends  # here: the edit stays within this check

    try:
        check_backends(cfg.log.backends)
    except ValueError as e:
        raise ConfigError(f"log.backends: {e}") from None


def _check_straggler(cfg: RunConfig, world_size: int) -> None:
    s = cfg.straggler
    if not -1 <= s.rank < world_size:
        raise ConfigError(f"straggler.rank must be -1 (none) or a rank in [0, {world_size - 1}], got {s.rank}")
    if s.factor < 1.0:
        raise ConfigError(f"straggler.factor must be at least 1 (how many times slower), got {s.factor}")
    if get_strategy(cfg.ddp.strategy).expendable_workers and s.rank >= world_size - cfg.ps.servers:
        raise ConfigError(f"straggler.rank {s.rank} is a parameter server (ranks {world_size - cfg.ps.servers}-"
                          f"{world_size - 1}); a straggler must be a worker, a rank below "
                          f"{world_size - cfg.ps.servers}")


def _check_nodes(cfg: RunConfig, world_size: int) -> None:
    per_node = cfg.ddp.ranks_per_node
    if per_node < 0 or (per_node and world_size % per_node):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"ddp.ranks_per_node={per_node} does not divide the world size {world_size}; "
                          f"choose one of {divisors} (or 0 for the local world size)")
    shard_size = cfg.zero.shard_size
    if shard_size and not get_strategy(cfg.ddp.strategy).shards_parameters:
        zero = strategy_names(lambda s: s.shards_parameters)
        raise ConfigError(f"zero.shard_size={shard_size} (hybrid sharding) needs strategy {_listed(zero, 'or')}, "
                          f"not {cfg.ddp.strategy!r}")
    if shard_size:
        try:
            check_shard_size(shard_size, world_size)
        except ValueError as e:
            raise ConfigError(f"zero.{e}, or 0 to shard over all ranks") from None


def _check_run_dir(run_dir: Path, n_params: int, cfg: RunConfig) -> None:
    """Before any training time is spent: the run directory can be written, and has room for the checkpoints.

    Writability is tried, not read from permission bits (root ignores them; a read-only
    mount does not): a temporary file is created and removed in the nearest existing
    directory. Room: ``keep_last + 1`` checkpoints (one being written while the last
    ``keep_last`` are kept) of fp32 parameters and two optimizer moments, and the final
    weights: ``(3 x (keep_last + 1) + 1) x 4 bytes x parameters``.
    """
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"the run directory {run_dir} cannot be created: {existing} is a file, not a directory. "
                          "Choose another --run-dir")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"the run directory {run_dir} is not writable ({existing}: {e.strerror}). Choose another "
                          "--run-dir") from None
    need = (3 * (cfg.checkpoint.keep_last + 1) + 1) * 4 * n_params
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ConfigError(f"the run directory {run_dir} has {free / 2**20:,.0f} MiB free, and "
                          f"{cfg.checkpoint.keep_last} kept checkpoints of {n_params:,} parameters with their "
                          f"optimizer state need about {need / 2**20:,.0f} MiB. Free space, choose another "
                          "--run-dir, or lower checkpoint.keep_last")


def _check_model_builds(task: Task, cfg: RunConfig) -> int:
    """Build the model on the meta device (no memory, no init cost) to catch bad model arguments."""
    try:
        with torch.device("meta"):
            model = architecture(task)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        section = "gpt" if cfg.task.name == "chargpt" else "classifier"
        where = (f"hf.path {cfg.hf.path!r}" if cfg.hf.path and cfg.data.source != "task" else
                 f"task.model {cfg.task.model!r} with task.model_args {cfg.task.model_args}" if cfg.task.model
                 else f"the [{section}] settings")
        raise ConfigError(f"{where} cannot build the model: {e}") from None
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameters")
    if get_strategy(cfg.ddp.strategy).checkpoint_layout == "ps":  # the servers' shards of the parameters
        try:
            partition([p.numel() for p in model.parameters()], cfg.ps.servers)
        except PSLayoutError as e:
            raise ConfigError(f"ps.servers={cfg.ps.servers}: {e}") from None
    return sum(p.numel() for p in model.parameters())


def _check_forward(task: Task, cfg: RunConfig, micro_batch: int) -> None:
    """Refuse a model whose output the task's loss cannot use, found by ``dptrain plan``'s fake-tensor trace.

    Without this the workers start, write the run directory, and fail at step 1. A forward
    that cannot be traced without data (``.item()``, data-dependent control flow) is let
    through: only the real run can tell (:func:`~dptrain.planner.from_config.loss_problem`).
    """
    from dptrain.planner.from_config import loss_problem  # the planner imports the trainer: only when checking

    problem = loss_problem(task, micro_batch)
    if problem is None:
        return
    model = (f"hf.path {cfg.hf.path!r}" if cfg.hf.path and cfg.data.source != "task" else
             f"task.model {cfg.task.model!r}" if cfg.task.model else "the built-in model")
    raise ConfigError(f"the output of {model} cannot be used by the {run_name(cfg)!r} task's loss (one micro-batch "
                      f"of {micro_batch} traced on fake tensors): {problem}. Make the model return a scalar loss, an "
                      "object with .loss, or logits whose last dimension is the classes and whose other dimensions "
                      "match the targets (docs/your-data.md: what a model may return)")


# Each strategy's own settings, checked before launch (the [ps] section); returns the ranks that take data.
_STRATEGY_CHECKS = {"ps": _check_ps}
