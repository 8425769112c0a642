"""One job that measures what a calibration needs before its probe runs: the links, then each model's compute.

A calibration used to start three jobs before its probes ran: the links' collectives
(:mod:`dptrain.tune.link_probe`), the probe models' compute profiles and the tuned
model's (:mod:`dptrain.tune.compute_probe`, twice). Each start costs the agents, every
rank importing torch and the rendezvous, about 13 s on the emulated 4-host cluster
(``docs/tune.md``), more than either measurement. Here one process group does all of it
in order: the links first, timed as the link probe's own job times them (each
collective once untimed, then its median of five, nothing else running), all ranks
and then, with ``--links-within``, inside each host; then each ``--probe`` model,
profiled on every rank at once without communication, as the compute probe's own job
profiles it. Rank 0 writes each result to its file.

    torchrun ... -m dptrain.tune.calibration_job --links L.json [--links-within W.json] \\
        --probe A.json A.toml 4 [--probe B.json B.toml 16,8 ...]
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from dptrain.launch.rendezvous import leave_process_groups
from dptrain.tune.compute_probe import add_probe_arguments, probes_from, profile_model
from dptrain.tune.link_probe import time_links
from dptrain.utils.collector import freeze_imports
from dptrain.utils.worker_exit import exit_worker

__all__ = ["main", "measure"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dptrain.tune.calibration_job")
    parser.add_argument("--links", required=True, help="where rank 0 writes the collectives' times over all ranks")
    parser.add_argument("--links-within", help="where rank 0 writes their times inside each host (several ranks)")
    add_probe_arguments(parser)
    args = parser.parse_args(argv)
    probes = probes_from(args, parser, [])
    dist.init_process_group("gloo")
    measure(args.links, args.links_within, probes, args.steps)
    leave_process_groups()


def measure(links: str, links_within: str | None, probes: list[tuple[str, str, list[int]]], steps: int) -> None:
    """In the job's process group: the links over all ranks into ``links``, inside each host into ``links_within``
    (if given), then each of ``probes`` (output, config, micro-batch sizes) profiled for ``steps`` steps."""
    time_links(links)
    if links_within:
        time_links(links_within, within_hosts=True)
    for out, config, micro_batches in probes:
        profile_model(out, config, micro_batches, steps)


if __name__ == "__main__":
    freeze_imports()  # this worker's exit walks none of torch's objects (dptrain.utils.collector)
    main()
    exit_worker(0)  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
