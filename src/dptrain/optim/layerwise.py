"""LARS and LAMB: a learning rate per layer, from the layer's norms, also when ZeRO splits the layer.

Both optimizers scale each layer's step by a *trust ratio*: the norm of the layer's
weights over the norm of its gradient (LARS) or of its Adam update (LAMB), so that
every layer moves by about the same fraction of its size whatever its gradient's
scale, which is what keeps very large batches trainable.

The "layer" is an original model parameter. For an ordinary parameter it is the whole
tensor and its norms are local. Under :class:`dptrain.zero.ZeRO` the optimizer sees
flat shards instead: ``shard._zero_unit`` (a :class:`~dptrain.zero.unit.FlatUnit`)
says which layers lie in the shard and where, and a layer may straddle the shards of
several ranks. A trust ratio taken per shard would then depend on the world size and
on where the shard boundaries fall; here it is the layer's, as without ZeRO.

[Note: one all-reduce per process group per step]
Every squared norm the step needs (||w||^2 and ||grad||^2 or ||u||^2 of every layer in
every ZeRO shard of the optimizer) goes into one vector per process group, summed with
one ``dist.all_reduce``; then the square root. A layer with no elements on this rank
contributes 0 but keeps its place, so every rank's vector has the same length and every
rank runs the same collective: no hang, whatever the shard boundaries. A shard without
a gradient this step keeps its place too (its gradient counts as 0) and is not updated.
The vector is tiny (2 floats per layer), so the call is latency-bound: it always uses
the backend's all-reduce, whatever collective algorithm the ZeRO units were built with.

:func:`naive_layer_norms` is the oracle: it all-gathers each shard whole and takes every
layer's norm directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dptrain import comm

__all__ = ["LARS", "LAMB", "LayerLayout", "layer_layout", "layer_norms", "naive_layer_norms"]


# --------------------------------------------------------------------- layers in a parameter


@dataclass(eq=False)
class LayerLayout:
    """The layers of one optimizer parameter, in order, as runs of its flattened elements.

    ``lengths[i]`` elements of layer ``i`` (0 when it has none on this rank) cover the
    parameter exactly. ``group`` is set for a ZeRO shard, whose norms are partial sums to
    be completed over that process group.
    """

    names: tuple[str, ...]
    ndims: tuple[int, ...]
    lengths: tuple[int, ...]
    device: torch.device
    group: dist.ProcessGroup | None = None
    counts: torch.Tensor = field(init=False)    # lengths, on device: repeats for repeat_interleave
    is_vector: torch.Tensor = field(init=False)  # ndim <= 1 (biases, norm gains), on device

    def __post_init__(self) -> None:
        self.counts = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        self.is_vector = torch.tensor([d <= 1 for d in self.ndims], dtype=torch.bool, device=self.device)

    @property
    def sharded(self) -> bool:
        return self.group is not None

    def per_element(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        """Per-layer ``values`` -> one per element of the parameter (a 0-d tensor when it is one layer)."""
        if not self.sharded:
            return values[0]
        return torch.repeat_interleave(values, self.counts, output_size=numel)


def layer_layout(p: torch.Tensor) -> LayerLayout:
    """``p``'s layers: the whole tensor, or for a ZeRO shard the pieces of its unit's parameters it holds."""
    unit = getattr(p, "_zero_unit", None)
    if unit is None:
        return LayerLayout(("",), (p.dim(),), (p.numel(),), p.device)
    if p.dim() != 1 or p.numel() != unit.hi - unit.lo:
        raise ValueError(f"parameter of shape {tuple(p.shape)} carries a ZeRO unit whose shard is "
                         f"[{unit.lo}, {unit.hi}); pass the ZeRO model's own parameters (model.parameters())")
    lengths = tuple(max(0, min(b, unit.hi) - max(a, unit.lo)) for a, b in unit.offsets())
    group = unit.group if unit.group is not None else dist.group.WORLD
    return LayerLayout(tuple(r.name for r in unit.refs), tuple(len(r.shape) for r in unit.refs), lengths,
                       p.device, group)


# --------------------------------------------------------------------- norms


def _local_sq_norms(layout: LayerLayout, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """(len(tensors), layers): this rank's sum of squares of each layer's elements; None counts as 0."""
    rows = []
    for t in tensors:
        if t is None:
            rows.append(torch.zeros(len(layout.lengths), dtype=torch.float32, device=layout.device))
            continue
        flat = t.detach().reshape(-1).float()
        rows.append(torch.stack([torch.dot(piece, piece) for piece in flat.split(layout.lengths)]))
    return torch.stack(rows)


def _sum_over_ranks(squares: list[torch.Tensor], layouts: Sequence[LayerLayout]) -> None:
    """Complete the sharded layers' sums in place: one all-reduce per process group (see the module's note)."""
    members: dict[dist.ProcessGroup, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout.sharded:
            members.setdefault(layout.group, []).append(i)
    launched = []
    for group, idx in members.items():  # every rank meets its groups in the same (parameter) order
        flat = torch.cat([squares[i].reshape(-1) for i in idx])
        launched.append((dist.all_reduce(flat, group=group, async_op=True), flat, idx))
    for work, flat, idx in launched:
        work.wait()
        for i, part in zip(idx, flat.split([squares[i].numel() for i in idx]), strict=True):
            squares[i] = part.view_as(squares[i])


def layer_norms(items: Sequence[tuple[LayerLayout, Sequence[torch.Tensor | None]]]) -> list[torch.Tensor]:
    """For each (layout, tensors): a (len(tensors), layers) tensor of every layer's L2 norm in each tensor.

    All ranks holding a shard in ``items`` must call this together, with the same shards
    in the same order (one all-reduce per process group).
    """
    squares = [_local_sq_norms(layout, tensors) for layout, tensors in items]
    _sum_over_ranks(squares, [layout for layout, _ in items])
    return [s.sqrt() for s in squares]


def naive_layer_norms(p: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The oracle for :func:`layer_norms`: gather each tensor (shaped like ``p``) whole, then norm each layer."""
    unit = getattr(p, "_zero_unit", None)
    if unit is None:
        return torch.stack([t.detach().float().norm() for t in tensors]).unsqueeze(1)
    rows = []
    for t in tensors:
        full = torch.empty(unit.numel, dtype=t.dtype, device=t.device)
        comm.all_gather(full, t.detach(), group=unit.group)  # uneven shards: rank r's at shard_range(...)
        rows.append(torch.stack([full[a:b].float().norm() for a, b in unit.offsets()]))
    return torch.stack(rows)


# --------------------------------------------------------------------- optimizers


class _LayerwiseOptimizer(Optimizer):
    """What LARS and LAMB share: each parameter's layer layout, read once, and the closure."""

    def _layout(self, p: torch.Tensor) -> LayerLayout:
        layouts = self.__dict__.setdefault("_layouts", {})  # not in state_dict: rebuilt from the parameters
        if p not in layouts:
            layouts[p] = layer_layout(p)
        return layouts[p]

    def _steppable(self) -> Iterable[tuple[dict, torch.Tensor, LayerLayout]]:
        """(group, p, layout) for every parameter with a gradient, and every ZeRO shard (see the module's note)."""
        for group in self.param_groups:
            for p in group["params"]:
                layout = self._layout(p)
                if p.grad is not None or layout.sharded:
                    yield group, p, layout

    @staticmethod
    def _trusted(layout: LayerLayout, exclude_1d: bool) -> torch.Tensor:
        """Per layer: True where the trust ratio and weight decay apply."""
        return ~layout.is_vector if exclude_1d else torch.ones_like(layout.is_vector)


def _run_closure(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _check(name: str, value: float, lo: float, hi: float | None = None) -> None:
    if not (lo <= value and (hi is None or value < hi)):
        span = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {span}, got {value!r}")


class LARS(_LayerwiseOptimizer):
    """Layer-wise Adaptive Rate Scaling: SGD with momentum whose step is scaled per layer by its norms.

    You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (2017). For
    each layer, with weights w and gradient grad::

        g        = grad + weight_decay * w
        local_lr = eta * ||w|| / (||grad|| + weight_decay * ||w|| + eps)   (1 if ||w|| or the denominator is 0)
        v        = momentum * v + lr * local_lr * g
        w        = w - v

    The trade-off: each layer moves by about ``lr * eta`` of its norm per step whatever
    its gradient's scale, which lets batches of many thousands train at one learning
    rate; the price is two norms per layer per step and, under ZeRO, one small
    all-reduce per step. ``exclude_1d``: layers with ndim <= 1 (biases, norm gains) get
    local_lr = 1 and no weight decay, as in the common implementations. ``lr`` is
    required: it multiplies ``eta``, so it is much larger than SGD's.

    Layers split by ZeRO across ranks get their norms summed over the ranks (see
    :mod:`dptrain.optim.layerwise`). State per parameter: ``momentum_buffer``.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001,
                 eps: float = 1e-8, exclude_1d: bool = False):
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        _check("eta", eta, 0.0)
        _check("eps", eps, 0.0)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                                      exclude_1d=exclude_1d))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = _run_closure(closure)
        todo = list(self._steppable())
        norms = layer_norms([(layout, (p, p.grad)) for _, p, layout in todo])
        for (group, p, layout), (w_norm, g_norm) in zip(todo, norms, strict=True):
            if p.grad is not None:
                self._update(group, p, layout, w_norm, g_norm)
        return loss

    def _update(self, group: dict, p: torch.Tensor, layout: LayerLayout, w_norm: torch.Tensor,
                g_norm: torch.Tensor) -> None:
        trusted = self._trusted(layout, group["exclude_1d"])
        decay = group["weight_decay"] * trusted  # per layer
        denom = g_norm + decay * w_norm
        local_lr = torch.where(trusted & (w_norm > 0) & (denom > 0),
                               group["eta"] * w_norm / (denom + group["eps"]), 1.0)
        g = p.grad
        if group["weight_decay"]:
            g = g + layout.per_element(decay, p.numel()) * p
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g * layout.per_element(group["lr"] * local_lr, p.numel()))
        p.sub_(buf)


class LAMB(_LayerwiseOptimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam's update, rescaled per layer to the layer's norm.

    You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes" (ICLR 2020). For each layer, with weights w and gradient g, at step t::

        m = beta1 * m + (1 - beta1) * g              v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
        w = w - lr * (||w|| / ||u||) * u             (trust ||w|| / ||u|| is 1 if either is 0)

    The trade-off: Adam's per-element adaptivity, with each layer's step set to ``lr``
    times its norm, so one learning rate serves every layer at batch sizes where Adam
    diverges; the cost is LARS's (two norms per layer, one small all-reduce per step
    under ZeRO). The paper's scaling function phi(||w||) is the identity here.
    ``exclude_1d``: layers with ndim <= 1 (biases, norm gains) get trust 1 and no
    weight decay, as in the common implementations.

    Layers split by ZeRO across ranks get their norms summed over the ranks (see
    :mod:`dptrain.optim.layerwise`). State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, exclude_1d: bool = False):
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      exclude_1d=exclude_1d))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = _run_closure(closure)
        todo = list(self._steppable())
        updates = [self._adam_direction(group, p, layout) if p.grad is not None else None
                   for group, p, layout in todo]
        norms = layer_norms([(layout, (p, u)) for (_, p, layout), u in zip(todo, updates, strict=True)])
        for (group, p, layout), u, (w_norm, u_norm) in zip(todo, updates, norms, strict=True):
            if u is None:
                continue
            trusted = self._trusted(layout, group["exclude_1d"])
            trust = torch.where(trusted & (w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
            p.sub_(u * layout.per_element(group["lr"] * trust, p.numel()))
        return loss

    def _adam_direction(self, group: dict, p: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
        """Update the moments; return u (bias-corrected Adam direction plus decoupled weight decay)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            decay = group["weight_decay"] * self._trusted(layout, group["exclude_1d"])
            u.add_(layout.per_element(decay, p.numel()) * p)
        return u
