"""A plan as a Markdown table, JSON, and a PNG of memory per rank by category (stacked bars)."""

from __future__ import annotations

import json
from pathlib import Path

from dptrain.planner.devices import DEFAULT_HEADROOM, fits, usable_bytes
from dptrain.planner.plan import Row
from dptrain.utils.atomic import replacing

__all__ = ["table", "row_fits", "to_json", "plot"]

_MiB = 2**20


def _fmt(n: int | None, unit: int) -> str:
    return "n/a" if n is None else f"{n / unit:,.1f}"


def table(rows: list[Row], device_memory: int | None = None, headroom: float = DEFAULT_HEADROOM) -> str:
    """Markdown: one line per row, per rank (rank 0), in MiB, or GiB when the largest total reaches 10 GiB.

    With ``device_memory`` (bytes) a last column says whether each row fits it less ``headroom``
    (:func:`~dptrain.planner.devices.fits`); "?" where only the model states could be planned.
    """
    largest = max((r.total() or r.states.total for r in rows), default=0)
    unit, name = (2**30, "GiB") if largest >= 10 * 2**30 else (_MiB, "MiB")
    head = ["strategy", "N", "precision", "micro-batch", "params", "grads", "optimizer", "buffers",
            "activations", "act. ckpt", "comm buffers", "total", "total ckpt", "sent / step"]
    if device_memory is not None:
        head.append(f"fits {usable_bytes(device_memory, headroom) / 2**30:.2f} GiB ({device_memory / 2**30:.2f} "
                    f"less {100 * headroom:g}%)")
    lines = [f"{name} per rank (rank 0, which holds the largest shards); sent / step in {name} per rank.",
             "| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for r in rows:
        acts = r.activations
        cells = [r.strategy, str(r.world_size), r.precision, str(r.micro_batch or "-"),
                 _fmt(r.states.parameters, unit), _fmt(r.states.gradients, unit), _fmt(r.states.optimizer, unit),
                 _fmt(r.states.buffers, unit), _fmt(acts.saved if acts else None, unit),
                 _fmt(acts.checkpointed if acts else None, unit), _fmt(r.comm_buffers, unit),
                 _fmt(r.total(), unit), _fmt(r.total(checkpointed=True), unit), _fmt(r.traffic.total, unit)]
        if device_memory is not None:
            cells.append(("yes" if row_fits(r, device_memory, headroom) else "no") +
                         ("" if r.total() is not None else "?"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def row_fits(row: Row, device_memory: int, headroom: float) -> bool:
    """Whether ``row``'s total (its model states and buffers where there is none) fits the device less headroom."""
    total = row.total() if row.total() is not None else row.states.total + row.states.buffers
    return fits(total, device_memory, headroom)


def to_json(rows: list[Row], path: Path, extra: dict | None = None) -> Path:
    """The rows' bytes as JSON; with ``extra["device_memory_bytes"]`` each row also says whether it ``fits``."""
    extra = extra or {}
    device = extra.get("device_memory_bytes")
    headroom = extra.get("headroom", DEFAULT_HEADROOM)
    out = [{**r.to_dict(), **({"fits": row_fits(r, device, headroom)} if device else {})} for r in rows]
    with replacing(path) as tmp:
        tmp.write_text(json.dumps({**extra, "rows": out}, indent=2))
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # file-only: works without a display
    from matplotlib import pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    _pyplot().close(fig)
    return path


def plot(rows: list[Row], path: Path, title: str = "") -> Path:
    """Stacked bars of rank 0's memory by category, grouped by world size, one bar per strategy."""
    plt = _pyplot()
    precisions = sorted({r.precision for r in rows})
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4.2), squeeze=False)
    parts = [("parameters", lambda r: r.states.parameters), ("gradients", lambda r: r.states.gradients),
             ("optimizer", lambda r: r.states.optimizer),
             ("activations", lambda r: r.activations.saved if r.activations else 0),
             ("comm buffers", lambda r: r.comm_buffers or 0)]
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]
    for ax, precision in zip(axes[0], precisions, strict=True):
        mine = [r for r in rows if r.precision == precision]
        sizes = sorted({r.world_size for r in mine})
        strategies = list(dict.fromkeys(r.strategy for r in mine))
        width = 0.8 / len(strategies)
        by_cell = {(r.strategy, r.world_size): r for r in mine}
        for si, strategy in enumerate(strategies):
            for wi, n in enumerate(sizes):
                row = by_cell.get((strategy, n))
                if row is None:
                    continue
                bottom = 0.0
                x = wi + (si - (len(strategies) - 1) / 2) * width
                for (name, value), color in zip(parts, colors, strict=True):
                    v = value(row) / _MiB
                    ax.bar(x, v, width * 0.95, bottom=bottom, color=color,
                           label=name if (si, wi) == (0, 0) else None)
                    bottom += v
                ax.text(x, bottom, strategy, ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(sizes)), [f"N={n}" for n in sizes])
        ax.set_ylabel("MiB per rank (rank 0)")
        ax.set_title(f"{title} {precision}".strip())
        ax.legend(fontsize=7)
    return _save(fig, path)


# --------------------------------------------------------------------- scaling (dptrain simulate)


def _scaling_rows(result: dict) -> list[dict]:
    """Per network and N: the step, its parts, samples/s and efficiency (throughput over N x one rank's ideal).

    One rank's ideal is the first world size's per-rank compute with no communication; with
    a fixed micro-batch the efficiency is that step over the N-rank step, as before.
    """
    rows = []
    batches = result.get("batches") or {}
    micro = {n: b.micro_batch_size for n, b in batches.items()}
    per_rank = {n: b.micro_batch_size * b.grad_accum_steps for n, b in batches.items()}  # samples per step
    ideal: dict[str, float] = {}
    for (net, n), p in result["predictions"].items():
        ideal.setdefault(net, per_rank.get(n, result["micro_batch"]) / p.compute_s)  # samples/s of one rank, no comm
    for (net, n), p in result["predictions"].items():
        m, samples = micro.get(n, result["micro_batch"]), per_rank.get(n, result["micro_batch"])
        rate = n * samples / p.step_s
        rows.append(dict(network=net, world_size=n, micro_batch=m, global_batch=n * samples, step_s=p.step_s,
                         compute_s=p.compute_s, comm_s=p.comm_s, exposed_s=p.exposed_s, samples_per_s=rate,
                         efficiency=rate / (n * ideal[net])))
    return rows


def batch_rule(fixed: str, global_batch: int | None = None, micro_batch: int | None = None) -> str:
    """The line ``dptrain plan`` and ``dptrain simulate`` print about how the batch follows the world size N."""
    if fixed == "global":
        return (f"batch rule: the global batch stays {global_batch} samples per step as N grows, each rank taking "
                f"{global_batch} / N (the config's batch, as dptrain run resolves it)")
    return (f"batch rule: the micro-batch stays {micro_batch} samples per rank as N grows, the global batch "
            f"{micro_batch} x N")


def skip_lines(skipped: dict[int, str]) -> list[str]:
    """One line per world size left out of a table, with why."""
    return [f"N={n} skipped: {why}" for n, why in skipped.items()]


def scaling_table(result: dict) -> str:
    lines = ["| network | N | micro-batch | step (ms) | compute (ms) | link busy (ms) | exposed (ms) | samples/s | "
             "efficiency |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in _scaling_rows(result):
        lines.append(f"| {r['network']} | {r['world_size']} | {r['micro_batch']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['compute_s'] * 1e3:.1f} | "
                     f"{r['comm_s'] * 1e3:.1f} | {r['exposed_s'] * 1e3:.1f} | {r['samples_per_s']:,.0f} | "
                     f"{r['efficiency']:.2f} |")
    return "\n".join(lines)


def scaling_json(result: dict, path: Path) -> Path:
    prof = result["profile"]
    data = {"micro_batch": result["micro_batch"],
            "profile": {"forward_s": prof.forward_s, "backward_s": prof.backward_s, "optimizer_s": prof.optimizer_s,
                        "source": prof.source},
            "skipped": {str(n): why for n, why in (result.get("skipped") or {}).items()},
            "rows": _scaling_rows(result)}
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))
    return path


def plot_scaling(result: dict, path: Path) -> Path:
    """Throughput and efficiency against N per network, and where the largest N's step time goes."""
    plt = _pyplot()
    rows = _scaling_rows(result)
    nets = list(dict.fromkeys(r["network"] for r in rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for net in nets:
        mine = [r for r in rows if r["network"] == net]
        a.plot([r["world_size"] for r in mine], [r["samples_per_s"] for r in mine], marker="o", label=net)
        b.plot([r["world_size"] for r in mine], [r["efficiency"] for r in mine], marker="o", label=net)
    for ax, label in ((a, "samples / s"), (b, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel degree N")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    a.set_yscale("log")
    b.set_ylim(0, 1.05)
    largest = max(r["world_size"] for r in rows)
    last = [r for r in rows if r["world_size"] == largest]
    prof = result["profile"]
    parts = [("forward", prof.forward_s), ("backward", prof.backward_s), ("optimizer", prof.optimizer_s)]
    for i, r in enumerate(last):
        bottom = 0.0
        for (name, value), color in zip(parts + [("exposed communication", r["exposed_s"])],
                                        ["#4C72B0", "#55A868", "#8172B3", "#C44E52"], strict=True):
            c.bar(i, value * 1e3, bottom=bottom, color=color, label=name if i == 0 else None)
            bottom += value * 1e3
    c.set_xticks(range(len(last)), [r["network"] for r in last], rotation=20, fontsize=7)
    c.set_ylabel(f"ms per step at N={largest}")
    c.legend(fontsize=7)
    return _save(fig, path)
