"""What every task of a Slurm job can compute alone: the job's first host, and a port derived from its id.

Both the workers ``srun`` starts (``rendezvous.detect_worker_env``) and one ``dptrain launch``
per node (``elastic.slurm_nodes``) meet there without talking to each other first. No torch
import: the launchers read it too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["first_slurm_host", "job_port"]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.fullmatch(r"(.*)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def job_port(environ: Mapping[str, str]) -> int:
    """A port in [20000, 40000) from ``SLURM_JOB_ID``: the same on every node of the job, different for the next."""
    return 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000
