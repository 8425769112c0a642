"""One run per run directory (``launch.run_lock``): a second is refused, a dead holder's lock taken over.

A holder is a real other process (the lock is a ``flock``, which the kernel drops when its
holder dies); the end-to-end cases run ``dptrain run`` twice on one ``--run-dir`` and
``python -m dptrain.run`` as torchrun would start it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli import TESTS, dptrain, tiny_gpt_config
from dptrain.launch.run_lock import FD_ENV, LOCK_NAME, TOKEN_ENV, Holder, RunDirBusy, acquire, hold_run_dir

HOLD = "import sys, time; from dptrain.launch.run_lock import acquire; acquire(sys.argv[1], 'holder test'); " \
       "print('held', flush=True); time.sleep(120)"


def _holder(run_dir: Path) -> subprocess.Popen:
    """A process that holds ``run_dir``'s lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.timeout(60)
def test_a_second_holder_is_refused_by_pid_and_a_killed_holders_lock_is_taken_over(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=rf"in use by pid {holder.pid} on host {socket.gethostname()}, "
                                             r"started .* \(holder test\).*kill"):
            acquire(tmp_path, "second")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    notes: list[str] = []
    lock = acquire(tmp_path, "third", log=notes.append)  # the kernel dropped the flock; the JSON still names it
    assert len(notes) == 1 and notes[0].startswith(f"note: taking over the lock of {tmp_path}: its holder, pid "
                                                   f"{holder.pid} on host {socket.gethostname()}, started ")
    assert notes[0].endswith("(holder test), is gone")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # a clean release: the next taker has nothing to report
    notes.clear()
    with hold_run_dir(tmp_path, "fourth", log=notes.append) as held:
        assert held.fd is not None and notes == []


def test_a_stale_lock_file_of_a_dead_pid_is_taken_over_and_another_hosts_is_refused(tmp_path: Path) -> None:
    dead = _dead_pid()
    record = {"pid": dead, "host": socket.gethostname(), "started": "2024-01-01T00:00:00+0000", "command": "old"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    notes: list[str] = []
    acquire(tmp_path, "new", log=notes.append).release()
    assert len(notes) == 1 and f"pid {dead}" in notes[0] and "is gone" in notes[0]

    (tmp_path / LOCK_NAME).write_text(json.dumps(dict(record, host="elsewhere-node-7")))
    with pytest.raises(RunDirBusy, match=rf"locked by pid {dead} on host elsewhere-node-7.*cannot tell.*"
                                         rf"empty the lock file \(: > {tmp_path / LOCK_NAME}\)"):
        acquire(tmp_path, "new")


@pytest.mark.timeout(60)
def test_a_worker_accepts_its_own_launchers_lock_and_no_other(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        token = Holder(**json.loads((tmp_path / LOCK_NAME).read_text())).token
        mine = acquire(tmp_path, "worker", environ={TOKEN_ENV: token})
        assert mine.fd is None  # not taken again: the launcher holds it
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            acquire(tmp_path, "worker", environ={TOKEN_ENV: "otherhost:1:2024"})
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_module_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, dptrain.launch.run_lock; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(300)
def test_two_dptrain_runs_on_one_run_dir_the_second_exits_2_naming_the_first(tmp_path: Path) -> None:
    config = tiny_gpt_config(tmp_path)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DPTRAIN_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    first = subprocess.Popen([sys.executable, "-m", "dptrain.cli", "run", "--nproc", "2", "--config", str(config),
                              "--run-dir", str(run_dir), "--set", "train.steps=40"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock_file = run_dir / LOCK_NAME
        while not (lock_file.exists() and lock_file.read_text()) and first.poll() is None:
            time.sleep(0.05)
        second = dptrain("run", "--nproc", "2", "--config", str(config), "--run-dir", str(run_dir), cwd=tmp_path)
        out, err = first.communicate(timeout=240)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr
    assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr and second.stderr.count("error:") == 1
    assert first.returncode == 0, err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    assert max(steps) == 40  # the first run's record is whole
    # the run is over: a third starts (and resumes from the first's last checkpoint)
    third = dptrain("run", "--nproc", "1", "--config", str(config), "--run-dir", str(run_dir),
                    "--set", "train.steps=50", cwd=tmp_path)
    assert third.returncode == 0 and "at step 40" in third.stdout + third.stderr, third.stderr


@pytest.mark.timeout(200)
def test_rank_0_under_torchrun_takes_the_lock_unless_its_launcher_holds_it(tmp_path: Path) -> None:
    config = tiny_gpt_config(tmp_path)
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("DPTRAIN_FAULT", "DPTRAIN_LAUNCHER")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])]))
    worker = [sys.executable, "-m", "dptrain.run", "--config", str(config), "--run-dir", str(run_dir),
              "--set", "train.steps=2", "--set", "checkpoint.every=0", "--set", "log.eval_every=0"]
    try:
        refused = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=150)
        assert refused.returncode == 2 and f"in use by pid {holder.pid}" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        token = Holder(**json.loads((run_dir / LOCK_NAME).read_text())).token
        ours = subprocess.run(worker, env=dict(env, **{TOKEN_ENV: token}), capture_output=True, text=True, timeout=150)
        assert ours.returncode == 0, ours.stderr  # its own launcher's lock (dptrain run --max-restarts)
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_run_leaves_the_lock_file_as_it_found_it(tmp_path: Path) -> None:
    lock_file = tmp_path / LOCK_NAME
    acquire(tmp_path, "bad input").release(undo=True)
    assert not lock_file.exists()  # created, then removed: nothing written
    lock_file.write_text("")
    os.utime(lock_file, ns=(1_000_000_000, 2_000_000_000))
    acquire(tmp_path, "bad input").release(undo=True)
    assert lock_file.read_text() == "" and lock_file.stat().st_mtime_ns == 2_000_000_000


@pytest.mark.timeout(60)
def test_dptrain_launch_refuses_a_run_directory_in_use(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        done = dptrain("launch", "--nproc", "1", "--run-dir", str(run_dir), str(script), cwd=tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert done.returncode == 2 and f"in use by pid {holder.pid}" in done.stderr
    assert "ran" not in done.stdout and "Traceback" not in done.stderr
    again = dptrain("launch", "--nproc", "1", "--run-dir", str(run_dir), str(script), cwd=tmp_path)
    assert again.returncode == 0 and "ran" in again.stdout  # the dead holder's lock is taken over


# --------------------------------------------------------------------------- every process of a run holds it

SPAWN = ("import os, sys, subprocess, time; from dptrain.launch.run_lock import FD_ENV, acquire; "
         "lock = acquire(sys.argv[1], 'launcher test'); "
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], pass_fds=(lock.fd,), "
         "env=dict(os.environ, **{FD_ENV: str(lock.fd)})); print(child.pid, flush=True); time.sleep(120)")


@pytest.mark.timeout(60)
def test_a_killed_launchers_workers_keep_the_directory_locked_until_the_last_ends(tmp_path: Path) -> None:
    """[Note: who holds the lock]: the flock is the open file description's, shared with every process started."""
    launcher = subprocess.Popen([sys.executable, "-c", SPAWN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    try:
        launcher.kill()  # kill -9: its worker (here, not armed to die with it) goes on
        launcher.wait()
        with pytest.raises(RunDirBusy, match=rf"processes that pid {launcher.pid} .* started: that launcher has "
                                             r"exited and its workers are still ending"):
            acquire(tmp_path, "second run")
    finally:
        os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the worker's descriptor closes as it ends
        try:
            acquire(tmp_path, "second run", log=lambda line: None).release()
            break
        except RunDirBusy:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_removing_the_lock_file_frees_nothing_and_a_claim_is_not_proof(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        (tmp_path / LOCK_NAME).unlink()  # the lock is on the directory, not on the file
        with pytest.raises(RunDirBusy, match="is empty or missing"):
            acquire(tmp_path, "second")
        other = tmp_path / "other"
        other.mkdir()
        fd = os.open(other, os.O_RDONLY)
        try:  # a descriptor of another directory proves nothing
            with pytest.raises(RunDirBusy):
                acquire(tmp_path, "worker", environ={FD_ENV: str(fd)})
            with pytest.raises(RunDirBusy):
                acquire(tmp_path, "worker", environ={FD_ENV: "not a number"})
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def _job_processes(directory: Path) -> list[int]:
    """Live processes of a dptrain job started in ``directory``: its workers and torchrun's agent."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if os.readlink(proc / "cwd") != str(directory) or "State:\tZ" in (proc / "status").read_text():
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (proc / "comm").read_text().startswith("dptrain-rank") or b"dptrain.run" in argv[1:4] \
                or b"torch.distributed.run" in argv[1:4]:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", [["--start-method", "exec"], ["--max-restarts", "1"]], ids=["exec", "torchrun"])
def test_a_killed_launcher_leaves_no_writer_beside_the_next_run(tmp_path: Path, how: list[str]) -> None:
    """kill -9 of ``dptrain run`` (workers as fresh interpreters, or under torchrun's agent): whenever the next run
    could take the directory, nothing of the first is left running, and all of it ends within seconds."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    env.pop("DPTRAIN_FAULT", None)
    launcher = subprocess.Popen([sys.executable, "-m", "dptrain.cli", "run", "--nproc", "2", "--config",
                                 str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir), "--set",
                                 "train.steps=100000", "--set", "checkpoint.every=0", "--set", "log.eval_every=0",
                                 *how], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size > 0):  # training
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while True:
        try:
            lock = acquire(run_dir, "the next run", log=lambda line: None)
        except RunDirBusy:
            assert time.monotonic() < deadline, f"still running 30 s after the launcher died: {_job_processes(tmp_path)}"
            time.sleep(0.05)
            continue
        assert _job_processes(tmp_path) == []  # the directory is free only once every writer is gone
        lock.release()
        break


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_run_started_from_a_launched_script_takes_its_own_lock(tmp_path: Path) -> None:
    """A sweep driver under ``dptrain launch`` starting ``python -m dptrain.run`` on the launch's own directory: the
    launcher's claims stay with its workers, so the nested run takes the lock itself and is refused."""
    config = tiny_gpt_config(tmp_path)
    script = tmp_path / "sweep.py"
    script.write_text("import os, subprocess, sys\n"
                      "assert 'DPTRAIN_LAUNCHER' not in os.environ and 'DPTRAIN_RUN_LOCK_FD' not in os.environ\n"
                      f"r = subprocess.run([sys.executable, '-m', 'dptrain.run', '--config', {str(config)!r}, "
                      f"'--run-dir', {str(tmp_path / 'run')!r}, '--set', 'train.steps=2'])\n"
                      "print('nested exit', r.returncode)\n")
    done = dptrain("launch", "--nproc", "1", "--run-dir", str(tmp_path / "run"), str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "nested exit 2" in done.stdout and "is in use by pid" in done.stdout + done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
