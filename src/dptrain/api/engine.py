"""The data-parallel training step, for loops you write yourself.

One optimizer step on the global batch is, on every rank, in this order (nanoGPT's):

1. ``grad_accum_steps`` micro-steps of forward and backward on ``micro_batch_size``
   samples, with gradient synchronisation on the last only (``no_sync`` before it); the
   gradients add up, and the step divides their sum by the micro-step count, so the
   gradient is the mean over the global batch (the accumulation rule of
   :mod:`dptrain.api.step`, which ``prepare()`` follows too);
2. gradient clipping by the global L2 norm (the gradients are identical on every rank
   after the all-reduce, so the norm is too);
3. the learning rate for this step, the optimizer step, zero_grad.

Mixed precision follows ``torch.autocast``: bf16 on CPU or GPU; fp16 on GPU with a
``GradScaler``. A step whose gradient norm is not finite is skipped; because the norm
is the same on every rank, every rank skips it together.

``strategy`` names an entry of the registry (:mod:`dptrain.strategies`; ``strategy_names()``,
or ``dptrain run --config-reference``, lists them with what each does), which wraps the
model: ``"ddp"`` is the DDP engine. ``options`` is the strategy's options whichever it is:
its options object or a dict of its wrapper's keyword arguments; the older per-wrapper
keywords (``ddp_kwargs``, ``zero_kwargs``, ``gossip_kwargs``) still work. Under a strategy
whose replicas differ between steps (``replicated_state`` false: gossip, local steps) the
gradient norm is each rank's own. Where the strategy shards the parameters
(``shards_parameters``: ZeRO) the optimizer must be built from the wrapped model's shards,
so pass a factory ``optimizer=lambda model: torch.optim.AdamW(model.parameters(), ...)``;
bf16 becomes its own mixed precision (the module computes in bf16 from fp32 master shards,
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from dptrain.api.step import OptimizerStep, clip_by_global_norm
from dptrain.api.wrap import autocast_dtype, options_for, user_api_entry, wrap_model
from dptrain.batching import BatchPlan
from dptrain.data.loader import ShardedLoader
from dptrain.launch.heartbeat import mark_progress
from dptrain.strategies.registry import strategy_names
from dptrain.utils.tensors import map_tensors

__all__ = ["Engine", "StepInfo", "clip_by_global_norm"]


@dataclass(frozen=True)
class StepInfo:
    step: int          # the optimizer step just taken (1-based count of steps done)
    loss: float        # this rank's mean loss over the step's micro-batches
    grad_norm: float   # global L2 norm before clipping
    lr: float
    skipped: bool      # non-finite gradients: the optimizer did not step


def _core_attribute(name: str, doc: str) -> property:
    """An attribute of the engine's step core (:class:`OptimizerStep`), readable and settable on the engine."""
    return property(lambda self: getattr(self._core, name), lambda self, value: setattr(self._core, name, value),
                    doc=doc)


class Engine:
    def __init__(self, model: nn.Module,
                 optimizer: torch.optim.Optimizer | Callable[[nn.Module], torch.optim.Optimizer], plan: BatchPlan,
                 *, precision: str = "fp32", grad_clip: float = 0.0, lr_at: Callable[[int], float] | None = None,
                 ddp_kwargs: dict | None = None, process_group: dist.ProcessGroup | None = None,
                 strategy: str = "ddp", zero_kwargs: dict | None = None, gossip_kwargs: dict | None = None,
                 options: Any = None):
        self.strategy = user_api_entry(strategy, "Engine")
        options = options_for(self.strategy, options, ddp_kwargs=ddp_kwargs, zero_kwargs=zero_kwargs,
                              gossip_kwargs=gossip_kwargs)
        self.model: nn.Module = wrap_model(self.strategy, model, precision=precision, process_group=process_group,
                                           options=options)
        self.optimizer = self._build_optimizer(optimizer)
        self.plan = plan
        self.device = self.model.device
        self.lr_at = lr_at
        self._autocast_dtype = autocast_dtype(self.strategy, precision)
        self.scaler = _scaler(precision, self.device)
        self._core = OptimizerStep(self.optimizer, self.model, grad_clip=grad_clip,
                                   sharded=self.strategy.shards_parameters, scaler=self.scaler)
        self._micro_steps = 0  # backward passes since the last step: the window the step averages
        self._in_backward = False  # optimizer_in_backward: the optimizer steps inside backward
        self._loss_sum = torch.zeros((), device=self.device)
        self._rank = dist.get_rank(process_group)

    def _build_optimizer(self, optimizer) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer(self.model)
        if self.strategy.shards_parameters:
            raise TypeError(f"strategy {self.strategy.name} shards the parameters when it wraps the model, so the "
                            "optimizer must be built afterwards: pass a factory, optimizer=lambda model: "
                            "torch.optim.AdamW(model.parameters(), ...)")
        return optimizer

    @property
    def sharded(self) -> bool:
        """Whether the strategy's parameters are shards (ZeRO), and so its checkpoints (the entry's layout)."""
        return self.strategy.checkpoint_layout == "sharded"

    grad_clip = _core_attribute("grad_clip", "Max global L2 norm of the gradient (0: no clipping).")
    step_count = _core_attribute("steps", "Optimizer steps taken, skipped ones included.")
    skipped_steps = _core_attribute("skipped_steps", "Steps skipped for a non-finite gradient norm.")

    # ------------------------------------------------------------------ data

    def loader(self, dataset: Dataset, seed: int = 0, collate_fn: Callable | None = None) -> ShardedLoader:
        """This rank's micro-batches of ``dataset`` (see :class:`ShardedLoader`)."""
        return ShardedLoader(dataset, self.plan, self._rank, seed, collate_fn)

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in any nesting of lists, tuples, dicts) on the engine's device."""
        return _to_device(batch, self.device)

    def micro_steps(self, batches: Iterator[Any], count: int | None = None) -> Iterator[Any]:
        """The next ``count`` (default ``grad_accum_steps``) micro-batches, all but the last under ``no_sync``.

        Run forward and backward for each inside the loop body: the context stays active
        while the generator is suspended there. Another count than the plan's comes with loss weights
        (:meth:`backward`): live recovery's rounds of fewer workers that keep the global batch take more.
        """
        count = self.plan.grad_accum_steps if count is None else count
        for k in range(count):
            last = k == count - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                yield _to_device(next(batches), self.device)

    # --------------------------------------------------------------- compute

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        """Backward of one micro-batch's mean loss; the step averages the window (:mod:`dptrain.api.step`).

        ``weight``: this micro-batch's factor on the step's gradient in place of ``1 /
        grad_accum_steps``, when ranks take unequal shares of the batch
        (:class:`dptrain.data.balance.DynamicBatcher.weight`). The step divides by the window's
        micro-step count, ``grad_accum_steps`` with dynamic batching, so the loss is scaled by
        the relative weight ``weight * grad_accum_steps``.
        """
        self._micro_steps += 1
        mark_progress(self.step_count + 1, "micro-step")  # a long accumulation window is progress, not a hang
        if self._in_backward:  # this backward steps the optimizer: the step's learning rate first
            self._set_lr()
        scaled = loss if weight is None else loss * (weight * self.plan.grad_accum_steps)
        self._loss_sum += scaled.detach().float()
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()

    def step(self) -> StepInfo:
        """Set the learning rate, then average, clip, step and zero (:class:`~dptrain.api.step.OptimizerStep`)."""
        lr = self.optimizer.param_groups[0]["lr"] if self._in_backward else self._set_lr()
        window = max(self._micro_steps, 1)
        outcome = self._core(window)
        self._micro_steps = 0
        loss = self._loss_sum.item() / window
        self._loss_sum.zero_()
        return StepInfo(self.step_count, loss, outcome.grad_norm, lr, outcome.skipped)

    def drop_window(self) -> None:
        """Forget the micro-steps since the last step, gradients included, without stepping (a step that live
        recovery's vote aborted: it is tried again)."""
        self._micro_steps = 0
        self._loss_sum.zero_()
        self.optimizer.zero_grad(set_to_none=True)

    def _set_lr(self) -> float:
        lr = self.lr_at(self.step_count) if self.lr_at else self.optimizer.param_groups[0]["lr"]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_in_backward(self) -> None:
        """Step each bucket's parameters inside backward, as its all-reduce completes (the DDP engine's
        :meth:`~dptrain.ddp.DistributedDataParallel.optimizer_in_backward`); the learning rate is then set
        before each backward. Needs one micro-step per step, no clip and no fp16 scaler."""
        if self.plan.grad_accum_steps != 1 or self.grad_clip or self.scaler is not None:
            raise ValueError(f"optimizer_in_backward steps inside backward, before the step could average "
                             f"{self.plan.grad_accum_steps} micro-steps, clip (grad_clip {self.grad_clip}) or "
                             f"unscale (fp16 scaler: {self.scaler is not None}): it needs one micro-step, "
                             "grad_clip 0 and no fp16")
        if not self.strategy.optimizer_in_backward:
            able = ", ".join(strategy_names(lambda s: s.optimizer_in_backward))
            raise ValueError(f"strategy {self.strategy.name!r} cannot step the optimizer inside backward; "
                             f"strategy {able} can")
        self.model.optimizer_in_backward(self.optimizer)
        self._in_backward = self._core.in_backward = True

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Replicated (DDP) state, under the names every strategy reads (:mod:`dptrain.checkpoint.replicated`), and
        under ``parts`` the run-state parts of the strategy itself (:func:`dptrain.checkpoint.run_state.run_state`,
        the list a checkpoint and a heal iterate: DiLoCo's global weights and outer momentum, local SGD's schedule,
        gossip's own replica), so that loading it continues the strategy where it was.

        A sharded model saves with :func:`dptrain.zero.checkpoint.save_sharded` (every rank).
        """
        from dptrain.checkpoint.run_state import run_state

        state = self._replicated_state()
        state["parts"] = {part.name: part.state_dict() for part in run_state(self, None, self.strategy.name)}
        return state

    def _replicated_state(self) -> dict[str, Any]:
        """The model, optimizer, step counts and loss scaler (no strategy part)."""
        from dptrain.checkpoint.replicated import replicated_state  # torch.distributed.checkpoint: when saving

        if self.sharded:
            raise RuntimeError("a ZeRO model's state is sharded: save it with dptrain.zero.checkpoint.save_sharded "
                               "(every rank), as dptrain run does")
        model_state, optim_state = replicated_state(self.model.module, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "step": self.step_count,
                 "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def local_state_dict(self) -> dict[str, Any]:
        """No collective: what this rank holds itself, to give a peer holding the same (live recovery's heal): the
        whole :meth:`state_dict` of a replicated model; a sharded one's shards, buffers and optimizer state (its
        ``local_state``), as the rank at the same position of another replica holds them."""
        if not self.sharded:  # (the strategy's parts: the heal sends them itself, as listed)
            return self._replicated_state()
        return {"model": self.model.local_state(self.optimizer), "step": self.step_count,
                "skipped_steps": self.skipped_steps,
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`local_state_dict`'s output of a peer."""
        if not self.sharded:
            return self._load_replicated_state(state)
        self.model.load_local_state(state["model"], self.optimizer)
        self.step_count, self.skipped_steps = state["step"], state["skipped_steps"]
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Load :meth:`state_dict`'s output (or an older one, whose optimizer state is keyed by parameter index, or
        without ``parts``); the strategy parts' notes on what starts afresh."""
        from dptrain.checkpoint.run_state import run_state

        self._load_replicated_state(state)
        saved = state.get("parts", {})
        notes = [part.load_state_dict(saved[part.name]) for part in run_state(self, None, self.strategy.name)
                 if part.name in saved]
        return [note for note in notes if note]

    def _load_replicated_state(self, state: dict[str, Any]) -> None:
        from dptrain.checkpoint.replicated import set_replicated_state

        if self.sharded:
            raise RuntimeError("a ZeRO model's state is sharded: load it with dptrain.zero.checkpoint.load_sharded "
                               "(every rank), as dptrain run does")
        set_replicated_state(self.model.module, self.optimizer, state["model"], state["optimizer"])
        self.step_count = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def _scaler(precision: str, device: torch.device) -> Any:
    """fp16's loss scaler (CUDA only); None for the other precisions."""
    if precision != "fp16":
        return None
    if device.type != "cuda":
        raise ValueError("precision fp16 needs a CUDA device (it relies on a loss scaler); use bf16 on CPU")
    return torch.amp.GradScaler("cuda")


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
