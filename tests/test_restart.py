"""``dptrain run --max-restarts``: restarts that run out, bad input, and a run directory that cannot hold the run.

That a restarted run ends with the uninterrupted run's parameters, bit for bit, is
``tests/test_cli_run.py::test_resume_after_a_kill_continues_exactly_by_hand_and_under_max_restarts``."""

from __future__ import annotations

import pytest

from _cli import dptrain, tiny_gpt_config

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, name: str, *args: str, env: dict | None = None, nproc: int = 2):
    config = tiny_gpt_config(tmp_path)
    return dptrain("run", "--nproc", str(nproc), "--config", str(config), "--run-dir", str(tmp_path / name), *args,
                   env=env, cwd=tmp_path, timeout=240)


@pytest.mark.slow
def test_restarts_run_out_and_the_job_fails(tmp_path):
    """A fault that fires on every attempt (raise, not once: the restart count is faked away) exhausts them. One
    worker: each attempt under torchrun's agent is an interpreter start per worker, and one shows the same."""
    done = _run(tmp_path, "doomed", "--max-restarts", "1", "--set", "train.steps=4", nproc=1,
                env={"DPTRAIN_FAULT": "0:2:raise", "DPTRAIN_FAULT_EVERY_ATTEMPT": "1"})
    assert done.returncode != 0
    assert done.stderr.count("fault injected by DPTRAIN_FAULT on rank 0 at step 2") >= 2  # first try and restart


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--nproc", "2", "--fault", "2:3:kill"], "--fault '2:3:kill': rank 2 does not exist with --nproc 2"),
    (["--fault", "0:3:explode"], "--fault '0:3:explode': expected RANK:STEP:KIND with KIND one of kill,"),
])
def test_bad_restart_input_is_refused(tmp_path, args, message):
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), "--set", "task.name=classifier", *args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("run_dir, extra, message", [
    ("afile/run", [], "afile is a file, not a directory. Choose another --run-dir"),
    ("/proc/dptrain_run", [], "the run directory /proc/dptrain_run is not writable (/proc:"),
    ("big", ["--set", "gpt.n_layer=200", "--set", "gpt.n_embd=8192", "--set", "gpt.n_head=64"],
     "kept checkpoints of 161,085,210,624 parameters with their optimizer state need about 6,144,913 MiB"),
])
def test_an_unusable_run_directory_is_refused_before_training(tmp_path, run_dir, extra, message):
    """Not a directory, not writable (even for root: /proc), or too small for the checkpoints: exit 2 at once."""
    (tmp_path / "afile").write_text("")
    args = [] if extra else ["--set", "task.name=classifier"]
    done = dptrain("run", "--run-dir", str(tmp_path / run_dir) if not run_dir.startswith("/") else run_dir,
                   *args, *extra, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written
