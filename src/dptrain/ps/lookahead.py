"""Delay compensation by look-ahead: a worker computes its gradient where the parameters will be.

Algorithm (DANA, Hakimi et al. 2019, "Taming momentum in a distributed asynchronous
environment"; adapted here to Adam): an async gradient is applied ``tau`` updates after
its worker read the parameters, so it is the gradient at ``theta_t`` applied to
``theta_{t+tau}``. With a momentum optimizer most of those ``tau`` updates are already
known at read time: they follow the momentum. So the server answers a worker with an
estimate of ``theta_{t+tau}`` instead of ``theta_t``:

    theta_send = theta_t - E[tau_w] * lr * d_t

where ``d_t`` is the deterministic part of the optimizer's next update (Adam and AdamW:
``m_hat / (sqrt(v_hat) + eps)``, plus ``weight_decay * theta`` for AdamW's decoupled
decay; SGD: its momentum buffer, which holds its L2 decay already) and
``E[tau_w]`` is worker ``w``'s expected delay, an exponential moving average of the
delays its gradients had (starting at ``workers - 1``, the delay of round-robin
arrivals). The server's own parameters and optimizer are unchanged: only what it sends
moves. With fresh gradients (``tau = 0``) it sends ``theta_t`` exactly.

On the default task with one of 2 workers slowed 2x, plain async ends 15% above sync's
loss and the look-ahead 2-3.5% above (a one-process replay and ``dptrain bench async``;
``docs/async.md``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Lookahead", "SUPPORTED"]

SUPPORTED = ("Adam", "AdamW", "SGD")


class Lookahead:
    """Predict the parameters a worker's gradient will be applied to (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: nn.ParameterList, flat: torch.Tensor,
                 workers: list[int], smoothing: float = 0.8):
        kind = type(optimizer).__name__
        if kind not in SUPPORTED:
            raise ValueError(f"ps.lookahead needs the optimizer's next step, which dptrain knows for "
                             f"{', '.join(SUPPORTED)}; the optimizer is {kind}. Use one of those or lookahead off")
        self.optimizer, self.params, self.flat, self.kind = optimizer, params, flat, kind
        self.smoothing = smoothing
        self.expected = {w: float(len(workers) - 1) for w in workers}
        self.direction = torch.zeros_like(flat)  # d_t, over the flat buffer
        self.sent = torch.empty_like(flat)
        self._direction_version = -1
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}  # fixed for a run

    def observe(self, worker: int, delay: int) -> None:
        """Fold one applied gradient's delay into its worker's expectation."""
        self.expected[worker] = self.smoothing * self.expected[worker] + (1 - self.smoothing) * delay

    def predict(self, worker: int, lr: float, version: int) -> torch.Tensor:
        """``theta - E[tau] * lr * d`` for ``worker``, in a buffer reused by the next call."""
        if version != self._direction_version:
            self._update_direction()
            self._direction_version = version
        return torch.add(self.flat, self.direction, alpha=-self.expected[worker] * lr, out=self.sent)

    @torch.no_grad()
    def _update_direction(self) -> None:
        """``d_t`` for every parameter (a view of the flat buffer, in order), zero where no state exists yet."""
        offset = 0
        for p in self.params:
            d = self.direction[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            state, group = self.optimizer.state.get(p), self._group_of[id(p)]
            if not state:
                d.zero_()
            elif self.kind == "SGD":  # L2 decay is inside the momentum buffer already
                buf = state.get("momentum_buffer")
                d.copy_(buf) if buf is not None else d.zero_()
            else:
                beta1, beta2 = group["betas"]
                t = float(state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** t)
                torch.div(state["exp_avg"] / (1 - beta1 ** t), v_hat.sqrt_().add_(group["eps"]), out=d)
                if self.kind == "AdamW" and group["weight_decay"]:  # decoupled: theta *= 1 - lr * decay
                    d.add_(p, alpha=group["weight_decay"])
