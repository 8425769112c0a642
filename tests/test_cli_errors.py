"""Bad input to ``dptrain run``: one clear error, exit code 2, nothing written."""

import hashlib

import pytest

from _cli import dptrain

SMOKE = ["--set", "task.name=classifier", "--set", "train.steps=4", "--set", "log.progress=lines",
         "--set", "log.plots=false", "--set", "checkpoint.every=2"]


def snapshot(directory):
    """Every file's mtime and hash, but the run-directory lock's (each run takes it, refused or not)."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("args, message", [
    (["--set", "train.lrr=1"], "unknown key 'train.lrr' in --set train.lrr=1; did you mean 'train.lr'?"),
    (["--config", "bad.toml"], "bad.toml is not valid TOML"),
    (["--config", "typo.toml"], "unknown key 'log.evry' in typo.toml; did you mean 'log.every'?"),
    (["--nproc", "3", "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=2",
      "--set", "train.grad_accum_steps=2"], "global batch 8 != micro 2 x accum 2 x world 3 = 12; set train.global_batch_size to 12 "
      "(--set train.global_batch_size=12)"),
    (["--nproc", "3", "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=2"],
     "global batch 8 is not a multiple of micro 2 x world 3 = 6"),
    (["--nproc", "3", "--set", "train.global_batch_size=32"], "global batch 32 is not divisible by accum 1 x world 3"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--set", "task.model=no_such_package.models:gpt"], "cannot import 'no_such_package.models'"),
    (["--set", "task.model=_user_models:missing"], "'_user_models' has no callable 'missing'"),
    (["--set", "task.model=_user_models:wide_mlp", "--set", "task.model_args={ depth = 3 }"],
     "cannot build the model: wide_mlp() got an unexpected keyword argument 'depth'"),
    (["--set", "gpt.n_embd=30"], "cannot build the model: n_embd 30 is not divisible by n_head 4"),
    (["--set", "task.name=classifier", "--set", "classifier.samples=20", "--set", "train.global_batch_size=32"],
     "the training set has 20 samples"),
    (["--set", "train.steps=0"], "train.steps must be at least 1, got 0"),
    (["--set", "distributed.roll_call_s=-1"], "distributed.roll_call_s must be at least 0.0, got -1"),
    (["--set", "ddp.last_bucket_cap_mb=-1"], "ddp.last_bucket_cap_mb must be a positive size in MiB, got -1"),
    (["--set", 'ddp.algorithm="rings"'], "'ddp.algorithm' in --set ddp.algorithm=\"rings\" must be one of native, ring"),
    (["--nproc", "2", "--set", "ddp.ranks_per_node=3"],
     "ddp.ranks_per_node=3 does not divide the world size 2; choose one of [1, 2]"),
    (["--nproc", "2", "--set", "distributed.strategy=zero3", "--set", "zero.shard_size=3"],
     "zero.shard_size=3 does not divide the world size 2; choose one of [1, 2]"),
    (["--set", "zero.shard_size=2"], "zero.shard_size=2 (hybrid sharding) needs strategy zero1, zero2 or zero3"),
    (["--set", "distributed.strategy=zero3", "--set", "compression.method=topk"],
     "compression.method 'topk' works with strategy ddp only, not 'zero3'; supported: strategy ddp with fp16, bf16, "
     "int8, topk or powersgd, and strategies zero1, zero2 and zero3 with fp16, bf16, int8"),
    (["--set", "compression.method=topk", "--set", "compression.topk_fraction=0"], "compression.topk_fraction must be in (0, 1], got 0"),
    (["--set", "compression.method=fp16", "--set", "ddp.algorithm=ring"], "set ddp.algorithm = \"native\""),
    (["--set", "train.min_lr_ratio=5"], "train.min_lr_ratio must be within [0, 1], got 5"),
    (["--set", "train.betas=[0.9]"], "train.betas must be two numbers in [0, 1), got [0.9]"),
    (["--set", "compression.method=topk", "--set", "compression.momentum_correction=true"],
     "it needs train.optimizer = \"sgd\", got 'adamw'"),
    (["--set", "compression.method=int8", "--set", "compression.topk_warmup_steps=10"],
     "compression: topk_warmup_steps set, but compression int8 has no use for it"),
    pytest.param(["--set", "train.precision=fp16"], "fp16 needs CUDA", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="fp16 is valid where CUDA is")),
])
def test_bad_input_fails_before_writing(tmp_path, args, message):
    (tmp_path / "bad.toml").write_text("[train]\nsteps = = 4\n")
    (tmp_path / "typo.toml").write_text("[log]\nevry = 5\n")
    proc = dptrain("run", "--run-dir", "out", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("finished")
    proc = dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd


def test_corrupt_checkpoint_is_refused_and_left_alone(finished_run, tmp_path):
    import shutil

    shutil.copytree(finished_run / "run", tmp_path / "run")
    model = tmp_path / "run" / "checkpoints" / "step_00000004" / "model.pt"
    model.write_bytes(model.read_bytes()[:-10])  # truncated
    before = snapshot(tmp_path / "run")
    proc = dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, "--set", "train.steps=6", cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.pt does not match its checksum" in proc.stderr and "delete" in proc.stderr
    assert snapshot(tmp_path / "run") == before


def test_checkpoint_from_another_config_is_refused(finished_run, tmp_path):
    import shutil

    shutil.copytree(finished_run / "run", tmp_path / "run")
    before = snapshot(tmp_path / "run")
    proc = dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, "--set", "train.lr=0.01", cwd=tmp_path)
    assert proc.returncode == 2
    assert "written by a different config" in proc.stderr and "train.lr: 0.002 -> 0.01" in proc.stderr
    assert snapshot(tmp_path / "run") == before
    fresh = dptrain("run", "--nproc", "1", "--run-dir", "run", *SMOKE, "--set", "checkpoint.resume=false", cwd=tmp_path)
    assert fresh.returncode == 2 and "already has checkpoints" in fresh.stderr
    assert snapshot(tmp_path / "run") == before
    # what may change between a run and its resumption: steps, logging, world size
    more = dptrain("run", "--nproc", "2", "--run-dir", "run", *SMOKE, "--set", "train.steps=6",
                   "--set", "log.every=1", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert "resumed from" in more.stdout and "steps             4 -> 6" in more.stdout
