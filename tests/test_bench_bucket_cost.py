"""``dptrain bench bucket-cost``: the op groups, and one small run's shape (no timing is asserted)."""

from dptrain.bench.bucket_cost import _group, run, table


def test_ops_fall_in_their_groups():
    assert [_group(n) for n in ("aten::copy_", "aten::mul", "aten::_foreach_copy_", "c10d::allreduce_",
                                "torch::autograd::AccumulateGrad", "aten::mm")] == \
        ["copies", "copies", "copies", "collectives", "hooks", "rest"]


def test_a_small_run_reports_every_variant_at_every_cap():
    result = run(1, [0.01, 1.0], "mlp", 64, 2, 4, rounds=2, steps=1, warmup=1)  # 16 KiB weights
    assert set(result["caps"]) == {"0.01", "1.0"}
    small, large = result["caps"]["0.01"], result["caps"]["1.0"]
    assert len(small["buckets"]["dptrain"]) > len(large["buckets"]["dptrain"]) == 1  # a bucket per cap's worth
    assert set(small["median_step_ms"]) == {"floor", "torch", "dptrain"}
    assert all(v > 0 for v in small["median_step_ms"].values())
    assert sum(small["profile_ms_per_step"]["dptrain"].values()) > 0
    assert "| 0.01 |" in table(result) and "| 1.0 | dptrain |" in table(result)
