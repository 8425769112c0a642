"""Reproduce: torch's PowerSGD hook deadlocks on gloo with several buckets (torch's own DDP).

PowerSGD's hook chains collectives in ``Future.then`` callbacks. On gloo those callbacks
run on gloo's worker threads as the previous collective finishes, so with several
buckets in flight the order in which ranks issue the chained collectives depends on
timing, and the ranks end up waiting in different collectives. With one bucket there
is nothing to interleave. The same happens on dptrain's engine, which runs torch's
hooks unchanged; dptrain's tests use PowerSGD with one bucket on gloo.

    python docs/repro/powersgd_gloo_deadlock.py
"""

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from dptrain.testing import RankTimeoutError, run_on_ranks


def _train(rank: int, world_size: int, bucket_cap_mb: float) -> str:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)),
        bucket_cap_mb=bucket_cap_mb)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, min_compression_rate=0.1)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(8):
        model(torch.randn(4, 6)).pow(2).mean().backward()
    return "ok"


if __name__ == "__main__":
    for cap, label in ((25, "one bucket"), (0.0004, "several buckets")):
        outcomes = []
        for _ in range(3):
            try:
                run_on_ranks(_train, 2, cap, timeout=20)
                outcomes.append("ran")
            except RankTimeoutError:
                outcomes.append("hung")
        print(f"torch DDP + torch PowerSGD hook, gloo, {label}: {', '.join(outcomes)}")
