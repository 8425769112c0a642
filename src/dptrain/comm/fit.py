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


def fit_link(rounds: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float],
             reduced: Sequence[float] | None = None) -> Link:
    """α, β (and γ, given ``reduced``) minimising the relative error of the model against ``seconds``.

    Each measurement is one collective (or one point-to-point exchange: rounds 1) with
    ``rounds`` rounds moving ``nbytes`` on the critical path and adding ``reduced``
    bytes locally. A parameter that comes out negative (the sizes did not pin it) is
    dropped and the rest refitted.
    """
    if len(seconds) < 2 or len(set(nbytes)) < 2:
        raise ValueError(f"fitting α and β needs at least two distinct sizes, got {sorted(set(nbytes))}")
    t = torch.tensor(seconds, dtype=torch.float64)
    columns = [list(rounds), list(nbytes)] + ([list(reduced)] if reduced is not None else [])
    features = torch.tensor(columns, dtype=torch.float64).T / t[:, None]
    keep = list(range(len(columns)))
    while True:
        solution = torch.linalg.lstsq(features[:, keep], torch.ones_like(t)[:, None]).solution.flatten()
        negative = [k for k, v in zip(keep, solution.tolist(), strict=True) if v < 0 and k != 1]
        if not negative:
            break
        keep.remove(negative[0])
    values = dict(zip(keep, solution.tolist(), strict=True))
    inv_beta = values.get(1, 0.0)
    return Link(alpha=values.get(0, 0.0), beta=1.0 / inv_beta if inv_beta > 0 else float("inf"),
                gamma=values.get(2, 0.0))


def fit_gamma(nbytes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds per byte of a local reduction, the slope of ``seconds`` against ``nbytes``."""
    x = torch.tensor(nbytes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    return float((x * y).sum() / (x * x).sum())
