"""Communication per step, counted: ZeRO stages 1-2 send what DDP sends, stage 3 about 1.5x.

Every byte goes through dptrain's ring algorithm with a :class:`dptrain.comm.Traffic`
counter, in the DDP engine and in ZeRO alike. Per optimizer step and rank, with Ψ
fp32 parameters: DDP all-reduces 2(N-1)/N x 4Ψ; stages 1-2 reduce-scatter the
gradients and all-gather the parameters, (N-1)/N x 4Ψ each, the same total; stage 3
all-gathers the parameters twice (forward and backward), 3/2 of that, less what the
root unit (kept through the step) saves.
"""

from __future__ import annotations

import pytest
import torch

from _models import Layer, build, global_batch, loss_fn
from dptrain import DistributedDataParallel, comm
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO

STEPS = 3


def _bytes_per_step(rank: int, world_size: int, stage: int, reshard: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = build("stack")
    numel = sum(p.numel() for p in model.parameters())
    traffic = comm.Traffic()
    if stage == 0:
        wrapped = DistributedDataParallel(model, algorithm="ring", traffic=traffic, bucket_cap_mb=0.001)
    else:
        kw = {"unit_classes": (Layer,), "reshard_after_forward": reshard} if stage == 3 else {"bucket_cap_mb": 0.001}
        wrapped = ZeRO(model, stage=stage, algorithm="ring", traffic=traffic, **kw)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    for step in range(STEPS + 1):
        if step == 1:
            traffic.reset()  # the first forward of stages 1-2 has nothing to gather
        x, y = global_batch("stack", step, 4)
        optimizer.zero_grad()
        loss_fn("stack", wrapped(x), y).backward()
        optimizer.step()
    return numel, traffic.bytes_sent // STEPS


@pytest.mark.parametrize("world_size", [2, 4])
def test_stages_1_2_send_what_ddp_sends_and_stage_3_half_as_much_again(world_size: int) -> None:
    ddp = run_on_ranks(_bytes_per_step, world_size, 0, True, timeout=120)
    numel = ddp[0][0]
    ring_all_reduce = 2 * (world_size - 1) / world_size * 4 * numel
    for rank in range(world_size):
        assert ddp[rank][1] == pytest.approx(ring_all_reduce, rel=0.02)
    for stage in (1, 2):
        zero = run_on_ranks(_bytes_per_step, world_size, stage, True, timeout=120)
        for rank in range(world_size):
            assert zero[rank][1] == pytest.approx(ddp[rank][1], rel=0.02), (stage, rank, zero[rank], ddp[rank])
    full = run_on_ranks(_bytes_per_step, world_size, 3, True, timeout=120)
    kept = run_on_ranks(_bytes_per_step, world_size, 3, False, timeout=120)
    for rank in range(world_size):
        ratio = full[rank][1] / ddp[rank][1]
        assert 1.3 <= ratio <= 1.5 + 1e-9, ratio  # 1.5 if the root unit were resharded too
        assert kept[rank][1] == pytest.approx(ddp[rank][1], rel=0.02)  # no re-gather for backward
