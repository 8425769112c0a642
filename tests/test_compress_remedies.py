"""Top-k's and PowerSGD's remedies (compress/remedies.py) through the DDP hook, step by step, against their formulas.

Each test runs the hook on 2 ranks for a few steps (the model held fixed, a new batch per
step) and recomputes every step's reduced gradient in one process, from the formulas
written out here in plain torch: DGC's local clipping, momentum correction with masking
and sparsity warm-up for top-k; for PowerSGD the uncompressed start, the warm-up rank and
the velocity fed to PowerSGD's error feedback.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.compress import make_codec
from dptrain.compress.hook import CompressionHook
from dptrain.compress.remedies import Remedies
from dptrain.testing import run_on_ranks

WORLD, STEPS = 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)


def _local_grads(rank: int, step: int) -> list[torch.Tensor]:
    model = _model()
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _hooked_steps(rank: int, world_size: int, codec: str, remedies: Remedies, bucket_mb: float) -> dict:
    model = DistributedDataParallel(_model(), bucket_cap_mb=bucket_mb)
    hook = CompressionHook(make_codec(codec, topk_fraction=0.01, powersgd_rank=1), remedies=remedies)
    model.register_comm_hook(None, hook)
    order = [n for n, _ in model.module.named_parameters()]
    steps = []
    for step in range(STEPS):
        hook.begin_step(step)
        for p in model.module.parameters():
            p.grad = None
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        steps.append([p.grad.clone() for p in model.module.parameters()])
    return {"steps": steps, "buckets": [[order.index(n) for n in names] for names in model.bucket_assignment]}


def _split(flat: torch.Tensor, bucket: list[int], like: list[torch.Tensor], out: list) -> None:
    at = 0
    for i in bucket:
        out[i] = flat[at:at + like[i].numel()].view_as(like[i])
        at += like[i].numel()


def test_topk_with_clipping_momentum_correction_masking_and_warmup_follows_dgc() -> None:
    m, clip, warmup = 0.9, 0.05, 2
    got = run_on_ranks(_hooked_steps, WORLD, "topk", Remedies(momentum=m, local_clip=clip, topk_warmup_steps=warmup),
                       0.01, timeout=120)
    buckets = got[0]["buckets"]
    assert len(buckets) > 1  # clipping and accumulation are per bucket
    u = {(r, b): 0.0 for r in range(WORLD) for b in range(len(buckets))}
    v = dict(u)
    clipped = 0
    # the fraction sent: 25%, then 4x less per stage (3 stages from 25% to 1%) over the warm-up, then 1%
    fractions = [0.25, 0.0625, 0.01, 0.01]
    for step in range(STEPS):
        local = [_local_grads(r, step) for r in range(WORLD)]
        want = [None] * len(local[0])
        for b, bucket in enumerate(buckets):
            total = 0.0
            for r in range(WORLD):
                g = torch.cat([local[r][i].reshape(-1) for i in bucket])
                limit = clip / math.sqrt(WORLD)  # local clipping of the rank's own gradient
                if g.norm() > limit:
                    g, clipped = g * (limit / g.norm()), clipped + 1
                share = g / WORLD
                u[r, b] = m * u[r, b] + share  # momentum correction: the rank's velocity ...
                v[r, b] = v[r, b] + u[r, b]  # ... accumulated
                k = max(1, math.ceil(fractions[step] * share.numel()))
                top = v[r, b].abs().topk(k).indices
                sent = torch.zeros_like(share)
                sent[top] = v[r, b][top]
                total = total + sent
                v[r, b], u[r, b] = v[r, b].clone(), u[r, b].clone()  # masking: sent coordinates leave both
                v[r, b][top] = 0.0
                u[r, b][top] = 0.0
            _split(total, bucket, local[0], want)
        for r in range(WORLD):
            for g, w in zip(got[r]["steps"][step], want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert clipped > 0  # the clip was small enough to act


def test_powersgd_uncompressed_start_warmup_rank_and_velocity_follow_their_formulas() -> None:
    from dptrain.compress.powersgd import PowerSGD

    m = 0.5
    remedies = Remedies(momentum=m, powersgd_uncompressed_steps=1, powersgd_warmup_rank=2, powersgd_warmup_steps=3)
    got = run_on_ranks(_hooked_steps, WORLD, "powersgd", remedies, 100, timeout=120)  # one bucket
    n_params = len(got[0]["steps"][0])
    position = {i: n_params - 1 - i for i in range(n_params)}  # the bucket holds them in gradient-ready order
    u = [0.0] * WORLD
    residual, qs = {}, {}
    ranks = [None, 2, 2, 1]  # step 0 uncompressed, steps 1-2 at the warm-up rank, then rank 1
    for step in range(STEPS):
        local = [_local_grads(r, step) for r in range(WORLD)]
        order = [i for i in reversed(range(n_params))]
        for r in range(WORLD):  # the velocity of each rank's share, over the whole bucket
            u[r] = m * u[r] + torch.cat([local[r][i].reshape(-1) for i in order]) / WORLD
        vel = [dict(zip(order, torch.split(u[r], [local[r][i].numel() for i in order]), strict=True)) for r in range(WORLD)]
        rank = ranks[step]
        if step > 0 and rank != ranks[step - 1]:
            qs.clear()  # a new rank: Q starts again from the seeded random one
        want = []
        for i in range(n_params):
            shape = local[0][i].shape
            if rank is None or len(shape) < 2:  # uncompressed: the sum of the velocities
                want.append((vel[0][i] + vel[1][i]).view(shape))
                continue
            mats = [vel[r][i].view(shape[0], -1) + residual.get((r, i), 0.0) for r in range(WORLD)]
            q = qs.get(i, PowerSGD(rank).initial_q((0, position[i]), mats[0].shape[1]))
            p_hat = torch.linalg.qr(sum(mt @ q for mt in mats), mode="reduced").Q
            q_local = [mt.t() @ p_hat for mt in mats]
            q_sum = q_local[0] + q_local[1]
            for r in range(WORLD):
                residual[r, i] = mats[r] - p_hat @ q_local[r].t()
            qs[i] = q_sum
            want.append((p_hat @ q_sum.t()).view(shape))
        for r in range(WORLD):
            for g, w in zip(got[r]["steps"][step], want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("codec,remedies,message", [
    ("int8", Remedies(momentum=0.9), "momentum_correction set"),
    ("powersgd", Remedies(topk_warmup_steps=10), "topk_warmup_steps"),
    ("topk", Remedies(powersgd_uncompressed_steps=10), "powersgd_uncompressed_steps"),
    ("powersgd", Remedies(powersgd_warmup_rank=8), "go together"),
])
def test_remedies_a_codec_has_no_use_for_are_refused(codec, remedies, message) -> None:
    with pytest.raises(ValueError, match=message):
        remedies.check(codec)


def _resumed_steps(rank: int, world_size: int, split: int) -> list[list[torch.Tensor]]:
    """PowerSGD with every remedy for STEPS steps, the hook rebuilt from its state dict before step ``split``."""
    remedies = Remedies(momentum=0.5, powersgd_uncompressed_steps=1, powersgd_warmup_rank=2, powersgd_warmup_steps=2)
    model = DistributedDataParallel(_model(), bucket_cap_mb=100)
    hook = CompressionHook(make_codec("powersgd", powersgd_rank=1), remedies=remedies)
    model.register_comm_hook(None, hook)
    steps = []
    for step in range(STEPS):
        if step == split:  # as a resumed run: a new model, engine and hook, loaded
            state = hook.state_dict()
            model = DistributedDataParallel(_model(), bucket_cap_mb=100)
            hook = CompressionHook(make_codec("powersgd", powersgd_rank=1), remedies=remedies)
            hook.load_state_dict(state)
            model.register_comm_hook(None, hook)
        hook.begin_step(step)
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        steps.append([p.grad.clone() for p in model.module.parameters()])
        for p in model.module.parameters():
            p.grad = None
    return steps


def test_a_hook_resumed_from_its_state_dict_mid_warmup_continues_exactly() -> None:
    # resumed before step 2, where the warm-up rank 2 ends and rank 1 begins
    straight, resumed = (run_on_ranks(_resumed_steps, WORLD, split, timeout=120) for split in (STEPS, 2))
    for a, b in zip(straight, resumed, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            for x, y in zip(step_a, step_b, strict=True):
                assert torch.equal(x, y)
