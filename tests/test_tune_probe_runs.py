"""A calibration round's probes in one job (dptrain.tune.probe_runs): each run whole, each in a group of its own."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from _cli import TINY_GPT_SETTINGS
from dptrain.tune.trials import read_steps, trial_overrides, write_config


def test_a_probe_job_runs_each_probe_whole_in_a_process_group_of_its_own(tmp_path, monkeypatch) -> None:
    from dptrain.tune import probe_runs

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    groups = []
    real = probe_runs.init_distributed

    def init(env, backend, timeout_s, store=None):
        assert not dist.is_initialized()  # the previous run's group was destroyed first
        device = real(env, backend, timeout_s, store=store)
        groups.append(dist.group.WORLD)
        return device

    monkeypatch.setattr(probe_runs, "init_distributed", init)
    plan = []
    for i, strategy in enumerate(("ddp", "zero3")):
        config = write_config(tmp_path / f"probe{i}" / "config.toml", None,
                              [*TINY_GPT_SETTINGS, "train.global_batch_size=2", f'distributed.strategy="{strategy}"',
                               *trial_overrides(3)])
        plan.append({"config": str(config), "run_dir": str(tmp_path / f"probe{i}" / "run")})
    (tmp_path / "plan.json").write_text(json.dumps(plan))

    assert probe_runs.main([str(tmp_path / "plan.json")]) == 0
    assert not dist.is_initialized()
    assert len(groups) == 2 and groups[0] is not groups[1]
    for p in plan:  # each run logged its steps after the warm-up, as a trial's are read
        assert read_steps(Path(p["run_dir"]), 1).step_s > 0
