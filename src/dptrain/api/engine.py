"""The data-parallel training step, for loops you write yourself.

One optimizer step on the global batch is, on every rank, in this order (nanoGPT's):

1. ``grad_accum_steps`` micro-steps of forward and backward on ``micro_batch_size``
   samples, with gradient synchronisation on the last only (``no_sync`` before it), each
   loss divided by ``grad_accum_steps`` so the accumulated gradient is the mean over
   the global batch;
2. gradient clipping by the global L2 norm (the gradients are identical on every rank
   after the all-reduce, so the norm is too);
3. the learning rate for this step, the optimizer step, zero_grad.

Mixed precision follows ``torch.autocast``: bf16 on CPU or GPU; fp16 on GPU with a
``GradScaler``. A step whose gradient norm is not finite is skipped; because the norm
is the same on every rank, every rank skips it together.

``strategy`` picks the data-parallel wrapper: ``"ddp"`` (replicated, the DDP engine),
``"zero1"``/``"zero2"``/``"zero3"`` (:class:`dptrain.zero.ZeRO`) or ``"gossip"``
(:class:`dptrain.gossip.module.GossipDataParallel`: gradients stay local, the parameters are
mixed with the neighbours' before each optimizer step; the gradient norm is then each
rank's own). Under ZeRO the
optimizer must be built from the wrapped model's shards, so pass a factory
``optimizer=lambda model: torch.optim.AdamW(model.parameters(), ...)``; bf16 becomes
ZeRO's own mixed precision (the module computes in bf16 from fp32 master shards,
no autocast); gradient clipping takes the norm over every rank's shard.

    engine = Engine(model, optimizer, plan, precision="bf16", grad_clip=1.0, lr_at=schedule)
    batches = engine.loader(dataset).micro_batches()
    for step in range(steps):
        for x, y in engine.micro_steps(batches):
            with engine.autocast():
                loss = loss_fn(engine.model(x), y)
            engine.backward(loss)
        info = engine.step()     # StepInfo(step, loss, grad_norm, lr, skipped)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from dptrain.batching import BatchPlan
from dptrain.ddp import DistributedDataParallel
from dptrain.utils.tensors import map_tensors
from dptrain.gossip.module import GossipDataParallel
from dptrain.launch.heartbeat import mark_progress
from dptrain.data.loader import ShardedLoader
from dptrain.zero import MixedPrecision, ZeRO

__all__ = ["Engine", "StepInfo", "clip_by_global_norm"]


@dataclass(frozen=True)
class StepInfo:
    step: int          # the optimizer step just taken (1-based count of steps done)
    loss: float        # this rank's mean loss over the step's micro-batches
    grad_norm: float   # global L2 norm before clipping
    lr: float
    skipped: bool      # non-finite gradients: the optimizer did not step


class Engine:
    def __init__(self, model: nn.Module,
                 optimizer: torch.optim.Optimizer | Callable[[nn.Module], torch.optim.Optimizer], plan: BatchPlan,
                 *, precision: str = "fp32", grad_clip: float = 0.0, lr_at: Callable[[int], float] | None = None,
                 ddp_kwargs: dict | None = None, process_group: dist.ProcessGroup | None = None,
                 strategy: str = "ddp", zero_kwargs: dict | None = None, gossip_kwargs: dict | None = None):
        if strategy == "ddp":
            self.model: nn.Module = DistributedDataParallel(model, process_group=process_group, **(ddp_kwargs or {}))
        elif strategy in ("zero1", "zero2", "zero3"):
            kwargs = dict(zero_kwargs or {})
            reduce_dtype = kwargs.pop("reduce_dtype", torch.float32)
            if precision == "bf16":
                kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            elif precision == "fp16":
                raise ValueError("precision fp16 is not supported with ZeRO (it needs a loss scaler over sharded "
                                 "gradients); use bf16, which needs none")
            self.model = ZeRO(model, stage=int(strategy[-1]), process_group=process_group, **kwargs)
        elif strategy == "gossip":
            self.model = GossipDataParallel(model, process_group=process_group, **(gossip_kwargs or {}))
        else:
            raise ValueError(f"unknown strategy {strategy!r}; use ddp, zero1, zero2, zero3 or gossip")
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(self.model)
        elif self.sharded:
            raise TypeError(f"strategy {strategy} shards the parameters when it wraps the model, so the optimizer "
                            "must be built afterwards: pass a factory, optimizer=lambda model: "
                            "torch.optim.AdamW(model.parameters(), ...)")
        self.optimizer = optimizer
        self.plan = plan
        self.device = self.model.device
        self.grad_clip = grad_clip
        self.lr_at = lr_at
        self.step_count = 0
        self.skipped_steps = 0
        self._autocast_dtype, self.scaler = _precision(precision, self.device)
        if self.sharded:
            self._autocast_dtype = None  # ZeRO's MixedPrecision casts the module itself
        self._loss_sum = torch.zeros((), device=self.device)
        self._rank = dist.get_rank(process_group)

    @property
    def sharded(self) -> bool:
        """Whether the model is ZeRO-sharded (checkpoints are then sharded too)."""
        return isinstance(self.model, ZeRO)

    @property
    def gossip(self) -> bool:
        """Whether replicas are mixed with neighbours instead of gradients all-reduced (gradients stay local)."""
        return isinstance(self.model, GossipDataParallel)

    # ------------------------------------------------------------------ data

    def loader(self, dataset: Dataset, seed: int = 0, collate_fn: Callable | None = None) -> ShardedLoader:
        """This rank's micro-batches of ``dataset`` (see :class:`ShardedLoader`)."""
        return ShardedLoader(dataset, self.plan, self._rank, seed, collate_fn)

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in any nesting of lists, tuples, dicts) on the engine's device."""
        return _to_device(batch, self.device)

    def micro_steps(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The next ``grad_accum_steps`` micro-batches, all but the last under ``no_sync``.

        Run forward and backward for each inside the loop body: the context stays active
        while the generator is suspended there.
        """
        for k in range(self.plan.grad_accum_steps):
            last = k == self.plan.grad_accum_steps - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                yield _to_device(next(batches), self.device)

    # --------------------------------------------------------------- compute

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        """Backward of one micro-batch's mean loss, scaled to a mean over the global batch.

        ``weight`` replaces the default scale ``1 / grad_accum_steps`` when ranks take
        unequal shares of the batch (:class:`dptrain.data.balance.DynamicBatcher.weight`).
        """
        scaled = loss / self.plan.grad_accum_steps if weight is None else loss * weight
        self._loss_sum += scaled.detach().float()
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()

    def step(self) -> StepInfo:
        """Clip, set the learning rate, step the optimizer, zero the gradients."""
        mark_progress(self.step_count + 1)  # this process's heartbeat, if any (dptrain launch --timeout)
        lr = self.lr_at(self.step_count) if self.lr_at else self.optimizer.param_groups[0]["lr"]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [] if self.sharded else [p for p in self.model.parameters() if p.grad is not None]
        norm = clip_by_global_norm(params, self.grad_clip, self.model if self.sharded else None)
        skipped = not math.isfinite(norm)
        self.skipped_steps += skipped
        if self.gossip:  # D-PSGD: mix the parameters, then apply the gradient taken before mixing
            self.model.mix()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself on inf/nan
            self.scaler.update()
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        loss = self._loss_sum.item()
        self._loss_sum.zero_()
        return StepInfo(self.step_count, loss, norm, lr, skipped)

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Replicated (DDP) state, under the names every strategy reads (:mod:`dptrain.strategies.state`).

        A sharded model saves with :func:`dptrain.zero.checkpoint.save_sharded` (every rank).
        """
        from dptrain.strategies.state import replicated_state  # torch.distributed.checkpoint: when saving

        if self.sharded:
            raise RuntimeError("a ZeRO model's state is sharded: save it with dptrain.zero.checkpoint.save_sharded "
                               "(every rank), as dptrain run does")
        model_state, optim_state = replicated_state(self.model.module, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "step": self.step_count,
                 "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (or an older one, whose optimizer state is keyed by parameter index)."""
        from dptrain.strategies.state import set_replicated_state

        if self.sharded:
            raise RuntimeError("a ZeRO model's state is sharded: load it with dptrain.zero.checkpoint.load_sharded "
                               "(every rank), as dptrain run does")
        set_replicated_state(self.model.module, self.optimizer, state["model"], state["optimizer"])
        self.step_count = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def clip_by_global_norm(params: list[torch.Tensor], grad_clip: float, zero: ZeRO | None = None) -> float:
    """The gradients' global L2 norm before clipping them to ``grad_clip`` (0: the norm only).

    Under ZeRO (``zero``) the norm is over every rank's shard, the same on every rank;
    otherwise over ``params``' gradients, which the all-reduce made the same on every rank.
    A norm that is not finite is for the caller to skip the step on.
    """
    max_norm = grad_clip if grad_clip > 0 else math.inf
    if zero is not None:
        return float(zero.clip_grad_norm_(max_norm))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0


def _precision(name: str, device: torch.device) -> tuple[torch.dtype | None, Any]:
    if name == "fp32":
        return None, None
    if name == "bf16":
        return torch.bfloat16, None
    if name == "fp16":
        if device.type != "cuda":
            raise ValueError("precision fp16 needs a CUDA device (it relies on a loss scaler); "
                             "use bf16 on CPU")
        return torch.float16, torch.amp.GradScaler("cuda")
    raise ValueError(f"unknown precision {name!r}; use fp32, bf16 or fp16")


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
