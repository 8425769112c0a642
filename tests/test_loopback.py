"""A job whose ranks are all on this machine listens on loopback only: its store and gloo's sockets.

Read from /proc (no psutil): the listening TCP sockets whose inodes the job's processes hold.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from tests.test_watchdog import _start, run_acting_once_beating

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.add(fields[1].split(":")[0])
    return addresses


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(180)
def test_a_single_machine_job_listens_on_loopback_only(tmp_path):
    """``dptrain run --nproc 2``, its ranks' listening sockets read once both train, then the ranks killed."""
    addresses = set()

    def look_then_kill(pids: list[int]) -> None:
        time.sleep(0.5)
        addresses.update(listening_addresses(pids))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    done = run_acting_once_beating(tmp_path, [0, 1], look_then_kill, "--nproc", "2")
    assert done.returncode == 1, done.stderr  # the killed ranks end it
    assert addresses, "the job's store listens somewhere: rank 0 hosts it"
    assert addresses <= LOOPBACK, f"listening beyond loopback: {addresses - LOOPBACK}"


SCRIPT = """
import os, time
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as a plain torch script does
out = os.getcwd()
with open(os.path.join(out, f"pid{dist.get_rank()}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid{dist.get_rank()}.tmp"), os.path.join(out, f"pid{dist.get_rank()}"))
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launched_script_that_makes_its_own_process_group_listens_on_loopback_only(tmp_path):
    (tmp_path / "own_group.py").write_text(SCRIPT)
    job = _start(tmp_path, "launch", "--nproc", "2", "--run-dir", "run", "own_group.py")
    job_env_out = tmp_path  # the script writes its pid files here
    try:
        deadline = time.monotonic() + 120
        while not all((job_env_out / f"pid{r}").exists() for r in (0, 1)):
            assert job.poll() is None, job.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pids = [int((job_env_out / f"pid{r}").read_text()) for r in (0, 1)]
        addresses = listening_addresses(pids)
        (job_env_out / "stop").write_text("")
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, out
    assert addresses, "the job's store listens somewhere: rank 0 hosts it"
    assert addresses <= LOOPBACK, f"listening beyond loopback: {addresses - LOOPBACK}"
