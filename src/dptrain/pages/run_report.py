"""A run's ``report.html``: summary, loss, learning rate, throughput, planned and measured memory, timeline.

One self-contained page (:mod:`dptrain.pages.html`: plotly.js, styles and data inline;
it opens offline) with interactive plots: zoom by dragging, hover for values, double-click
to reset. ``dptrain run`` writes it at the end beside its PNGs (with ``log.plots``);
``python -m dptrain.pages.run_report RUN_DIR`` writes it again from the run's files.

Each section stands alone (:mod:`dptrain.pages.run_report_data`): one that cannot be
drawn (no traced steps, a strategy the planner does not cover, a forward that does not
trace) says why in one line and the page is still written; and a report that cannot be
written at all is one warning in the run's log, never a failed run
(:func:`try_write_run_report`).
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.pages.html import asset, document, json_script, plotly_script, write_page
from dptrain.pages.plots import MARK_STYLES
from dptrain.pages.run_report_data import MiB, loss_spans_decades, report_data

__all__ = ["write_run_report", "try_write_run_report", "render", "figures", "main"]

# the colours of timeline.png (matplotlib's tab10), so the PNG and the page read alike
SPAN_COLORS = {"forward": "#1f77b4", "backward": "#2ca02c", "backward (no sync)": "#bcbd22",
               "wait for gradients": "#d62728", "optimizer": "#ff7f0e", "all-reduce (bucket)": "#9467bd",
               "all-gather (unit)": "#17becf", "reduce-scatter (unit)": "#9467bd",
               "all-reduce over replicas (unit)": "#e377c2", "wait for a collective": "#d62728",
               "push gradient, wait for parameters": "#d62728"}
PLAN_PARTS = [("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
              ("buffers", "module buffers"), ("activations", "activations (one micro-batch)"),
              ("comm_buffers", "communication buffers")]


def write_run_report(run_dir: Path, summary: dict | None, cfg) -> Path:
    """Write ``run_dir/report.html`` whole or not at all; return its path.

    ``summary``: what :func:`dptrain.runner.report.summarize` returned (None: the run has not
    finished); ``cfg``: the run's resolved config, which the planner plans, and whose
    ``log.report_js`` says where the page gets plotly.js (:func:`dptrain.pages.html.plotly_script`).
    """
    run_dir = Path(run_dir)
    data = report_data(run_dir, summary, cfg)
    tag = plotly_script(cfg.log.report_js, run_dir)
    return write_page(run_dir / "report.html", render(data, _title(run_dir, summary), plotly_tag=tag))


def try_write_run_report(run_dir: Path, summary: dict | None, cfg, log: Callable[[str], None]) -> Path | None:
    """:func:`write_run_report`, saying where it wrote or, if it failed, why in one line: never an exception."""
    try:
        path = write_run_report(run_dir, summary, cfg)
    except Exception as e:  # the run is done and its other outputs are written: a report must not fail it
        first = (str(e).strip().splitlines() or [""])[0]
        log(f"warning: report.html not written: {type(e).__name__}: {first}")
        return None
    log(f"report: {path} (open in a browser; interactive, works offline)")
    return path


def _title(run_dir: Path, summary: dict | None) -> tuple[str, str]:
    """The page's heading and the line under it."""
    if summary is None:
        return f"run report: {run_dir.name}", "unfinished: no summary.json yet"
    strategy = f", strategy {summary['strategy']}" if summary.get("strategy") else ""
    return (f"run report: {run_dir.name}",
            f"{summary['task']} on {summary['world_size']} x {summary['device']}{strategy}, {summary['steps']} steps")


def render(data: dict[str, dict], title: tuple[str, str], plotly_tag: str | None = None) -> str:
    """The page for :func:`~dptrain.pages.run_report_data.report_data`'s sections; ``title``: heading, subheading.

    ``plotly_tag``: how the page loads plotly.js (:func:`dptrain.pages.html.plotly_script`; default inline).
    """
    series = data["series"].get("data")
    log_default = series is not None and loss_spans_decades(series["loss"] + series["val_loss"])
    body = "\n".join([
        f'<header class="page"><h1>{html.escape(title[0])}</h1><p>{html.escape(title[1])}. '
        "Drag to zoom, double-click to reset, hover for values.</p></header><main>",
        _panel("summary", "Summary", data["summary"], _summary_table),
        _panel("loss", "Loss and learning rate", data["series"], lambda s: _loss_controls(log_default)
               + '<div class="figure" id="fig-loss"></div>'),
        _panel("throughput", "Throughput and step time", data["series"],
               lambda s: '<div class="figure" id="fig-throughput"></div>'),
        _panel("memory", "Memory: planned and measured", data["memory"], _memory_tables),
        _panel("timeline", "Timeline of the traced steps", data["timeline"], _timeline_intro),
        "</main>",
        json_script("report-figures", figures(data, log_default)),
    ])
    return document(title[0], body, styles=asset("report.css"), scripts=(asset("report.js"),), plotly_tag=plotly_tag)


def _panel(key: str, heading: str, section: dict, content: Callable[[Any], str]) -> str:
    inner = (f'<p class="notice why">{html.escape(section["why"])}</p>' if "why" in section
             else content(section["data"]))
    return f'<section class="panel" id="{key}"><h2>{heading}</h2>{inner}</section>'


def _loss_controls(log_default: bool) -> str:
    checked = " checked" if log_default else ""
    return (f'<div class="controls"><label class="toggle"><input type="checkbox" id="loss-log"{checked}> '
            "log-scale loss axis</label></div>")


def _summary_table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="data summary" id="summary-table">{cells}</table>'


def _memory_tables(m: dict) -> str:
    intro = (f'<p class="notice">dptrain plan for this run: {m["strategy"]} on {m["world_size"]} ranks, '
             f'{m["precision"]}, micro-batch {m["micro_batch"]}; the plan is rank 0\'s (it holds the largest '
             "shards). Measured: each rank's peak of live tensors, and its resident set (libraries and "
             f"allocator slack included). {html.escape(m.get('note', ''))}</p>")
    parts = "".join(f"<tr><td>{label}</td><td>{_mib(m['bytes'][key] / MiB)}</td></tr>" for key, label in PLAN_PARTS)
    plan = (f'<table class="data" id="memory-plan"><tr><th>planned, rank 0</th><th>MiB</th></tr>{parts}'
            f'<tr class="total"><td>total</td><td>{_mib(m["total_mb"])}</td></tr></table>')
    ranks = "".join(f'<tr><td>{r["rank"]}</td><td>{_mib(r["peak_tensor_mb"])}</td><td>{_mib(m["total_mb"])}</td>'
                    f'<td>{_ratio(r["ratio"])}</td><td>{_mib(r["peak_rss_mb"])}</td></tr>'
                    for r in m["ranks"])
    measured = ('<table class="data" id="memory-ranks"><tr><th>rank</th><th>measured peak tensors (MiB)</th>'
                "<th>planned (MiB)</th><th>measured / planned</th><th>peak resident (MiB)</th></tr>"
                f"{ranks}</table>")
    return f'{intro}<div class="side-by-side">{plan}{measured}</div><div class="figure" id="fig-memory"></div>'


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value:,.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _timeline_intro(timeline: dict) -> str:
    return ('<p class="notice">One row per rank and track: the compute track (forward, backward, the wait for '
            "gradients, the optimizer) and each gradient bucket's all-reduce, from launch to completion. Bucket "
            "spans under the backward span were hidden by it; the wait for gradients is what was not.</p>"
            '<div class="figure" id="fig-timeline"></div>')


def figures(data: dict[str, dict], log_loss: bool) -> dict[str, dict]:
    """Plotly figure specs (``{"data", "layout"}``) by the id of the element each is drawn in."""
    out = {}
    if "data" in data["series"]:
        out["fig-loss"] = _loss_figure(data["series"]["data"], log_loss)
        out["fig-throughput"] = _throughput_figure(data["series"]["data"])
    if "data" in data["memory"]:
        out["fig-memory"] = _memory_figure(data["memory"]["data"])
    if "data" in data["timeline"]:
        out["fig-timeline"] = _timeline_figure(data["timeline"]["data"])
    return {key: json.loads(_clear_of_the_toolbar(fig).to_json()) for key, fig in out.items()}


MODEBAR_MARGIN = 40  # px: plotly's toolbar, upright, fits in a right margin this wide


def _clear_of_the_toolbar(fig):
    """``fig`` with plotly's toolbar upright in a right margin of its own: lying along the top (plotly's default)
    it covers the legends and titles drawn there."""
    fig.update_layout(modebar=dict(orientation="v"), margin=dict(r=MODEBAR_MARGIN))
    return fig


def _two_rows(heights: tuple[float, float], steps: list[int]):
    """Two plots over the optimizer step, one above the other, zoomed together."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=list(heights), vertical_spacing=0.06)
    fig.update_layout(template="plotly_white", height=480, margin=dict(l=70, r=20, t=30, b=50),
                      hovermode="x unified", legend=dict(orientation="h", y=1.08, x=0, traceorder="normal"))
    fig.update_xaxes(title_text="optimizer step", row=2, col=1)
    if steps and max(steps) - min(steps) <= 12:  # a tick per step: plotly would label half steps too
        fig.update_xaxes(dtick=1)                    # (over more steps it chooses a few whole ones itself)
    return fig


def _line_mode(steps: list[int]) -> str:
    """Markers as well as lines where there are few records: one record alone is no line."""
    return "lines+markers" if len(steps) <= 30 else "lines"


def _loss_figure(s: dict, log_loss: bool):
    import plotly.graph_objects as go

    fig = _two_rows((0.72, 0.28), s["step"])
    mode = _line_mode(s["step"])
    fig.add_trace(go.Scatter(x=s["step"], y=s["loss"], name="train loss (mean over ranks)", mode=mode,
                             line_color="#1f77b4"), row=1, col=1)
    if s["eval_step"]:
        fig.add_trace(go.Scatter(x=s["eval_step"], y=s["val_loss"], name="validation loss", mode="lines+markers",
                                 line_color="#ff7f0e"), row=1, col=1)
    fig.add_trace(go.Scatter(x=s["step"], y=s["lr"], name="learning rate", mode=mode, line_color="#2ca02c"),
                  row=2, col=1)
    for trace in _mark_traces(s.get("marks", {}), s["loss"] + s["val_loss"]):
        fig.add_trace(trace, row=1, col=1)
    fig.update_yaxes(title_text="loss", type="log" if log_loss else "linear", row=1, col=1)
    fig.update_yaxes(title_text="learning rate", exponentformat="e", row=2, col=1)
    return fig


def _throughput_figure(s: dict):
    import plotly.graph_objects as go

    fig = _two_rows((0.5, 0.5), s["step"])
    unit = "tokens/s" if s["rate_key"] == "tokens_per_s" else "samples/s"
    fig.add_trace(go.Scatter(x=s["step"], y=s["rate"], name=f"{unit} (global)", mode=_line_mode(s["step"]),
                             line_color="#9467bd"), row=1, col=1)
    for key, name, color in (("compute_ms", "compute", "#1f77b4"), ("exposed_comm_ms", "exposed communication",
                             "#d62728"), ("other_ms", "other (data, logging)", "#7f7f7f")):
        fig.add_trace(go.Scatter(x=s["step"], y=s[key], name=f"{name} ms", mode="lines", stackgroup="ms",
                                 line_color=color), row=2, col=1)
    for trace in _mark_traces(s.get("marks", {}), s["rate"], legend=False):  # named in the loss plot's legend
        fig.add_trace(trace, row=1, col=1)
    fig.update_yaxes(title_text=f"{unit} (global)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="ms per step (slowest rank)", row=2, col=1)
    return fig


def _mark_traces(marks: dict[str, dict], values: list[float | None], legend: bool = True) -> list:
    """Each kind of :func:`~dptrain.pages.plots.step_marks` as one trace of vertical lines over ``values``' range (a
    strategy's meetings, live recovery's failures and heals), the mark's text on hover."""
    import plotly.graph_objects as go

    finite = [v for v in values if v is not None]
    if not finite:
        return []
    low, high = min(finite), max(finite)
    traces = []
    for kind, mark in marks.items():
        color, dash = MARK_STYLES[kind]
        ends = list(zip(mark["steps"], mark["text"], strict=True))
        traces.append(go.Scatter(
            x=[x for step, _ in ends for x in (step, step, None)], y=[y for _ in ends for y in (low, high, None)],
            hovertext=[t for _, text in ends for t in (text, text, None)], hoverinfo="text", mode="lines",
            name=mark["name"], legendgroup=kind, showlegend=legend, line=dict(color=color, dash=dash, width=1)))
    return traces


def _memory_figure(m: dict):
    import plotly.graph_objects as go

    bars = ["planned (rank 0)"] + [f"measured, rank {r['rank']}" for r in m["ranks"]]
    fig = go.Figure()
    for key, label in PLAN_PARTS:
        fig.add_trace(go.Bar(x=[m["bytes"][key] / MiB], y=[bars[0]], name=label, orientation="h",
                             hovertemplate=f"{label}: %{{x:.3f}} MiB<extra></extra>"))
    fig.add_trace(go.Bar(x=[r["peak_tensor_mb"] for r in m["ranks"]], y=bars[1:], name="measured peak tensors",
                         orientation="h", marker_color="#444",
                         hovertemplate="%{y}: %{x:.3f} MiB of live tensors<extra></extra>"))
    fig.update_layout(template="plotly_white", barmode="stack", height=140 + 28 * len(bars),
                      margin=dict(l=140, r=20, t=40, b=40), legend=dict(orientation="h", y=1.02, yanchor="bottom",
                                                                         traceorder="normal"),
                      xaxis_title="MiB", yaxis=dict(autorange="reversed"))
    return fig


def _timeline_figure(t: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind in dict.fromkeys(span["kind"] for span in t["spans"]):  # first-seen order: forward, backward, ...
        spans = [span for span in t["spans"] if span["kind"] == kind]
        fig.add_trace(go.Bar(
            y=[span["row"] for span in spans], x=[span["dur_ms"] for span in spans],
            base=[span["start_ms"] for span in spans], orientation="h", name=kind,
            marker_color=SPAN_COLORS.get(kind, "#8c564b"),
            customdata=[[span["name"], span["start_ms"], span["dur_ms"], span["detail"]] for span in spans],
            hovertemplate="<b>%{customdata[0]}</b> (%{y})<br>start %{customdata[1]:.3f} ms<br>"
                          "duration %{customdata[2]:.3f} ms<br>%{customdata[3]}<extra></extra>"))
    fig.update_layout(template="plotly_white", barmode="overlay", bargap=0.25, height=130 + 26 * len(t["rows"]),
                      margin=dict(l=190, r=20, t=40, b=50), legend=dict(orientation="h", y=1.0, yanchor="bottom"),
                      xaxis_title="ms since the first traced span began",
                      yaxis=dict(categoryorder="array", categoryarray=t["rows"], autorange="reversed"))
    return fig


USAGE = "usage: python -m dptrain.pages.run_report RUN_DIR   (writes RUN_DIR/report.html from the run's files)"


def main(argv: list[str]) -> int:
    """``python -m dptrain.pages.run_report RUN_DIR``: write the run's report again; 2 on a usage error."""
    from dptrain.config import ConfigError, load_config

    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    run_dir = Path(argv[0])
    if not (run_dir / "config.toml").is_file():
        print(f"error: {run_dir} is not a run directory (no config.toml in it); pass the --run-dir of a dptrain run",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(run_dir / "config.toml")
    except ConfigError as e:
        print(f"error: {run_dir / 'config.toml'}: {e}", file=sys.stderr)
        return 2
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    print(write_run_report(run_dir, summary, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
