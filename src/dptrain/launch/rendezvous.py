"""Where a worker stands in the job, read from its launcher's environment.

dptrain uses the conventions users already have, and brings no launcher agent or
transport of its own:

- **torchrun** (and dptrain's local launcher, which sets the same variables): ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
  the process group is initialised with ``env://`` so torchrun's own rendezvous store
  is reused.
- **Slurm** (``srun`` starting one task per device): ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``. ``MASTER_ADDR`` defaults to the first host
  of ``SLURM_JOB_NODELIST`` and ``MASTER_PORT`` to a port derived from the job id, so
  every task computes the same address without talking to the others.
- **nothing**: a single process (world size 1) on 127.0.0.1.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dptrain.comm import stop_progress_threads
from dptrain.launch.local import AGENT_STORE, LOOPBACK, free_port  # the launcher's, which imports no torch
from dptrain.launch.slurm import first_slurm_host, job_port
from dptrain.live.store import LIVE_STORE_ENV

__all__ = ["WorkerEnv", "PortInUse", "RendezvousTimeout", "CONNECT_SLACK_S", "detect_worker_env", "init_distributed",
           "join_store", "leave_process_groups", "init_alone", "replica_env", "free_port", "first_slurm_host",
           "is_loopback_job", "loopback_store", "use_loopback"]



@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def detect_worker_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return WorkerEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])),
                         int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0].split(",")[0]
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        port = int(env.get("MASTER_PORT") or job_port(env))
        return WorkerEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), int(per_node),
                         addr, port, "slurm")
    return WorkerEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "single")


def replica_env(env: WorkerEnv, environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """Live recovery with one launcher per replica (torchrun ``--standalone`` on each machine, as torchft runs one
    per replica group): ``DPTRAIN_REPLICA_ID`` and ``DPTRAIN_REPLICAS`` name this worker's replica and how many the
    job has, in place of the launcher's rank and world size; ``env`` as it is without them."""
    environ = os.environ if environ is None else environ
    if "DPTRAIN_REPLICA_ID" not in environ:
        return env
    replica, replicas = environ["DPTRAIN_REPLICA_ID"], environ.get("DPTRAIN_REPLICAS", "")
    if not (replica.isdigit() and replicas.isdigit() and int(replica) < int(replicas)):
        raise ValueError(f"DPTRAIN_REPLICA_ID={replica!r} and DPTRAIN_REPLICAS={replicas!r}: expected 0 <= id < "
                         "replicas, both whole numbers")
    return WorkerEnv(int(replica), int(replicas), env.local_rank, env.local_world_size, env.master_addr,
                     env.master_port, env.launcher)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times torchrun's agent has restarted this worker group (0 on the first attempt, or without it)."""
    return int((os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0"))


def choose_backend(requested: str, local_world_size: int, cuda_devices: int) -> str:
    """The backend every rank of a node agrees on: ``auto`` is NCCL only when each local rank has a device.

    The choice depends on the node, not the rank: with 2 local ranks and 1 GPU, rank 0 alone
    could take NCCL and rank 1 gloo, and the two would never rendezvous. NCCL also refuses two
    ranks on one device. So ``auto`` falls back to gloo on CPU for every rank, with a warning.
    """
    if requested != "auto":
        return requested
    if cuda_devices and cuda_devices < local_world_size:
        warnings.warn(f"{local_world_size} ranks on this node but {cuda_devices} CUDA device(s): every rank uses "
                      f"gloo on CPU. Run at most {cuda_devices} rank(s) per node to train on the GPU(s).",
                      stacklevel=3)
        return "gloo"
    return "nccl" if cuda_devices else "gloo"


CONNECT_SLACK_S = 2.0  # past distributed.timeout_s, so that torch's own timeout (a refused connection) speaks first


class RendezvousTimeout(RuntimeError):
    """The job's store did not answer within the deadline: one line naming the address, exit 1."""


def init_distributed(env: WorkerEnv | None = None, backend: str = "auto", timeout_s: float = 300.0,
                     store: dist.Store | None = None) -> torch.device:
    """Join the process group; return this worker's device (cuda:LOCAL_RANK with NCCL, else CPU).

    ``store``: one already joined (:func:`join_store`), e.g. prefixed anew for each of several groups made one
    after another in one process; by default the job's store is joined here.

    ``env`` defaults to :func:`detect_worker_env` (torchrun, Slurm, or a single process). Joining the job's
    store has a deadline of ``timeout_s`` (+ :data:`CONNECT_SLACK_S`): :func:`join_store`. Under live recovery
    (``dptrain launch --live-restarts N``, which names the job's live store in ``DPTRAIN_LIVE_STORE``) and no
    ``env`` given, the default group is this worker alone (:func:`init_alone`): ``dptrain.Live``'s rounds span
    the job.
    """
    if env is None and os.environ.get(LIVE_STORE_ENV):
        return init_alone(detect_worker_env(), backend)
    env = detect_worker_env() if env is None else env
    backend, device = _take_device(env, backend)
    timeout = timedelta(seconds=timeout_s)
    store = join_store(env, timeout) if store is None else store
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    return device


def join_store(env: WorkerEnv, timeout: timedelta) -> dist.Store:
    """The job's store (this machine's loopback store, or torch's ``env://`` or ``tcp://`` rendezvous), joined
    within ``timeout`` + :data:`CONNECT_SLACK_S` or :class:`RendezvousTimeout`.

    [Note: a store that never answers] torch's TCPStore client gives up on a refused connection after its
    timeout, but not on a listener that accepts and never answers (another program on ``MASTER_PORT``, a
    stopped rank 0): its handshake waited past 200 s with a 10 s timeout. No torch argument bounds it, so
    the store is made in a thread that the caller stops waiting for; the thread, blocked outside Python,
    is left behind and ends with the process.
    """
    address = f"{env.master_addr}:{env.master_port}"
    if use_loopback(env):
        return _within(lambda: loopback_store(env, timeout), timeout, env, address)
    url = "env://" if env.launcher == "torchrun" else f"tcp://{address}"
    return _within(lambda: _rendezvous_store(url, env, timeout), timeout, env, address)


def _rendezvous_store(url: str, env: WorkerEnv, timeout: timedelta) -> dist.Store:
    """The store ``init_process_group(init_method=url)`` would make, prefixed as it prefixes it."""
    store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)


def _within(make, timeout: timedelta, env: WorkerEnv, address: str):
    """``make()``'s store, or its exception; :class:`RendezvousTimeout` when it has not returned in time."""
    done: list = []

    def run() -> None:
        try:
            done.append((True, make()))
        except BaseException as e:  # handed to the caller's thread
            done.append((False, e))

    thread = threading.Thread(target=run, daemon=True, name="dptrain-store-connect")
    thread.start()
    thread.join(timeout.total_seconds() + CONNECT_SLACK_S)
    if not done:  # [Note: a store that never answers]
        role = "host" if env.rank == 0 else "join"
        raise RendezvousTimeout(
            f"rank {env.rank} could not {role} the job's store at {address} within "
            f"{timeout.total_seconds() + CONNECT_SLACK_S:g} s (distributed.timeout_s {timeout.total_seconds():g} s + "
            f"{CONNECT_SLACK_S:g}): something there accepts connections but never answers. Check that "
            f"MASTER_ADDR:MASTER_PORT ({address}) is where rank 0 hosts the store, that rank 0 runs and is not "
            f"stopped, and that no other program listens on port {env.master_port} (ss -ltnp)")
    ok, value = done[0]
    if not ok:
        raise value
    return value


def init_alone(env: WorkerEnv, backend: str = "auto") -> torch.device:
    """A default process group of this worker alone (live recovery: the workers meet in rounds of their own, so no
    group spans a fixed set of processes that one death would break); this worker's device."""
    _, device = _take_device(env, backend)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return device


def _take_device(env: WorkerEnv, backend: str) -> tuple[str, torch.device]:
    """The backend ``backend`` resolves to, and this worker's device (cuda:LOCAL_RANK with NCCL, made current)."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = choose_backend(backend, env.local_world_size, devices)
    if backend == "nccl" and devices <= env.local_rank:
        raise RuntimeError(f"backend nccl needs a CUDA device for local rank {env.local_rank}; "
                           f"found {devices}. Use distributed.backend = \"gloo\" on CPU.")
    device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend, device


def is_loopback_job(env: WorkerEnv) -> bool:
    """Every rank on this machine, meeting at a loopback address: nothing needs to listen beyond 127.0.0.1."""
    return env.world_size == env.local_world_size and env.master_addr in LOOPBACK


def use_loopback(env: WorkerEnv, environ: dict[str, str] | None = None) -> bool:
    """Whether this worker hosts (rank 0) or joins the job's store on 127.0.0.1, and sends gloo over ``lo``.

    A loopback job, unless torchrun's agent hosts the store already (``TORCHELASTIC_USE_AGENT_STORE``:
    its own choice of address, kept). Sets ``GLOO_SOCKET_IFNAME=lo`` unless the user set it: without it
    gloo listens on the interface the host name resolves to, reachable from the network.
    """
    environ = os.environ if environ is None else environ
    if not is_loopback_job(env) or environ.get(AGENT_STORE) == "True":
        return False
    environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return True


class PortInUse(ValueError):
    """The job's store port is taken: bad input (MASTER_PORT), one line, exit 2."""


def loopback_store(env: WorkerEnv, timeout: timedelta) -> dist.TCPStore:
    """The job's store, listening on 127.0.0.1 only: rank 0 hosts it, the others connect.

    ``TCPStore(is_master=True)`` listens on every interface whatever host it is given; handed a
    socket already bound to 127.0.0.1 (``master_listen_fd``), it listens there instead.
    """
    if env.rank != 0:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout)
    listener = socket.socket(socket.AF_INET6 if env.master_addr == "::1" else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    address = ("::1" if env.master_addr == "::1" else "127.0.0.1", env.master_port)
    try:
        listener.bind(address)
    except OSError as e:
        listener.close()
        raise PortInUse(f"the job's store cannot listen on {address[0]}:{address[1]} ({e.strerror}): another "
                        "process has that port. Set MASTER_PORT to a free port (dptrain run and dptrain launch "
                        "choose one themselves when they start the workers)") from None
    listener.listen(max(128, env.world_size))
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.detach())  # the store's socket from now on
    return store


def leave_process_groups() -> None:
    """Destroy every process group and free them, with their backend threads, before the interpreter exits.

    ``destroy_process_group`` forgets the groups, but a group's backend (gloo's worker and
    transport threads) lives until its last reference goes, and the engines, checkpoints and
    hooks of a finished run hold theirs in reference cycles that only the collector frees. Left
    to the interpreter's exit, that free raced with it: a gloo worker releasing the tensors of
    the last collective needs the GIL, a thread that asks for the GIL during finalization is
    ended, and ending a C++ thread there calls ``std::terminate`` ("terminate called without
    an active exception", SIGABRT; one torchrun job in about 30 did this). Collecting here
    runs each backend's destructor while the interpreter is whole: it joins its threads with
    the GIL released, so they finish their work and stop.
    """
    stop_progress_threads()  # dptrain's own collectives' threads, which hold their groups
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
