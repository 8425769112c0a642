"""`dptrain bench zero` at toy size: it runs, writes its JSON, and what it measures is consistent.

Times are not checked (a benchmark is not a test); the memory counts and the warm-up
losses are deterministic, so they are.
"""

import json

import pytest
from click.testing import CliRunner

from dptrain.cli import main

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "8", "--rounds", "2", "--steps", "1",
        "--warmup", "2", "--memory-steps", "1", "--device", "cpu"]


@pytest.mark.slow
def test_bench_zero_compares_zero3_with_fsdp2_and_counts_their_memory(tmp_path):
    out = tmp_path / "zero.json"
    result = CliRunner().invoke(main, ["bench", "zero", *TINY, "--variants", "torch_fsdp2", "dptrain_zero3",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| dptrain_zero3 / torch_fsdp2 |" in result.output
    res = json.loads(out.read_text())
    assert set(res["ratios"]) == {"dptrain_zero3"} and res["ratios"]["dptrain_zero3"]["median"] > 0
    assert all(len(r) == 1 for r in res["step_times_s"]["torch_fsdp2"]) and len(res["step_times_s"]["torch_fsdp2"]) == 2
    for variant, row in res["memory"].items():
        # Both shard everything: 16 bytes per parameter over 2 ranks, counted from live tensors.
        assert row["live"] == pytest.approx(row["formula"], rel=0.02), (variant, row)
        assert row["parameters"] + row["gradients"] + row["optimizer"] == pytest.approx(row["formula"], rel=0.02)
        assert row["peak"] > 0
    # Same seed, same data, same AdamW: the two engines train the same model.
    assert res["warmup_losses"]["dptrain_zero3"] == pytest.approx(res["warmup_losses"]["torch_fsdp2"], rel=1e-5)
