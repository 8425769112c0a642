"""The simulator calibrated to a machine: its links as fitted, and the step's overheads fitted to short probe runs.

The α-β model of a collective prices the link; a real step also pays for what runs on
the compute thread around each collective and for communication that shares the cores
with compute, and the run's compute is slower than the bare model's. Those are
:class:`~dptrain.planner.simulate.Overheads`' thirteen terms: a fixed time per step, per
DDP bucket, per ZeRO-1/2 bucket, per ZeRO-3 unit collective, per byte communicated
while the device computes, per byte communicated at all, per byte of the parameters a
rank steps, a share of the profiled compute, per micro-step that accumulates
without reducing (fixed, and per byte accumulated into a buffer of the engine's own),
and per bucket a gradient codec reduces (fixed, and per byte it encodes), and the share of
the time hybrid sharding's two groups would lose taking turns on one link where both cross hosts.
:func:`fit_overheads` fits them to probe runs, each a measured step time beside the
simulator's timeline for the same run without overheads
(:attr:`~dptrain.planner.simulate.StepPrediction.features`): non-negative least squares
on the residuals (measured - timeline), relative to the measured step so that a short
step counts as much as a long one. Thirteen unknowns, solved exactly by trying every
subset of terms held at zero (8,192 small least-squares problems) and keeping the best with no
negative term, as Lawson and Hanson's active-set NNLS would find. A term the probes
cannot tell apart (its feature zero in every probe, or all but 5% of it a combination of
the earlier terms' features) is not fitted but held at zero and named
(:func:`unidentified`): a value for it would be the noise amplified.

A :class:`Calibration` is what ``dptrain tune`` measures once per machine (or emulated
cluster) and reuses: the links inside and across hosts, the overheads, the probe runs
with their fitted and measured steps (the fit's own residuals), and where and when it
was taken. Stored as JSON; reading it runs no code.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dptrain.comm.cost import Link
from dptrain.planner.network import Network
from dptrain.planner.simulate import Overheads
from dptrain.utils.atomic import write_text_atomic

__all__ = ["ProbeRun", "Calibration", "fit_overheads", "unidentified", "CalibrationError"]

VERSION = 5  # 2: ten terms (ZeRO-1/2 apart from ZeRO-3, the micro-steps); 3: twelve (a codec's buckets); 4: per byte
# communicated, the bytes that cross hosts (hybrid sharding's inside a host no longer); 5: thirteen (one wire for
# hybrid sharding's two groups)


class CalibrationError(ValueError):
    """A calibration file that cannot be used: unreadable, another version, or missing a field."""


@dataclass(frozen=True)
class ProbeRun:
    """One probe: a run's measured step time and the simulator's for it without overheads, with the features."""

    label: str
    measured_s: float
    timeline_s: float
    features: tuple[float, ...]


def _matrix(probes: list[ProbeRun]) -> tuple[np.ndarray, np.ndarray]:
    n = len(Overheads().terms())
    if not probes:
        raise ValueError("no probe runs to fit the overheads to")
    if any(len(p.features) != n for p in probes):
        raise ValueError(f"each probe needs {n} features (Overheads' terms)")
    X = np.array([[f / p.measured_s for f in p.features] for p in probes], dtype=float)
    y = np.array([(p.measured_s - p.timeline_s) / p.measured_s for p in probes], dtype=float)
    return X, y


APART = 0.05  # a term's feature must keep this share of its norm outside the earlier terms' span to be fitted


def _identified(X: np.ndarray) -> list[bool]:
    """Whether the probes tell each term apart, in :class:`Overheads`' order: its column is not zero and keeps at
    least ``APART`` of its norm once projected off the columns of the earlier terms that were. A nearly collinear
    column's coefficient would be the noise amplified; of two twins the first is fitted, the second named."""
    kept: list[int] = []
    out = []
    for k in range(X.shape[1]):
        column = X[:, k]
        norm = float(np.linalg.norm(column))
        if norm == 0.0:
            out.append(False)
            continue
        rest = column
        if kept:
            coef, *_ = np.linalg.lstsq(X[:, kept], column, rcond=None)
            rest = column - X[:, kept] @ coef
        ok = float(np.linalg.norm(rest)) >= APART * norm
        out.append(ok)
        if ok:
            kept.append(k)
    return out


def unidentified(probes: list[ProbeRun]) -> list[str]:
    """The :class:`Overheads` terms these probes cannot identify: their feature is zero in every probe (no probe
    exercises it) or within ``APART`` of a combination of the earlier terms' (the probes cannot tell them apart)."""
    X, _ = _matrix(probes)
    return [name for name, ok in zip(Overheads.names(), _identified(X), strict=True) if not ok]


def fit_overheads(probes: list[ProbeRun]) -> Overheads:
    """The :class:`Overheads` minimising the probes' squared relative error, every term >= 0.

    Each probe gives ``(measured - timeline) / measured = sum_k term_k * feature_k / measured``.
    Every subset of the identified terms (:func:`unidentified`: the others stay at zero) is
    fitted by least squares with the rest at zero; the best fit with no negative term wins
    (the empty subset, all zero, always qualifies).
    """
    X, y = _matrix(probes)
    n = X.shape[1]
    free = [k for k, ok in enumerate(_identified(X)) if ok]
    best, best_err = np.zeros(n), float(np.sum(y ** 2))
    for size in range(1, len(free) + 1):
        for cols in itertools.combinations(free, size):
            A = X[:, cols]
            coef, *_ = np.linalg.lstsq(A, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((A @ coef - y) ** 2))
            if err < best_err - 1e-15:
                best, best_err = np.zeros(n), err
                best[list(cols)] = coef
    return Overheads(*(float(v) for v in best))


@dataclass
class Calibration:
    """The links and overheads of one machine or cluster, as measured: what the simulator needs besides compute.

    ``inside``/``across``: α-β of the links between a host's ranks and between hosts
    (fitted to timed collectives); ``per_host``: ranks per host; ``shared_net``: a host's
    ranks share one link out (one NIC per host); ``backend``: the process group's.
    ``probes``: the runs the overheads were fitted to, ``where``: the machine or cluster,
    ``taken``: when (ISO date).
    """

    where: str
    taken: str
    hosts: int
    per_host: int
    backend: str
    shared_net: bool
    inside: Link
    across: Link
    overheads: Overheads = field(default_factory=Overheads)
    probes: list[ProbeRun] = field(default_factory=list)

    def network(self) -> Network:
        return Network(f"calibrated: {self.where}", self.inside, self.across, self.per_host,
                       f"fitted on {self.where}, {self.taken}", shared_net=self.shared_net, backend=self.backend)

    def unidentified(self) -> list[str]:
        """The terms the probes could not identify (:func:`unidentified`), held at zero."""
        return unidentified(self.probes) if self.probes else list(Overheads.names())

    def residuals(self) -> list[dict]:
        """Each probe's measured step and the calibrated simulator's (timeline + overheads)."""
        out = []
        for p in self.probes:
            fitted = p.timeline_s + sum(k * x for k, x in zip(self.overheads.terms(), p.features, strict=True))
            out.append({"label": p.label, "measured_s": p.measured_s, "fitted_s": fitted,
                        "ratio": fitted / p.measured_s})
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["version"] = VERSION
        return d

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise CalibrationError(f"not a dptrain calibration of version {VERSION} (found version "
                                   f"{d.get('version') if isinstance(d, dict) else None!r}); measure a new one (or "
                                   "refit an earlier one's probe runs: docs/repro/tune_refit.py)")
        try:
            links = {k: Link(**_floats(d[k], ("alpha", "beta", "gamma"), {"duplex"})) for k in ("inside", "across")}
            overheads = Overheads(**_floats(d["overheads"], Overheads.names()))
            probes = [ProbeRun(str(p["label"]), float(p["measured_s"]), float(p["timeline_s"]),
                               tuple(float(x) for x in p["features"])) for p in d["probes"]]
            terms = len(Overheads.names())
            for p in probes:
                if len(p.features) != terms:
                    raise ValueError(f"probe {p.label!r} has {len(p.features)} features, not {terms}")
            return cls(str(d["where"]), str(d["taken"]), int(d["hosts"]), int(d["per_host"]), str(d["backend"]),
                       bool(d["shared_net"]), links["inside"], links["across"], overheads, probes)
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"a damaged calibration ({type(e).__name__}: {e}); measure a new one") from None

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CalibrationError(f"cannot read the calibration {path}: {e}") from None
        return cls.from_dict(d)


def _floats(d: dict, names: tuple[str, ...], flags: set[str] = frozenset()) -> dict:
    out = {}
    for name in names:
        value = float(d[name])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} = {value} (must be finite and >= 0)")
        out[name] = value
    for name in flags:
        out[name] = bool(d[name])
    return out
