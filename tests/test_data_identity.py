"""Data identity: a checkpoint records its data files' fingerprints, and a resume on other data is refused."""

import hashlib
import json
import os

import numpy as np
import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.checkpoint.files import CheckpointError, save_checkpoint
from dptrain.config import load_config
from dptrain.data.identity import BLOCK, data_changes, data_identity, file_identity
from dptrain.runner.validate import validate_run


def write_tokens(directory, train_tokens: int = 100_000, val_tokens: int = 5_000, seed: int = 0):
    """A token directory as nanoGPT writes one (uint16, no meta.json), bytes-valued ids."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rng.integers(0, 256, train_tokens).astype(np.uint16).tofile(directory / "train.bin")
    rng.integers(0, 256, val_tokens).astype(np.uint16).tofile(directory / "val.bin")
    return directory


def settings(data_dir, run_dir, *extra):
    return ["data.source=tokens", f'data.dir="{data_dir}"', "gpt.vocab_size=256", f'run_dir="{run_dir}"', *extra]


def checkpoint_as_the_trainer_writes_it(run_dir, rp, record_data: bool = True) -> None:
    """The checkpoint's files as runner/hooks/checkpoint.py's save_run_checkpoint writes them, its meta.json with ``"data"`` when asked."""
    meta = {"identity": json.loads(json.dumps(rp.identity)), "identity_hash": rp.identity_hash,
            "global_batch_size": rp.plan.global_batch_size, "world_size": 1}
    if record_data:
        meta["data"] = rp.data_identity
    save_checkpoint(run_dir, 10, {"model.pt": {}, "optimizer.pt": {}, "trainer.pt": {}}, meta)


# ----------------------------------------------------------------------------- the fingerprint


def test_the_fingerprint_samples_a_large_file_and_hashes_a_small_one_whole(tmp_path):
    path = tmp_path / "train.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())  # 3 MiB
    path.write_bytes(data)
    before = file_identity(path, itemsize=2)
    assert before["bytes"] == 3 << 20 and before["tokens"] == 3 << 19
    for offset, seen in [(0, True), (len(data) - 1, True), (BLOCK + 1000, False)]:  # first, last, between samples
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        assert (file_identity(path, 2)["sampled_sha256"] != before["sampled_sha256"]) == seen, offset
    small = tmp_path / "val.bin"
    small.write_bytes(bytes(data[:5000]))
    assert file_identity(small)["sampled_sha256"] == hashlib.sha256(b"5000" + bytes(data[:5000])).hexdigest()


def test_a_new_mtime_or_path_is_not_a_change_but_size_and_contents_are(tmp_path):
    a = write_tokens(tmp_path / "a")
    before = data_identity({"train.bin": (a / "train.bin", 2), "val.bin": (a / "val.bin", 2)})
    os.utime(a / "train.bin", ns=(1, 1))
    os.rename(a, tmp_path / "b")
    b = tmp_path / "b"
    assert data_changes(before, data_identity({"train.bin": (b / "train.bin", 2), "val.bin": (b / "val.bin", 2)})) == []
    write_tokens(b, train_tokens=50_000)
    assert data_changes(before, data_identity({"train.bin": (b / "train.bin", 2), "val.bin": (b / "val.bin", 2)})) == [
        f"{b / 'train.bin'}: 100,000 tokens before, 50,000 tokens now",
        f"{b / 'val.bin'}: same size (5,000 tokens) but other contents (sampled blocks differ)"]


# ----------------------------------------------------------------------------- resume, before launch


@pytest.fixture
def resumable(tmp_path):
    """A token directory and a run directory whose checkpoint recorded that data."""
    data, run = write_tokens(tmp_path / "data"), tmp_path / "run"
    rp = validate_run(load_config(None, settings(data, run)), 1, check_forward=False)
    assert set(rp.data_identity) == {"train.bin", "val.bin"} and rp.data_identity["train.bin"]["tokens"] == 100_000
    checkpoint_as_the_trainer_writes_it(run, rp)
    return data, run


def test_a_resume_on_the_same_data_says_nothing(resumable):
    data, run = resumable
    rp = validate_run(load_config(None, settings(data, run)), 1, check_forward=False)
    assert rp.resume_from is not None and rp.warnings == []


def test_a_resume_on_replaced_data_is_refused_naming_the_file_and_sizes(resumable):
    data, run = resumable
    write_tokens(data, train_tokens=50_000, seed=1)
    with pytest.raises(CheckpointError, match=r"the data changed since checkpoint .*step_00000010 was written: "
                       r".*train\.bin: 100,000 tokens before, 50,000 tokens now.*--set data\.allow_changed=true"):
        validate_run(load_config(None, settings(data, run)), 1, check_forward=False)


def test_data_allow_changed_resumes_with_a_warning_and_keeps_the_config_identity(resumable):
    data, run = resumable
    write_tokens(data, train_tokens=50_000, seed=1)
    rp = validate_run(load_config(None, settings(data, run, "data.allow_changed=true")), 1, check_forward=False)
    assert rp.resume_from is not None
    assert [w for w in rp.warnings if w.startswith("warning: the data changed") and "data.allow_changed" in w]


def test_a_checkpoint_from_before_data_identity_resumes_with_a_note(tmp_path):
    data, run = write_tokens(tmp_path / "data"), tmp_path / "run"
    rp = validate_run(load_config(None, settings(data, run)), 1, check_forward=False)
    checkpoint_as_the_trainer_writes_it(run, rp, record_data=False)
    write_tokens(data, train_tokens=50_000, seed=1)  # unknowable: the checkpoint did not record its data
    rp = validate_run(load_config(None, settings(data, run)), 1, check_forward=False)
    assert rp.resume_from is not None
    assert any(w.startswith("note: checkpoint step_00000010 does not record its data") for w in rp.warnings)


@pytest.mark.timeout(120)
def test_dptrain_run_on_replaced_data_exits_2_and_touches_nothing(resumable):
    data, run = resumable
    write_tokens(data, train_tokens=50_000, seed=1)
    def files():  # the run-directory lock that `dptrain run` takes first is not the run's content
        return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != ".lock"}

    before = files()
    proc = dptrain("run", "--nproc", "1", "--run-dir", str(run), *[a for s in settings(data, run)[:3]
                                                                    for a in ("--set", s)], cwd=run.parent)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error: ") == 1 and "100,000 tokens before, 50,000 tokens now" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert files() == before


# ----------------------------------------------------------------------------- end to end


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "ps"])
def test_a_real_checkpoint_records_its_data_and_refuses_a_resume_on_other_data(tmp_path, strategy):
    data = write_tokens(tmp_path / "data")
    nproc = "2" if strategy == "ps" else "1"
    args = ["run", "--nproc", nproc, "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", "run",
            "--set", "data.source=tokens", "--set", f"data.dir={data}", "--set", "gpt.vocab_size=256",
            "--set", f"distributed.strategy={strategy}", "--set", "train.steps=4", "--set", "checkpoint.every=2"]
    assert (proc := dptrain(*args, cwd=tmp_path)).returncode == 0, proc.stderr
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["data"]["train.bin"]["tokens"] == 100_000
    write_tokens(data, train_tokens=50_000, seed=1)
    proc = dptrain(*args, "--set", "train.steps=6", cwd=tmp_path)
    assert proc.returncode == 2 and "100,000 tokens before, 50,000 tokens now" in proc.stderr, proc.stderr
    proc = dptrain(*args, "--set", "train.steps=6", "--set", "data.allow_changed=true", cwd=tmp_path)
    assert proc.returncode == 0 and "warning: the data changed" in proc.stderr, proc.stderr
