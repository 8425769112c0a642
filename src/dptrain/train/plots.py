"""Plots of a run: loss (and LR), throughput and step-time breakdown from ``metrics.jsonl``,
and a timeline of the traced steps from ``trace.json`` (the picture of overlap).

Drawn with matplotlib's file-only Agg backend, so they work on machines without a display.
``python -m dptrain.train.plots RUN_DIR`` redraws them from a finished or running run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dptrain.train.atomic import replacing

__all__ = ["read_metrics", "plot_run", "plot_timeline"]


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a ``metrics.jsonl``."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
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
    ax.plot(steps, [r["loss"] for r in train], label="train loss (mean over ranks)", color="tab:blue")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss",
                color="tab:orange")
    ax.set_ylabel("loss")
    ax.set_title(title or f"{run_dir.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax_lr.plot(steps, [r["lr"] for r in train], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, run_dir / "loss.png"))
    plt.close(fig)

    fig, (ax, ax_ms) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    ax.plot(steps, [r["tokens_per_s"] for r in train], color="tab:purple")
    ax.set_ylabel("tokens / s (global)")
    ax.set_title(title or f"{run_dir.name}: throughput")
    ax.grid(alpha=0.3)
    compute = [r["compute_ms"] for r in train]
    exposed = [r["exposed_comm_ms"] for r in train]
    other = [max(0.0, r["step_ms"] - c - e) for r, c, e in zip(train, compute, exposed)]
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


if __name__ == "__main__":
    for written in plot_run(Path(sys.argv[1])):  # also draws timeline.png when trace.json exists
        print(written)
