"""``dptrain run`` with ZeRO strategies: sharded checkpoints resumed on another world size.

An uninterrupted ZeRO-3 run on 2 workers is the reference. A second run fails at step 6
(its step-4 checkpoint survives) and is resumed once on 1 worker and once on 3; the
global batch (12) is the same, so steps 5-8 must log the same losses as the reference,
up to the order of the gradient sums. Dropout is off so that the ranks' random streams,
which depend on the world size, do not enter.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from _cli import dptrain, tiny_gpt_config
from dptrain.pages.plots import read_metrics

ZERO = """
[zero]
unit_classes = ["Block"]
"""


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]}


def test_zero3_checkpoint_saved_on_2_workers_resumes_on_1_and_3_and_as_hsdp_on_4(tmp_path):
    config = str(tiny_gpt_config(tmp_path, ZERO))
    common = ["--config", config, "--set", "gpt.dropout=0.0", "--set", "train.global_batch_size=12",
              "--set", "train.steps=8", "--set", "checkpoint.every=4", "--set", 'distributed.strategy="zero3"']
    straight = dptrain("run", "--nproc", "2", *common, "--run-dir", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    failed = dptrain("run", "--nproc", "2", *common, "--run-dir", str(tmp_path / "b"), cwd=tmp_path,
                     env={"DPTRAIN_FAULT": "0:6:raise"})
    assert failed.returncode == 1
    checkpoint = tmp_path / "b" / "checkpoints" / "step_00000004"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["format"] == "sharded" and any(name.startswith("sharded/") for name in meta["files"])
    assert not (checkpoint / "model.pt").exists()
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.copytree(tmp_path / "b", tmp_path / "d")

    reference = _losses(tmp_path / "a")
    # each unit's gradient, reduce-scattered (on gloo: all-reduced, so 2 ranks send 4 bytes per parameter)
    params = json.loads((tmp_path / "a" / "summary.json").read_text())["parameters"]
    last = read_metrics(tmp_path / "a" / "metrics.jsonl")[0][-1]
    assert last["comm_bytes_per_step"] == last["comm_sent_bytes_per_step"] == 4 * params
    exported = load_file(tmp_path / "a" / "model.safetensors")
    # ... and on 4 as hybrid sharding: 2 shard groups of 2 ranks, replicas all-reducing their shards
    for nproc, run, extra in (("1", "b", []), ("3", "c", []), ("4", "d", ["--set", "zero.shard_size=2"])):
        resumed = dptrain("run", "--nproc", nproc, *common, *extra, "--run-dir", str(tmp_path / run), cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert "step_00000004 at step 4" in resumed.stdout
        losses = _losses(tmp_path / run)
        for step in range(5, 9):
            assert losses[step] == pytest.approx(reference[step], rel=1e-4), (nproc, step, losses, reference)
        weights = load_file(tmp_path / run / "model.safetensors")
        assert weights.keys() == exported.keys()
        for name in weights:
            assert torch.allclose(weights[name], exported[name], rtol=1e-3, atol=1e-5), name

    # the replicated strategy resumes a sharded checkpoint too (the same names: tests/test_strategy_resume.py)
    as_ddp = dptrain("run", "--nproc", "1", *common[:-2], "--set", "train.steps=10", "--run-dir",
                     str(tmp_path / "a"), cwd=tmp_path)
    assert as_ddp.returncode == 0, as_ddp.stderr
    assert "step_00000008 at step 8" in as_ddp.stdout


def test_zero2_bf16_with_lamb_trains(tmp_path):
    config = str(tiny_gpt_config(tmp_path))
    proc = dptrain("run", "--nproc", "2", "--config", config, "--set", 'distributed.strategy="zero2"', "--set",
                   'train.precision="bf16"', "--set", 'train.optimizer="lamb"', "--set", "train.lr=0.05",
                   "--set", "train.steps=20", "--set", 'zero.reduce_dtype="bf16"', "--run-dir",
                   str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(tmp_path / "run")
    assert losses[20] < losses[1] - 0.3, losses  # measured: 5.46 -> 4.16
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())  # the fp32 master weights
