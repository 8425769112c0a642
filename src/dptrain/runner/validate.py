"""Everything about a run that can be wrong, checked before anything is written.

``validate_run`` resolves the run directory and the batch plan, imports the model
factory, builds the task's datasets far enough to know they fit one global batch, and
verifies the checkpoint a resumption would start from (its config, and its data: the
fingerprints of the data files it was trained on, ``data/identity.py``). It raises
:class:`~dptrain.config.ConfigError`, :class:`~dptrain.batching.BatchSizeError` or
:class:`~dptrain.checkpoint.files.CheckpointError` (exit code 2 from the CLI) and has no
side effects, so ``dptrain run`` calls it before spawning workers or creating the run
directory, and each worker calls it again (under torchrun there is no ``dptrain run``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from dptrain.batching import BatchPlan, BatchSizeError
from dptrain.checkpoint.files import CheckpointError, check_readable, scan_checkpoints, verify_checkpoint
from dptrain.config import ConfigError, RunConfig, identity, identity_hash
from dptrain.config.loader import unused_settings
from dptrain.data.identity import data_changes, data_identity
from dptrain.data.loader import steps_per_epoch
from dptrain.optim.onebit_freeze import FreezeRule
from dptrain.runner.plan import RunPlan
from dptrain.strategies import Strategy, get_strategy, strategy_names
from dptrain.strategies.options import compression_remedies
from dptrain.tasks import Task, architecture, build_task, run_name

__all__ = ["RunPlan", "validate_run", "default_run_dir", "schedule_warnings", "DEFAULT_GLOBAL_BATCH"]

DEFAULT_GLOBAL_BATCH = 32


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / run_name(cfg)


def validate_run(cfg: RunConfig, world_size: int, check_forward: bool = True) -> RunPlan:
    """The checked plan of a run; ``check_forward``: trace the model's forward and loss on fake tensors
    (:func:`_check_forward`; a launcher that already did may skip it in the workers)."""
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, got {world_size}")
    entry = _strategy(cfg)
    _check_ranges(cfg)
    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps)
    if all(v is None for v in sizes):
        sizes = (DEFAULT_GLOBAL_BATCH, None, None)
    data_ranks = _own_check(entry, cfg, world_size)  # the strategy's own settings; the ranks that take data
    _check_straggler(cfg, world_size, data_ranks)
    _check_balance(cfg)
    _check_divergence(cfg)
    _check_log_backends(cfg)
    try:
        plan = BatchPlan.resolve(data_ranks, *sizes)
    except BatchSizeError as e:
        if data_ranks == world_size:
            raise
        takers, others = entry.roles
        raise BatchSizeError(f"{e} (strategy {cfg.ddp.strategy}: the world here is the {data_ranks} {takers}; the "
                             f"{world_size - data_ranks} {others} take no data)") from None
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
    n_params = _check_model_builds(task, cfg, entry)
    if check_forward:
        _check_forward(task, cfg, plan.micro_batch_size)
    run_dir = default_run_dir(cfg).resolve()
    _check_run_dir(run_dir, n_params, cfg)
    ident = identity(cfg)
    ident["train.global_batch_size"] = plan.global_batch_size  # resolved, whichever two were given
    ident_hash = identity_hash(ident)
    resume_from, meta = None, None
    found, strays = scan_checkpoints(run_dir)
    latest = found[-1][1] if found else None
    if latest is not None and cfg.checkpoint.resume:
        resume_from = latest
        meta = verify_checkpoint(resume_from, ident, ident_hash, plan.global_batch_size, entry.checkpoint_layout)
        check_readable(resume_from, meta)
        _check_resume(entry, resume_from, meta, cfg, world_size)
    elif latest is not None:
        raise ConfigError(f"checkpoint.resume is false but {run_dir} already has checkpoints (newest: "
                          f"{latest.name}); a new run there would mix its checkpoints with the old ones. "
                          f"Use another run_dir, or delete {latest.parent}")
    notes = [f"warning: {line}" for line in [unused_settings(cfg)] if line] + schedule_warnings(cfg.train.steps,
                                                                                              cfg.train.warmup_steps)
    notes += list(getattr(task, "notes", []))
    notes += [f"note: {stray}: not one of this run's checkpoints, so neither resumed from nor deleted"
              for stray in strays]
    notes += onebit_notes(cfg)
    data = data_identity(getattr(task, "data_files", {}))
    if meta is not None:
        notes += check_data_identity(meta.get("data"), data, resume_from, cfg.data.allow_changed)
    return RunPlan(cfg, run_dir, plan, task, ident, ident_hash, resume_from, meta, notes, data)


def _strategy(cfg: RunConfig) -> Strategy:
    """The run's registry entry; an unknown name is a ConfigError with the registered ones."""
    try:
        return get_strategy(cfg.ddp.strategy)
    except ValueError as e:
        raise ConfigError(f"ddp.strategy: {e}") from None


def _own_check(entry: Strategy, cfg: RunConfig, world_size: int) -> int:
    """The strategy's own settings (its entry's ``check``); the ranks that take data."""
    try:
        return entry.data_ranks(cfg, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_resume(entry: Strategy, path: Path, meta: dict, cfg: RunConfig, world_size: int) -> None:
    """Before launch: what the strategy says of the checkpoint (its entry's ``check_resume``), else whether its layout
    can read the one that wrote it (older formats named; ddp <-> zero otherwise resume either way)."""
    try:
        if entry.check_resume is not None:
            entry.check_resume(path, meta, cfg, world_size)
            return
        from dptrain.checkpoint.state import check_strategy_resume  # DCP: only when resuming

        check_strategy_resume(path, meta.get("format", "replicated"), entry.checkpoint_layout)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


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


def schedule_warnings(steps: int, warmup_steps: int) -> list[str]:
    """A warning when the learning-rate warm-up does not end before the run does (the schedule is
    :func:`~dptrain.optim.schedule.warmup_cosine`: the rate rises for ``warmup_steps`` steps, then decays)."""
    if warmup_steps < steps:
        return []
    reached = (f"reaches {steps}/{warmup_steps} = {steps / warmup_steps:.0%} of its peak at the last step"
               if warmup_steps > steps else "reaches its peak only at the last step")
    return [f"warning: train.warmup_steps {warmup_steps} is not below train.steps {steps}: the learning rate rises "
            f"for the whole run, {reached}, and never decays (train.min_lr_ratio has no effect); set "
            f"train.warmup_steps below {steps}, e.g. {max(1, steps // 10)} (a tenth of the run, as the default 30 "
            "of 300)"]


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
             "ddp.strategy " + _listed([f"{n} ({get_strategy(n).summary})" for n in
                                         strategy_names(lambda s: s.optimizer_in_backward)], "or"):
                 get_strategy(d.strategy).optimizer_in_backward}
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


def _check_straggler(cfg: RunConfig, world_size: int, data_ranks: int) -> None:
    s = cfg.straggler
    if not -1 <= s.rank < world_size:
        raise ConfigError(f"straggler.rank must be -1 (none) or a rank in [0, {world_size - 1}], got {s.rank}")
    if s.factor < 1.0:
        raise ConfigError(f"straggler.factor must be at least 1 (how many times slower), got {s.factor}")
    if s.rank >= data_ranks:
        raise ConfigError(f"straggler.rank {s.rank} takes no data (strategy {cfg.ddp.strategy}: ranks "
                          f"{data_ranks}-{world_size - 1} are its own, such as parameter servers); a straggler must "
                          f"compute, a rank below {data_ranks}")


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


def _check_model_builds(task: Task, cfg: RunConfig, entry: Strategy) -> int:
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
    if entry.check_model is not None:  # what only the strategy can say of the model (a ps server's shards)
        try:
            entry.check_model(cfg, model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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

