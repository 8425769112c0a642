"""Every hang ends: a stopped rank (SIGSTOP) of every strategy, a stuck main thread, a hung launched script.

The whole-job tests start a real `dptrain run` (in this process, its ranks forked; a thread of the test
stops one rank once it beats) or `dptrain launch` (a fresh process), and check that the job ends on its
own with exit 1, naming that rank. None asserts a time: each is bounded by its pytest-timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dptrain.launch.errors import error_file, read_error_record
from dptrain.launch.heartbeat import Heartbeat, heartbeat_file, process_state, read_heartbeats, stale_ranks
from dptrain.runner.skips import NonFiniteRun, SkipBound

TINY = """
[task]
name = "chargpt"
[gpt]
n_layer = 1
n_head = 2
n_embd = 16
block_size = 16
corpus_bytes = 50000
[train]
steps = 1000000
global_batch_size = 8
[distributed]
timeout_s = 3
roll_call_s = 1.0
[log]
every = 1000
eval_every = 0
plots = false
[checkpoint]
every = 0
"""


def test_stale_ranks_are_those_whose_heartbeat_is_older_than_the_timeout():
    beats = {0: {"time": 100.0}, 1: {"time": 80.0}, 2: {"time": 96.0}}
    assert stale_ranks(beats, timeout_s=10, now=100.0) == [1]
    assert stale_ranks(beats, timeout_s=1, now=100.0) == [1]  # never below STALE_MIN_S (5 s): rank 2 is fine
    assert stale_ranks(beats, timeout_s=10, now=100.0, exclude={1}) == []


@pytest.mark.parametrize("content", ["", '{"rank": 0, "traceb', "[1, 2]", '{"rank": 0}'])
def test_an_empty_or_truncated_error_record_is_none_not_a_crash(tmp_path, content):
    error_file(tmp_path, 0).parent.mkdir(parents=True)
    error_file(tmp_path, 0).write_text(content)
    assert read_error_record(tmp_path, 0) is None


def test_the_heartbeat_file_is_written_and_read_back(tmp_path):
    with Heartbeat(tmp_path, 1, 2, timeout_s=60) as beat:
        beat.mark(7, "eval")
        time.sleep(1.5)
        beats = read_heartbeats(tmp_path, 2)
    assert list(beats) == [1] and beats[1]["step"] == 7 and beats[1]["phase"] == "eval"
    assert beats[1]["pid"] == os.getpid()


@pytest.mark.timeout(60)
def test_a_stuck_main_thread_ends_its_rank_with_a_record_naming_the_stale_rank(tmp_path):
    heartbeat_file(tmp_path, 1).parent.mkdir(parents=True)
    heartbeat_file(tmp_path, 1).write_text(json.dumps({"rank": 1, "time": time.time() - 100, "step": 3}))
    code = textwrap.dedent(f"""
        import time
        from dptrain.launch.heartbeat import Heartbeat
        with Heartbeat({str(tmp_path)!r}, 0, 2, timeout_s=0.5, margin_s=0.5) as beat:
            beat.mark(4)
            time.sleep(120)  # stuck: the watchdog ends the process
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 1, done.stderr
    record = read_error_record(tmp_path, 0)
    assert record["silent_ranks"] == [1]
    assert "made no progress" in record["summary"] and "rank(s) [1] sent no heartbeat" in record["summary"]


def test_a_streak_of_skipped_steps_ends_the_run():
    bound = SkipBound(limit=3, skipped=0)
    for step, skipped in enumerate([0, 1, 1, 1], start=1):  # a good step, a skip, good steps: it goes on
        bound.check(step, skipped)
    bound.check(5, 2)
    bound.check(6, 3)
    with pytest.raises(NonFiniteRun, match="steps 5-7: 3 steps in a row"):
        bound.check(7, 4)


def test_a_short_run_that_ends_on_skipped_steps_fails_too():
    bound = SkipBound(limit=20, skipped=0)
    bound.check(1, 0)
    for step in range(2, 11):
        bound.check(step, step - 1)
    with pytest.raises(NonFiniteRun):
        bound.check_end(10)
    fine = SkipBound(limit=20, skipped=0)
    fine.check(1, 1)
    fine.check(2, 1)
    fine.check_end(2)  # one skip in the middle of a run: it goes on


# --------------------------------------------------------------------------- whole jobs


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    (tmp_path / "tiny.toml").write_text(TINY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "dptrain.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _once_beating(run_dir: Path, ranks: list[int], ended: threading.Event, act, pids: list[int]) -> None:
    """``act(pids)`` once every rank in ``ranks`` has marked step 2 (their pids read from their heartbeats)."""
    while not ended.wait(0.3):
        beats = read_heartbeats(run_dir, max(ranks) + 1)
        if all(beats.get(r, {}).get("step", 0) >= 2 for r in ranks):
            pids += [beats[r]["pid"] for r in ranks]
            act(pids)
            return


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


def run_acting_once_beating(tmp_path: Path, ranks: list[int], act, *overrides: str):
    """``dptrain run`` of TINY in this process (its ranks forked) while a thread of the test calls ``act(pids)`` once
    ``ranks`` train; the finished command. A rank ``act`` stopped and the job left is killed after it."""
    from _cli import dptrain

    (tmp_path / "tiny.toml").write_text(TINY)
    ended, pids = threading.Event(), []
    actor = threading.Thread(target=_once_beating, args=(tmp_path / "run", ranks, ended, act, pids), daemon=True)
    actor.start()
    try:
        done = dptrain("run", "--config", "tiny.toml", "--run-dir", "run", *overrides, cwd=tmp_path)
    finally:
        ended.set()
        actor.join()
        for pid in pids:  # still one of the job's forked ranks (named dptrain-rank<r>), not a pid reused since
            if process_state(pid) not in (None, "Z") and _comm(pid).startswith("dptrain-rank"):
                os.kill(pid, signal.SIGKILL)
    assert pids, f"the job ended before ranks {ranks} trained: {done.stderr}"
    return done


def _stop_rank_and_wait(tmp_path: Path, rank: int, *overrides: str) -> str:
    """Rank ``rank`` SIGSTOPped once it trains: the job ends with exit 1; its output."""
    done = run_acting_once_beating(tmp_path, [rank], lambda pids: os.kill(pids[0], signal.SIGSTOP), *overrides)
    assert done.returncode == 1, done.stderr
    return done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_a_stopped_rank_0_store_host_ends_the_job_naming_it(tmp_path):
    out = _stop_rank_and_wait(tmp_path, 0, "--nproc", "2")
    assert "rank 0 failed first" in out and "sent no heartbeat" in out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rank", [2, 1], ids=["server", "worker"])
def test_a_stopped_parameter_server_rank_ends_the_job_naming_it(tmp_path, rank):
    out = _stop_rank_and_wait(tmp_path, rank, "--nproc", "3", "--set", "distributed.strategy=ps")
    assert f"rank {rank} failed first" in out and "sent no heartbeat" in out


HUNG_SCRIPT = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(600)  # hangs: the others wait in the all-reduce
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_hung_launched_script_ends_under_timeout_naming_the_silent_rank(tmp_path):
    (tmp_path / "hung.py").write_text(HUNG_SCRIPT)
    job = _start(tmp_path, "launch", "--nproc", "2", "--timeout", "3", "--run-dir", "run", "hung.py")
    try:
        out, _ = job.communicate(timeout=150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1, out
    assert "rank 0 failed first" in out and "rank(s) [1] were still running" in out


@pytest.mark.timeout(180)
def test_a_run_whose_steps_are_all_non_finite_ends_with_exit_1_and_one_message(tmp_path):
    from _cli import dptrain

    (tmp_path / "tiny.toml").write_text(TINY)
    done = dptrain("run", "--config", "tiny.toml", "--run-dir", "run", "--nproc", "2", "--set", "train.steps=12",
                   "--set", "train.lr=1e30", "--set", "train.max_skipped_steps=4", "--set", "log.plots=false",
                   cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "4 steps in a row had non-finite gradients and were skipped" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "summary.json").exists()  # no summary of NaN weights


# --------------------------------------------------------------------------- a long phase is not a hang


def _accumulating_engine_marks(rank: int, world_size: int, run_dir: str) -> list[tuple[int, str]]:
    """The heartbeat's marks during one optimizer step of 6 micro-steps, through the Engine."""
    import torch

    from dptrain import BatchPlan, Engine

    marks: list[tuple[int, str]] = []
    with Heartbeat(Path(run_dir), rank, world_size, timeout_s=600) as beat:
        mark = beat.mark
        beat.mark = lambda step, phase="step": (marks.append((step, phase)), mark(step, phase))
        engine = Engine(torch.nn.Linear(4, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        BatchPlan.resolve(world_size, 6, 1, None))
        batches = iter([torch.randn(1, 4)] * 6)
        for x in engine.micro_steps(batches):
            engine.backward(engine.model(x).square().mean())
        engine.step()
    return marks


def test_every_micro_step_of_a_long_accumulation_marks_progress(tmp_path):
    from dptrain.testing import run_on_ranks

    marks = run_on_ranks(_accumulating_engine_marks, 1, str(tmp_path))[0]
    assert marks.count((1, "micro-step")) == 6 and marks[-1] == (1, "step")


def test_an_evaluation_and_a_checkpoint_mark_progress_batch_by_batch_and_file_by_file(tmp_path):
    import torch

    from dptrain.checkpoint.files import save_checkpoint
    from dptrain.runner.outputs import val_sums

    class Task:
        val_set = [(torch.randn(3), torch.tensor(1)) for _ in range(40)]

        @staticmethod
        def eval_sums(model, batch):
            return {"loss_sum": 1.0, "count": 1.0}

    calls = []
    val_sums(torch.nn.Linear(3, 2), Task(), 4, num_batches=7, progress=lambda: calls.append("eval"))
    assert calls == ["eval"] * 7
    calls.clear()
    save_checkpoint(tmp_path, 3, {"model.pt": {}, "optimizer.pt": {}, "trainer.pt": {}}, {},
                    progress=lambda: calls.append("file"))
    assert calls == ["file"] * 3


# --------------------------------------------------------------------------- a full disk, clocks, stopped peers


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs, to be filled by the test (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (a full disk is emulated with one)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)


def test_a_full_disk_silences_no_heartbeat_and_is_named_as_full(full_disk):
    from dptrain.launch.supervise import disk_full_note

    with Heartbeat(full_disk, 0, 1, timeout_s=60) as beat:
        beat.mark(5)
        _fill(full_disk)
        first = read_heartbeats(full_disk, 1)[0]["time"]
        time.sleep(1.6)
        beats = read_heartbeats(full_disk, 1)
        assert beats[0]["time"] > first  # rewritten in place: no new block needed
        assert stale_ranks(beats, timeout_s=1, now=first + 10) == [0]
        assert stale_ranks(beats, timeout_s=1) == []
    note = disk_full_note(full_disk)
    assert note is not None and f"file system holding {full_disk} is full" in note
    assert disk_full_note(full_disk.parent) is None


def test_ages_on_one_host_come_from_the_monotonic_clock():
    from dptrain.launch.heartbeat import _BOOT_ID, heartbeat_age

    beat = {"time": time.time() - 1000, "mono": time.monotonic() - 1.0, "host": __import__("socket").gethostname(),
            "boot": _BOOT_ID}  # the wall clock stepped forward 999 s since it was written (NTP, a resumed VM)
    assert heartbeat_age(beat) < 5 and stale_ranks({0: beat}, timeout_s=10) == []
    assert heartbeat_age(dict(beat, host="elsewhere")) > 900  # another host: only the wall clock is shared


@pytest.mark.timeout(60)
def test_a_watchdog_ends_a_stopped_peer_on_its_host_so_the_job_ends_at_once(tmp_path):
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        heartbeat_file(tmp_path, 1).parent.mkdir(parents=True)
        heartbeat_file(tmp_path, 1).write_text(json.dumps({"rank": 1, "pid": peer.pid, "time": time.time() - 100,
                                                           "host": __import__("socket").gethostname(), "step": 3}))
        code = textwrap.dedent(f"""
            import time
            from dptrain.launch.heartbeat import Heartbeat
            with Heartbeat({str(tmp_path)!r}, 0, 2, timeout_s=0.5, margin_s=0.5) as beat:
                beat.mark(4)
                time.sleep(120)
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
        assert done.returncode == 1, done.stderr
        assert peer.wait(timeout=10) == -signal.SIGKILL  # not left for an agent's 30 s grace
        assert "rank(s) [1] were stopped (SIGSTOP) on this host and were ended" in read_error_record(tmp_path, 0)["summary"]
    finally:
        peer.kill()


def test_a_failure_report_names_only_files_that_exist(tmp_path):
    from dptrain.launch.supervise import look as _look

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank1.console").write_text("")
    assert _look(tmp_path, 1, on_terminal=False) == f"; see {tmp_path / 'logs' / 'rank1.console'}"
    assert _look(tmp_path, 0, on_terminal=True) == "; see its output above"
