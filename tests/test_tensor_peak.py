"""TensorPeak: the live tensor bytes of a step, counted exactly, operation by operation."""

from __future__ import annotations

import torch
from torch import nn

from dptrain.runner.tensor_peak import TensorPeak, data_tensors

MiB = 2**20


def test_the_peak_is_the_most_bytes_alive_at_once_each_storage_counted_once() -> None:
    kept = torch.zeros(MiB // 4)  # 1 MiB alive before and after
    with TensorPeak(extra=[kept]) as peak:
        start = peak.live_bytes
        a = torch.ones(2 * MiB // 4)          # +2 MiB
        view = a[: MiB // 4]                  # a view: no new storage
        b = view * 2                          # +1 MiB (3 MiB above the start: the peak)
        del a, view, b                        # -3 MiB
        c = torch.ones(MiB // 4)              # +1 MiB
        c.resize_(2 * MiB // 4)               # grown in place: +1 MiB
        del kept                              # a storage alive at the start, freed: -1 MiB
    assert peak.peak_bytes - start == 3 * MiB
    assert peak.live_bytes - start == MiB     # c (2 MiB) in, kept (1 MiB) out
    del c


def test_a_training_step_holds_parameters_gradients_optimizer_state_and_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 256)
    data = torch.randn(10_000, 256)  # a data set: not counted

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the momentum buffers exist from here on
    params = sum(p.numel() for p in model.parameters()) * 4
    with TensorPeak(exclude=data_tensors(torch.utils.data.TensorDataset(data))) as peak:
        start = peak.live_bytes
        step()
    # parameters and momentum (2P) among the tensors alive at the start, not the data set's 10 MiB;
    # the step's gradients (P) and activations (32 x (1024 + 1024 + 256) floats, some freed early) on top
    assert start >= 2 * params
    with TensorPeak() as everything:
        pass
    assert everything.live_bytes - start >= data.numel() * 4  # the data set is what was left out
    assert params + 0.1 * MiB < peak.peak_bytes - start < params + 0.4 * MiB
