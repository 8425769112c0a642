"""Plan what ``dptrain run`` would run: the model, batch, optimizer and engine options of a config.

The model is built by the config's task under a fake tensor mode
(``torch._subclasses.fake_tensor.FakeTensorMode``): its tensors have shapes, dtypes and
a device but no storage, so building even a 70B model takes no memory, and the
traced forward dispatches as it would on the real device (on CPU the attention kernel
saves its log-sum-exp, not the T x T weights the meta device's would). Every
strategy's options come from the same code ``dptrain run`` uses, so the plan describes
the engine that will run, not a textbook one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dptrain.batching import BatchPlan, BatchSizeError
from dptrain.config import ConfigError, RunConfig
from dptrain.optim.build import build_optimizer
from dptrain.planner.activations import ActivationTraceError, trace_activations
from dptrain.planner.layout import STRATEGIES, Setup
from dptrain.planner.plan import Row, plan_row
from dptrain.planner.target import PlanTarget, plan_target, plan_task
from dptrain.strategies import get_strategy
from dptrain.strategies.options import zero_options
from dptrain.tasks import architecture, collate

__all__ = ["plan_config", "flat_model", "plan_count", "CountedBlock", "simulate_config", "setup_for", "optimizer_for", "compute_mode", "planned_precision",
           "checkpoint_classes", "trace_model", "loss_problem"]


class CountedBlock(nn.Module):
    """The one parameter of a bare count (:func:`flat_model`), owned as a transformer's block owns its weights.

    Planned as a unit ZeRO-3 reshards (gathered for forward, freed, gathered again for
    backward), as it does a transformer's blocks, which hold nearly all its parameters.
    """

    def __init__(self, numel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(int(numel), dtype=dtype, device="meta"))


def flat_model(numel: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model that is one parameter of ``numel`` elements in one :class:`CountedBlock`, on the meta device."""
    if numel < 1:
        raise ValueError(f"the parameter count must be positive, got {numel}")
    model = nn.Module()
    model.block = CountedBlock(numel, dtype)
    return model


def plan_count(numel: int, world_sizes: list[int], strategies: list[str], precisions: list[str]) -> list[Row]:
    """Model states and bytes sent for a bare parameter count (``dptrain plan --params``), one :class:`Row` each.

    The count is one tensor in one resharded ZeRO-3 unit (:class:`CountedBlock`), so
    ZeRO-3 gathers it twice a step as it gathers a transformer's blocks: 3/2 of DDP's
    bytes. A real model's root unit (embeddings, head, final norm) is gathered once, so
    its ZeRO-3 traffic is a little lower. Activations and communication buffers depend on
    the layers and are not estimated.
    """
    model = flat_model(numel)
    return [plan_row(model, Setup(s, n, p, unit_classes=(CountedBlock,)), None, layered=False)
            for n in world_sizes for p in precisions for s in strategies]


def plan_config(cfg: RunConfig, world_sizes: list[int], strategies: list[str], precisions: list[str],
                notes: list[str] | None = None, target: PlanTarget | None = None) -> list[Row]:
    """One :class:`Row` per strategy x world size x precision for the run ``cfg`` describes.

    ``notes`` collects what could not be estimated (e.g. a forward that does not trace);
    ``target``: :func:`~dptrain.planner.target.plan_target` of ``cfg``, when the caller has it.
    """
    notes = [] if notes is None else notes
    target = target if target is not None else plan_target(cfg)
    task, model, mode = target.task, target.model, target.mode
    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps)
    if all(v is None for v in sizes):
        sizes = (32, None, None)
    traced: dict[tuple[int, str], Any] = {}
    checkpoint = checkpoint_classes(cfg, model)
    rows = []
    for world_size in world_sizes:
        try:  # the global batch is fixed: a world size it cannot be split over is skipped, not fatal
            batch = BatchPlan.resolve(world_size, *sizes, section="train")
        except BatchSizeError as e:
            notes.append(f"N={world_size} skipped: {e} (set it with --set train.global_batch_size=..., or leave "
                         f"{world_size} out of --world-sizes)")
            continue
        for precision in precisions:
            for strategy in strategies:
                key = (batch.micro_batch_size, compute_mode(strategy, precision))
                if key not in traced:
                    traced[key] = _trace(task, *key, checkpoint, mode, notes)
                setup = setup_for(cfg, model, strategy, world_size, precision)
                rows.append(plan_row(model, setup, traced[key], batch.micro_batch_size,
                                     optimizer=lambda params: optimizer_for(cfg, params),
                                     micro_steps=batch.grad_accum_steps))
    return rows


def setup_for(cfg: RunConfig, model: nn.Module, strategy: str, world_size: int, precision: str) -> Setup:
    spec = get_strategy(strategy, among=STRATEGIES)
    if not spec.shards_parameters:
        return Setup(strategy, world_size, precision, bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                     last_bucket_cap_mb=cfg.ddp.last_bucket_cap_mb,
                     gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view)
    kw = spec.options(cfg, model, 1)
    return Setup(strategy, world_size, precision, reduce_dtype=kw["reduce_dtype"],
                 bucket_cap_mb=kw.get("bucket_cap_mb"), unit_classes=kw.get("unit_classes", ()),
                 min_unit_numel=kw.get("min_unit_numel"), reshard_after_forward=kw.get("reshard_after_forward", True),
                 split_by=kw["split_by"], shard_size=_hybrid(kw.get("shard_size"), world_size))


def planned_precision(cfg: RunConfig) -> str:
    """The config's precision as the planner models it: fp32 or bf16 (fp16 is planned as fp32)."""
    return cfg.train.precision if cfg.train.precision in ("fp32", "bf16") else "fp32"


def _hybrid(shard_size: int | None, world_size: int) -> int | None:
    """``zero.shard_size`` where it makes this world size hybrid (a proper divisor); else plain ZeRO."""
    return shard_size if shard_size and shard_size < world_size and world_size % shard_size == 0 else None


def optimizer_for(cfg: RunConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    holder = nn.Module()
    holder.params = nn.ParameterList(params)
    t = cfg.train
    return build_optimizer(holder, t.optimizer, t.lr, t.weight_decay, tuple(t.betas), t.momentum)


def compute_mode(strategy: str, precision: str) -> str:
    """How the forward computes: fp32; bf16 under autocast (the DDP engine: fp32 weights, bf16 matmuls,
    fp32 norms and softmax); or a bf16 model (ZeRO's mixed precision casts the module)."""
    if precision == "fp32":
        return "fp32"
    return "bf16" if get_strategy(strategy).casts_itself else "autocast"


def _trace(task, micro_batch: int, compute: str, checkpoint: tuple[type, ...], mode: FakeTensorMode,
           notes: list[str]):
    def batch():
        return collate(task)([task.train_set[i % len(task.train_set)] for i in range(micro_batch)])

    return trace_model(lambda: architecture(task), batch, task.loss, compute, checkpoint, mode, notes,
                       f"micro-batch {micro_batch}")


def trace_model(build: Callable[[], nn.Module], batch: Callable[[], Any], loss: Callable[[nn.Module, Any], Any],
                compute: str, checkpoint: tuple[type, ...], mode: FakeTensorMode, notes: list[str],
                what: str = "") -> Any:
    """Activations of ``loss(build(), batch())`` computed as ``compute`` (:func:`compute_mode`), traced in
    ``mode`` (fake tensors); None, with the reason in ``notes``, when the forward does not trace."""
    try:
        with mode:
            model = _build(build, torch.bfloat16 if compute == "bf16" else torch.float32)
            inputs = torch.utils._pytree.tree_map(lambda x: _fake(mode, x, compute == "bf16"), batch())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "autocast"):
                return trace_activations(model, inputs, loss, checkpoint)
    except ActivationTraceError as e:
        notes.append(f"activations ({compute}{', ' + what if what else ''}): {e}")
        return None


def loss_problem(task, micro_batch: int) -> str | None:
    """Why the task's loss cannot use the model's output, found by tracing one micro-batch on fake tensors.

    The trace is :func:`trace_model`'s (no memory, no compute, milliseconds for a small
    model). Only a forward that runs on fake tensors counts: then a loss that raises on its
    output (a tuple where logits were expected, logits that do not line up with the
    targets, neither a loss nor logits), or logits with fewer classes than the batch's
    targets (:func:`~dptrain.tasks.protocol.check_classes`), is the problem. A forward that
    cannot run without data (``.item()``, data-dependent control flow, an operation
    without a fake kernel) gives None: the real run may well work.
    """
    from dptrain.tasks.protocol import ProtocolError, check_classes

    samples = [task.train_set[i % len(task.train_set)] for i in range(micro_batch)]
    probe = _LossProbe(task.loss)
    try:
        real = collate(task)(samples)
        traced = trace_model(lambda: architecture(task), lambda: real, probe, "fp32", (),
                             FakeTensorMode(allow_non_fake_inputs=True), [])
    except Exception:  # building the model or the batch: checked elsewhere, or left to the real run
        return None
    if not probe.forward_returned:
        return None
    if traced is None:
        error = probe.error
        # an operation without a fake kernel raises NotImplementedError: a limit of the trace, not of the model
        limit = isinstance(error, NotImplementedError) or type(error).__module__.startswith(_FAKE_LIMITS)
        return None if error is None or limit else f"{type(error).__name__}: {error}"
    try:
        check_classes(probe.output, real)
    except ProtocolError as e:
        return str(e)
    return None


# Where the exceptions of a computation that fake tensors cannot follow come from (a value read, a
# data-dependent shape): the forward's failure, not the output's.
_FAKE_LIMITS = ("torch._subclasses", "torch.fx", "torch._dynamo")


class _LossProbe:
    """``loss(model, batch)`` that records whether the model's forward returned, its output, and what was raised."""

    def __init__(self, loss: Callable[[nn.Module, Any], Any]):
        self.loss = loss
        self.forward_returned = False
        self.output: Any = None
        self.error: Exception | None = None

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        handle = model.register_forward_hook(self._record)
        try:
            return self.loss(model, batch)
        except Exception as e:
            self.error = e
            raise
        finally:
            handle.remove()

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.forward_returned, self.output = True, output


def _build(build: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """``build()`` with its floating-point parameters created in ``dtype`` (fake tensors cannot be cast)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(default)


def _fake(mode: FakeTensorMode, x: Any, bf16: bool) -> Any:
    if not torch.is_tensor(x):
        return x
    if bf16 and x.is_floating_point():
        x = x.to(torch.bfloat16)
    return mode.from_tensor(x)


def checkpoint_classes(cfg: RunConfig, model: nn.Module) -> tuple[type, ...]:
    """The module classes checkpointed in the estimate: ZeRO stage 3's unit classes, as ``dptrain run`` picks them."""
    return tuple(zero_options(cfg, model, nodes=1, stage=3).get("unit_classes", ()))


def simulate_config(cfg: RunConfig, world_sizes: list[int], strategy: str, networks: list, algorithm: str,
                    profile: str, micro_batch: int | None = None, device_flops: float | None = None,
                    overlap: bool = True, compression: int = 1, overheads=None) -> dict:
    """Predicted steps of the run ``cfg`` describes at each world size, its batch resolved as ``dptrain run`` does.

    The rule is :func:`plan_config`'s: the config's batch sizes are kept and the rest follows
    the world size (:meth:`BatchPlan.resolve`). The config's global batch (32 if none is
    given) stays fixed as N grows, each rank taking global / N; ``micro_batch`` fixes the
    samples per rank instead (no global batch, accumulation 1), so N ranks process N
    times as many. A world size the batch cannot be split over is skipped with the
    reason in ``skipped``; one that accumulates is simulated micro-step by micro-step.

    ``profile="measured"`` times the real model on this machine (one thread), once per
    micro-batch size; ``"flops"`` counts its FLOPs on fake tensors at ``device_flops`` FLOP/s.
    ``overlap``, ``compression`` and ``overheads``: as :func:`~dptrain.planner.simulate.simulate_step`.
    Returns the profiles by micro-batch, the batch plan and one
    :class:`~dptrain.planner.simulate.StepPrediction` per network and world size.
    """
    from dptrain.planner.simulate import flops_profile, measure_profile, simulate_step

    task = plan_task(cfg)
    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps) if micro_batch is None else \
        (None, micro_batch, None)
    if all(v is None for v in sizes):
        sizes = (32, None, None)
    batches, skipped = {}, {}
    for n in world_sizes:
        try:
            batches[n] = BatchPlan.resolve(n, *sizes, section="train")
        except BatchSizeError as e:
            skipped[n] = f"{e} (set it with --set train.global_batch_size=..., or fix the samples per rank with " \
                         "--micro-batch)"
            continue
    if profile == "flops" and device_flops is None:
        raise ConfigError("profile 'flops' needs the device's throughput: --device-flops (FLOP/s)")
    if profile not in ("measured", "flops"):
        raise ConfigError(f"unknown profile {profile!r}; choose measured or flops")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if profile == "measured":
        torch.manual_seed(t.seed)
        model = task.build_model()
        opt = optimizer_for(cfg, [p for p in model.parameters() if p.requires_grad])
    else:
        with mode:
            model = architecture(task)
    profiles = {}
    for m in sorted({b.micro_batch_size for b in batches.values()}, reverse=True):
        samples = collate(task)([task.train_set[i % len(task.train_set)] for i in range(m)])
        if profile == "measured":
            profiles[m] = measure_profile(model, samples, task.loss, opt)
        else:
            with mode:
                batch = torch.utils._pytree.tree_map(lambda x: _fake(mode, x, False), samples)
                profiles[m] = flops_profile(model, batch, task.loss, device_flops)
    predictions = {}
    for net in networks:
        for n, b in batches.items():
            setup = setup_for(cfg, model, strategy, n, planned_precision(cfg))
            predictions[(net.name, n)] = simulate_step(model, setup, profiles[b.micro_batch_size], net, algorithm,
                                                       overlap, compression, b.grad_accum_steps, overheads)
    first = batches[min(batches)].micro_batch_size if batches else None
    return {"profile": profiles.get(first), "profiles": profiles, "micro_batch": first, "batches": batches,
            "skipped": skipped, "fixed": "micro" if micro_batch is not None or sizes[0] is None else "global",
            "predictions": predictions}
