"""Plots of a run: loss (and LR), throughput and step-time breakdown from ``metrics.jsonl``,
and a timeline of the traced steps from ``trace.json`` (the picture of overlap). The loss is
marked where the strategy met (local SGD's averages, DiLoCo's outer steps: the loss jumps
there) and, under live recovery, where a round failed and where a worker was healed
(:func:`step_marks`, which report.html draws as well).

Drawn with matplotlib's file-only Agg backend, so they work on machines without a display.
``python -m dptrain.pages.plots RUN_DIR`` redraws them from a finished or running run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dptrain.live.records import read_live_logs
from dptrain.runner.metrics import has_tokens, run_sync_steps
from dptrain.utils.atomic import replacing

__all__ = ["read_metrics", "plot_run", "plot_timeline", "spans_a_decade", "step_marks", "MARK_STYLES"]

# Each kind of mark: its legend entry, colour and line style, the same in loss.png and report.html.
MARK_STYLES = {"sync": ("#7f7f7f", "dot"), "failure": ("#d62728", "dash"), "heal": ("#2ca02c", "dashdot")}
MAX_MARKS = 100  # of one kind: more would hide the curve (local SGD averaging every step); the legend says so


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a ``metrics.jsonl``; a line that is no whole record (a crash cut it) is
    left out."""
    train, evals = [], []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            (evals if rec.get("kind") == "eval" else train).append(rec)
    return train, evals


def plot_run(run_dir: Path, title: str = "") -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` into ``run_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    run_dir = Path(run_dir)
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    if not train:
        return []
    steps = [r["step"] for r in train]
    written = []

    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 1])
    _draw_marks(ax, step_marks(run_dir, train))
    _draw_loss(ax, train, evals)
    ax.set_title(title or f"{run_dir.name}: loss")
    ax_lr.plot(steps, [r["lr"] for r in train], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, run_dir / "loss.png"))
    plt.close(fig)

    fig, (ax, ax_ms) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    tokens = all(has_tokens(r.get("tokens_per_s"), r["samples_per_s"]) for r in train)
    ax.plot(steps, [r["tokens_per_s" if tokens else "samples_per_s"] for r in train], color="tab:purple")
    ax.set_ylabel("tokens / s (global)" if tokens else "samples / s (global)")
    ax.set_title(title or f"{run_dir.name}: throughput")
    ax.grid(alpha=0.3)
    compute = [r["compute_ms"] for r in train]
    exposed = [r["exposed_comm_ms"] for r in train]
    other = [max(0.0, r["step_ms"] - c - e) for r, c, e in zip(train, compute, exposed, strict=True)]
    ax_ms.stackplot(steps, compute, exposed, other, labels=["compute", "exposed communication", "other (data, logging)"],
                    colors=["tab:blue", "tab:red", "tab:gray"], alpha=0.8)
    ax_ms.set_ylabel("ms per step (slowest rank)")
    ax_ms.set_xlabel("optimizer step")
    ax_ms.legend(loc="upper right", fontsize="small")
    ax_ms.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, run_dir / "throughput.png"))
    plt.close(fig)
    if (run_dir / "trace.json").exists():
        written.append(plot_timeline(run_dir / "trace.json", run_dir / "timeline.png"))
    return written


def _draw_loss(ax, train: list[dict], evals: list[dict]) -> None:
    """Train and validation loss, on a log scale when they span more than a decade; validation accuracy on a
    second y-axis when the eval records have it (a classifier's)."""
    losses = [r["loss"] for r in train] + [r["val_loss"] for r in evals]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (mean over ranks)",
            color="tab:blue")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss",
                color="tab:orange")
    if spans_a_decade(losses):
        ax.set_yscale("log")
    ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    scored = [r for r in evals if r.get("val_accuracy") is not None]
    if scored:
        ax_acc = ax.twinx()
        ax_acc.plot([r["step"] for r in scored], [100 * r["val_accuracy"] for r in scored], "s--",
                    label="validation accuracy", color="tab:red")
        ax_acc.set_ylabel("validation accuracy (%)")
        ax_acc.set_ylim(0, 100)
        more = ax_acc.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels)


def step_marks(run_dir: Path, train: list[dict]) -> dict[str, dict]:
    """Steps worth a vertical line, by kind: ``sync`` where the strategy met (the records' ``sync_`` fields,
    :func:`dptrain.runner.metrics.run_sync_steps`), ``failure`` where a live round was aborted after a commit (the
    first of a failure's rounds) and ``heal`` where a live worker was healed (``logs/live<r>.jsonl``). Each kind:
    its ``name`` (the legend's), ``steps``, a hover ``text`` per step, and how many there were in all
    (``count``: at most :data:`MAX_MARKS` are kept)."""
    noun = next((r["sync_name"] for r in reversed(train) if "sync_name" in r), "sync")
    syncs = [(s, f"{noun} at step {s}") for s in run_sync_steps(train)]
    name = f"{noun}s"
    failures, heals = _live_marks(run_dir)
    marks = {}
    for kind, label, found in (("sync", name, syncs), ("failure", "live: failed rounds", failures),
                               ("heal", "live: heals", heals)):
        if found:
            kept = found[:MAX_MARKS]
            marks[kind] = {"name": label if len(found) == len(kept) else f"{label} (the first {len(kept)} of "
                           f"{len(found)})", "steps": [s for s, _ in kept], "text": [t for _, t in kept],
                           "count": len(found)}
    return marks


def _live_marks(run_dir: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(failures, heals) of a live run's logs, as (step, text): a failure is the first aborted round after a
    commit, at the step it attempted; a heal, where a worker received the state, at the step it then took."""
    rounds: dict[int, dict] = {}
    heals = []
    for replica, records in sorted(read_live_logs(run_dir).items()):
        for r in records:
            if isinstance(r.get("round"), int):
                rounds.setdefault(r["round"], r)
            if r.get("heal_received") and isinstance(r.get("step"), int):
                heals.append((r["step"], f"replica {replica} healed before step {r['step']}: "
                                         f"{r['heal_received'] / 2**20:.1f} MiB in {r.get('heal_s', 0):.2f} s"))
    failures, failing = [], False
    for _, r in sorted(rounds.items()):
        if not r.get("commit") and not failing:
            why = f": {r['error'][:120]}" if r.get("error") else ""
            failures.append((r["step"], f"round {r['round']} aborted at step {r['step']} "
                                        f"(members {', '.join(map(str, r.get('members', [])))}){why}"))
        failing = not r.get("commit")
    return failures, sorted(heals)


def _draw_marks(ax, marks: dict[str, dict]) -> None:
    """Each mark a thin vertical line, one legend entry per kind."""
    dashes = {"dot": ":", "dash": "--", "dashdot": "-."}
    for kind, mark in marks.items():
        color, dash = MARK_STYLES[kind]
        for i, step in enumerate(mark["steps"]):
            ax.axvline(step, color=color, linestyle=dashes[dash], linewidth=0.8, alpha=0.7,
                       label=mark["name"] if i == 0 else None)


def spans_a_decade(values: list[float]) -> bool:
    """Whether positive values range over more than a factor of 10 (a log scale then shows the late steps)."""
    finite = [v for v in values if v > 0 and v != float("inf")]
    return bool(finite) and max(finite) > 10 * min(finite)


_COLORS = {"forward": "tab:blue", "backward": "tab:green", "backward (no sync)": "tab:olive",
           "wait for gradients": "tab:red", "optimizer": "tab:orange"}


def plot_timeline(trace_path: Path, out_path: Path) -> Path:
    """Each rank's compute track and per-bucket all-reduce tracks, as in Perfetto."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    t0 = min(e["ts"] for e in spans)
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.32 * len(tracks)))
    for row, (pid, tid) in enumerate(tracks):
        y = len(tracks) - 1 - row
        for e in (e for e in spans if (e["pid"], e["tid"]) == (pid, tid)):
            color = _COLORS.get(e["name"], "tab:purple")
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)], (y - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"rank {pid}: {names.get((pid, tid), tid)}" for pid, tid in reversed(tracks)],
                       fontsize="small")
    ax.set_xlabel("ms since the first traced step began")
    ax.set_title("traced steps: compute and each bucket's all-reduce (overlap = purple under green)")
    handles = [Patch(color=c, label=n) for n, c in _COLORS.items() if n != "backward (no sync)"]
    fig.legend(handles=handles + [Patch(color="tab:purple", label="all-reduce (bucket)")], fontsize="small",
               loc="lower center", ncol=6, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    path = _save(fig, out_path)
    plt.close(fig)
    return path


def _save(fig, path: Path) -> Path:
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


_USAGE = "usage: python -m dptrain.pages.plots RUN_DIR   (redraws loss.png, throughput.png, timeline.png)"


def main(argv: list[str]) -> int:
    """The command line: redraw a run's plots; exit status 2 with the usage when RUN_DIR is missing or wrong."""
    if argv[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if len(argv) != 1:
        print(_USAGE, file=sys.stderr)
        return 2
    metrics = Path(argv[0]) / "metrics.jsonl"
    if not metrics.exists():
        print(f"{_USAGE}\nerror: {metrics} does not exist: RUN_DIR is the directory dptrain run wrote", file=sys.stderr)
        return 2
    for written in plot_run(Path(argv[0])):  # also draws timeline.png when trace.json exists
        print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
