"""ZeRO's bad input: clear errors on every rank, and the cases it must handle rather than refuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _models import Layer, build, global_batch, loss_fn
from dptrain.testing import RankFailedError, run_on_ranks
from dptrain.zero import ZeRO


def _wrap(rank: int, world_size: int, kw: dict) -> None:
    ZeRO(build("stack"), **kw)


def test_a_unit_class_that_does_not_occur_is_named_with_the_classes_that_do() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_wrap, 2, {"stage": 3, "unit_classes": (nn.Conv2d,)}, timeout=60)
    message = str(info.value)
    assert "unit_classes ['Conv2d'] do not occur in the model" in message
    assert "'Layer'" in message and "'Linear'" in message


@pytest.mark.parametrize("kw, text", [
    ({"stage": 4}, "stage must be 1, 2 or 3, got 4"),
    ({"stage": 2, "unit_classes": (Layer,)}, "stage 2 shards buckets"),
    ({"stage": 3, "algorithm": "rng"}, "did you mean 'ring'"),
])
def test_bad_options_are_refused_before_any_communication(kw: dict, text: str) -> None:
    with pytest.raises(RankFailedError, match=text):
        run_on_ranks(_wrap, 2, kw, timeout=60)


def _optimizer_first(rank: int, world_size: int) -> None:
    model = build("stack")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # wrong order
    wrapped = ZeRO(model, stage=3, unit_classes=(Layer,))
    x, y = global_batch("stack", 0, 4)
    loss_fn("stack", wrapped(x), y).backward()
    optimizer.step()


def test_an_optimizer_created_before_wrapping_is_explained() -> None:
    with pytest.raises(RankFailedError, match="created before the model was wrapped with ZeRO") as info:
        run_on_ranks(_optimizer_first, 2, timeout=60)
    assert "Wrap first, then create the optimizer" in str(info.value)


def _different_models(rank: int, world_size: int) -> None:
    model = build("stack" if rank == 0 else "mlp")
    ZeRO(model, stage=2)


def test_ranks_wrapping_different_models_fail_together() -> None:
    with pytest.raises(RankFailedError, match="model replicas differ between rank 0 and rank 1"):
        run_on_ranks(_different_models, 2, timeout=60)


def _meta_build(rank: int, world_size: int) -> dict:
    """Build on the meta device, materialise one unit at a time, train one step."""
    with torch.device("meta"):
        model = build("stack")
    wrapped = ZeRO(model, stage=3, unit_classes=(Layer,), device="cpu")
    shard_numel = sum(u.shard.numel() for u in wrapped.units)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    x, y = global_batch("stack", 0, 4)
    loss = loss_fn("stack", wrapped(x), y)
    loss.backward()
    optimizer.step()
    state = wrapped.gathered_state()
    return {"shard_numel": shard_numel, "loss": loss.item(),
            "finite": all(torch.isfinite(t).all().item() for t in state.values()),
            "bias_zero": state["layers.0.norm.bias"].abs().max().item() < 0.02,  # LayerNorm reset: bias 0
            "fc_std": state["layers.0.fc.weight"].std().item()}


def test_a_model_built_on_the_meta_device_is_materialised_shard_by_shard() -> None:
    out = run_on_ranks(_meta_build, 2, timeout=60)
    assert sum(o["shard_numel"] for o in out) == 663  # the shards tile the model
    assert out[0]["loss"] == out[1]["loss"]  # same data, same (broadcast) parameters
    for o in out:
        assert o["finite"] and o["bias_zero"]
        assert 0.05 < o["fc_std"] < 0.5  # nn.Linear's reset_parameters: U(-1/sqrt(12), 1/sqrt(12)), std 0.167


def _read_between_steps(rank: int, world_size: int) -> tuple:
    bare = build("tied")
    shape, dtype = bare.embed.weight.shape, bare.embed.weight.dtype
    model = ZeRO(bare, stage=3, unit_classes=(nn.Embedding,))
    x, y = global_batch("tied", 0, 4)
    loss_fn("tied", model(x), y).backward()  # inside the forward the parent's read gathers the unit
    weight = model.module.embed.weight  # between steps: the placeholder, as module.parameters() gives it
    try:
        model.module.state_dict()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    full = model.full_state_dict()["embed.weight"]
    return (weight.shape == shape, weight.dtype == dtype, bool(weight.isnan().all()), refused,
            bool(full.isfinite().all()) and full.shape == shape)


def test_reading_a_stage_3_parameter_between_steps_gives_its_placeholder_and_the_state_dict_says_how() -> None:
    """Between steps a stage-3 parameter reads as its placeholder (shape, dtype; NaN, never plausible values);
    the module's own state_dict() refuses by name of the call that works; full_state_dict() has the values."""
    for same_shape, same_dtype, all_nan, refused, full_ok in run_on_ranks(_read_between_steps, 2, timeout=60):
        assert same_shape and same_dtype and all_nan and full_ok
        assert "dptrain.get_state_dict(model) on every rank" in refused, refused
