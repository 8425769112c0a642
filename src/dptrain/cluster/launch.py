"""Run a torchrun job across the emulated hosts: one torchrun agent per host, a real c10d rendezvous.

Host ``i`` runs ``python -m torch.distributed.run --nnodes H --nproc-per-node G
--rdzv-backend c10d --rdzv-endpoint 10.213.0.1:PORT --local-addr <its address> ARGS``
inside its namespace, so its workers reach the others only through the rate-limited
links. ``--local-addr`` matters: otherwise an agent advertises the machine's hostname,
whose address does not exist inside the namespaces. The rendezvous store is served on
host 0 by a process of its own (``python -m dptrain.live.store``, as a live job's), and
every agent is told it does not serve it (``--rdzv-conf is_host=0``), so that it outlives
every agent: served by host 0's agent, it ends when that agent does, while the others may
still be closing the rendezvous in it (a finished job once printed an agent's
``DistNetworkError`` trace from its ``compare_set``). gloo is pinned to the host's
interface (``GLOO_SOCKET_IFNAME``). The job ends when every agent has exited; if one
fails, the others are stopped. Whatever happens (failure, timeout, Ctrl-C), the
agents' process groups are killed and the network is torn down.

A live-recovery job (``live_restarts``: ``live.enabled``, the failed worker restarted alone
while the others go on) is started as torchft starts one: the job's live store served on
host 0 by a process of its own (``python -m dptrain.live.store``), and on every host one
worker under a torchrun agent of its own (``--standalone``, ``--max-restarts``), told its
replica id (the host), the number of replicas and the store's address. No agent spans the
job, so no death can stop the others; the job ends when every host's agent has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dptrain.cluster.netns import Network

__all__ = ["run_on_cluster", "kill_groups", "LIVE_STORE_PORT"]

LIVE_STORE_PORT = 29611  # a live-recovery job's store, on host 0


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group of each of ``procs`` still running (each started with ``start_new_session``), and
    reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def run_on_cluster(network: Network, per_host: int, args: list[str], port: int = 29400,
                   timeout: float | None = None, env: dict[str, str] | None = None, stdout=None, stderr=None,
                   live_restarts: int | None = None) -> int:
    """Run ``torchrun ... args`` on every host of ``network`` (already up); returns the job's exit code.

    ``stdout``, ``stderr``: where the agents and workers write (``subprocess.Popen``'s; default: this process's).
    ``live_restarts``: start it as a live-recovery job (see the module docstring), each host's worker restarted up
    to this many times; one worker per host.
    """
    if per_host < 1:
        raise ValueError(f"at least one worker per host, got {per_host}")
    if not args:
        raise ValueError("nothing to run: give the training script and its arguments (e.g. -m dptrain.run)")
    if live_restarts is not None and per_host != 1:
        raise ValueError(f"a live-recovery job runs one worker per host (each its own replica), got --per-host "
                         f"{per_host}: use --hosts {network.hosts * per_host} --per-host 1")
    procs: list[subprocess.Popen] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in previous:
        signal.signal(s, stop)
    try:
        if live_restarts is None:
            procs += _agents(network, per_host, args, port, env, stdout, stderr)
        else:
            procs += _live_agents(network, args, live_restarts, env, stdout, stderr)
        deadline = None if timeout is None else time.monotonic() + timeout
        agents = procs[1:]  # the store is no agent
        while True:
            codes = [p.poll() for p in agents]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and live_restarts is None:  # one agent gave up: the job cannot go on without it
                return failed[0]
            if all(c is not None for c in codes):
                return max(codes)
            if deadline is not None and time.monotonic() > deadline:
                print(f"dptrain cluster: the job ran past its {timeout:g} s timeout; stopping it", file=sys.stderr)
                return 124
            time.sleep(0.2)
    finally:
        kill_groups(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _host_env(network: Network, i: int, env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": network.interface(i),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DPTRAIN_CLUSTER_HOST": str(i)}


def _agents(network: Network, per_host: int, args: list[str], port: int, env, stdout, stderr) \
        -> list[subprocess.Popen]:
    """The rendezvous store on host 0 (first in the list), then one torchrun agent per host, one c10d rendezvous
    across them in that store."""
    procs = [_store(network, port, subprocess.DEVNULL, stderr)]
    for i in range(network.hosts):
        cmd = network.exec_prefix(i) + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(network.hosts),
            "--nproc-per-node", str(per_host), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{network.address(0)}:{port}", "--rdzv-id", f"dptrain-{network.tag}",
            "--rdzv-conf", "is_host=0", "--local-addr", network.address(i), *args]
        procs.append(subprocess.Popen(cmd, env=_host_env(network, i, env), start_new_session=True, stdout=stdout,
                                      stderr=stderr))
    return procs


def _store(network: Network, port: int, stdout, stderr) -> subprocess.Popen:
    """A store served on host 0's ``port`` by a process of its own, which no agent or worker outlives; started half
    a second before its clients (who retry their connection for their timeout anyway)."""
    proc = subprocess.Popen(network.exec_prefix(0) + [sys.executable, "-W", "ignore::RuntimeWarning:runpy", "-m",
                                                      "dptrain.live.store", "--host", network.address(0), "--port",
                                                      str(port)],  # runpy's warning: dptrain.live imports it
                            stdout=stdout, stderr=stderr, start_new_session=True)
    time.sleep(0.5)
    return proc


def _live_agents(network: Network, args: list[str], restarts: int, env, stdout, stderr) -> list[subprocess.Popen]:
    """The live store on host 0 (first in the list), then each host's worker under a standalone torchrun agent."""
    address = f"{network.address(0)}:{LIVE_STORE_PORT}"
    procs = [_store(network, LIVE_STORE_PORT, stdout, stderr)]
    time.sleep(0.5)
    for i in range(network.hosts):
        live_env = {**(env or {}), "DPTRAIN_REPLICA_ID": str(i), "DPTRAIN_REPLICAS": str(network.hosts),
                    "DPTRAIN_LIVE_STORE": address}
        cmd = network.exec_prefix(i) + [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", str(restarts),
                                         "--monitor-interval", "0.1", *args]
        procs.append(subprocess.Popen(cmd, env=_host_env(network, i, live_env), start_new_session=True,
                                      stdout=stdout, stderr=stderr))
    return procs
