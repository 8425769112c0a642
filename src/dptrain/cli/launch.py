"""``dptrain launch``: your own training script on N workers, with ``dptrain run``'s launcher.

The script is any torch.distributed program: a plain torch DDP script
(``init_process_group`` with ``env://``), one on dptrain's ``Engine`` or ``prepare()``, or
one on dptrain's DDP or ZeRO. Each rank runs it as ``python SCRIPT ARGS`` would, with
torchrun's variables set (``launch.script``); the launcher supervises them as it does
``dptrain run``'s workers (``launch.local``): the rank that failed first is reported
first, with its traceback, and the others are stopped rather than left waiting in a
collective. With ``--max-restarts`` or several nodes (``--nnodes``, or a Slurm job of
several nodes) torchrun's agent runs the same workers (``launch.elastic``). torchrun's own flags work too
(``--nproc-per-node``, ``--standalone``, ``--rdzv_endpoint``...): ``launch.torchrun_flags`` reads them before
click parses the rest, so a torchrun command line runs with ``torchrun`` replaced by ``dptrain launch``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

import click

from dptrain.launch.torchrun_flags import TorchrunFlagError, TorchrunFlags, split_torchrun_flags, terminal_ranks

__all__ = ["launch"]


NO_FLAGS = TorchrunFlags()  # none of torchrun's flags given
LIVE_FINISH_GRACE_S = 60.0  # after replica 0 finished, the others' time to leave (they stay only to heal it)


class LaunchError(ValueError):
    """Bad input to ``dptrain launch``: one line, exit 2, nothing started or written."""


class _TorchrunFlagsCommand(click.Command):
    """A click command that reads torchrun's flags first (``launch.torchrun_flags``): those with an option of ours
    become it, the rest reach the command as its ``torchrun`` argument, a refused one ends it (one line, exit 2)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = {name: not getattr(p, "is_flag", False) for p in self.get_params(ctx) if isinstance(p, click.Option)
               for name in (*p.opts, *p.secondary_opts)}
        try:
            args, flags = split_torchrun_flags(args, own)
        except TorchrunFlagError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        rest = super().parse_args(ctx, args)
        ctx.params["torchrun"] = flags
        return rest


@click.command(cls=_TorchrunFlagsCommand,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
               epilog="torchrun's flags are accepted too (--nproc-per-node, --standalone, --rdzv-endpoint, "
                      "--master-port...): see docs/launch.md, \"torchrun's flags\".")
@click.option("--nproc", type=int, default=1, show_default=True, help="worker processes on this machine (per node)")
@click.option("-m", "--module", "as_module", is_flag=True,
              help="SCRIPT is a module to run as `python -m MODULE` (e.g. -m mypkg.train)")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="where logs/ and the workers' error records go (default runs/<script name>); the script finds "
                   "it in $DPTRAIN_RUN_DIR")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="restart every worker up to this many times after a failure (torchrun's elastic agent); your "
                   "script resumes from its own checkpoints ($TORCHELASTIC_RESTART_COUNT says which attempt)")
@click.option("--live-restarts", type=int, metavar="N",
              help="live recovery (your loop on dptrain.Live): a failed worker alone is restarted, up to N times, "
                   "and healed by a peer while the others go on; the launcher serves the job's live store "
                   "(docs/api.md, \"Live recovery in your own loop\")")
@click.option("--nnodes", type=int, help="machines in the job, one `dptrain launch` on each (torchrun's c10d "
              "rendezvous); inside a Slurm job of several nodes this and the endpoint come from Slurm")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes: the rendezvous, on one of the machines")
@click.option("--node-rank", type=int, help="with --nnodes: this machine's rank (default: assigned at rendezvous)")
@click.option("--start-method", type=click.Choice(["exec", "forkserver"]), default="exec", show_default=True,
              help="local workers: a fresh interpreter each, as torchrun and `python SCRIPT` start them (exec), "
                   "or forks of a process that imported torch once (forkserver: starts faster, but torch is "
                   "imported before your script runs, so environment variables it sets for torch's import "
                   "come too late)")
@click.option("--timeout", "timeout_s", type=float, metavar="S",
              help="end a hang within S seconds and a few more: the script's collectives time out after S (torch's "
                   "default for groups made without a timeout), a rank whose heartbeat stops for S is ended, "
                   "and so is one whose Engine/prepare() steps stop for S + 5 (default: torch's 30 minutes, no "
                   "watchdog)")
@click.option("--ranks", "ranks_text", metavar="all|R[,R...]",
              help="show these ranks' output on this terminal, each line prefixed [rank r] (as torchrun's --tee "
                   "does), and still write every rank's to RUN_DIR/logs/rank<r>.console (default: rank 0's, "
                   "unprefixed)")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(nproc: int, as_module: bool, run_dir: Path | None, max_restarts: int, live_restarts: int | None,
           nnodes: int | None,
           rdzv_endpoint: str | None, node_rank: int | None, start_method: str, timeout_s: float | None,
           ranks_text: str | None, script: str, args: tuple[str, ...], torchrun: TorchrunFlags = NO_FLAGS) -> None:
    """Run your training script on NPROC workers, as torchrun would, with dptrain's failure report.

    \b
    dptrain launch --nproc 2 train.py --lr 1e-3          # a plain torch DDP script
    dptrain launch --nproc 4 -m mypkg.train              # a module
    dptrain launch --nproc 2 --max-restarts 3 train.py   # under torchrun's elastic agent
    dptrain launch --nproc 4 --live-restarts 10 train.py # live recovery: dptrain.Live in train.py
    srun --ntasks-per-node=1 dptrain launch --nproc 8 train.py   # Slurm, one launch per node

    Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT, so init_process_group("gloo" or "nccl") reads them (env://), and so does
    dptrain.init_distributed(). Rank 0 writes to this terminal, rank r to
    RUN_DIR/logs/rank<r>.console. When a rank fails, the rank that failed first is
    named with its traceback, the others are stopped, and the exit code is 1; see
    docs/launch.md.
    """
    try:
        target = _check_target(script, as_module)
        if nproc < 1:
            raise LaunchError(f"--nproc must be at least 1, got {nproc}")
        if max_restarts < 0:
            raise LaunchError(f"--max-restarts must be >= 0, got {max_restarts}")
        if timeout_s is not None and not 0 < timeout_s < float("inf"):
            raise LaunchError(f"--timeout must be a positive number of seconds, got {timeout_s}")
        nodes = _nodes(nnodes, rdzv_endpoint, node_rank, torchrun, max_restarts)
        if live_restarts is not None and (live_restarts < 0 or max_restarts or nodes is not None):
            raise LaunchError(f"--live-restarts restarts a failed worker alone on this machine (got "
                              f"{live_restarts}, --max-restarts {max_restarts}, {nodes.nnodes if nodes else 1} "
                              "node(s)): give a count >= 0 without --max-restarts or several nodes; on several "
                              "machines run one launch per replica (docs/cluster.md, \"live recovery\")")
        shown = terminal_ranks(torchrun, nproc) if torchrun.output else _shown(ranks_text, nproc)
    except (LaunchError, TorchrunFlagError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    run_dir = (run_dir or Path("runs") / target).resolve()
    worker_args = (["-m"] if as_module else []) + [script, *args]
    env = {"DPTRAIN_RUN_DIR": str(run_dir)}
    if timeout_s is not None:
        env["DPTRAIN_TIMEOUT_S"] = repr(timeout_s)
    from dptrain.launch.threads import omp_threads, omp_warning, threads_per_worker

    if omp_threads(os.environ) is None:  # unset, or not a thread count (torch ignores such a value too)
        if omp_warning(os.environ):
            click.echo(omp_warning(os.environ), err=True)
        env["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    for note in torchrun.notes:
        click.echo(f"dptrain launch: {note}", err=True)
    if nodes is not None:
        click.echo(f"dptrain launch: {nproc} worker(s) here, one of {nodes.nnodes} node(s) meeting at "
                   f"{nodes.endpoint} (torchrun's {nodes.backend} rendezvous)", err=True)
    from dptrain.launch.run_lock import RunDirError, hold_run_dir

    # One machine's launcher holds the run directory; over several nodes on a shared file system each node's
    # launcher would refuse the others, so the lock is this machine's only.
    alone = nodes is None or nodes.nnodes == 1
    try:
        with hold_run_dir(run_dir, "dptrain launch") if alone else contextlib.nullcontext() as lock:
            if live_restarts is not None:
                sys.exit(_start_live(nproc, worker_args, run_dir, live_restarts, env, timeout_s, start_method,
                                     shown, lock.fd, torchrun))
            sys.exit(_start(nproc, worker_args, run_dir, max_restarts, nodes, env, timeout_s, start_method, shown,
                            None if lock is None else lock.fd, torchrun))
    except RunDirError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _start(nproc: int, worker_args: list[str], run_dir: Path, max_restarts: int, nodes, env: dict[str, str],
           timeout_s: float | None, start_method: str, shown: frozenset[int] | None, lock_fd: int | None,
           torchrun: TorchrunFlags) -> int:
    """The workers, under this launcher or torchrun's agent (restarts, several nodes); the job's exit code.
    They hold the run directory's lock with us (``lock_fd``)."""
    if max_restarts or nodes is not None:
        from dptrain.launch.elastic import launch_elastic

        if timeout_s is not None and torchrun.monitor_interval_s:  # the agent reaps its workers this often
            timeout_s = max(timeout_s, 2 * torchrun.monitor_interval_s)
        return launch_elastic(nproc, worker_args, run_dir, max_restarts, "dptrain.launch.script", nodes, env,
                              shown=shown, lock_fd=lock_fd, timeout_s=timeout_s, agent_args=torchrun.agent_args)
    from dptrain.launch.local import launch_local

    env = {**env, **_torchrun_env(torchrun)}
    return launch_local(nproc, worker_args, run_dir, timeout_s=timeout_s or float("inf"), start_method=start_method,
                        roll_call_s=0.0, module="dptrain.launch.script", env=env, shown=shown, lock_fd=lock_fd)


def _start_live(nproc: int, worker_args: list[str], run_dir: Path, live_restarts: int, env: dict[str, str],
                timeout_s: float | None, start_method: str, shown: frozenset[int] | None, lock_fd: int,
                torchrun: TorchrunFlags) -> int:
    """A live-recovery job: the live store served here, held until every worker is done (it outlives each of
    them), and a failed worker restarted alone (``launch.local``'s :class:`RestartFailed`)."""
    from dptrain.launch.local import RestartFailed, launch_local
    from dptrain.live.store import LIVE_STORE_ENV, serve_store

    store = serve_store("127.0.0.1", 0)
    env = {**env, **_torchrun_env(torchrun), LIVE_STORE_ENV: f"127.0.0.1:{store.port}"}
    policy = RestartFailed(live_restarts, LIVE_FINISH_GRACE_S, limit="--live-restarts", who="dptrain launch")
    return launch_local(nproc, worker_args, run_dir, timeout_s=timeout_s or float("inf"), start_method=start_method,
                        roll_call_s=0.0, module="dptrain.launch.script", env=env, shown=shown, lock_fd=lock_fd,
                        restart=policy)


def _torchrun_env(torchrun: TorchrunFlags) -> dict[str, str]:
    """torchrun's variables that are the same on every local worker, as torchrun's flags set them; each worker
    adds its own (ROLE_RANK...) and the rendezvous of --master-addr/--master-port (``launch.script``)."""
    from dptrain.launch.script import MASTER_ADDR_ENV, MASTER_PORT_ENV

    run_id = str(uuid.uuid4()) if torchrun.standalone else torchrun.rdzv_id or "none"  # torchrun's, both
    env = {"ROLE_NAME": torchrun.role or "default", "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    if _static(torchrun, None):  # torchrun meets at --master-addr:--master-port only then
        if torchrun.master_addr is not None:
            env[MASTER_ADDR_ENV] = torchrun.master_addr
        if torchrun.master_port is not None:
            env[MASTER_PORT_ENV] = str(torchrun.master_port)
    return env


def _static(torchrun: TorchrunFlags, endpoint: str | None) -> bool:
    """Whether torchrun would meet at --master-addr:--master-port (its static rendezvous) for these flags."""
    if torchrun.standalone or torchrun.rdzv_backend == "c10d":
        return False
    return torchrun.rdzv_backend == "static" or endpoint is None


def _shown(text: str | None, nproc: int) -> frozenset[int] | None:
    """``--ranks``: the local ranks whose output the terminal shows, prefixed; None: rank 0's as it is."""
    if text is None:
        return None
    from dptrain.launch.output import parse_ranks

    try:
        return parse_ranks(text, nproc)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def _check_target(script: str, as_module: bool) -> str:
    """The script's (module's) short name, once it is known to exist: the default run directory's name."""
    if as_module:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # where `python -m` looks first
        try:
            found = importlib.util.find_spec(script)
        except (ImportError, ValueError) as e:
            raise LaunchError(f"module {script!r} cannot be found: {e}") from None
        finally:
            sys.path.pop(0)
        if found is None:
            raise LaunchError(f"no module named {script!r} from {os.getcwd()} (is its package installed, or on "
                              "PYTHONPATH?)")
        return script.rsplit(".", 1)[-1]
    path = Path(script)
    if not path.is_file():
        hint = " (a module? add -m)" if "/" not in script and not script.endswith(".py") else ""
        raise LaunchError(f"no script {script!r}{hint}: give the path of a Python file to run")
    return path.stem


def _nodes(nnodes: int | None, endpoint: str | None, node_rank: int | None, torchrun: TorchrunFlags,
           max_restarts: int):
    """Where the job meets: None for this machine alone (the local launcher, or torchrun's --standalone agent under
    --max-restarts), else torchrun's rendezvous: from the options, from --master-addr/--master-port (torchrun's
    static rendezvous), or from Slurm."""
    from dptrain.launch.elastic import Nodes, slurm_nodes

    steps = int(os.environ.get("SLURM_STEP_NUM_TASKS", 0))
    if steps > int(os.environ.get("SLURM_STEP_NUM_NODES", steps)):
        raise LaunchError(f"this Slurm step runs {steps} tasks on {os.environ['SLURM_STEP_NUM_NODES']} node(s), but "
                          "dptrain launch starts its node's workers itself: run one per node (srun "
                          "--ntasks-per-node=1 dptrain launch --nproc G ...), or each task as one worker (srun "
                          "python -m dptrain.launch.script SCRIPT ...)")
    if nnodes is not None and nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {nnodes}")
    if torchrun.standalone:  # as torchrun does, --rdzv-endpoint and --node-rank are then ignored
        if nnodes not in (None, 1):
            raise LaunchError(f"--standalone runs one machine, but --nnodes {nnodes}: drop --standalone and give "
                              "every machine the same --rdzv-endpoint HOST:PORT")
        return None
    static = _static(torchrun, endpoint) and (torchrun.master_addr, torchrun.master_port) != (None, None)
    if nnodes is None and endpoint is None and not static:
        if node_rank:
            raise LaunchError(f"--rdzv-endpoint and --node-rank go with --nnodes N: --node-rank {node_rank} "
                              "names a machine of several")
        return slurm_nodes(os.environ)
    if (nnodes or 1) == 1 and endpoint is None and not (static and max_restarts):  # this machine, our launcher
        if node_rank:
            raise LaunchError(f"--node-rank {node_rank} with one machine: node ranks run from 0 to --nnodes - 1")
        return None
    if endpoint is None and static:
        endpoint = f"{torchrun.master_addr or '127.0.0.1'}:{torchrun.master_port or 29500}"  # torchrun's defaults
    if endpoint is None:
        slurm = slurm_nodes(os.environ)
        if slurm is None:
            raise LaunchError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every machine "
                              "(one of them, reachable from all)")
        endpoint = slurm.endpoint
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")
    run_id = torchrun.rdzv_id or os.environ.get("SLURM_JOB_ID", "dptrain")
    backend = "static" if static or torchrun.rdzv_backend == "static" else "c10d"
    return Nodes(nnodes or 1, endpoint, run_id, node_rank, backend)
