"""Checkpoint files: atomic layout, checksums, config identity, pruning, RNG round trip."""

import json
import random

import numpy as np
import pytest
import torch

from dptrain.checkpoint.files import (
    CheckpointError,
    find_latest,
    load_checkpoint,
    prune_checkpoints,
    remove_partial,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)

IDENT = {"train.lr": 0.1, "task.name": "classifier"}
HASH = "abc123"


def save(run_dir, step, value=1.0):
    files = {"model.pt": {"w": torch.full((3,), value)}, "optimizer.pt": {"state": {}}, "trainer.pt": {"step": step}}
    meta = {"identity": IDENT, "identity_hash": HASH, "global_batch_size": 8}
    return save_checkpoint(run_dir, step, files, meta)


def test_save_verify_load_and_latest(tmp_path):
    save(tmp_path, 10)
    path = save(tmp_path, 20, value=2.0)
    assert find_latest(tmp_path) == path and path.name == "step_00000020"
    meta = verify_checkpoint(path, IDENT, HASH, 8)
    assert meta["step"] == 20 and set(meta["files"]) == {"model.pt", "optimizer.pt", "trainer.pt"}
    state = load_checkpoint(path, torch.device("cpu"))
    assert torch.equal(state["model"]["w"], torch.full((3,), 2.0)) and state["trainer"]["step"] == 20
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary left behind


def test_partial_saves_are_invisible_and_removed(tmp_path):
    save(tmp_path, 10)
    partial = tmp_path / "checkpoints" / ".step_00000020.tmp"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"half")
    assert find_latest(tmp_path).name == "step_00000010"
    assert remove_partial(tmp_path) == [partial] and not partial.exists()


def test_corruption_is_detected(tmp_path):
    path = save(tmp_path, 10)
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.pt does not match its checksum"):
        verify_checkpoint(path, IDENT, HASH, 8)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        verify_checkpoint(path, IDENT, HASH, 8)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no meta.json"):
        verify_checkpoint(path, IDENT, HASH, 8)


def test_missing_file_and_other_config(tmp_path):
    path = save(tmp_path, 10)
    with pytest.raises(CheckpointError, match=r"different config.*train.lr: 0.1 -> 0.2"):
        verify_checkpoint(path, dict(IDENT, **{"train.lr": 0.2}), "other", 8)
    with pytest.raises(CheckpointError, match="global batch 8, this run resolves to 16"):
        verify_checkpoint(path, IDENT, HASH, 16)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt is missing"):
        verify_checkpoint(path, IDENT, HASH, 8)


def test_prune_keeps_the_newest(tmp_path):
    for step in (5, 10, 15, 20):
        save(tmp_path, step)
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step_00000005", "step_00000010"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000015", "step_00000020"]
    assert json.loads((tmp_path / "checkpoints" / "step_00000020" / "meta.json").read_text())["step"] == 20


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = rng_state(torch.device("cpu"))
    expected = (random.random(), np.random.rand(), torch.rand(2))
    path = save_checkpoint(tmp_path, 1, {"model.pt": {}, "optimizer.pt": {}, "trainer.pt": {"rng": [state]}},
                           {"identity": {}, "identity_hash": "h", "global_batch_size": 1})
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(path, torch.device("cpu"))["trainer"]["rng"][0], torch.device("cpu"))
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
