"""Above the registry, no list of strategy names is written by hand (issue 55): every list is the registry's
entries filtered by a fact, so a new entry joins with no edit; the registry's errors name the strategy and what
it takes, and its did-you-mean ignores case. Pure logic: no process group."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from torch import nn

from dptrain.checkpoint.files import CheckpointError, layout_mismatch, save_checkpoint, verify_checkpoint
from dptrain.strategies import REGISTRY, get_strategy, strategy_names
from dptrain.strategies.registry import Strategy, checkpoint_writers

PLANNED = strategy_names(lambda s: s.planned)


def _fake(name: str, like: str, **facts) -> Strategy:
    """A new entry, a copy of ``like``'s under another name with ``facts`` changed: what registering one does."""
    return dataclasses.replace(REGISTRY[like], name=name, label=name.upper(), **facts)


# ------------------------------------------------------------------------- the derived lists


def test_the_planned_lists_are_the_registrys_planned_entries() -> None:
    from dptrain.pages import explore_data
    from dptrain.planner import STRATEGIES

    assert PLANNED == tuple(n for n, s in REGISTRY.items() if s.units is not None) and PLANNED
    assert STRATEGIES == PLANNED == explore_data.PLANNED
    assert explore_data.STRATEGIES == (*PLANNED, *explore_data.HYBRID)
    assert explore_data.LABELS == {**{n: REGISTRY[n].label or n for n in PLANNED},
                                   **{h: h.upper() for h in explore_data.HYBRID}}
    [(base, _)] = explore_data.HYBRID.values()  # HSDP: the planned strategy that shards the most, over hosts
    assert base == max((n for n in PLANNED if REGISTRY[n].shards_parameters), key=lambda n: REGISTRY[n].zero_stage)
    assert not REGISTRY[explore_data.BASELINE].shards_parameters and REGISTRY[explore_data.BASELINE].buckets


def test_planned_means_a_memory_model_not_a_zero_stage() -> None:
    for entry in REGISTRY.values():
        assert entry.planned == (entry.zero_stage is not None)  # the planner's formulas need both
    with pytest.raises(ValueError, match="the planner needs both its units and its zero_stage"):
        _fake("half", "ddp", zero_stage=None)


_FRESH = """
import dataclasses, json, sys
from dptrain.strategies import REGISTRY
REGISTRY["fake"] = dataclasses.replace(REGISTRY["ddp"], name="fake", label="Fake")  # registered before any use
from dptrain.pages import explore_data
from dptrain.planner import STRATEGIES, Setup
Setup("fake", 2)  # the planner takes it
json.dump({"planner": STRATEGIES, "page": explore_data.STRATEGIES, "labels": explore_data.LABELS}, sys.stdout)
"""


def test_a_new_planned_entry_joins_the_planner_and_the_page_with_no_edit() -> None:
    """The module-level lists are made at import: a fresh interpreter registers a fake entry first."""
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["planner"] == [*PLANNED, "fake"] and "fake" in got["page"] and got["labels"]["fake"] == "Fake"


def test_a_new_entry_joins_the_tuners_space_and_probes(monkeypatch) -> None:
    from dptrain.tune.calibrate import probe_variants
    from dptrain.tune.space import candidates

    # a sharded strategy without buckets: hybrid candidates, one bucket setting, no codec
    monkeypatch.setitem(REGISTRY, "shardy", _fake("shardy", "zero3"))
    # a replicated one that takes the DDP engine's codecs: bucket sizes and codecs, no hybrid
    monkeypatch.setitem(REGISTRY, "reppy", _fake("reppy", "ddp"))
    space = candidates(4, 8, ["shardy", "reppy"], micro_batches=[2], buckets=[1.0, 25.0], codecs=["none", "bf16"])
    assert [c.label for c in space] == ["shardy 2x1", "shardy/hybrid2 2x1", "reppy 2x1 1MiB", "reppy 2x1 1MiB bf16",
                                        "reppy 2x1 25MiB", "reppy 2x1 25MiB bf16"]
    # the calibration probes one strategy of each kind of step: a new kind (replicated, no buckets) joins them
    before = probe_variants(4, 2)
    monkeypatch.setitem(REGISTRY, "flat", _fake("flat", "ddp", buckets=False))
    assert probe_variants(4, 2) == {**before, "flat": ['distributed.strategy="flat"']}


def test_the_tuner_refuses_a_strategy_the_simulator_does_not_model_naming_those_it_does(tmp_path) -> None:
    from dptrain.cli.tune import tune

    out = CliRunner().invoke(tune, ["--nproc", "2", "--strategies", "gossip", "--out", str(tmp_path / "t")])
    assert out.exit_code == 2, out.output
    assert f"'gossip' is not modelled by the simulator; choose among {', '.join(PLANNED)}" in out.output


# ------------------------------------------------------------------------------ did you mean


@pytest.mark.parametrize("typed, meant", [("DDP", "ddp"), ("ZeRO3", "zero3"), ("ZeRO-2", "zero2"),
                                          ("DiLoCo", "diloco"), ("LocalSGD", "localsgd"), ("zer3", "zero3")])
def test_did_you_mean_ignores_case(typed, meant) -> None:
    with pytest.raises(ValueError, match=rf"unknown strategy '{typed}' \(did you mean '{meant}'\?\)"):
        get_strategy(typed)


def test_the_planner_and_its_command_suggest_across_case() -> None:
    from dptrain.cli.planning import plan
    from dptrain.planner import Setup

    with pytest.raises(ValueError, match=r"\(did you mean 'zero3'\?\)"):
        Setup("ZeRO3", 2)
    out = CliRunner().invoke(plan, ["--params", "1e6", "--strategies", "DDP"])
    assert out.exit_code == 2 and "did you mean 'ddp'?" in out.output, out.output


def test_hybrid_sharding_in_the_planner_names_the_strategies_that_shard() -> None:
    from dptrain.planner import Setup

    sharding = [n for n in PLANNED if REGISTRY[n].shards_parameters]
    with pytest.raises(ValueError, match=f"needs a ZeRO strategy, one that shards: {', '.join(sharding[:-1])} or "
                                         f"{sharding[-1]}, not 'ddp'"):
        Setup("ddp", 4, shard_size=2)


# ----------------------------------------------------------------------------- options errors


class _SomeoneElsesOptions:
    pass


@pytest.mark.parametrize("name", strategy_names(lambda s: s.wrap is not None))
def test_every_wrap_path_names_the_strategy_and_what_it_takes(name) -> None:
    with pytest.raises(TypeError, match=rf"^strategy '{name}' takes a .* keyword arguments.*, got _SomeoneElsesOptions$"):
        get_strategy(name).wrap(nn.Linear(2, 2), options=_SomeoneElsesOptions())


def test_another_strategys_options_name_the_class_this_one_takes() -> None:
    from dptrain.localsgd import LocalSGDOptions

    with pytest.raises(TypeError, match=r"^strategy 'diloco' takes a DiLoCoOptions or a dict of DiLoCo's keyword "
                                        r"arguments, got LocalSGDOptions$"):
        get_strategy("diloco").wrap(nn.Linear(2, 2), options=LocalSGDOptions())
    with pytest.raises(TypeError, match=r"^strategy 'ddp' takes a dict of DistributedDataParallel's keyword "
                                        r"arguments, got LocalSGDOptions$"):
        get_strategy("ddp").wrap(nn.Linear(2, 2), options=LocalSGDOptions())


# ------------------------------------------------------------------------------ checkpoints


def test_checkpoint_writers_are_every_entry_by_its_layout(monkeypatch) -> None:
    writers = checkpoint_writers()
    assert {name for names in writers.values() for name in names} == set(REGISTRY)
    for layout, names in writers.items():
        assert names == tuple(n for n, s in REGISTRY.items() if s.checkpoint_layout == layout)
    assert {"localsgd", "diloco"} <= set(writers["replicated"])
    monkeypatch.setitem(REGISTRY, "fake", _fake("fake", "gossip"))
    assert checkpoint_writers()["replicated"][-1] == "fake"


def test_a_checkpoint_of_another_layout_lists_every_strategy_that_writes_and_reads_it(tmp_path) -> None:
    writers = checkpoint_writers()
    message = layout_mismatch(tmp_path, "replicated", "ps", writers)
    written = message.split("(written with distributed.strategy ")[1].split(")")[0]
    readers = message.split("reads it (")[1].split(")")[0]
    for name in writers["replicated"]:  # localsgd and diloco among them
        assert name in written and name in readers
    for name in writers["sharded"]:  # the same names in another container
        assert name not in written and name in readers
    assert "ps" not in readers.replace(",", " ").split()


def test_verify_checkpoint_passes_the_callers_names_into_its_message(tmp_path) -> None:
    ident, digest = {"train.lr": 0.1}, "abc"
    path = save_checkpoint(tmp_path, 1, {"trainer.pt": {"step": 1}},
                           {"identity": ident, "identity_hash": digest, "global_batch_size": 8, "format": "ps"})
    with pytest.raises(CheckpointError, match=r"is ps \(written with distributed.strategy ps\) and this run's strategy "
                                              r"writes replicated checkpoints; resume with a strategy that reads "
                                              r"it \(ps\)"):
        verify_checkpoint(path, ident, digest, 8, "replicated", writers=checkpoint_writers())
    with pytest.raises(CheckpointError, match="resume with a strategy that writes ps checkpoints"):
        verify_checkpoint(path, ident, digest, 8, "replicated")  # no names: the layout only
