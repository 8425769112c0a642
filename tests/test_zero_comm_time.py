"""ZeRO's communication is measured as the DDP engine's is: busy time, and the part computation did not hide."""

from __future__ import annotations

import json

import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.zero.timing import ShardedStepComm


def test_exposed_is_the_union_of_waits_cut_to_their_collectives():
    stats = ShardedStepComm()
    gather, reduce = [0, 1.0, 3.0], [0, 2.0, 6.0]
    stats.bucket_spans += [gather, reduce]
    stats.collectives += ["all-gather", "reduce-scatter"]
    # waited 0.5-3.5 for the gather (only 1-3 was it running), 2.5-4 and 3.5-5 for the reduction (overlapping)
    stats.waits += [(gather, 0.5, 3.5), (reduce, 2.5, 4.0), (reduce, 3.5, 5.0)]
    assert stats.comm_busy_s == pytest.approx(5.0)     # 1 .. 6
    assert stats.exposed_comm_s == pytest.approx(4.0)  # 1 .. 5
    assert stats.overlap == pytest.approx(0.2)
    assert stats.span_name(1) == "reduce-scatter unit 0"


def test_no_waits_is_fully_hidden_and_no_collectives_is_no_overlap():
    stats = ShardedStepComm()
    assert (stats.comm_busy_s, stats.exposed_comm_s, stats.overlap) == (0.0, 0.0, 0.0)
    stats.bucket_spans.append([3, 1.0, 2.0])
    assert (stats.exposed_comm_s, stats.overlap) == (0.0, 1.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_a_zero_run_reports_its_collectives_busy_and_exposed(tmp_path, strategy):
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir),
                   "--set", f"distributed.strategy={strategy}", "--set", "train.steps=6", "--set", "checkpoint.every=0",
                   "--set", "log.eval_every=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    busy, exposed = summary["median_comm_busy_ms"], summary["median_exposed_comm_ms"]
    assert busy > 0 and exposed >= 0  # their arithmetic on given spans: the tests above
    assert f"busy {busy:.1f} ms" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    # Every step reports both. No order between them is asserted: they are clocks read on two threads (the wait on
    # the training thread, the collective's span on gloo's), and on a busy machine a collective can finish before it
    # is waited for (0 exposed) or the waiting thread wake up after it finished (exposed past the span).
    assert all(r["exposed_comm_ms"] >= 0 and r["comm_busy_ms"] > 0 for r in train)
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"all-gather unit 0", "reduce-scatter unit 0"} <= names
    assert any(n.startswith("wait for ") for n in names)
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "unit 0" in tracks
