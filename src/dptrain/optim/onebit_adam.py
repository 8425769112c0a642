"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888): after a warm-up, Adam's momentum travels at 1 bit per element.

Adam's gradient all-reduce does not survive aggressive compression: its per-coordinate
normalisation turns a compressed or delayed gradient into a full-size step
(docs/compression.md measures it). 1-bit Adam's remedy: the second moment v changes
slowly once training is under way, so after a warm-up it is frozen, and Adam becomes
momentum SGD with a fixed per-coordinate preconditioner; what is then averaged over
ranks is the momentum, a linear quantity, which 1-bit compression with error feedback
on both sides averages without losing Adam's convergence (the paper's Theorem 1). Per
step t (1-based), g_i rank i's gradient:

- **warm-up**, until v freezes at the end of step T: AdamW, exactly torch's arithmetic (bias
  corrections; weight decay decoupled, ``p *= 1 - lr * weight_decay``, when > 0), on the
  gradient the DDP engine all-reduces as usual (uncompressed fp32). T is ``freeze_step`` if
  given, else the first step where :class:`~dptrain.optim.onebit_freeze.FreezeRule` finds v
  settled (its per-tensor mass drifted by at most ~10% over the last 10 steps; measured on the
  v every rank holds, the verdict all-reduced);
- **compression stage**, t > T: the engine no longer all-reduces gradients (this optimizer's
  comm hook keeps each rank's own); each rank updates the shared momentum with its own
  gradient, m_i = beta1 m + (1 - beta1) g_i, and m becomes the 1-bit average of the m_i
  (:class:`~dptrain.compress.onebit.OneBitAllReduce`); v and its bias correction stay as they
  were at T; p -= lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^T)) + eps). The parameters
  stay equal on every rank: every rank decodes the same average.

Against DeepSpeed's ``OnebitAdam`` (the reference implementation): bias corrections are
kept (DeepSpeed has none), so the warm-up is AdamW; the momentum of a coordinate whose v
is exactly 0 at the freeze (its gradient was 0 through the whole warm-up) is held at 0,
since 1 bit cannot say 0 and m / eps would be a huge step: DeepSpeed asks the user for
that mask (``exp_avg_mask``). A parameter without a gradient in the compression stage
counts as a zero gradient (its momentum decays); in the warm-up it is skipped, as Adam does.

Around the optimizer, after the freeze: a clipping step before ``step()`` sees each rank's
own gradient (the average is never formed), so the trainer's ``grad_clip`` clips each
rank's gradient by its own norm, as DeepSpeed does; and a non-finite gradient on any rank
makes every rank's gradient NaN (one all-reduce of a flag per step), so every rank skips
the step together, as they do in the warm-up. Checkpoints: the optimizer's state (m, v,
step, and the freeze rule's record: each tensor's v mass at its last recording, the steps v
settled and froze at; the same on every rank) is ordinary optimizer state; the error buffers
are per rank, in :attr:`compressor`'s ``state_dict``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.cost import collective_cost
from dptrain.comm.step_stats import InStepComm
from dptrain.comm.work import Work
from dptrain.compress.onebit import OneBitAllReduce
from dptrain.ddp.comm_hooks import GradBucket, allreduce_hook
from dptrain.optim.onebit_freeze import FreezeRule, v_mass

__all__ = ["OneBitAdam", "PhaseHook"]


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam for dptrain's DDP engine; see the module docstring for the algorithm.

    ``model``: the :class:`dptrain.DistributedDataParallel` wrapping the parameters, before
    its first forward; the optimizer registers its comm hook there (:class:`PhaseHook`), so
    it must have none (ZeRO, gossip and a compression hook are refused). ``freeze_step``: the
    warm-up's steps (at least 1), or None (default): until ``freeze_rule`` (default
    ``FreezeRule()``; ``dptrain run`` gives it the LR warm-up as ``earliest``) finds v settled.
    With a ``freeze_step`` the rule still measures, and a warning says so if v had not settled
    by then. ``process_group``: the model's (default: the world).
    ``lr``, ``betas``, ``eps``, ``weight_decay``: AdamW's, per param group.

    What it communicates: ``compressor.stats`` counts the bytes of every step (the warm-up's
    fp32 all-reduces, through its hook, and the momentum's 1-bit phases); ``step_comm`` spans
    the momentum's all-reduce inside the last ``step()`` (an
    :class:`~dptrain.comm.step_stats.InStepComm`, None in the warm-up), which no engine sees.
    """

    # its step() all-reduces the momentum of every parameter at once: the DDP engine's optimizer_in_backward,
    # which steps one bucket's parameters at a time, refuses it
    communicates_in_step = True

    def __init__(self, params: Iterable, model: nn.Module, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int | None = None, freeze_rule: FreezeRule | None = None,
                 process_group: dist.ProcessGroup | None = None):
        if freeze_step is not None and freeze_step < 1:
            raise ValueError(f"1-bit Adam needs at least one uncompressed warm-up step to estimate the second "
                             f"moment it freezes; got freeze_step={freeze_step}: use None (freeze when v settles, "
                             "freeze_rule) or e.g. the LR warm-up's length")
        if not (lr >= 0 and eps > 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"1-bit Adam: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay}: need lr "
                             ">= 0, betas in [0, 1), eps > 0, weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.freeze_step, self.freeze_rule = freeze_step, freeze_rule or FreezeRule()
        self.steps_done = 0
        self.frozen_at: int | None = None  # the step v froze at (its bias correction's t); None in the warm-up
        self.settled_at: int | None = None  # the first step the rule found v settled (with freeze_step: it warns)
        self.last_drift: float | None = None  # the rule's latest measure (for the warning)
        self._legacy = False  # resumed from a state saved before the rule: keeps the freeze it had then
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {p: i for i, p in enumerate(self._params)}  # a parameter's place in the flat momentum
        self._numels = torch.tensor([p.numel() for p in self._params], dtype=torch.float64)
        self.compressor = OneBitAllReduce(sum(p.numel() for p in self._params), process_group)
        self.hook = PhaseHook(self, process_group)
        self._zero_v: list[torch.Tensor | None] | None = None  # derived from frozen v, rebuilt after a load
        self.step_comm: InStepComm | None = None  # what the last step() communicated itself (the compression stage)
        _register(model, self.hook)

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compression stage (the hook asks, at backward)."""
        return self.frozen_at is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.steps_done + 1
        self.step_comm = None
        if self.frozen_at is None:
            self._adam_step(t)
            self._consider_freezing(t)
        else:
            self._onebit_step(t)
        self.steps_done = t
        return loss

    def _state(self, p: torch.Tensor, t: int) -> dict:
        """A parameter's state, created at its first step: Adam's m, v and step, and the freeze rule's record (its
        v's mass at the rule's last recording step; the steps v settled and froze at, 0 for not yet, the same in
        every parameter's state, as ``step`` is)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v_mass"] = torch.tensor(0.0, dtype=torch.float64)
            state["freeze"] = self._record()  # [settled_at, frozen_at]
        state["step"].fill_(t)
        return state

    def _adam_step(self, t: int) -> None:
        """AdamW's update (torch's single-tensor arithmetic) on the averaged gradient."""
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            step_size, bc2_sqrt = lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, t)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)

    def _consider_freezing(self, t: int) -> None:
        """After warm-up step ``t``: the rule's masses when due, its verdict when it decides, and the freeze: at
        ``freeze_step`` if one was given (with a warning where the rule has not found v settled by then), else at
        the rule's first settled verdict."""
        rule, before = self.freeze_rule, (self.settled_at, self.frozen_at)
        if rule.records_at(t):
            masses = self._v_masses(t)
            if rule.checks_at(t) and self.settled_at is None:
                self.last_drift = rule.drift(masses, self._recorded_masses(), self._numels)
                if self._on_every_rank(rule.settled(self.last_drift)):
                    self.settled_at = t
            for p, mass in zip(self._params, masses.tolist(), strict=True):
                if self.state[p]:
                    self.state[p]["v_mass"].fill_(mass)
        if t == (self.freeze_step if self.freeze_step is not None else self.settled_at):
            if self.settled_at is None and not self._legacy:
                warnings.warn(_early_freeze(t, rule, self.last_drift), stacklevel=5)  # the caller of step()
            self.frozen_at = t
        if (self.settled_at, self.frozen_at) != before:
            self._write_record()

    def _v_masses(self, t: int) -> torch.Tensor:
        """The rule's statistic now: per parameter, its bias-corrected v's mass (float64; 0 without a v yet)."""
        return torch.tensor([v_mass(self.state[p].get("exp_avg_sq"), group["betas"][1], t)
                             for group in self.param_groups for p in group["params"]], dtype=torch.float64)

    def _recorded_masses(self) -> torch.Tensor:
        return torch.tensor([float(self.state[p]["v_mass"]) if self.state[p] else 0.0 for p in self._params],
                            dtype=torch.float64)

    def _on_every_rank(self, flag: bool) -> bool:
        """``flag`` if it holds on every rank: a MIN all-reduce of it (4 bytes, counted)."""
        self.compressor.stats.sent_bytes += _ring_bytes(self.hook.world_size, self.hook.rank, 1, 4)
        return self.compressor.all_reduce_flag(flag, self._params[0].device)

    def _record(self) -> torch.Tensor:
        return torch.tensor([self.settled_at or 0, self.frozen_at or 0], dtype=torch.float64)

    def _write_record(self) -> None:
        """settled_at and frozen_at into every parameter's state (0: not yet), where a checkpoint finds them."""
        record = self._record()
        for p in self._params:
            if self.state[p]:
                self.state[p]["freeze"].copy_(record)

    def _onebit_step(self, t: int) -> None:
        """Local momentum, its 1-bit average over ranks, the update with the frozen v."""
        ms = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                m = self._state(p, t)["exp_avg"]
                if p.grad is None:
                    m.mul_(beta1)
                else:
                    m.lerp_(p.grad, 1 - beta1)
                ms.append(m)
        flat = self.compressor.flat_buffer(ms[0].device)
        torch.cat([m.reshape(-1) for m in ms], out=flat)
        start = time.perf_counter()
        self.compressor.all_reduce_(flat)
        self.step_comm = InStepComm([(start, time.perf_counter())])
        torch._foreach_copy_(ms, [f.view_as(m) for f, m in zip(flat.split([m.numel() for m in ms]), ms, strict=True)])
        for m, zero in zip(ms, self._zero_variance(), strict=True):
            if zero is not None:
                m.masked_fill_(zero, 0.0)
        # the denominators go into the flat buffer, free again (a fresh tensor per parameter and step would leave
        # holes in the heap: [Note: no temporaries in the 1-bit all-reduce] in dptrain.compress.onebit)
        denominators = flat.split([m.numel() for m in ms])
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            step_size, bc2_sqrt = lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** self.frozen_at)
            for p in group["params"]:
                state, denominator = self.state[p], denominators[self._index[p]].view_as(p)
                torch.sqrt(state["exp_avg_sq"], out=denominator).div_(bc2_sqrt).add_(eps)
                p.mul_(1 - lr * wd)
                p.addcdiv_(state["exp_avg"], denominator, value=-step_size)

    def _zero_variance(self) -> list[torch.Tensor | None]:
        """Per parameter, where its frozen v is exactly 0 (None where nowhere): computed once, v is frozen."""
        if self._zero_v is None:
            zeros = [self.state[p]["exp_avg_sq"] == 0 for p in self._params]
            self._zero_v = [z if bool(z.any()) else None for z in zeros]
        return self._zero_v

    def load_state_dict(self, state_dict: dict) -> None:
        """Optimizer state as saved (m, v, step and the freeze rule's record per parameter).

        A state saved before the rule existed has no record (torch's flat state dicts hand back
        ``{}`` for it): it froze, or was to freeze, where 1-bit Adam did then, at ``freeze_step``
        if given, else at the LR warm-up (``freeze_rule.earliest``, what ``dptrain run`` passes;
        at least step 1), and it keeps doing so.
        """
        super().load_state_dict(state_dict)
        states = [self.state[p] for p in self._params if "step" in self.state[p]]
        self.steps_done = int(max(float(s["step"]) for s in states)) if states else 0
        record = next((s["freeze"] for s in states if torch.is_tensor(s.get("freeze"))), None)
        if record is None and states:
            self.freeze_step, self._legacy = self.freeze_step or max(self.freeze_rule.earliest, 1), True
            self.settled_at, self.frozen_at = None, self.freeze_step if self.steps_done >= self.freeze_step else None
        else:
            self.settled_at, self.frozen_at = (int(x) or None for x in (record.tolist() if states else (0, 0)))
        for s in states:
            if not torch.is_tensor(s.get("v_mass")):
                s["v_mass"], s["freeze"] = torch.tensor(0.0, dtype=torch.float64), self._record()
        self._write_record()
        self._zero_v = None


def _register(model: nn.Module, hook: PhaseHook) -> None:
    register = getattr(model, "register_comm_hook", None)
    if register is None:
        raise TypeError(f"1-bit Adam runs on dptrain's DistributedDataParallel (strategy ddp), which takes its comm "
                        f"hook; got {type(model).__name__}. ZeRO, gossip and a plain module are not supported: wrap "
                        "the model with dptrain.DistributedDataParallel")
    try:
        register(None, hook)
    except RuntimeError as e:
        raise ValueError(f"1-bit Adam could not register its comm hook on the model ({e}). It replaces the "
                         "gradient all-reduce itself: register no other hook and no gradient compression "
                         "(compression.method = \"none\"), and build the optimizer before the model's first forward") from None


class PhaseHook:
    """The DDP comm hook of :class:`OneBitAdam`: buckets averaged in the warm-up, each rank's own after.

    In the warm-up, the all-reduce of ``dptrain.ddp.comm_hooks.allreduce_hook`` (divide by N,
    sum), counted in the optimizer's ``compressor.stats`` as uncompressed (raw and sent bytes,
    no payload). After the freeze,
    nothing travels but one flag per step: whether every rank's gradient is finite. The
    flags of the buckets launched so far are all-reduced (MIN) at the first wait, which
    comes after the step's launches on every rank (the engine launches every bucket, then
    waits in order; a bucket reduced again is launched and waited for alone, the same on
    every rank); a False makes every rank's buckets NaN, so every rank skips the step.
    """

    def __init__(self, optimizer: OneBitAdam, process_group: dist.ProcessGroup | None):
        self.optimizer = optimizer
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self._verdict = _Verdict()

    def __call__(self, state, bucket: GradBucket) -> Work:
        buffer = bucket.buffer()
        stats = self.optimizer.compressor.stats
        if not self.optimizer.compressing:  # fp32: nothing encoded (payload 0, as for an uncompressed run)
            stats.raw_bytes += buffer.numel() * buffer.element_size()
            stats.sent_bytes += _ring_bytes(self.world_size, self.rank, buffer.numel(), buffer.element_size())
            stats.buckets += 1
            return allreduce_hook(self.group, bucket)
        verdict = self._verdict
        verdict.flags.append(torch.isfinite(buffer.sum()))  # NaN and inf propagate through a sum
        return Work.completed(lambda: self._checked(verdict, buffer))

    def _checked(self, verdict: _Verdict, buffer: torch.Tensor) -> torch.Tensor:
        if verdict.all_finite is None:
            compressor = self.optimizer.compressor
            compressor.stats.sent_bytes += _ring_bytes(self.world_size, self.rank, 1, 4)
            verdict.all_finite = compressor.all_reduce_flag(bool(torch.stack(verdict.flags).all()), buffer.device)
            self._verdict = _Verdict()  # the buckets launched from now on are the next reduction's
        if not verdict.all_finite:
            buffer.fill_(float("nan"))
        return buffer



def _ring_bytes(world_size: int, rank: int, numel: int, element_size: int) -> int:
    """What ``rank`` sends in a ring all-reduce of ``numel`` elements (the cost model's count; 0 alone)."""
    if world_size == 1:
        return 0
    return collective_cost("all_reduce", "ring", numel, element_size, world_size).bytes_sent[rank]


class _Verdict:
    """The finiteness flags of one step's buckets, and, once all-reduced, whether every rank's are all finite."""

    def __init__(self):
        self.flags: list[torch.Tensor] = []
        self.all_finite: bool | None = None


def _early_freeze(t: int, rule: FreezeRule, drift: float | None) -> str:
    """The warning for a freeze_step that came before the rule found v settled."""
    measured = (f"v's drift over the last {rule.window} steps was {drift:.3f}, above the rule's {rule.tolerance}"
                if drift is not None else f"the rule had not measured it yet (its first check is at step "
                f"{rule.first_check})")
    return (f"1-bit Adam froze its second moment at step {t} (freeze_step) before it settled: {measured}. Frozen "
            f"early, v is stale for the rest of the run (docs/compression.md: up to 1.5x AdamW's loss); leave "
            f"freeze_step unset (train.onebit_freeze_step = 0) to freeze when it settles")
