"""Fitting the cost model's link parameters (α, β, γ) to measured times.

``t = rounds x α + bytes / β`` is linear in (α, 1/β), so a least-squares fit over
measurements gives both. Errors are weighted by 1/t (relative error), so the
microsecond-scale small messages that pin α count as much as the large ones that pin
β. Used by ``dptrain bench comm``; its JSON output feeds the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dptrain.comm.cost import Link

__all__ = ["fit_link", "fit_gamma"]


def fit_link(rounds: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """α, β minimising the relative error of ``rounds x α + nbytes / β`` against ``seconds``.

    Each measurement is one collective (or one point-to-point exchange, with rounds 1).
    α is clamped at 0 (a negative latency means the sizes did not reach small enough).
    """
    if len(seconds) < 2 or len(set(nbytes)) < 2:
        raise ValueError(f"fitting α and β needs at least two distinct sizes, got {sorted(set(nbytes))}")
    t = torch.tensor(seconds, dtype=torch.float64)
    features = torch.tensor([list(rounds), list(nbytes)], dtype=torch.float64).T / t[:, None]
    solution = torch.linalg.lstsq(features, torch.ones_like(t)[:, None]).solution.flatten()
    alpha, inv_beta = solution.tolist()
    if alpha < 0:  # refit bandwidth alone
        inv_beta = float((torch.tensor(nbytes, dtype=torch.float64) / t).sum() /
                         ((torch.tensor(nbytes, dtype=torch.float64) / t) ** 2).sum())
        alpha = 0.0
    return Link(alpha=alpha, beta=1.0 / inv_beta if inv_beta > 0 else float("inf"))


def fit_gamma(nbytes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds per byte of a local reduction, the slope of ``seconds`` against ``nbytes``."""
    x = torch.tensor(nbytes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    return float((x * y).sum() / (x * x).sum())
