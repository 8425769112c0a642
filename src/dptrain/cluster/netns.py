"""An emulated multi-host network on one Linux machine: hosts as network namespaces on a bridge.

Each *host* is a network namespace with one interface, the host end of a veth pair
whose other end is a port of a bridge in a *switch* namespace. Every veth end carries a
token-bucket filter (``tc qdisc ... tbf``), so each host's link is limited to the rate
in both directions: from the host (its own end's egress) and to it (the switch end's
egress), as a NIC on a switch is. Addresses (``10.213.0.0/24``) exist only inside the
namespaces this module creates, never on the machine's own interfaces.

What ``tbf`` can and cannot emulate: the rate, and how long a packet may wait in the
bucket's queue (``latency``, which sizes the queue). It adds no propagation delay;
that needs ``netem``, which these kernels do not have. Round trips are the kernel's
veth and TCP costs, tens of microseconds.

Everything is torn down by :meth:`Network.down`, which is idempotent and also finds
namespaces left by a process that was killed (``cleanup_stale``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["Network", "NetworkError", "check_root", "cleanup_stale", "PREFIX"]

PREFIX = "dpt-"  # every namespace this module creates starts with it
SUBNET = "10.213.0"


class NetworkError(RuntimeError):
    """The emulated network could not be set up (with what failed and the fix)."""


def check_root() -> None:
    """Raise NetworkError unless this process can create namespaces and qdiscs."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        raise NetworkError("dptrain cluster needs Linux network namespaces")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(f"dptrain cluster needs the {' and '.join(missing)} command(s) (iproute2); install them")
    if os.geteuid() != 0:
        raise NetworkError("dptrain cluster needs root (CAP_NET_ADMIN) to create network namespaces, veth pairs "
                           "and tc qdiscs; run it as root, e.g. with sudo")


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete every namespace this module ever created (killing what still runs there); returns their names."""
    removed = []
    for name in namespaces():
        if name.startswith(PREFIX):
            _kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _kill_inside(namespace: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


@dataclass
class Network:
    """``hosts`` namespaces on a bridge, each link limited to ``rate_mbit`` (tbf, both directions)."""

    hosts: int
    rate_mbit: float
    queue_latency_ms: float = 50.0
    burst_kb: int | None = None  # default: what the rate sends in 4 ms (a kernel tick at HZ=250), at least 64 KiB
    tag: str = ""

    def __post_init__(self):
        if self.hosts < 1:
            raise ValueError(f"at least one host is needed, got {self.hosts}")
        if self.hosts > 250:
            raise ValueError(f"at most 250 hosts fit the emulated subnet, got {self.hosts}")
        if not self.rate_mbit > 0:
            raise ValueError(f"the link rate must be > 0 Mbit/s, got {self.rate_mbit}")
        if not self.queue_latency_ms > 0:
            raise ValueError(f"the queue latency must be > 0 ms, got {self.queue_latency_ms}")
        self.tag = self.tag or secrets.token_hex(2)
        if self.burst_kb is None:  # a smaller bucket than one tick's worth caps the rate below the nominal one
            self.burst_kb = max(64, int(self.rate_mbit * 1e6 / 8 * 0.004 / 1024))
        self._up = False

    # names: interface names must fit 15 characters
    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def host(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-h{i}"

    def interface(self, i: int) -> str:
        return f"dpt{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def up(self) -> Network:
        """Create the switch, the hosts and their limited links (torn down again if any step fails)."""
        check_root()
        self._up = True
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, ifname, port = self.host(i), self.interface(i), f"dpt{self.tag}s{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port,
                     "netns", self.switch)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", ifname)
                _run("ip", "-n", ns, "link", "set", ifname, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                for where, dev in ((ns, ifname), (self.switch, port)):
                    _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kb}kb",
                         "latency", f"{self.queue_latency_ms}ms")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill what runs inside and delete every namespace (their veths and qdiscs go with them)."""
        if not self._up:
            return
        for ns in [self.host(i) for i in range(self.hosts)] + [self.switch]:
            if ns in namespaces():
                _kill_inside(ns)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._up = False

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.host(i)]

    def __enter__(self) -> Network:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
