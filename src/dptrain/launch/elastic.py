"""``dptrain run --max-restarts K``: the same workers under torchrun's elastic agent.

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

The same job under plain torchrun behaves the same:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        -m dptrain.run --run-dir runs/job --set checkpoint.every=50
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["launch_elastic", "torchrun_command"]


def torchrun_command(nproc: int, max_restarts: int, worker_args: list[str]) -> list[str]:
    """torchrun on this machine (a standalone rendezvous on a free port) running ``dptrain.run``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", "dptrain.run", *worker_args]


def launch_elastic(nproc: int, worker_args: list[str], run_dir: Path, max_restarts: int) -> int:
    """Run the job under torchrun with ``max_restarts``; return its exit code."""
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # [Note: a fresh store per restart]
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # torchrun would say 1
    env.pop("DPTRAIN_LAUNCHER", None)  # the workers print their own errors, as under torchrun
    try:
        return subprocess.run(torchrun_command(nproc, max_restarts, worker_args), env=env).returncode
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
