"""Where the tuner's probes and trials run: this machine, the emulated cluster, or the user's launcher.

Each runs a job (``python -m MODULE ARGS`` on every rank, torchrun's environment set)
and returns its exit code; a job past its timeout is killed with its process group and
reported as 124; a failed job's whole error output is kept in the file its caller names
(``errors``, in the trial's or probe's own directory), which a one-line reason cannot
hold. Every probe and trial is such a job, so what is measured is measured on the ranks
that will train:

- :class:`Local`: ``torchrun --standalone --nproc-per-node N`` on this machine;
- :class:`Emulated`: ``dptrain cluster``'s hosts (network namespaces, each host's link
  limited by tc's token bucket; root), the network kept up for the whole search;
- :class:`Launcher`: a command the user gives, which starts ``python -m ...`` on every
  rank of several machines (``srun ... torchrun ...``; ARGS are appended). Its files
  (the probes' results, the trials' run directories) must be on a file system every
  host and this process share.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from dptrain.utils.atomic import write_text_atomic

__all__ = ["Machine", "Local", "Emulated", "Launcher", "JOB_ERRORS", "where_kept"]

JOB_ERRORS = "job-errors.txt"  # a failed job's whole error output: the file name's end, beside what the job ran


def where_kept(errors: Path) -> str:
    """Where a failed job's whole error output is, for its one-line reason: nothing where the machine kept none."""
    return f" (all its error output: {errors})" if errors.is_file() else ""


class Machine(ABC):
    """``hosts`` x ``per_host`` ranks; ``shared_net``: a host's ranks share one link to the others.

    ``probes_in_one_job``: whether a calibration round's probes may run in one job (:mod:`dptrain.tune.probe_runs`)
    rather than one job each, as trials do. Only where the two were measured to time a probe alike and the
    calibration so made was checked against trials (``docs/tune.md``): on 2 local ranks (median
    ratio 0.999, 0.979-1.014) and on the emulated cluster (4 x 1 at 10 Gbit/s: 1.011, 0.995-1.036; its calibrations
    so made predicted three settings' measured medians with a mean error of 7.7% and 8.0%, against 7.3% one job
    each; the fourth and fifth passes). Not under a launcher (torchrun, Slurm): not measured there.
    """

    probes_in_one_job = False

    def __init__(self, hosts: int, per_host: int, shared_net: bool = False):
        self.hosts, self.per_host, self.shared_net = hosts, per_host, shared_net

    @property
    def world_size(self) -> int:
        return self.hosts * self.per_host

    @property
    @abstractmethod
    def where(self) -> str:
        """The machine in words, for the table and the calibration."""

    @abstractmethod
    def job(self, args: list[str], timeout: float, errors: Path | None = None) -> tuple[int, str]:
        """Run ``python -m ...`` (``args``) on every rank; the exit code (124: killed at ``timeout``) and the
        last lines of its error output (where the machine captures it), all of which a failed job leaves in a new
        file ``errors`` (where given)."""

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
         errors: Path | None = None) -> tuple[int, str]:
    """``cmd`` in its own session; killed with its process group after ``timeout`` s (124)."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        code = 124
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, _failed(code, err, errors)


def _failed(code: int, err: bytes, errors: Path | None) -> str:
    """What a job's error output ``err`` leaves: nothing where it succeeded; else its last lines (:func:`_tail`), and
    all of it in ``errors`` (where given; written whole or not at all, never through a link)."""
    if not code:
        return ""
    if errors is not None:
        write_text_atomic(errors, err.decode(errors="replace"))
    return _tail(err)


_RAISED = re.compile(r"^\[rank\d+\]: [\w.]*(Error|Exception)\w*: ")  # a rank's exception, as torchrun prefixes it


def _tail(err: bytes, lines: int = 3) -> str:
    """A failed job's last ``lines`` lines that say something, ending in the last exception a rank printed where
    one did (torchrun's ``[rankN]: `` prefix on it, kept once): torchrun's summary after it ends in a rule of ``=``
    and a pointer to its docs, which a trial's one-line reason (the last line) would otherwise be."""
    kept = [re.sub(r"^(\[rank\d+\]: )+", r"\1", x) for x in err.decode(errors="replace").splitlines()
            if x.strip() and x.strip().strip("=-") != ""]
    raised = [x for x in kept if _RAISED.match(x)]
    if raised and raised[-1] != kept[-1]:
        return "\n".join([*kept[-(lines - 1):], raised[-1]])
    return "\n".join(kept[-lines:])


class Local(Machine):
    """``nproc`` ranks on this machine."""

    probes_in_one_job = True  # measured alike (the Machine docstring above)

    def __init__(self, nproc: int):
        super().__init__(1, nproc)

    @property
    def where(self) -> str:
        return f"this machine, {self.per_host} ranks"

    def job(self, args: list[str], timeout: float, errors: Path | None = None) -> tuple[int, str]:
        """``python -m ARGS`` on every rank, under ``dptrain launch`` (its logs and lock in a directory of the job's
        own, removed after): the rank that failed first is the one the tail names."""
        with tempfile.TemporaryDirectory(prefix="dptrain-tune-") as launch_dir:
            return _run([sys.executable, "-m", "dptrain.cli", "launch", "--nproc", str(self.per_host),
                         "--run-dir", launch_dir, *args], timeout, errors=errors)


class Emulated(Machine):
    """``hosts`` emulated hosts of ``per_host`` ranks, each host's link at ``rate_gbit`` (``dptrain cluster``)."""

    probes_in_one_job = True  # measured alike (the Machine docstring above)

    def __init__(self, hosts: int, per_host: int, rate_gbit: float):
        if not 0 < rate_gbit < math.inf:
            raise ValueError(f"--bandwidth-gbit must be a positive link rate in Gbit/s, got {rate_gbit:g}; e.g. "
                             "--bandwidth-gbit 1")
        super().__init__(hosts, per_host, shared_net=True)
        self.rate_gbit, self._network = rate_gbit, None

    @property
    def where(self) -> str:
        return f"the emulated cluster, {self.hosts} hosts x {self.per_host} ranks, links at {self.rate_gbit:g} Gbit/s"

    def __enter__(self) -> Emulated:
        from dptrain.cluster import Network, check_root

        check_root()
        self._network = Network(self.hosts, rate_mbit=self.rate_gbit * 1000).__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._network is not None:
            self._network.__exit__(*exc)
            self._network = None

    def job(self, args: list[str], timeout: float, errors: Path | None = None) -> tuple[int, str]:
        from dptrain.cluster import run_on_cluster

        if self._network is None:
            raise RuntimeError("the emulated cluster is not up: use it in a with-block")
        with tempfile.TemporaryFile() as err:
            code = run_on_cluster(self._network, self.per_host, args, timeout=timeout, env={"OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.DEVNULL, stderr=err)
            err.seek(0)
            return code, _failed(code, err.read(), errors)


class Launcher(Machine):
    """The user's command for a job of ``hosts`` x ``per_host`` ranks; ``python -m ARGS`` is appended."""

    def __init__(self, command: str, hosts: int, per_host: int):
        super().__init__(hosts, per_host, shared_net=False)
        if not shlex.split(command):
            raise ValueError("the launcher command is empty: give e.g. 'srun --nodes 2 python -m torch.distributed.run "
                             "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500'")
        self.command = command

    @property
    def where(self) -> str:
        return f"{self.hosts} hosts x {self.per_host} ranks, started by: {self.command}"

    def job(self, args: list[str], timeout: float, errors: Path | None = None) -> tuple[int, str]:
        return _run(shlex.split(self.command) + args, timeout, errors=errors)
