"""Where a config's rules live: each section checks its own values, each feature its needs of the strategy.

The messages themselves are pinned by the CLI tests (tests/test_cli_errors.py and the
feature's own); here, that each rule is where docs/architecture.md says, and that a
feature's rule reads the strategy's facts, not its name: a new strategy with the right
facts passes, one without them is refused by what it lacks.
"""

from __future__ import annotations

import dataclasses

import pytest

from dptrain.config import ConfigError, RunConfig, load_config
from dptrain.strategies import get_strategy
from dptrain.strategies.requirements import check_divergence, check_dynamic_batching, check_onebit_adam


@pytest.mark.parametrize("override, message", [
    ("train.steps=0", "train.steps must be at least 1, got 0"),
    ("train.min_lr_ratio=2.0", "train.min_lr_ratio must be within [0, 1]"),
    ("log.eval_batches=0", "log.eval_batches must be at least 1, got 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be at least 1, got 0"),
    ("compression.topk_fraction=0.0", "compression.topk_fraction must be in (0, 1]"),
    ("straggler.factor=0.5", "straggler.factor must be at least 1"),
    ("divergence.every=-1", "divergence.every must be >= 0"),
])
def test_each_section_checks_its_own_values(override, message):
    cfg = load_config(None, [override])
    section = getattr(cfg, override.split(".")[0])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        section.check()  # the section alone, without the run
    with pytest.raises(ConfigError):
        cfg.check()


def test_a_valid_config_passes_every_section():
    RunConfig().check()
    load_config(None, ["balance.dynamic_batching=true", "balance.every=1"]).check()


def test_a_features_rule_reads_the_strategys_facts_not_its_name():
    ddp = get_strategy("ddp")
    newcomer = dataclasses.replace(ddp, name="newcomer", summary="a strategy no rule names")
    cfg = load_config(None, ["train.optimizer=onebit_adam", "divergence.every=5", "balance.dynamic_batching=true"])
    for rule in (check_onebit_adam, check_divergence, check_dynamic_batching):
        rule(cfg, newcomer)  # the facts of ddp under another name: accepted
    lacking = dataclasses.replace(newcomer, comm_hooks=False, replicated_state=False, dynamic_batching=False)
    with pytest.raises(ConfigError, match="strategy 'newcomer' has none"):
        check_onebit_adam(cfg, lacking)
    with pytest.raises(ConfigError, match=r"strategy 'newcomer' does not keep \(a strategy no rule names"):
        check_divergence(cfg, lacking)
    with pytest.raises(ConfigError, match="not 'newcomer'"):
        check_dynamic_batching(cfg, lacking)
