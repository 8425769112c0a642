"""What a run's ``report.html`` shows, as plain data read from the run's own files.

Four sections, each computed on its own so that a missing or broken input costs its
section only, never the page or the run: the per-step series of ``metrics.jsonl`` (with
the steps to mark on the charts: the strategy's meetings, live recovery's failures and
heals), the traced spans of ``trace.json``, the summary's headline numbers, and the
planner's prediction for the run's own config beside the measured peaks. A section that cannot be
had is replaced by the one line that says why (:class:`Unavailable`, or the error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.pages.plots import read_metrics, step_marks
from dptrain.planner import PRECISIONS, STRATEGIES
from dptrain.runner.report import summary_rows
from dptrain.strategies import get_strategy

__all__ = ["Unavailable", "report_data", "metric_series", "loss_spans_decades", "timeline_spans", "summary_rows",
           "plan_vs_measured", "no_trace_why"]

MiB = 2**20


class Unavailable(Exception):
    """A section of the report cannot be drawn; the message says why, in one line."""


def report_data(run_dir: Path, summary: dict | None, cfg) -> dict[str, dict]:
    """Every section of the report of ``run_dir``: ``{"data": ...}``, or ``{"why": one line}`` where it failed.

    ``summary``: what :func:`dptrain.runner.report.summarize` returned (None while the run has
    not finished); ``cfg``: the run's resolved config, planned at the run's world size.
    """
    run_dir = Path(run_dir)
    return {
        "series": _section(lambda: _series(run_dir)),
        "timeline": _section(lambda: timeline_spans(run_dir / "trace.json", no_trace_why(cfg, summary))),
        "summary": _section(lambda: summary_rows(_finished(summary))),
        "memory": _section(lambda: plan_vs_measured(cfg, _finished(summary))),
    }


def _section(build: Callable[[], Any]) -> dict:
    try:
        return {"data": build()}
    except Unavailable as e:
        return {"why": " ".join(str(e).split())}
    except Exception as e:  # the page shows what went wrong in its place; the other sections still render
        first = (str(e).strip().splitlines() or [""])[0]
        return {"why": f"{type(e).__name__}: {first}"}


def _series(run_dir: Path) -> dict[str, Any]:
    train, evals = _metrics(run_dir / "metrics.jsonl")
    return {**metric_series(train, evals), "marks": step_marks(run_dir, train)}


def no_trace_why(cfg, summary: dict | None) -> str:
    """Why a run left no ``trace.json``, from its config (and where it started, for a resumed run)."""
    log, steps, start = cfg.log, cfg.train.steps, (summary or {}).get("start_step", 0)
    first = log.trace_start + start
    if not log.trace_steps:
        return "no timeline: the run traced no step (log.trace_steps = 0)"
    if first > steps:
        resumed = f" (log.trace_start = {log.trace_start}, counted from step {start}, where it resumed)" if start \
            else f" (log.trace_start = {log.trace_start})"
        return f"no timeline: the run ended at step {steps}, before its first traced step {first}{resumed}"
    return f"no timeline: steps {first}-{first + log.trace_steps - 1} were to be traced; the run wrote no trace.json"


def _metrics(path: Path) -> tuple[list[dict], list[dict]]:
    if not path.is_file():
        raise Unavailable(f"no metrics: {path} does not exist")
    return read_metrics(path)


def _finished(summary: dict | None) -> dict:
    if summary is None:
        raise Unavailable("the run has not finished: summary.json is written at its end")
    return summary


def metric_series(train: list[dict], evals: list[dict]) -> dict[str, Any]:
    """Per-step loss, learning rate, throughput and step-time parts (non-finite values as None).

    Throughput is in tokens/s where a sample has several tokens, in samples/s where the two
    are the same (a classifier's). ``other_ms`` is the step's time outside compute and
    exposed communication (data loading, logging), as in ``throughput.png``.
    """
    if not train:
        raise Unavailable("no training step logged yet: metrics.jsonl has no train records")
    tokens = any(r["tokens_per_s"] != r["samples_per_s"] for r in train)
    rate_key = "tokens_per_s" if tokens else "samples_per_s"
    return {
        "step": [r["step"] for r in train],
        "loss": [_finite(r["loss"]) for r in train],
        "lr": [_finite(r["lr"]) for r in train],
        "rate_key": rate_key,
        "rate": [_finite(r[rate_key]) for r in train],
        "compute_ms": [_finite(r["compute_ms"]) for r in train],
        "exposed_comm_ms": [_finite(r["exposed_comm_ms"]) for r in train],
        "other_ms": [_finite(max(0.0, r["step_ms"] - r["compute_ms"] - r["exposed_comm_ms"])) for r in train],
        "eval_step": [e["step"] for e in evals],
        "val_loss": [_finite(e.get("val_loss")) for e in evals],
    }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def loss_spans_decades(losses: list[float | None]) -> bool:
    """Whether the positive losses span more than a factor of 10 (then the plot starts on a log axis)."""
    positive = [x for x in losses if x is not None and x > 0]
    return bool(positive) and max(positive) > 10 * min(positive)


def timeline_spans(trace_path: Path, missing: str = "no timeline: the run wrote no trace.json") -> dict[str, list]:
    """The traced steps' spans, one row per (rank, track) in Perfetto's order, times in ms since the first span.

    Each span: its ``row`` label ("rank 0: compute", "rank 1: bucket 2 (0.03 MiB)"), ``name``, ``kind``
    (the legend entry: every bucket's all-reduce is one kind), ``start_ms``, ``dur_ms`` and ``detail``
    (the bucket's bytes, the micro-step). The step spans that enclose them are left out, as in
    ``timeline.png``. ``missing``: what to say when there is no trace (:func:`no_trace_why`).
    """
    if not trace_path.is_file():
        raise Unavailable(missing)
    try:
        events = json.loads(trace_path.read_text())["traceEvents"]
    except (ValueError, KeyError, TypeError) as e:
        raise Unavailable(f"no timeline: {trace_path.name} could not be read: {type(e).__name__}: {e}") from None
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"]
    if not spans:
        raise Unavailable(f"no timeline: {trace_path.name} holds no compute or communication span")
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    label = {t: f"rank {t[0]}: {names.get(t, f'track {t[1]}')}" for t in tracks}
    t0 = min(e["ts"] for e in spans)
    return {
        "rows": [label[t] for t in tracks],
        "spans": [{"row": label[(e["pid"], e["tid"])], "name": e["name"], "kind": _kind(e),
                   "start_ms": (e["ts"] - t0) / 1e3, "dur_ms": e["dur"] / 1e3, "detail": _detail(e.get("args", {}))}
                  for e in spans],
    }


def _kind(event: dict) -> str:
    """The legend entry of a span: a bucket's or a ZeRO unit's collective by its kind, a wait for one as one kind."""
    name = event["name"]
    if name.startswith("all-reduce bucket"):
        return "all-reduce (bucket)"
    if name.startswith("wait for ") and name != "wait for gradients":
        return "wait for a collective"
    collective, _, unit = name.rpartition(" unit ")
    return f"{collective} (unit)" if collective and unit.isdigit() else name


def _detail(args: dict) -> str:
    """A span's arguments, for its hover: a bucket's bytes, a micro-step's index."""
    return ", ".join(f"{v:,} bytes" if k == "bytes" else f"{k.replace('_', ' ')} {v}" for k, v in args.items())



def plan_vs_measured(cfg, summary: dict) -> dict[str, Any]:
    """``dptrain plan`` for this run (its config, world size, strategy and precision) beside each rank's peaks.

    The plan is rank 0's (it holds the largest shards), in bytes by part; each rank's
    measured peak of live tensors is divided by its total (``ratio``), the resident set
    (libraries and allocator slack included) shown beside.
    """
    plan = planned_bytes(cfg, summary["world_size"])
    total_mb = plan["bytes"]["total"] / MiB
    ranks = [{"rank": r, "peak_tensor_mb": t, "peak_rss_mb": rss, "ratio": None if t is None else t / total_mb}
             for r, (t, rss) in enumerate(zip(summary["peak_tensor_mb_per_rank"], summary["peak_rss_mb_per_rank"], strict=True))]
    return {**plan, "total_mb": total_mb, "ranks": ranks, "note": _measured_where(summary, len(ranks))}


def _measured_where(summary: dict, measured: int) -> str:
    """Where fewer ranks were measured than ran: a live run's replica 0 alone, and why."""
    if measured >= summary["world_size"] or not summary.get("live"):
        return ""
    rss = summary["live"].get("peak_rss_mb_by_replica") or []
    others = (" Their peak resident MiB, from logs/live<r>.jsonl: " + ", ".join(
        f"replica {r}: {'-' if m is None else f'{m:,.0f}'}" for r, m in enumerate(rss)) + ".") if rss else ""
    return (f"Measured on replica 0 of {summary['world_size']} only: it keeps the run's records, and the replicas of "
            f"a live run share no process group to gather the others' in.{others}")


def planned_bytes(cfg, world_size: int) -> dict[str, Any]:
    """The planner's :class:`~dptrain.planner.Row` for this run, flattened: rank 0's bytes by part."""
    from dptrain.planner.from_config import plan_config  # here: a report without a plan does not pay for it

    strategy, precision = cfg.distributed.strategy, cfg.train.precision
    if not get_strategy(strategy).planned:  # the planner's memory and traffic model does not cover it
        raise Unavailable(f"no plan: dptrain plan covers the strategies {', '.join(STRATEGIES)}; "
                          f"this run's is {strategy}")
    if precision not in PRECISIONS:
        raise Unavailable(f"no plan: dptrain plan covers the precisions {', '.join(PRECISIONS)}; "
                          f"this run's is {precision}")
    notes: list[str] = []
    row = plan_config(cfg, [world_size], [strategy], [precision], notes)[0]
    if row.total() is None:
        why = "; ".join(note.splitlines()[0] for note in notes)  # a traced error may run on for lines
        raise Unavailable(f"no planned total: {why or 'activations or communication buffers were not estimated'}")
    return {"strategy": strategy, "world_size": world_size, "precision": precision, "micro_batch": row.micro_batch,
            "bytes": {"parameters": row.states.parameters, "gradients": row.states.gradients,
                      "optimizer": row.states.optimizer, "buffers": row.states.buffers,
                      "activations": row.activations.saved, "comm_buffers": row.comm_buffers, "total": row.total()}}
