"""Plots of a run from its ``metrics.jsonl``: loss (and LR), throughput and step-time breakdown.

Drawn with matplotlib's file-only Agg backend, so they work on machines without a display.
``python -m dptrain.train.plots RUN_DIR`` redraws them from a finished or running run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["read_metrics", "plot_run"]


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
    return written


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)
    return path


if __name__ == "__main__":
    for written in plot_run(Path(sys.argv[1])):
        print(written)
