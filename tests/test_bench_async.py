"""The async study's per-round table: each round's speed over DDP's in the same round, and the goal count."""

from dptrain.bench.async_study import per_round


def test_per_round_ratios_pair_each_run_with_ddps_run_of_the_same_round():
    ddp = {"variant": "DDP", "runs": [{"samples_per_s": 100.0}, {"samples_per_s": 50.0}]}
    ps = {"variant": "PS async", "runs": [{"samples_per_s": 160.0}, {"samples_per_s": 70.0}]}
    text = per_round({"rounds": 2, "rows": [ddp, ps]}, ddp)
    assert "| PS async | 1.60 | 1.40 | 1 of 2 |" in text
    assert "| DDP |" not in text
