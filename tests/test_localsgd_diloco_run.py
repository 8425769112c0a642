"""Local SGD and DiLoCo through every way in: dptrain run (an exact resume in the middle of a round, a resume on
another number of ranks), the Engine and prepare() with options=."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from _cli import dptrain
from dptrain.testing import run_on_ranks
from test_cli_run import _steps, _straight_and_resumed

pytestmark = pytest.mark.timeout(240)

SETTINGS = {"localsgd": ["--set", "distributed.strategy=localsgd", "--set", "localsgd.period=4", "--set",
                         "localsgd.warmup_steps=1"],
            "diloco": ["--set", "distributed.strategy=diloco", "--set", "diloco.period=4", "--set", "diloco.compression=int8",
                       "--set", "diloco.warmup_steps=1"],
            # Streaming DiLoCo: the checkpoint at step 3 holds fragment 1's int4 reduction in flight
            "streaming": ["--set", "distributed.strategy=diloco", "--set", "diloco.period=4", "--set",
                          "diloco.fragments=2", "--set", "diloco.overlap_steps=1", "--set", "diloco.mixing=0.5",
                          "--set", "diloco.compression=int4"]}


@pytest.mark.parametrize("strategy", ["localsgd", "diloco", "streaming"])
def test_dptrain_run_resumes_in_the_middle_of_a_round_bit_for_bit(tmp_path, strategy):
    """Step 3 of a round of 4: each rank's replica and optimizer state, the step count (and DiLoCo's global weights,
    outer momentum and int8 residuals; Streaming DiLoCo's reduction in flight) come back from the checkpoint."""
    def saved(run_dir):
        ckpt = run_dir / "checkpoints" / "step_00000003" / ("diloco" if strategy == "streaming" else strategy)
        assert sorted(p.name for p in ckpt.iterdir()) == ["rank0.pt", "rank1.pt", "shared.pt"]

    a, b = _straight_and_resumed(tmp_path, SETTINGS[strategy], saved)
    assert _steps(a) == _steps(b)
    assert [r.get("comm_bytes_per_step") for r in a] == [r.get("comm_bytes_per_step") for r in b]
    weights = [load_file(tmp_path / run / "model.safetensors") for run in ("a", "b")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_diloco_checkpoint_resumes_on_another_number_of_ranks_and_says_what_restarts(tmp_path):
    common = ["--set", "task.name=classifier", "--set", "checkpoint.every=3", "--set", "log.progress=lines",
              "--set", "log.plots=false", *SETTINGS["diloco"]]
    first = dptrain("run", "--nproc", "2", *common, "--set", "train.steps=3", "--run-dir", "r", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    more = dptrain("run", "--nproc", "1", *common, "--set", "train.steps=6", "--run-dir", "r", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert "continue their round from the global weights" in more.stdout + more.stderr


# ----------------------------------------------------------------------------- the user API


def _engine_and_prepare(rank: int, world_size: int) -> list[float]:
    from dptrain import BatchPlan, Engine, prepare
    from dptrain.diloco import DiLoCoOptions
    from dptrain.localsgd import LocalSGDOptions

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    from dptrain import end_training, get_state_dict

    spreads = []
    streaming = DiLoCoOptions(period=4, fragments=2, overlap_steps=1, mixing=0.5)  # ends with fragment 0 unmet
    for strategy, options in (("localsgd", LocalSGDOptions(period=2, warmup_steps=1)), ("diloco", DiLoCoOptions(period=2)),
                              ("diloco", streaming)):
        engine = Engine(model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        BatchPlan.resolve(world_size, 4 * world_size, 4, None), strategy=strategy, options=options)
        mine = model()
        prepared, opt = prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1), strategy=strategy, options=options)
        for step in range(4):  # local SGD averages after steps 1 and 3 (0-based), DiLoCo after 2 and 4: equal at the end
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            for k, (m, o) in enumerate(((engine.model, None), (prepared, opt))):
                loss = m(x).square().mean()
                if k == 0:
                    engine.backward(loss)
                    engine.step()
                else:
                    loss.backward()
                    o.step()
                    o.zero_grad()
        if options is streaming:  # fragment 0 took steps 3 and 4 alone: the replicas differ until the close meets it
            before = torch.cat([p.detach().reshape(-1) for p in mine.parameters()])
            for m in (engine, prepared):
                end_training(m)
            after = torch.cat([p.detach().reshape(-1) for p in mine.parameters()])
            same = all(torch.equal(a, b) for a, b in zip(get_state_dict(engine).values(),
                                                          get_state_dict(prepared).values(), strict=True))
            spreads.append(0.0 if same and not torch.equal(before, after) else 1.0)
        for m in (engine.model.module, mine):
            flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(world_size)]
            torch.distributed.all_gather(everyone, flat)
            spreads.append(max((e - flat).abs().max().item() for e in everyone))
    return spreads


def test_the_engine_and_prepare_take_the_strategies_options_and_end_rounds_with_equal_replicas():
    for spreads in run_on_ranks(_engine_and_prepare, 2):
        assert spreads == [0.0] * 7
