"""The held-out mode of ``dptrain bench ddp``: its model, its ABBA order, its slowest-rank arithmetic (no timings)."""

from dptrain.bench.ddp_models import build_model
from dptrain.bench.ddp_pairs import ENGINES, HELD_OUT, abba, slowest_rank
from dptrain.bench.stats import paired_ratios


def test_the_held_out_model_is_issue_38s_16_8m_parameter_mlp():
    model = build_model(HELD_OUT["width"], HELD_OUT["depth"], HELD_OUT["model"])
    params = list(model.parameters())
    assert len(params) == 32  # 8 blocks x 2 Linear x (weight, bias)
    assert sum(p.numel() for p in params) == 8 * (512 * 2048 + 2048 + 2048 * 512 + 512) == 16_797_696  # 16.8M
    assert [type(m).__name__ for m in model[:3]] == ["Linear", "GELU", "Linear"]
    assert (model[0].in_features, model[0].out_features) == (512, 2048)


def test_abba_puts_each_engine_first_every_other_round():
    orders = [abba(r) for r in range(4)]
    assert orders == [ENGINES, ENGINES[::-1], ENGINES, ENGINES[::-1]]
    assert "".join(o[0][0] + o[1][0] for o in orders[:2]) == "dttd"  # A B B A


def test_a_step_takes_as_long_as_its_slowest_rank():
    rank0 = [[1.0, 4.0], [2.0, 2.0]]  # [round][step]
    rank1 = [[3.0, 1.0], [2.0, 5.0]]
    assert slowest_rank([rank0, rank1]) == [[3.0, 4.0], [2.0, 5.0]]


def test_the_ratio_is_per_round_median_over_median():
    ours = [[1.1, 1.3, 1.2], [2.0, 2.2, 2.4]]
    theirs = [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    result = paired_ratios(ours, theirs)
    assert result["per_round"] == [1.2, 1.1]
    assert abs(result["median"] - 1.15) < 1e-12
