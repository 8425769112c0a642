"""What a run says about its strategy (issue 55): bytes per step over the whole run, not the last record's share; the
strategy named in the log, summary.json and report.html; H, the meetings taken and the bytes against DDP's for a
strategy that meets every few steps; the meetings, live failures and heals marked on the charts; and a live run
traced and measured like any other."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.config import load_config
from dptrain.pages.plots import step_marks
from dptrain.pages.run_report_data import no_trace_why, report_data
from dptrain.runner.metrics import format_line, run_comm_per_step, run_sync_steps
from dptrain.runner.report import summarize, summary_rows

pytestmark = pytest.mark.timeout(120)

STEPS, EVERY = 12, 4
# strategy: (its period H, its settings, the steps its meetings fall on in a 12-step run logged every 4, its noun);
# in both, the last round is incomplete (2 steps), and the last record's share differs from the run's
STRATEGIES = {
    "diloco": (5, ["diloco.period=5"], [5, 10], "outer step"),
    # local SGD averages right after its first local step, then every period (torch's averager)
    "localsgd": (3, ["localsgd.period=3", "localsgd.warmup_steps=0"], [1, 4, 7, 10], "averaging round"),
}


def _records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_strategy_that_meets_every_few_steps_reports_the_bytes_it_sent_over_the_run(tmp_path, strategy):
    """2 ranks of the classifier, 12 steps, a record every 4 steps: each record holds a meeting's bytes over its 4
    steps (or none); the summary is every meeting's bytes over the 12 steps (it used to copy the last record's 1/4
    of a meeting's bytes per step), and it names the strategy, H, the meetings and the ratio to DDP's."""
    period, settings, at, noun = STRATEGIES[strategy]
    run_dir = tmp_path / "run"
    sets = [f"distributed.strategy={strategy}", *settings, "task.name=classifier", f"train.steps={STEPS}",
            f"log.every={EVERY}", "log.progress=lines", "log.plots=false", "log.trace_steps=0", "checkpoint.every=0"]
    proc = dptrain("run", "--nproc", "2", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, records = json.loads((run_dir / "summary.json").read_text()), _records(run_dir)

    # what a meeting sends: the fp32 model once, which is what DDP all-reduces every step
    gradient_bytes = 4 * summary["parameters"]
    assert summary["comm_bytes_per_step"] == pytest.approx(len(at) * gradient_bytes / STEPS)
    assert summary["comm_bytes_per_step"] != records[-1]["comm_bytes_per_step"]  # what the summary used to copy
    assert {r["gradient_bytes"] for r in records} == {gradient_bytes}
    assert [r["step"] for r in records] == [4, 8, 12]
    assert sum(EVERY * r["comm_bytes_per_step"] for r in records) == pytest.approx(len(at) * gradient_bytes)
    assert run_sync_steps(records) == at

    rows = dict(map(tuple, summary["strategy_rows"]))
    assert rows["period"] == f"H = {period} steps from one {noun} to the next"
    assert rows[f"{noun}s"] == (f"{len(at)} in steps 1-{STEPS} (at steps {', '.join(map(str, at))}); then 1 more at "
                                "the end, closing the last round's 2 step(s) (its bytes are not in the bytes per step: "
                                "it follows the last record)")
    ratio = len(at) / STEPS
    assert f"{ratio:.3g}x DDP's, {1 / ratio:.1f}x fewer" in rows["bytes vs DDP"]
    assert f"{summary['parameters']:,} parameters x 4 bytes" in rows["bytes vs DDP"]

    console = proc.stdout
    assert re.search(rf"^  strategy +{strategy}: ", console, re.MULTILINE), console
    assert re.search(rf"^  {noun}s +{len(at)} in steps", console, re.MULTILINE)
    assert re.search(rf"^  period +H = {period} steps", console, re.MULTILINE)
    assert f"strategy {strategy}: " in console.split("\nstep ")[0]  # under the run's header, before the first line
    # every line says which steps its bytes per step are the mean of, and which meetings fell in them
    lines = [line for line in console.splitlines() if line.startswith("step ")]
    assert [re.search(r"MiB/step, mean of steps (\d+-\d+)", line)[1] for line in lines] == ["1-4", "5-8", "9-12"]
    met = next(s for s in at if 5 <= s <= 8)
    assert f"| {noun} {at.index(met) + 1} at step {met} (every {period} steps) |" in lines[1]


def test_summary_bytes_per_step_weigh_each_record_by_its_steps(tmp_path):
    """DDP's constant bytes stay as they were; a meeting every 50 steps, recorded every 10, is its bytes over all the
    steps (the issue's run: 6 outer steps of 7.02 MiB in 300 steps, 0.14 MiB/step, not the last record's 0.70)."""
    outer = 7.02 * 2**20
    diloco = [_record(step, outer / 10 if step % 50 == 0 else 0.0, sync=(step // 50, step % 50)) for step in
              range(10, 301, 10)]
    summary = summarize(tmp_path, _facts(tmp_path, "diloco", 300), diloco, [])
    assert summary["comm_bytes_per_step"] == pytest.approx(6 * outer / 300)
    ddp = [_record(step, 2**20) for step in range(10, 61, 10)]
    assert summarize(tmp_path, _facts(tmp_path, "ddp", 60), ddp, [])["comm_bytes_per_step"] == 2**20
    assert run_comm_per_step(ddp) == {"steps": 60, "comm_bytes_per_step": 2**20, "comm_compressed_bytes_per_step": 0,
                                      "comm_sent_bytes_per_step": 2**20}
    rows = dict(summary_rows(summary))
    assert rows["strategy"].startswith("diloco: DiLoCo")
    assert rows["communication"].startswith("0.14 MiB/step per rank over the run's 300 steps")
    assert rows["outer steps"] == "6 in steps 1-300 (at steps 50, 100, 150, 200, 250, 300)"
    assert rows["bytes vs DDP"].startswith("0.140 MiB/step sent per rank over the run's 300 steps, against DDP's "
                                           "7.020 MiB/step: 0.02x DDP's, 50.0x fewer")


def test_a_progress_line_says_its_bytes_are_the_mean_of_its_steps_and_names_the_meetings():
    met = _record(50, 0.7 * 2**20, sync=(1, 0))
    line = format_line(met, 300, previous_step=40)
    assert "0.70 MiB/step, mean of steps 41-50 (0.70 MiB sent) | outer step 1 at step 50 (every 50 steps) |" in line
    quiet = format_line(_record(60, 0.0, sync=(1, 10)), 300, previous_step=50)
    assert "0.00 MiB/step, mean of steps 51-60 | no outer step since step 50 (every 50 steps)" in quiet
    many = format_line(_record(20, 2**20, sync=(20, 0)) | {"sync_period": 1}, 300, previous_step=10)
    assert "| outer steps 11-20 at steps 11, ..., 20 (every step) |" in many
    assert "mean of steps" not in format_line(_record(60, 2**20), 300, previous_step=50)  # DDP: the same each step


def test_live_failures_and_heals_are_marked_where_they_happened(tmp_path):
    """A round aborted at step 12 (the first of the failure's rounds is marked), and the victim healed before the
    step's next attempt; outer steps from the records."""
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = {0: [{"round": 10, "step": 11, "members": [0, 1], "commit": True},
                 {"round": 11, "step": 12, "members": [0, 1], "commit": False, "error": "RuntimeError: peer gone"},
                 {"round": 12, "step": 12, "members": [0, 1], "commit": False},
                 {"round": 13, "step": 12, "members": [0, 1], "commit": True, "heal_sent": 100}],
             1: [{"round": 13, "step": 12, "members": [0, 1], "commit": True, "heal_received": 3 * 2**20,
                  "heal_s": 0.25}]}
    for replica, records in lines.items():
        (logs / f"live{replica}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    marks = step_marks(tmp_path, [_record(50, 0.0, sync=(1, 0))])
    assert marks["failure"]["steps"] == [12] and "round 11 aborted at step 12" in marks["failure"]["text"][0]
    assert marks["heal"]["steps"] == [12] and marks["heal"]["text"] == [
        "replica 1 healed before step 12: 3.0 MiB in 0.25 s"]
    assert marks["sync"] == {"name": "outer steps", "steps": [50], "text": ["outer step at step 50"], "count": 1}


def test_a_missing_trace_says_why_from_the_config(tmp_path):
    cfg = load_config(tiny_gpt_config(tmp_path))  # traces steps 3-4 of 20
    assert no_trace_why(cfg, {"start_step": 0}) == "no timeline: steps 3-4 were to be traced; the run wrote no " \
                                                   "trace.json"
    assert "ended at step 20, before its first traced step 21" in no_trace_why(cfg, {"start_step": 18})
    cfg.log.trace_steps = 0
    assert no_trace_why(cfg, None) == "no timeline: the run traced no step (log.trace_steps = 0)"


def test_a_live_run_is_traced_and_measured_and_says_whose_memory(tmp_path):
    """Live recovery's replica 0 traces its steps (3-4) and measures its tensors as the SPMD loop does; the summary
    says the memory is replica 0's, with every replica's resident peak from its live log."""
    run_dir = tmp_path / "run"
    config = tiny_gpt_config(tmp_path, "\n[live]\nenabled = true\nheartbeat_timeout_s = 1.0\n")
    proc = dptrain("run", "--nproc", "2", "--config", str(config), "--run-dir", str(run_dir), "--set", "train.steps=4",
                   "--set", "train.global_batch_size=4", "--set", "log.eval_every=0", "--set", "log.plots=true",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert {"step 3", "step 4", "forward", "backward", "optimizer"} <= {e["name"] for e in events}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_tensor_mb_per_rank"][0] is not None  # measured, as in the SPMD loop
    assert len(summary["live"]["peak_rss_mb_by_replica"]) == 2 and None not in summary["live"]["peak_rss_mb_by_replica"]
    memory = dict(summary_rows(summary))["peak memory"]
    assert "replica 0 of 2" in memory and "ranks 0-0" not in memory
    data = report_data(run_dir, summary, load_config(run_dir / "config.toml"))
    assert "data" in data["timeline"] and "not measured" not in (run_dir / "report.html").read_text()
    assert "Measured on replica 0 of 2 only" in data["memory"]["data"]["note"]


def _record(step: int, bytes_per_step: float, sync: tuple[int, int] | None = None) -> dict:
    """A train record logged every 10 steps; ``sync``: (meetings so far, steps since the last) of DiLoCo at H 50."""
    record = {"kind": "train", "step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "skipped_steps": 0,
              "samples_per_s": 80.0, "tokens_per_s": 80.0, "step_ms": 100.0, "compute_ms": 90.0,
              "exposed_comm_ms": 0.0, "tail_comm_ms": 0.0, "comm_busy_ms": 0.0, "overlap_pct": 0.0,
              "comm_bytes_per_step": bytes_per_step, "comm_compressed_bytes_per_step": 0.0,
              "comm_sent_bytes_per_step": bytes_per_step, "peak_rss_mb": [400.0, 400.0],
              "peak_tensor_mb": [10.0, 10.0], "compute_ms_per_rank": [90.0, 90.0]}
    if sync is not None:
        record.update(sync_name="outer step", sync_period=50, syncs=sync[0], steps_since_sync=sync[1],
                      gradient_bytes=7.02 * 2**20, gradient_sent_bytes=7.02 * 2**20)
    return record


def _facts(run_dir: Path, strategy: str, steps: int) -> dict:
    return dict(run_dir=str(run_dir), task="chargpt", parameters=1_840_250, world_size=2, device="cpu",
                backend="gloo", global_batch_size=32, micro_batch_size=16, grad_accum_steps=1, lr_rule="2e-3",
                start_step=0, steps=steps, wall_s=20.0, strategy=strategy)
