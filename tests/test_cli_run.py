"""``dptrain run`` end to end: the real CLI, 2 worker processes, a tiny GPT."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from _cli import dptrain, tiny_gpt_config
from dptrain.checkpoint.files import load_checkpoint
from dptrain.config import load_config
from dptrain.planner.from_config import plan_config


def train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["kind"] == "train"]


@pytest.mark.slow
def test_two_workers_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir),
                   "--set", "log.plots=true", cwd=tmp_path, fresh=True)  # python -m dptrain.cli, forked workers
    assert proc.returncode == 0, proc.stderr
    assert "run summary" in proc.stdout and "files written" in proc.stdout and "2 x cpu (gloo)" in proc.stdout

    # config: the resolved config, readable back
    cfg = load_config(run_dir / "config.toml")
    assert cfg.gpt.n_embd == 32 and cfg.run_dir == str(run_dir)

    # metrics: one record per step, the fields users look for, loss going down
    train = train_records(run_dir)
    assert [r["step"] for r in train] == list(range(1, 21))
    for r in train:
        assert math.isfinite(r["loss"]) and r["comm_bytes_per_step"] > 0 and len(r["peak_rss_mb"]) == 2
        assert r["tokens_per_s"] == pytest.approx(16 * r["samples_per_s"]) and 0 <= r["overlap_pct"] <= 100
        assert r["compute_ms"] > 0 and r["exposed_comm_ms"] >= 0
    assert train[0]["loss"] == pytest.approx(math.log(256), rel=0.05)
    assert sum(r["loss"] for r in train[-5:]) / 5 < train[0]["loss"] - 0.5
    assert train[0]["lr"] < train[3]["lr"] and train[-1]["lr"] < train[3]["lr"]  # warmup, then decay
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20] and all(math.isfinite(e["val_loss"]) for e in evals)

    # trace: loads, both ranks, compute spans and per-bucket communication spans
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "wait for gradients", "step 3", "step 4"} <= names
        comm = [e for e in spans if e["pid"] == rank and e["name"].startswith("all-reduce bucket")]
        assert len({e["tid"] for e in comm}) > 1 and all(e["cat"] == "comm" and e["dur"] >= 0 for e in comm)
        backward = next(e for e in spans if e["pid"] == rank and e["name"] == "backward")
        assert any(e["ts"] < backward["ts"] + backward["dur"] for e in comm)  # launched during backward
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "compute" in threads and any(name.startswith("bucket 0 (") for name in threads)

    # checkpoints and exported weights
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]
    state = load_checkpoint(run_dir / "checkpoints" / "step_00000020", torch.device("cpu"))
    exported = load_file(run_dir / "model.safetensors")
    assert state["trainer"]["step"] == 20 and len(state["trainer"]["rng"]) == 2
    for name, tensor in exported.items():
        assert torch.equal(tensor, state["model"][name])

    # summary: every file written, the plots among them
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("config.toml", "metrics.jsonl", "trace.json", "loss.png", "throughput.png", "model.safetensors",
                 "logs/rank0.log", "logs/rank1.log", "checkpoints/step_00000020/"):
        assert name in summary["files"], name
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 8 and summary["steps"] == 20
    # uncompressed, 2 ranks: a ring all-reduce of the fp32 gradients sends each rank's 4 bytes per parameter once
    assert all(r["comm_sent_bytes_per_step"] == 4 * summary["parameters"] for r in train)

    # memory, two ways: the resident set (libraries included) and the live tensors of step 2, which is what
    # `dptrain plan` predicts (measured 0.97x its total for this model)
    planned = plan_config(cfg, [2], ["ddp"], ["fp32"])[0].total() / 2**20
    assert train[0]["peak_tensor_mb"] == [None, None]
    for r in train[1:]:
        assert all(0.8 * planned < m < 1.1 * planned and m + 100 < rss
                   for m, rss in zip(r["peak_tensor_mb"], r["peak_rss_mb"], strict=True)), (r, planned)
    assert summary["peak_tensor_mb_per_rank"] == train[-1]["peak_tensor_mb"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_resume_after_a_kill_continues_exactly_by_hand_and_under_max_restarts(tmp_path):
    """8 steps, a checkpoint every 4; rank 1 is SIGKILLed at the start of step 6, after the step-4 checkpoint and
    one step beyond it (logged, then replayed)."""
    config = str(tiny_gpt_config(tmp_path))
    short = ["--set", "train.steps=8", "--set", "checkpoint.every=4"]
    straight = dptrain("run", "--nproc", "2", "--config", config, *short, "--run-dir", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr

    killed = dptrain("run", "--nproc", "2", "--config", config, *short, "--run-dir", str(tmp_path / "b"), cwd=tmp_path,
                     env={"DPTRAIN_FAULT": "1:6:kill"})
    assert killed.returncode == 1
    assert "rank 1" in killed.stderr and "SIGKILL" in killed.stderr
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step_00000004"]
    assert max(r["step"] for r in train_records(tmp_path / "b")) == 5

    resumed = dptrain("run", "--nproc", "2", "--config", config, *short, "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_00000004 at step 4" in resumed.stdout

    # The same kill under --max-restarts: torchrun's agent restarts both ranks, which resume by themselves.
    restarted = dptrain("run", "--nproc", "2", "--config", config, *short, "--run-dir", str(tmp_path / "c"),
                        "--max-restarts", "2", cwd=tmp_path, env={"DPTRAIN_FAULT": "1:6:kill"})
    assert restarted.returncode == 0, restarted.stderr
    assert "step_00000004 at step 4" in restarted.stdout
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["start_step"] == 4

    a = load_file(tmp_path / "a" / "model.safetensors")
    losses_a = [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(tmp_path / "a")]
    for other in ("b", "c"):
        b = load_file(tmp_path / other / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), other
        losses_b = [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(tmp_path / other)]
        assert losses_a == losses_b, other  # step 5 was logged twice; the replay replaced it


@pytest.mark.slow
def test_a_failing_rank_is_reported_first_and_the_job_stops(tmp_path):
    """With workers started as torchrun starts them: a fresh `python -m dptrain.run` each."""
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir",
                   str(tmp_path / "run"), "--start-method", "exec", cwd=tmp_path, env={"DPTRAIN_FAULT": "1:3:raise"})
    assert proc.returncode == 1
    first = proc.stderr.index("rank 1 failed first")
    assert proc.stderr.index("RuntimeError: fault injected by DPTRAIN_FAULT on rank 1 at step 3") > first
    assert "Traceback" in proc.stderr[first:]


def _workers_running_in(directory) -> list[int]:
    """Pids of forked dptrain workers (named dptrain-rank<r>) whose working directory is ``directory``."""
    import os
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "comm").read_text().startswith("dptrain-rank") and os.readlink(proc / "cwd") == str(directory):
                if "State:\tZ" not in (proc / "status").read_text():  # a zombie has ended
                    pids.append(int(proc.name))
        except (OSError, ValueError):  # not a process, or it ended while we looked
            pass
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_no_worker_trains_on_after_its_launcher_ends(tmp_path, sig):
    """SIGTERM: the launcher stops its workers before it exits 143. SIGKILL: it cannot, but its fork server ends
    with it, and each forked worker is armed to get SIGTERM when that happens (launch/workers.py); the server's
    own exit (an interpreter with torch loaded, tearing down) takes a moment, longer on a loaded machine."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from _cli import TESTS

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    stderr = tmp_path / "stderr"  # a file, not a pipe: rank 0 writes there too, so a pipe stays open while it lives
    with open(stderr, "w") as err_file:
        launcher = subprocess.Popen([sys.executable, "-m", "dptrain.cli", "run", "--nproc", "2", "--config",
                                     str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir), "--set",
                                     "train.steps=100000", "--set", "checkpoint.every=0", "--set", "log.eval_every=0"],
                                    cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size > 0):  # training: rank 0 logs every step
        assert launcher.poll() is None and time.monotonic() < deadline, stderr.read_text()
        time.sleep(0.2)
    assert len(_workers_running_in(tmp_path)) == 2  # what the checks below look for is there to find
    launcher.send_signal(getattr(signal, sig))
    code = launcher.wait(timeout=30)
    err = stderr.read_text()
    assert code == (143 if sig == "SIGTERM" else -signal.SIGKILL), err
    if sig == "SIGTERM":
        assert "terminated (SIGTERM): workers stopped" in err, err
        assert _workers_running_in(tmp_path) == []  # stopped before the launcher exited
    else:
        deadline = time.monotonic() + 60
        while _workers_running_in(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _workers_running_in(tmp_path) == [], "workers still running a minute after their launcher died"


def test_own_model_accumulation_and_bf16(tmp_path):
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "2", "--run-dir", str(run_dir), "--set", "task.name=classifier",
                   "--set", "task.model=_user_models:wide_mlp", "--set", "task.model_args={ width = 24 }",
                   "--set", "train.steps=12", "--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=4",
                   "--set", "train.precision=bf16", "--set", "log.progress=lines", "--set", "log.plots=false",
                   "--set", "train.lr_scaling=linear", "--set", "train.base_batch_size=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["grad_accum_steps"] == 4 and summary["micro_batch_size"] == 4
    assert summary["parameters"] == 16 * 24 + 24 + 24 * 8 + 8
    assert summary["peak_lr"] == pytest.approx(2 * 2e-3)  # linear rule: x 32/16
    assert "peak 0.004 = 0.002 x linear scaling" in proc.stdout
    assert "loss.png" not in summary["files"]


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    import subprocess
    import sys

    from _cli import TESTS

    run_dir = tmp_path / "run"
    config = tiny_gpt_config(tmp_path, extra="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dptrain.run", "--config", str(config), "--run-dir", str(run_dir),
                           "--set", "train.steps=4", "--set", "checkpoint.every=0"],
                          cwd=tmp_path, text=True, capture_output=True, timeout=150,
                          env={**__import__("os").environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()


def test_training_with_dptrains_ring_matches_the_native_all_reduce(tmp_path):
    losses = {}
    for algorithm in ("native", "ring"):
        run_dir = tmp_path / algorithm
        proc = dptrain("run", "--nproc", "2", "--run-dir", str(run_dir), "--set", "task.name=classifier",
                       "--set", "train.steps=8", "--set", f"ddp.algorithm={algorithm!r}".replace("'", '"'),
                       "--set", "log.progress=lines", "--set", "log.plots=false", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        losses[algorithm] = [r["loss"] for r in train_records(run_dir)]
    # Two ranks: a + b is the same sum in either algorithm, so training is bit-identical.
    assert losses["ring"] == losses["native"]


def test_training_with_int8_compression_reports_its_bytes(tmp_path):
    run_dir = tmp_path / "int8"
    proc = dptrain("run", "--nproc", "2", "--run-dir", str(run_dir), "--set", "task.name=classifier",
                   "--set", "train.steps=6", "--set", "log.every=2", "--set", 'compression.method="int8"',
                   "--set", "log.progress=lines", "--set", "log.plots=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = train_records(run_dir)
    raw, payload = records[-1]["comm_bytes_per_step"], records[-1]["comm_compressed_bytes_per_step"]
    assert 3.5 < raw / payload <= 4  # one byte per element plus a scale per 1024
    assert records[-1]["comm_sent_bytes_per_step"] > 0
    assert records[-1]["loss"] < records[0]["loss"]  # it still trains
    assert "MiB compressed" in proc.stdout


def _straight_and_resumed(tmp_path, settings: list[str], after_first=None):
    """6 steps straight (run a), and 3 steps resumed to 6 (run b): both runs' (step, loss, grad norm) records."""
    common = ["--nproc", "2", "--set", "task.name=classifier", "--set", "checkpoint.every=3", "--set", "log.every=1",
              "--set", "log.progress=lines", "--set", "log.plots=false", *settings]
    straight = dptrain("run", *common, "--set", "train.steps=6", "--run-dir", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    first = dptrain("run", *common, "--set", "train.steps=3", "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    if after_first is not None:
        after_first(tmp_path / "b")
    resumed = dptrain("run", *common, "--set", "train.steps=6", "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "residuals start from zero" not in resumed.stdout
    return [train_records(tmp_path / run) for run in ("a", "b")]


def _steps(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_zero2_with_int8_compression_reduces_shards_compressed_and_resumes_exactly(tmp_path):
    a, b = _straight_and_resumed(tmp_path, ["--set", "distributed.strategy=zero2", "--set", "compression.method=int8"])
    params = 16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8  # the default classifier
    payload = a[-1]["comm_compressed_bytes_per_step"]
    assert params <= payload < 1.1 * params  # one byte per element, plus the scales
    assert 0 < a[-1]["comm_sent_bytes_per_step"] < payload  # each rank sends the shard it does not own
    assert _steps(a) == _steps(b)  # the error-feedback residuals of every unit carried over


def test_resume_with_compression_restores_the_residuals_and_continues_exactly(tmp_path):
    def saved_per_rank(run_dir):
        assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000003" / "compression").iterdir()) \
            == ["rank0.pt", "rank1.pt"]

    a, b = _straight_and_resumed(tmp_path, ["--set", "compression.method=topk", "--set", "compression.topk_fraction=0.05"],
                                 saved_per_rank)
    assert _steps(a) == _steps(b)  # the residuals carried over: top-k sends the same elements after the resume
