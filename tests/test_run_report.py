"""A run's report.html: its data is the run's metrics, trace, summary and plan; it renders offline and responds;
a section that cannot be drawn says why in one line, and a report that cannot be written never fails the run."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs_version

from _browser import open_page, plot_layout_problems
from _cli import dptrain, tiny_gpt_config
from dptrain.config import load_config
from dptrain.pages.html import plotly_js
from dptrain.pages.plots import read_metrics
from dptrain.pages.run_report import figures, main, render, try_write_run_report, write_run_report
from dptrain.pages.run_report_data import report_data
from dptrain.planner.from_config import plan_config

pytestmark = pytest.mark.timeout(90)

DOCS_SCREENSHOT = Path(__file__).parent.parent / "docs" / "images" / "report.png"
# 4 steps: step 2 is the first whose peak of live tensors is measured, TINY_GPT traces steps 3-4, and the run
# evaluates at its end
STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny GPT run on 2 ranks with plots (and so the report) on, shared by the tests that read it."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir = tmp / "chargpt"
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp)), "--run-dir", str(run_dir),
                   "--set", f"train.steps={STEPS}", "--set", "checkpoint.every=0", "--set", "log.plots=true", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    assert f"report: {run_dir / 'report.html'}" in proc.stdout
    assert re.search(r"^  report\.html +\d", proc.stdout, re.MULTILINE), proc.stdout  # in the summary's files
    return run_dir


@pytest.fixture(scope="module")
def planned(run_dir):
    """The planner's Row for the run's own config: 2 ranks, ddp, fp32."""
    return plan_config(load_config(run_dir / "config.toml"), [2], ["ddp"], ["fp32"])[0]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_report_data_is_the_runs_metrics_trace_summary_and_plan(run_dir, planned):
    summary = _summary(run_dir)
    data = report_data(run_dir, summary, load_config(run_dir / "config.toml"))
    assert [key for key, section in data.items() if "why" in section] == []

    train, evals = read_metrics(run_dir / "metrics.jsonl")
    series = data["series"]["data"]
    assert series["step"] == [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "compute_ms", "exposed_comm_ms"):
        assert series[key] == [r[key] for r in train], key
    assert series["rate_key"] == "tokens_per_s" and series["rate"] == [r["tokens_per_s"] for r in train]
    assert series["other_ms"] == [max(0.0, r["step_ms"] - r["compute_ms"] - r["exposed_comm_ms"]) for r in train]
    assert (series["eval_step"], series["val_loss"]) == ([STEPS], [evals[-1]["val_loss"]])

    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    timeline = data["timeline"]["data"]
    t0 = min(e["ts"] for e in spans)
    assert [(s["name"], s["start_ms"], s["dur_ms"]) for s in timeline["spans"]] == \
        [(e["name"], (e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in spans]
    assert timeline["rows"][0] == "rank 0: compute" and "rank 1: compute" in timeline["rows"]
    assert len(timeline["rows"]) == len({(e["pid"], e["tid"]) for e in spans}) > 2  # the buckets have rows

    memory = data["memory"]["data"]
    assert memory["bytes"] == {"parameters": planned.states.parameters, "gradients": planned.states.gradients,
                               "optimizer": planned.states.optimizer, "buffers": planned.states.buffers,
                               "activations": planned.activations.saved, "comm_buffers": planned.comm_buffers,
                               "total": planned.total()}
    assert memory["total_mb"] == planned.total() / 2**20
    assert [r["peak_tensor_mb"] for r in memory["ranks"]] == summary["peak_tensor_mb_per_rank"]
    assert [r["peak_rss_mb"] for r in memory["ranks"]] == summary["peak_rss_mb_per_rank"]
    assert [r["ratio"] for r in memory["ranks"]] == [m / memory["total_mb"] for m in summary["peak_tensor_mb_per_rank"]]
    assert ("steps", str(STEPS)) in data["summary"]["data"]
    parts = summary["step_breakdown"]  # the summary's step time: one record's, in parts that add up
    record = next(r for r in train if r["step"] == parts["step"])
    assert (parts["step_ms"], parts["compute_ms"], parts["exposed_comm_ms"]) == \
        (record["step_ms"], record["compute_ms"], record["exposed_comm_ms"])
    assert parts["step_ms"] == pytest.approx(parts["compute_ms"] + parts["rest_ms"]) and parts["rest_ms"] >= 0


def test_report_renders_offline_and_responds(run_dir, planned, tmp_path):
    summary = _summary(run_dir)
    with open_page(run_dir / "report.html") as (page, console):
        page.wait_for_selector("#fig-timeline .main-svg")
        for figure in ("fig-loss", "fig-throughput", "fig-memory", "fig-timeline"):
            assert page.locator(f"#{figure} .main-svg").count() > 0, figure
        shot = DOCS_SCREENSHOT if os.environ.get("DPTRAIN_UPDATE_SCREENSHOTS") == "1" else tmp_path / "report.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)

        # the summary table: the run's step count
        steps = page.locator("#summary-table tr", has=page.locator("th", has_text=re.compile("^steps$"))).locator("td")
        assert steps.inner_text() == str(summary["steps"]) == str(STEPS)

        # planned beside measured: rank 0's peak of live tensors, the plan's total, their ratio, the resident set
        cells = page.locator("#memory-ranks tr").nth(1).locator("td").all_inner_texts()
        measured, total = summary["peak_tensor_mb_per_rank"][0], planned.total() / 2**20
        assert cells == ["0", f"{measured:,.2f}", f"{total:,.2f}", f"{measured / total:.3f}",
                         f"{summary['peak_rss_mb_per_rank'][0]:,.2f}"]

        # the log-scale toggle: the loss axis changes type and the loss curve is drawn again on it
        axis_type = "document.getElementById('fig-loss').layout.yaxis.type"
        loss_line = page.locator("#fig-loss .scatterlayer .trace path.js-line").first
        linear_path = loss_line.get_attribute("d")
        assert page.evaluate(axis_type) == "linear"  # the tiny run's loss spans less than a decade
        page.click("#loss-log")
        page.wait_for_function(f"{axis_type} === 'log'")
        assert loss_line.get_attribute("d") != linear_path

        # hovering over a span of the timeline shows its name, start and duration
        page.locator("#fig-timeline .bars .point path").first.hover(force=True)  # under plotly's drag layer
        hover = page.locator("#fig-timeline .hoverlayer .hovertext")
        hover.wait_for()
        assert re.search(r"start [\d.]+ ms.*duration [\d.]+ ms", hover.text_content(), re.S), hover.text_content()
        assert console.problems() == []


def test_a_plan_that_cannot_trace_is_one_line_and_the_run_succeeds(tmp_path):
    """A forward whose control flow reads a value cannot be traced on fake tensors: the plan has no total."""
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "2", "--run-dir", str(run_dir), "--set", "task.name=classifier",
                   "--set", "task.model=_user_models:data_dependent", "--set", "ddp.find_unused_parameters=true",
                   "--set", "train.steps=2", "--set", "log.trace_steps=0", "--set", "log.progress=lines",
                   "--set", "log.plots=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "report.html not written" not in proc.stdout
    page = (run_dir / "report.html").read_text()
    memory = _section(page, "memory")
    why = re.findall(r'<p class="notice why">([^<\n]*)</p>', memory)
    assert len(why) == 1 and why[0].startswith("no planned total: activations") and "could not trace" in why[0]
    assert '<div class="figure" id="fig-loss">' in page  # the other sections are drawn


def test_a_broken_trace_is_one_line_in_its_place(run_dir, tmp_path, capsys):
    """``python -m dptrain.pages.run_report`` on a copy of the run whose trace.json was cut short."""
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("config.toml", "metrics.jsonl", "summary.json"):
        shutil.copy(run_dir / name, copy / name)
    (copy / "trace.json").write_text((run_dir / "trace.json").read_text()[:100])
    assert main([str(copy)]) == 0
    assert capsys.readouterr().out.strip() == str(copy / "report.html")
    page = (copy / "report.html").read_text()
    why = re.findall(r'<p class="notice why">([^<\n]*)</p>', _section(page, "timeline"))
    assert len(why) == 1 and why[0].startswith("no timeline: trace.json could not be read: JSONDecodeError: ")
    assert "notice why" not in _section(page, "memory") and '<div class="figure" id="fig-memory">' in page


def test_the_entry_point_names_its_usage_and_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m dptrain.pages.run_report RUN_DIR")
    assert main([str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run directory" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_is_one_warning(tmp_path):
    lines = []
    assert try_write_run_report(tmp_path / "gone", None, load_config(), lines.append) is None
    assert len(lines) == 1 and lines[0].startswith("warning: report.html not written: FileNotFoundError")


def _section(page: str, key: str) -> str:
    start = page.index(f'<section class="panel" id="{key}">')
    return page[start:page.index("</section>", start)]


def _long_run_data(steps: int) -> dict[str, dict]:
    """report_data's sections for a run logged every 10 steps up to ``steps``, with only the series drawn."""
    step = list(range(10, steps + 1, 10))
    ones = [1.0] * len(step)
    series = {"step": step, "loss": ones, "lr": ones, "eval_step": [], "val_loss": [], "rate_key": "samples_per_s",
              "rate": ones, "compute_ms": ones, "exposed_comm_ms": ones, "other_ms": ones}
    return {"summary": {"why": "no summary"}, "series": {"data": series}, "memory": {"why": "no plan"},
            "timeline": {"why": "no trace"}}


def test_step_axes_leave_the_ticks_to_plotly_over_many_steps(tmp_path):
    """A 60-step run logged every 10 steps: not a tick per step (18, 19, ... 62), but plotly's few."""
    data = _long_run_data(60)
    for key, fig in figures(data, log_loss=False).items():
        assert all("dtick" not in axis and "tickvals" not in axis
                   for name, axis in fig["layout"].items() if name.startswith("xaxis")), key
    few = figures(_long_run_data(10) | {"series": {"data": {**_long_run_data(60)["series"]["data"],
                                                             "step": [1, 4, 8]}}}, log_loss=False)
    assert few["fig-loss"]["layout"]["xaxis"]["dtick"] == 1  # over a few steps: whole steps only
    page = tmp_path / "report.html"
    page.write_text(render(data, ("long run", "60 steps")))
    with open_page(page) as (browser_page, console):
        browser_page.wait_for_selector("#fig-loss .main-svg")
        ticks = browser_page.locator("#fig-loss .x2tick text").all_inner_texts()  # the shared bottom axis
        assert 2 <= len(ticks) <= 12, ticks
        assert console.problems() == []


def _report_with(run_dir: Path, folder: Path, mode: str) -> Path:
    """A copy of the run in ``folder`` with its report written again under ``log.report_js = mode``."""
    copy = folder / "run"
    shutil.copytree(run_dir, copy)
    cfg = load_config(copy / "config.toml")
    cfg.log.report_js = mode
    return write_run_report(copy, _summary(copy), cfg)


def test_report_js_inline_cdn_and_shared(run_dir, tmp_path):
    inline = (run_dir / "report.html").stat().st_size
    assert inline > 3 * 2**20  # plotly.js inline: opens offline (test_report_renders_offline_and_responds)

    cdn = _report_with(run_dir, tmp_path / "cdn", "cdn")
    text = cdn.read_text()
    version = get_plotlyjs_version()
    assert f'<script src="https://cdn.plot.ly/plotly-{version}.min.js"' in text
    assert cdn.stat().st_size < 2**20 and not list((tmp_path / "cdn").glob("*.js"))

    shared = _report_with(run_dir, tmp_path / "shared", "shared")
    js = tmp_path / "shared" / f"plotly-{version}.min.js"
    assert js.read_text() == plotly_js() and shared.stat().st_size < 2**20
    assert f'<script src="../plotly-{version}.min.js"' in shared.read_text()
    js.write_text(js.read_text() + "\n// the copy written first")  # a second report keeps the folder's copy
    second = tmp_path / "shared" / "second"
    shutil.copytree(run_dir, second)
    cfg = load_config(second / "config.toml")
    cfg.log.report_js = "shared"
    write_run_report(second, _summary(second), cfg)
    assert js.read_text().endswith("// the copy written first")
    with open_page(shared) as (page, console):  # the relative copy loads from disk: the plots are drawn
        page.wait_for_selector("#fig-timeline .main-svg")
        assert page.locator("#fig-loss .main-svg").count() > 0
        assert console.problems() == []


def test_report_js_is_checked_with_a_did_you_mean(tmp_path):
    from dptrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"'log.report_js'.*must be one of inline, cdn, shared; got 'shard'.*shared"):
        load_config(None, ["log.report_js=shard"])


def test_report_plots_keep_the_toolbar_clear_of_their_legends(run_dir):
    with open_page(run_dir / "report.html", width=900) as (page, console):  # narrow: legends run long
        page.wait_for_selector("#fig-timeline .main-svg")
        assert plot_layout_problems(page, axis_titles=False) == []
        assert console.problems() == []


def _train_record(step: int, step_ms: float, compute_ms_per_rank: list[float], exposed_ms: float) -> dict:
    return {"kind": "train", "step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "skipped_steps": 0,
            "samples_per_s": 80.0, "tokens_per_s": 5120.0, "step_ms": step_ms, "compute_ms": max(compute_ms_per_rank),
            "exposed_comm_ms": exposed_ms, "tail_comm_ms": 0.0, "comm_busy_ms": 50.0, "overlap_pct": 40.0,
            "comm_bytes_per_step": 2**20, "peak_rss_mb": [400.0, 401.0], "peak_tensor_mb": [10.0, 10.0],
            "compute_ms_per_rank": compute_ms_per_rank}


def test_the_summary_step_time_adds_up_from_one_record_and_names_its_parts(tmp_path):
    from dptrain.runner.report import summarize, summary_rows

    # the medians are issue 46's "394.8 ms: compute 383.2 ms, exposed comm 32.8 ms", from three different records
    train = [_train_record(10, 900.0, [800.0, 790.0], 90.0), _train_record(20, 390.0, [383.2, 350.0], 40.0),
             _train_record(30, 394.8, [370.0, 360.0], 32.8), _train_record(40, 400.0, [390.0, 365.0], 20.0)]
    info = dict(run_dir=str(tmp_path), task="chargpt", parameters=1000, world_size=2, device="cpu", backend="gloo",
                global_batch_size=8, micro_batch_size=4, grad_accum_steps=1, lr_rule="2e-3", start_step=0, steps=40,
                wall_s=20.0)
    summary = summarize(tmp_path, info, train, [])
    assert (summary["median_step_ms"], summary["median_compute_ms"], summary["median_exposed_comm_ms"]) == \
        (394.8, 383.2, 32.8)  # kept in summary.json, but they do not add up
    rows = dict(summary_rows(summary))
    parts = re.match(r"([\d.]+) ms = compute ([\d.]+) ms \+ rest ([\d.]+) ms \(step 30, the median of 3 logged",
                     rows["step time"])
    assert parts, rows["step time"]
    step, compute, rest = map(float, parts.groups())
    assert (step, compute, rest) == (394.8, 370.0, 24.8) and step == pytest.approx(compute + rest)
    assert "the slowest rank's forward, backward and optimizer (rank 0)" in rows["step time"]
    assert rows["exposed comm"].startswith("32.8 ms at step 30: the longest wait for communication on any rank")
