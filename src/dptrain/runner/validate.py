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
from dptrain.optim.onebit_freeze import onebit_notes
from dptrain.optim.schedule import schedule_warnings
from dptrain.runner.plan import RunPlan
from dptrain.strategies import Strategy, get_strategy
from dptrain.strategies.registry import checkpoint_writers
from dptrain.strategies.requirements import check_features, check_optimizer_in_backward
from dptrain.tasks import Task, architecture, build_task, run_name

__all__ = ["RunPlan", "validate_run", "default_run_dir", "DEFAULT_GLOBAL_BATCH"]

DEFAULT_GLOBAL_BATCH = 32


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / run_name(cfg)


def validate_run(cfg: RunConfig, world_size: int, check_forward: bool = True) -> RunPlan:
    """The checked plan of a run; ``check_forward``: trace the model's forward and loss on fake tensors
    (:func:`_check_forward`; a launcher that already did may skip it in the workers)."""
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, got {world_size}")
    entry = _strategy(cfg)
    cfg.check()  # each section its own values
    _check_machine(cfg)
    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps)
    if all(v is None for v in sizes):
        sizes = (DEFAULT_GLOBAL_BATCH, None, None)
    data_ranks = _own_check(entry, cfg, world_size)  # the strategy's own settings; the ranks that take data
    check_features(cfg, entry, world_size, data_ranks)  # the rules across sections, each feature's own
    _check_log_backends(cfg)
    try:
        plan = BatchPlan.resolve(data_ranks, *sizes, section="train")
    except BatchSizeError as e:
        if data_ranks == world_size:
            raise
        takers, others = entry.roles
        raise BatchSizeError(f"{e} (strategy {cfg.distributed.strategy}: the world here is the {data_ranks} {takers}; the "
                             f"{world_size - data_ranks} {others} take no data)") from None
    _check_nodes(cfg, world_size)
    check_optimizer_in_backward(cfg, entry, plan.grad_accum_steps)
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
        meta = verify_checkpoint(resume_from, ident, ident_hash, plan.global_batch_size, entry.checkpoint_layout,
                                 writers=checkpoint_writers())
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
        return get_strategy(cfg.distributed.strategy)
    except ValueError as e:
        raise ConfigError(f"distributed.strategy: {e}") from None


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


def _check_machine(cfg: RunConfig) -> None:
    """What the settings ask of this machine."""
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision fp16 needs CUDA (it relies on a loss scaler); use bf16 on CPU")
    if cfg.distributed.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError('distributed.backend nccl needs CUDA devices; use "gloo" (or "auto") on CPU')


def _check_log_backends(cfg: RunConfig) -> None:
    """``log.backends``: known names, with metrics.jsonl, and each one's library installed (nothing imported)."""
    from dptrain.runner.log_backends import check_backends  # here: the edit stays within this check

    try:
        check_backends(cfg.log.backends)
    except ValueError as e:
        raise ConfigError(f"log.backends: {e}") from None


def _check_nodes(cfg: RunConfig, world_size: int) -> None:
    per_node = cfg.ddp.ranks_per_node
    if per_node < 0 or (per_node and world_size % per_node):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"ddp.ranks_per_node={per_node} does not divide the world size {world_size}; "
                          f"choose one of {divisors} (or 0 for the local world size)")


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

