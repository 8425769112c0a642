"""``dptrain run --max-restarts K`` and ``dptrain launch`` over nodes: the same workers under torchrun's agent.

dptrain does not restart workers itself. With ``--max-restarts K > 0`` the local launcher
hands the job to torchrun (``python -m torch.distributed.run --standalone``), whose agent
stops every worker when one fails and starts them all again, up to K times. A restarted
worker resumes from the run directory's newest complete checkpoint, as any
``dptrain run`` started again in the same directory does. So a restart loses at most
the steps since that checkpoint, and the run continues exactly, bit for bit, as if
nothing had happened (``tests/test_cli_run.py``).

[Note: a fresh store per restart] torch's elastic agent shares its rendezvous TCP store
with the workers by default. With gloo, workers of a restarted round then read the
previous round's addresses from it and fail to connect ("Gloo connectFullMesh failed ...
Connection refused"), so the restart is lost. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
gives each round's process group a store of its own: 6 of 6 trials restarted with it, 0
of 6 without (``docs/repro/restart_store_trials.sh``). It is set unless the environment
already sets it.

The run directory's lock (:mod:`dptrain.launch.run_lock`) is held by ``dptrain run``'s
process for the whole job, every restart included: torchrun's agent and its workers run
under it, and the agent holds the lock's descriptor too, so a launcher killed with
``kill -9`` does not free the directory while the agent lives; the agent is started
through ``launch.orphans`` and ends with the launcher, stopping its workers. The workers
are not "local" (they report their own errors), so rank 0 would take the lock itself; the
launcher passes its token in ``env`` (``DPTRAIN_RUN_LOCK``), by which rank 0 knows the lock
for its own launcher's.

[Note: judging the agent] The workers' heartbeats are judged by the workers' watchdogs, but nothing judged
the agent: stopped (SIGSTOP), it reaped no worker and restarted none, and the job hung with its finished
workers as zombies (a rank killed meanwhile: both ranks sat 45 s, silent, until the agent was continued).
So the launcher watches it as the local launcher watches a rank's heartbeat: an agent that is stopped, or
that leaves an ended worker unreaped (it polls them every 0.5 s), for longer than the timeout (the workers'
``distributed.timeout_s``, at least ``STALE_MIN_S``) is killed with its workers, and the job ends with one line
naming it (exit 1).

``dptrain launch --nnodes N`` (or inside a Slurm job of several nodes) hands its job to
torchrun the same way, with a c10d rendezvous (:class:`Nodes`): torchrun's agent is the
multi-node launcher; dptrain brings none of its own.

The same job under plain torchrun behaves the same:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        -m dptrain.run --run-dir runs/job --set checkpoint.every=50
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dptrain.launch.heartbeat import STALE_MIN_S, process_state, read_heartbeats
from dptrain.launch.slurm import first_slurm_host, job_port
from dptrain.launch.threads import threads_per_worker

__all__ = ["launch_elastic", "torchrun_command", "Nodes", "slurm_nodes", "agent_trouble", "children"]

POLL_S = 0.5  # between two looks at the agent
STOP_GRACE_S = 10.0  # after Ctrl-C, the agent's time to stop its workers before it is killed with them


@dataclass(frozen=True)
class Nodes:
    """A job over several machines: torchrun's c10d rendezvous at ``endpoint`` (``host:port``), ``nnodes`` agents
    (or its static one, ``torchrun --master-addr --master-port``, where each node gives its ``node_rank``)."""
    nnodes: int
    endpoint: str
    run_id: str = "dptrain"
    node_rank: int | None = None  # None: the rendezvous assigns it (c10d), or 0 (static)
    backend: str = "c10d"

    def torchrun_args(self) -> list[str]:
        args = [f"--nnodes={self.nnodes}", f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}"]
        return args + ([f"--node-rank={self.node_rank}"] if self.node_rank is not None else [])


def slurm_nodes(environ: Mapping[str, str]) -> Nodes | None:
    """The nodes of the Slurm job this runs in (one ``dptrain launch`` per node: ``srun --ntasks-per-node=1``),
    or None outside Slurm or on one node. The rendezvous is on the job's first host, at a port derived from
    the job id (``launch.slurm``: the same on every node, with no communication)."""
    nnodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    if nnodes <= 1 or "SLURM_JOB_NODELIST" not in environ:
        return None
    endpoint = f"{first_slurm_host(environ['SLURM_JOB_NODELIST'])}:{job_port(environ)}"
    node_rank = int(environ["SLURM_NODEID"]) if "SLURM_NODEID" in environ else None
    return Nodes(nnodes, endpoint, f"slurm-{environ.get('SLURM_JOB_ID', '0')}", node_rank)


def torchrun_command(nproc: int, max_restarts: int, worker_args: list[str], module: str = "dptrain.run",
                     nodes: Nodes | None = None, shown: frozenset[int] | None = None,
                     agent_args: tuple[str, ...] = ()) -> list[str]:
    """torchrun running ``python -m MODULE WORKER_ARGS`` on ``nproc`` workers per node: on this machine alone (a
    standalone rendezvous on a free port) or on ``nodes``. ``shown``: the local ranks whose output the terminal
    shows, prefixed (torchrun's ``--tee 3 --local-ranks-filter``; none: ``--redirects 3``); None: torchrun's
    default. ``agent_args``: more of torchrun's flags (``--role=...``), after ours, so they win."""
    where = nodes.torchrun_args() if nodes else ["--standalone"]
    output = ([] if shown is None else ["--redirects=3"] if not shown else
              ["--tee=3", f"--local-ranks-filter={','.join(map(str, sorted(shown)))}"])
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *output, *agent_args, "-m", module,
            *worker_args]


def launch_elastic(nproc: int, worker_args: list[str], run_dir: Path, max_restarts: int,
                   module: str = "dptrain.run", nodes: Nodes | None = None, env: Mapping[str, str] = (),
                   shown: frozenset[int] | None = None, lock_fd: int | None = None,
                   timeout_s: float | None = None, agent_args: tuple[str, ...] = ()) -> int:
    """Run the job under torchrun with ``max_restarts``; return its exit code. ``env``: added to the workers'.
    ``lock_fd``: the locked run directory's descriptor, held by the agent too. ``timeout_s``: how long the agent
    may stay stopped or unresponsive ([Note: judging the agent]); None: the ``timeout_s`` its workers'
    heartbeats record (their ``distributed.timeout_s``, or ``dptrain launch --timeout``), and until one does, unjudged.
    ``agent_args``: more of torchrun's flags for its agent (:func:`torchrun_command`)."""
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **dict(env))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # [Note: a fresh store per restart]
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc)))  # torchrun would say 1
    env.pop("DPTRAIN_LAUNCHER", None)  # the workers print their own errors, as under torchrun
    guard = [sys.executable, "-m", "dptrain.launch.orphans", str(os.getpid()), "--"]  # the agent ends with us
    command = guard + torchrun_command(nproc, max_restarts, worker_args, module, nodes, shown, agent_args)
    agent = subprocess.Popen(command, env=env, pass_fds=() if lock_fd is None else (lock_fd,))
    world = nproc * (nodes.nnodes if nodes else 1)
    try:
        return _watch_agent(agent, run_dir, world, timeout_s)
    except KeyboardInterrupt:  # the agent got it too (same process group) and stops its workers
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(STOP_GRACE_S)
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if agent.poll() is None:  # whatever ends us first (an exception): nothing of the job goes on
            _kill_agent(agent)


def _watch_agent(agent: subprocess.Popen, run_dir: Path, world: int, timeout_s: float | None) -> int:
    """The agent's exit code, or 1 once it has been stopped or unresponsive for longer than the timeout."""
    since, limit = None, timeout_s
    while True:
        try:
            return agent.wait(POLL_S)
        except subprocess.TimeoutExpired:
            pass
        trouble = agent_trouble(agent.pid)
        since = None if trouble is None else since or time.monotonic()
        if since is not None and limit is None:  # read once a worker has recorded it
            limit = _workers_timeout(run_dir, world, agent.pid)
        if since is None or limit is None or time.monotonic() - since <= max(limit, STALE_MIN_S):
            continue
        workers = _kill_agent(agent)
        print(f"error: torchrun's agent (pid {agent.pid}) {trouble} for over {max(limit, STALE_MIN_S):g} s: it "
              f"was killed with its workers (pids {', '.join(map(str, workers)) or 'none'}), and the job ends; "
              f"their logs: {run_dir / 'logs'}", file=sys.stderr)
        return 1


def agent_trouble(pid: int) -> str | None:
    """Why the agent ``pid`` cannot be doing its work now (stopped, or leaving an ended worker unreaped), or None."""
    state = process_state(pid)
    if state in ("T", "t"):
        return "was stopped (SIGSTOP)"
    ended = [c for c in children(pid) if process_state(c) == "Z"]
    return f"did not reap its ended worker(s) {ended} (unresponsive)" if ended else None


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; elsewhere none)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                            found.append(int(entry.name))
    return found


def _workers_timeout(run_dir: Path, world: int, agent: int) -> float | None:
    """The timeout the agent's own workers' heartbeats record (left-over heartbeats of other processes aside)."""
    mine = set(children(agent))
    limits = [b["timeout_s"] for b in read_heartbeats(run_dir, world).values()
              if b.get("pid") in mine and isinstance(b.get("timeout_s"), (int, float))]
    return max(limits) if limits else None


def _kill_agent(agent: subprocess.Popen) -> list[int]:
    """SIGKILL the agent and its workers (each a session of its own, so each process group); their pids."""
    workers = children(agent.pid)
    agent.kill()
    for pid in workers:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # torch starts each worker in a new session: its group is its pid
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()
    return workers
