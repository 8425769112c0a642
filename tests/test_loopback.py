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

from tests.test_watchdog import _pid_once_beating, _start

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
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_single_machine_job_listens_on_loopback_only(tmp_path):
    job = _start(tmp_path, "run", "--config", "tiny.toml", "--run-dir", "run", "--nproc", "2")
    try:
        pids = [_pid_once_beating(tmp_path / "run", r, job) for r in (0, 1)]
        time.sleep(0.5)
        addresses = listening_addresses(pids)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert addresses, "the job's store listens somewhere: rank 0 hosts it"
    assert addresses <= LOOPBACK, f"listening beyond loopback: {addresses - LOOPBACK}"
