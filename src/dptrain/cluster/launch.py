"""Run a torchrun job across the emulated hosts: one torchrun agent per host, a real c10d rendezvous.

Host ``i`` runs ``python -m torch.distributed.run --nnodes H --nproc-per-node G
--rdzv-backend c10d --rdzv-endpoint 10.213.0.1:PORT --local-addr <its address> ARGS``
inside its namespace, so its workers reach the others only through the rate-limited
links. ``--local-addr`` matters: otherwise an agent advertises the machine's hostname,
whose address does not exist inside the namespaces; and host 0 is told it serves the
rendezvous store (``--rdzv-conf is_host=1``; torchrun's own hostname check does not
recognise a namespace's address). gloo is pinned to the host's
interface (``GLOO_SOCKET_IFNAME``). The job ends when every agent has exited; if one
fails, the others are stopped. Whatever happens (failure, timeout, Ctrl-C), the
agents' process groups are killed and the network is torn down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dptrain.cluster.netns import Network

__all__ = ["run_on_cluster", "kill_groups"]


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
                   timeout: float | None = None, env: dict[str, str] | None = None, stdout=None, stderr=None) -> int:
    """Run ``torchrun ... args`` on every host of ``network`` (already up); returns the job's exit code.

    ``stdout``, ``stderr``: where the agents and workers write (``subprocess.Popen``'s; default: this process's).
    """
    if per_host < 1:
        raise ValueError(f"at least one worker per host, got {per_host}")
    if not args:
        raise ValueError("nothing to run: give the training script and its arguments (e.g. -m dptrain.run)")
    procs: list[subprocess.Popen] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in previous:
        signal.signal(s, stop)
    try:
        for i in range(network.hosts):
            cmd = network.exec_prefix(i) + [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(network.hosts),
                "--nproc-per-node", str(per_host), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{network.address(0)}:{port}", "--rdzv-id", f"dptrain-{network.tag}",
                "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", network.address(i), *args]
            host_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": network.interface(i),
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DPTRAIN_CLUSTER_HOST": str(i)}
            procs.append(subprocess.Popen(cmd, env=host_env, start_new_session=True, stdout=stdout, stderr=stderr))
            if i == 0:
                time.sleep(0.5)  # host 0 serves the rendezvous store
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"dptrain cluster: the job ran past its {timeout:g} s timeout; stopping it", file=sys.stderr)
                return 124
            time.sleep(0.2)
    finally:
        kill_groups(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)
