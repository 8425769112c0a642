"""CPU ports of torch's GPU-only DDP tests, continued: comm hooks and SyncBatchNorm (issue 41).

The harness: tests/_ddp_ports.py; what "equal" means: tests/test_ddp_ports.py. One spawn for this group.

Comm hooks (test_ddp_hook_parity_*): torch's own hooks from
``torch.distributed.algorithms.ddp_comm_hooks``, registered on torch's DDP and on dptrain's,
each with a fresh state built the same way; 12 steps of an MLP, gradients and parameters
compared after every step. PowerSGD runs with one bucket (several deadlock on gloo with
either engine: docs/ddp.md).

SyncBatchNorm (test_DistributedDataParallel_SyncBatchNorm*): torch 2.13's ``SyncBatchNorm``
refuses CPU input in training (``ValueError: SyncBatchNorm expected input tensor to be on
GPU...``) and its kernels (``torch.batch_norm_stats``) have no CPU implementation, so those
tests cannot run here with either engine (torch's DDP also refuses a CPU model holding
SyncBatchNorm layers at construction, in eval mode too). Ported: that both engines raise
ValueError; and what SyncBatchNorm asks of DDP, a collective inside the
forward and one inside the backward interleaved with the buckets' reductions, with a CPU
stand-in that normalises over the global batch (different batch sizes per rank, as
test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_* do).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from _ddp_ports import BatchNormNet, Record, check_case, group_results, rank_input, sgd_step, snapshot

STEPS = 12


# ------------------------------------------------------------------ comm hooks

def _hook(name: str):
    """(state, hook) as test_ddp_hook_parity_* build them; a fresh state per call."""
    if name == "allreduce":
        return None, default_hooks.allreduce_hook
    if name == "allreduce_process_group":
        return dist.new_group(list(range(dist.get_world_size()))), default_hooks.allreduce_hook
    if name == "fp16_compress":
        return None, default_hooks.fp16_compress_hook
    if name.startswith("powerSGD"):
        return (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            warm_start=name.endswith("warm_start")), powerSGD_hook.powerSGD_hook)
    if name == "fp16_wrapped_allreduce":
        return None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    if name == "fp16_wrapped_powerSGD":
        return (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))
    assert name == "post_localSGD", name
    # local SGD from step 10, on the global group: it still all-reduces every step (torch's comment)
    return (post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=10),
            post_localSGD_hook.post_localSGD_hook)


def hook_parity(rank: int, world_size: int, ddp, hook: str) -> Record:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    state, fn = _hook(hook)
    net = ddp(model, process_group=state if hook == "allreduce_process_group" else None, bucket_cap_mb=25)
    net.register_comm_hook(state, fn)
    record: Record = snapshot("init", model, "value")
    for i in range(STEPS):
        net(rank_input(rank, i, 6, 8)).square().mean().backward()
        record += snapshot(f"iter {i}", model)
        sgd_step(model)
        record += snapshot(f"iter {i}", model, "value")
    return record


# bf16_compress_hook is left out: torch's refuses gloo/CPU (TypeError: "required CUDA 11+ and NCCL 2.10+")
HOOKS = ["allreduce", "allreduce_process_group", "fp16_compress", "powerSGD_warm_start",
         "powerSGD_cold_start", "fp16_wrapped_allreduce", "fp16_wrapped_powerSGD", "post_localSGD"]


# ------------------------------------------------------------------ SyncBatchNorm

def syncbn_refused_on_cpu(rank: int, world_size: int, ddp) -> Record:
    """A converted model on CPU is a ValueError under either engine: torch's DDP refuses it at construction ("SyncBatchNorm
    layers only work with GPU modules"), dptrain's at the first training forward, where SyncBatchNorm itself refuses CPU
    input. The type is compared; where and the message differ (docs/ddp.md)."""
    torch.manual_seed(0)
    try:
        net = ddp(nn.SyncBatchNorm.convert_sync_batchnorm(BatchNormNet()))
        net(rank_input(rank, 0, 2, 2))
    except ValueError as exc:
        assert "SyncBatchNorm" in str(exc), exc
        return [("raised", "ValueError")]
    return [("raised", None)]


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """A CPU stand-in for SyncBatchNorm on (N, C) inputs: statistics over every rank's batch, from one differentiable
    all-reduce of (sum, sum of squares, count) per forward (its backward is one all-reduce too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        c = x.shape[1]
        stats = differentiable_all_reduce(torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])]))
        count = stats[-1]
        mean = stats[:c] / count
        var = stats[c:2 * c] / count - mean * mean  # (C,) biased, as batch norm normalises
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def syncbn_collectives_in_forward_and_backward(rank: int, world_size: int, ddp, find_unused: bool) -> Record:
    """The stand-in between two linear layers; rank r's batch has 2 + 3r rows."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 8), GlobalBatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    net = ddp(model, bucket_cap_mb=0.0004, find_unused_parameters=find_unused)
    record: Record = snapshot("init", model, "value")
    for i in range(6):
        net(rank_input(rank, i, 2 + 3 * rank, 4)).square().mean().backward()
        record += snapshot(f"iter {i}", model)
        sgd_step(model)
        record += snapshot(f"iter {i}", model, "value")
    return record


CASES = {f"hook_parity_{h}": functools.partial(hook_parity, hook=h) for h in HOOKS}
CASES.update({
    "syncbn_refused_on_cpu": syncbn_refused_on_cpu,
    "syncbn_standin": functools.partial(syncbn_collectives_in_forward_and_backward, find_unused=False),
    "syncbn_standin_find_unused": functools.partial(syncbn_collectives_in_forward_and_backward, find_unused=True),
})
NOT_TRAINING = {"syncbn_refused_on_cpu"}


@pytest.mark.parametrize("name", list(CASES))
def test_port_matches_torchs_ddp(request, name: str) -> None:
    check_case(group_results(request, "test_ddp_ports_hooks", list(CASES)), name,
               expect_moved=name not in NOT_TRAINING)
