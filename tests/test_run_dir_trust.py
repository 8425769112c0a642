"""What a run directory or a checkpoint may hold, and what dptrain does with it (issue 45).

A link where dptrain writes, a torn last line of metrics.jsonl, a stray entry under
``checkpoints/``, a ``meta.json`` naming files outside its checkpoint, a ``trainer.pt`` that
``weights_only`` refuses: each is either refused before anything is written (exit 2, the
directory byte for byte as it was, the file a link points to untouched) or, where it is
the expected result of a crash, survived with a note. Most cases tamper with a copy of one
finished smoke run (a classifier, 4 steps, checkpoints at 2 and 4).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from _cli import dptrain
from dptrain.checkpoint.files import CheckpointError, prune_checkpoints, scan_checkpoints, verify_files
from dptrain.utils.files import UnsafePath, inside, open_file, read_bytes, replacing

SMOKE = ["--set", "task.name=classifier", "--set", "train.steps=4", "--set", "log.progress=lines",
         "--set", "log.plots=false", "--set", "checkpoint.every=2"]


def snapshot(directory: Path) -> dict:
    """Every entry's kind, and each regular file's mtime and hash (links are listed, never followed)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        key = str(p.relative_to(directory))
        if p.is_symlink():
            out[key] = ("link", os.readlink(p))
        elif p.is_file():
            out[key] = (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("finished")
    proc = dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd / "run"


def _copy(finished_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _resume(tmp_path: Path, *extra: str):
    return dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, "--set", "train.steps=6", *extra, cwd=tmp_path)


# ------------------------------------------------------------------ links (item 2)

@pytest.mark.parametrize("link", [".lock", "logs/rank0.log", "logs/rank1.console", "metrics.jsonl", "config.toml"])
def test_a_link_where_dptrain_writes_is_refused_and_its_target_untouched(finished_run, tmp_path, link):
    run = _copy(finished_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / link).unlink(missing_ok=True)
    (run / link).symlink_to(victim)
    before = snapshot(run)
    proc = _resume(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "symbolic link" in proc.stderr and link in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert victim.read_text() == "precious\n"
    assert snapshot(run) == before  # nothing written


def test_files_are_opened_without_following_links_and_only_when_regular(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    for mode in ("w", "a", "r", "r+b"):
        with pytest.raises(UnsafePath, match="symbolic link"):
            open_file(tmp_path / "link", mode)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="a FIFO"):
        open_file(tmp_path / "fifo", "r")  # would block forever without O_NONBLOCK
    with pytest.raises(UnsafePath, match="a FIFO"):
        open_file(tmp_path / "fifo", "w")
    with pytest.raises(UnsafePath):
        read_bytes(Path("/dev/zero"))  # would read until memory runs out
    assert victim.read_text() == "precious"
    # a replaced file's temporary is always a fresh one: a link planted at an old fixed name is never written
    (tmp_path / ".out.tmp").symlink_to(victim)
    with replacing(tmp_path / "out") as tmp, open_file(tmp, "w") as f:
        f.write("new")
    assert (tmp_path / "out").read_text() == "new" and victim.read_text() == "precious"


# ------------------------------------------------------------------ a torn metrics line (item 5)

def test_a_torn_last_metrics_line_is_dropped_with_a_note_and_the_run_resumes(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a crash (or a full disk) mid-line
    proc = _resume(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "its last line held no whole record" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert [r["step"] for r in records if r["kind"] == "train"] == [4, 6]  # log.every 4's, the last one too


# ------------------------------------------------------------------ stray checkpoints (item 6)

def test_stray_checkpoints_are_neither_resumed_from_nor_rotate_the_real_ones_away(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "step_00000004", checkpoints / "step_99999999")  # a copy: its meta says 4
    (checkpoints / "step_99999998").symlink_to(checkpoints / "step_00000004")
    (checkpoints / "step_99999997").write_text("not a checkpoint")
    shutil.copytree(checkpoints / "step_00000004", checkpoints / ("step_" + "\u0669" * 8))  # Arabic-Indic 9s
    strays = sorted(p.name for p in checkpoints.iterdir() if p.name != "step_00000002" and p.name != "step_00000004")
    proc = _resume(tmp_path, "--set", "checkpoint.keep_last=1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "at step 4" in out and out.count("not one of this run's checkpoints") == 4, out
    found, left = scan_checkpoints(run)
    assert [step for step, _ in found] == [6]  # the newest kept: rotation went past the strays, not through them
    assert len(left) == 4 and sorted(p.name for p in checkpoints.iterdir() if p.name != "step_00000006") == strays


def test_rotation_never_deletes_the_checkpoint_it_has_just_written(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    fake = run / "checkpoints" / "step_99999999"
    shutil.copytree(run / "checkpoints" / "step_00000004", fake)
    meta = json.loads((fake / "meta.json").read_text())
    (fake / "meta.json").write_text(json.dumps(dict(meta, step=99999999)))  # a consistent higher checkpoint
    just = run / "checkpoints" / "step_00000004"
    deleted = prune_checkpoints(run, keep_last=1, saved=just)
    assert just.is_dir() and run / "checkpoints" / "step_00000002" in deleted


# ------------------------------------------------------------------ meta.json names (item 8)

@pytest.mark.parametrize("name, why", [
    ("/etc/hostname", "not a plain relative path"),
    ("../../../victim.txt", "not a plain relative path"),
    ("fifo", "a FIFO"),
    ("zero", "a character device"),
    ("linked/model.pt", "a symbolic link"),
])
def test_meta_json_cannot_name_files_outside_its_checkpoint(finished_run, tmp_path, name, why):
    run = _copy(finished_run, tmp_path)
    checkpoint = run / "checkpoints" / "step_00000004"
    (tmp_path / "victim.txt").write_text("secret")
    os.mkfifo(checkpoint / "fifo")
    os.symlink("/dev/zero", checkpoint / "zero")
    (checkpoint / "linked").symlink_to(tmp_path)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = hashlib.sha256(b"secret").hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    done: list = []
    reader = threading.Thread(target=lambda: done.append(_expect_refusal(checkpoint)), daemon=True)
    reader.start()
    reader.join(20)
    assert done, "reading the checkpoint blocked (a FIFO) or did not end (/dev/zero)"
    assert why in done[0] or "symbolic link" in done[0], done[0]
    assert "secret" not in done[0] and hashlib.sha256(b"secret").hexdigest()[:12] not in done[0]
    before = snapshot(run)
    proc = _resume(tmp_path)
    assert proc.returncode == 2 and "will not read" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(run) == before


def _expect_refusal(checkpoint: Path) -> str:
    with pytest.raises(CheckpointError) as refused:
        verify_files(checkpoint)
    return str(refused.value)


def test_inside_keeps_names_within_their_directory(tmp_path):
    (tmp_path / "sharded").mkdir()
    assert inside(tmp_path, "sharded/__0_0.distcp") == tmp_path / "sharded" / "__0_0.distcp"
    for bad in ("", "/abs", "a/../b", "./x", "a//b", "..\\x"):
        with pytest.raises(UnsafePath):
            inside(tmp_path, bad)


# ------------------------------------------------------------------ late failures (item 9)

class _Refused:
    """What ``weights_only`` refuses to load: an object of a class of its own."""


def test_a_trainer_pt_that_weights_only_refuses_is_bad_input_before_anything_is_written(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    checkpoint = run / "checkpoints" / "step_00000004"
    torch.save({"step": 4, "rng": [_Refused()]}, checkpoint / "trainer.pt")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["trainer.pt"] = hashlib.sha256((checkpoint / "trainer.pt").read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))  # the checksums pass: only weights_only stands
    before = snapshot(run)
    proc = _resume(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "trainer.pt cannot be loaded safely" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(run) == before


@pytest.mark.parametrize("damage", ["header 2**63", "truncated"])
def test_a_damaged_hugging_face_weights_file_is_bad_input_before_launch(tmp_path, damage):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "gpt2-tiny"
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes((2**63).to_bytes(8, "little") + data[8:] if damage == "header 2**63" else data[:-100])
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    for split, n in (("train.bin", 4000), ("val.bin", 400)):
        (torch.arange(n) % 256).numpy().astype("uint16").tofile(tokens / split)
    proc = dptrain("run", "--run-dir", "out", "--set", f"hf.path={model_dir}", "--set", "data.source=tokens",
                   "--set", f"data.dir={tokens}", "--set", "train.steps=2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "model.safetensors is not a readable safetensors file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_omp_num_threads_that_is_not_a_count_is_ignored_with_a_warning(tmp_path):
    proc = dptrain("run", "--nproc", "2", "--run-dir", "run", *SMOKE, "--set", "checkpoint.every=0", cwd=tmp_path,
                   env={"OMP_NUM_THREADS": "abc"})
    assert proc.returncode == 0, proc.stderr
    assert "OMP_NUM_THREADS='abc' is not a positive whole number: ignored" in proc.stderr


# ------------------------------------------------------------------ smaller ones (item 10)

def test_a_config_nested_ten_thousand_deep_or_of_50_mb_is_one_line(tmp_path):
    (tmp_path / "deep.toml").write_text("x = " + "[" * 10_000 + "]" * 10_000)
    (tmp_path / "huge.toml").write_text("[train]\nsteps = 4\n# " + "x" * (50 << 20) + "\n")
    for name, message in (("deep.toml", "nests arrays or tables too deeply"), ("huge.toml", "is over 1 MiB")):
        proc = dptrain("run", "--config", name, "--run-dir", "out", cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr) < 1000 and not (tmp_path / "out").exists()


def test_a_string_batch_size_in_meta_json_is_named_as_what_it_is(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    checkpoint = run / "checkpoints" / "step_00000004"
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps(dict(meta, global_batch_size=str(meta["global_batch_size"]))))
    proc = _resume(tmp_path)
    assert proc.returncode == 2 and "records the global batch as '32', not a whole number" in proc.stderr, proc.stderr


def test_the_advice_on_a_foreign_checkpoint_is_advice_that_works(finished_run, tmp_path):
    _copy(finished_run, tmp_path)
    proc = _resume(tmp_path, "--set", "train.lr=0.01")
    assert proc.returncode == 2 and "start afresh with another run_dir" in proc.stderr
    assert "checkpoint.resume=false" not in proc.stderr  # which is refused where checkpoints exist


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".weights.safetensors.{dead.pid}.3f2a.tmp"  # what a kill -9 mid-write leaves
    left.write_bytes(b"x" * 1000)
    mine = tmp_path / f".weights.safetensors.{os.getpid()}.9b1c.tmp"  # a live writer's: kept
    mine.write_bytes(b"y")
    with replacing(tmp_path / "weights.safetensors") as tmp, open_file(tmp, "w") as f:
        f.write("done")
    assert not left.exists() and mine.exists() and (tmp_path / "weights.safetensors").read_text() == "done"


def test_a_store_port_in_use_is_one_line_not_a_traceback():
    import socket

    from dptrain.launch.rendezvous import PortInUse, WorkerEnv, loopback_store

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = WorkerEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                        master_port=port, launcher="none")
        from datetime import timedelta

        with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{port}.*Set MASTER_PORT"):
            loopback_store(env, timedelta(seconds=5))
