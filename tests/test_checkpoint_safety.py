"""Checkpoints against readers, races and strangers' files.

- rotation skips a checkpoint a reader holds and deletes it at a later rotation; what it
  deletes is renamed away first, so a resume never picks it and racing deletions raise
  nothing;
- ``dptrain consolidate`` checks a checkpoint as resume does: truncated, partial or
  without ``meta.json`` is exit 2 with one message and no traceback;
- a crafted ``sharded/.metadata`` (or non-tensor entry) runs no code: the payload would
  create a file, and the file is never there, through consolidate and through resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from _cli import dptrain, tiny_gpt_config
from dptrain.checkpoint.files import (
    CheckpointError,
    find_latest,
    prune_checkpoints,
    reading,
    remove_partial,
    save_checkpoint,
)
from dptrain.checkpoint.safe_metadata import SafeLoadPlanner, UnsafeCheckpointError
from dptrain.cli.checkpoint import consolidate
from test_consolidate import META, zero2_checkpoint


class Payload:
    """What a stranger's pickle would hold: unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def save(run_dir: Path, step: int) -> Path:
    files = {"model.pt": {"w": torch.full((3,), float(step))}, "optimizer.pt": {}, "trainer.pt": {"step": step}}
    return save_checkpoint(run_dir, step, files, META)


def test_rotation_skips_a_checkpoint_being_read_and_deletes_it_later(tmp_path: Path) -> None:
    first = save(tmp_path, 10)
    save(tmp_path, 20)
    with reading(first):
        newest = save(tmp_path, 30)
        assert prune_checkpoints(tmp_path, keep_last=1) == [tmp_path / "checkpoints" / "step_00000020"]
        assert first.is_dir() and (first / "model.pt").is_file()  # held: kept whole
    assert prune_checkpoints(tmp_path, keep_last=1) == [first]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [newest.name]  # no trash left


def test_a_checkpoint_being_deleted_is_never_the_latest_and_its_leftovers_are_removed(tmp_path: Path) -> None:
    save(tmp_path, 10)
    doomed = save(tmp_path, 20)
    trash = doomed.with_name(f".{doomed.name}.trash-12345")
    doomed.rename(trash)  # what rotation does first; a crash here leaves the trash
    assert find_latest(tmp_path).name == "step_00000010"
    with pytest.raises(CheckpointError, match="was deleted .* while it was being opened"):
        with reading(doomed):
            pass
    assert remove_partial(tmp_path) == [trash] and not trash.exists()


def test_racing_rotations_raise_nothing_and_delete_each_checkpoint_once(tmp_path: Path) -> None:
    for step in range(1, 41):
        save(tmp_path, step)
    deleted: list[Path] = []
    errors: list[BaseException] = []

    def prune() -> None:
        try:
            deleted.extend(prune_checkpoints(tmp_path, keep_last=2))
        except BaseException as e:  # noqa: BLE001 - any escape is the failure under test
            errors.append(e)

    threads = [threading.Thread(target=prune) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(deleted) == sorted(set(deleted)) and len(deleted) == 38
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000039", "step_00000040"]


def _consolidate(checkpoint: Path, out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(consolidate, [str(checkpoint), "-o", str(out)])
    return result.exit_code, result.output


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _rehash(checkpoint: Path, name: str) -> None:
    """Rewrite meta.json's sha256 of ``name`` to match it, as anyone who can write the files can."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, message", [
    (lambda c: _truncate(c / "model.pt"), "model.pt does not match its checksum"),
    (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    (lambda c: (c / "meta.json").unlink(), "has no meta.json, so it is incomplete"),
    (lambda c: (c / "meta.json").write_text('{"files": '), "meta.json is corrupt"),
    (lambda c: _truncate(c / "model.pt") or _rehash(c, "model.pt"), "could not be read"),  # checksum forged
])
def test_consolidate_of_a_damaged_checkpoint_exits_2_with_one_message(tmp_path: Path, damage, message) -> None:
    checkpoint = save(tmp_path, 10)
    damage(checkpoint)
    code, output = _consolidate(checkpoint, tmp_path / "w.safetensors")
    assert code == 2 and output.startswith("error: ") and message in output, output
    assert output.count("error:") == 1 and "Traceback" not in output
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.timeout(120)
def test_a_crafted_metadata_or_entry_runs_no_code_through_consolidate(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    checkpoint, _ = zero2_checkpoint(tmp_path / "run")
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rehash(checkpoint, "sharded/.metadata")  # passes the checksums: only the unpickler stands in the way
    code, output = _consolidate(tmp_path / "run", tmp_path / "w.safetensors")
    assert code == 2 and "names the global posix.system" in output and ".metadata" in output, output
    assert "Traceback" not in output
    assert not marker.exists()
    # a non-tensor entry (an optimizer hyperparameter) is read with weights_only too
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    buffer.seek(0)
    with pytest.raises(UnsafeCheckpointError, match="param_groups.w.lr is not plain data"):
        SafeLoadPlanner().load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="param_groups.w.lr")), buffer)
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_a_crafted_metadata_runs_no_code_when_a_run_resumes(tmp_path: Path) -> None:
    config = tiny_gpt_config(tmp_path)
    common = ["--nproc", "1", "--config", str(config), "--run-dir", "run", "--set", 'distributed.strategy="zero2"']
    first = dptrain("run", *common, "--set", "train.steps=10", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    checkpoint = find_latest(tmp_path / "run")
    marker = tmp_path / "payload-ran"
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rehash(checkpoint, "sharded/.metadata")
    resumed = dptrain("run", *common, "--set", "train.steps=20", cwd=tmp_path)
    assert resumed.returncode == 2 and "names the global posix.system" in resumed.stderr, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert not marker.exists()
