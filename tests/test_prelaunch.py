"""Before launch: a model whose output the loss cannot use is refused, unused settings warn and leave the identity.

The factories below are loaded by ``task.model = "test_prelaunch:..."`` (tests/ is on the path).
"""

import json

import pytest
import torch
from torch import nn

from _cli import dptrain
from dptrain.checkpoint.files import CheckpointError, save_checkpoint, staging_dir
from dptrain.config import identity, identity_hash, load_config
from dptrain.config.loader import _flat_identity
from dptrain.config.schema import ADDED_LATER, RunConfig
from dptrain.planner.from_config import loss_problem
from dptrain.runner.validate import validate_run
from dptrain.tasks import build_task


class _Tuple(nn.Module):
    def __init__(self, features: int = 16, classes: int = 8):
        super().__init__()
        self.net = nn.Linear(features, classes)

    def forward(self, x):
        return self.net(x), x  # (logits, features): the classifier's loss takes logits alone


def tuple_output(**kwargs) -> nn.Module:
    return _Tuple(**kwargs)


def few_classes(features: int = 16) -> nn.Module:
    return nn.Linear(features, 3)  # the data has 8 classes


class _Hidden(nn.Module):
    def __init__(self, features: int = 16):
        super().__init__()
        self.net = nn.Linear(features, 8)

    def forward(self, x, labels=None):
        return {"hidden": self.net(x)}  # neither a loss nor logits


def hidden_only(**kwargs) -> nn.Module:
    return _Hidden(**kwargs)


class _FlatLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)

    def forward(self, idx):
        return self.emb(idx).mean(1) @ self.emb.weight.T  # (B, 256): a logit per sample, not per position


def flat_logits() -> nn.Module:
    return _FlatLogits()


class _ReadsAfter(nn.Module):
    """A forward that returns good logits but reads a value first: fake tensors cannot follow it."""

    def __init__(self, features: int = 16, classes: int = 8):
        super().__init__()
        self.net = nn.Linear(features, classes)

    def forward(self, x):
        scale = 1.0 if float(x.abs().max()) < 1e6 else 0.5
        return self.net(x) * scale


def reads_a_value(**kwargs) -> nn.Module:
    return _ReadsAfter(**kwargs)


CLASSIFIER = ["--set", "task.name=classifier", "--set", "classifier.samples=64", "--set", "train.global_batch_size=8",
              "--set", "log.plots=false", "--set", "log.progress=lines", "--set", "log.trace_steps=0",
              "--set", "log.eval_batches=1"]
FACTORY_DATA = ["--set", "data.source=factory", "--set", "data.factory=_user_data:clusters"]


@pytest.mark.parametrize("args, problem", [
    (["--set", "task.model=test_prelaunch:tuple_output"], "AttributeError: 'tuple' object has no attribute 'float'"),
    (["--set", "task.model=test_prelaunch:few_classes"], "the model's logits have 3 classes"),
    (FACTORY_DATA + ["--set", "task.model=test_prelaunch:hidden_only"], "which is not a loss, logits, or an object"),
    (["--set", "task.name=chargpt", "--set", "gpt.corpus_bytes=20000", "--set", "gpt.block_size=8",
      "--set", "task.model=test_prelaunch:flat_logits"], "ValueError: Expected input batch_size"),
])
def test_unusable_output_exits_2_before_writing(tmp_path, args, problem):
    proc = dptrain("run", "--run-dir", "out", *CLASSIFIER, *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "cannot be used by the" in proc.stderr and problem in proc.stderr, proc.stderr
    assert "docs/your-data.md" in proc.stderr and "task.model 'test_prelaunch:" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("model", ["_user_models:data_dependent", "test_prelaunch:reads_a_value"])
def test_untraceable_forward_is_not_refused(model):
    """.item() or a float() of a value: no verdict on fake tensors, so the run is let through (it trains below)."""
    cfg = load_config(None, ["task.name=classifier", "classifier.samples=64", f"task.model={model}"])
    assert loss_problem(build_task(cfg), 8) is None


def test_untraceable_forward_trains(tmp_path):
    proc = dptrain("run", "--run-dir", "out", *CLASSIFIER, "--set", "task.model=test_prelaunch:reads_a_value",
                   "--set", "train.steps=1", "--set", "checkpoint.every=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("overrides", [[], ["task.name=classifier"], ["data.source=factory",
                                                                       "data.factory=_user_data:clusters",
                                                                       "task.model=_user_data:KeywordMLP"]])
def test_working_models_have_no_problem(overrides):
    cfg = load_config(None, ["gpt.corpus_bytes=20000", *overrides])
    assert loss_problem(build_task(cfg), 16) is None


# ----------------------------------------------------------------------------- unused sections

@pytest.mark.parametrize("overrides, warning", [
    (["task.model=_user_models:wide_mlp", "task.name=classifier", "gpt.n_layer=2"], "gpt.n_layer=2 is not used"),
    (["task.name=classifier", "gpt.n_embd=64", "gpt.dropout=0.1"], "gpt.n_embd=64, gpt.dropout=0.1 are not used"),
    (["task.model=_user_models:wide_mlp", "task.name=classifier", "classifier.hidden=32"],
     "classifier.hidden=32 is not used by this run (task.model '_user_models:wide_mlp' builds the model"),
    (["gpt.corpus_bytes=20000", "classifier.classes=4"], "classifier.classes=4 is not used by this run (the task is "
                                                         "'chargpt')"),
    (["task.model=_user_models:wide_mlp", "task.name=classifier"], None),  # nothing set: silence
    (["task.name=classifier", "gpt.n_layer=4"], None),  # set to the default: silence
    (["gpt.corpus_bytes=20000", "gpt.n_layer=2"], None),  # the built-in GPT reads it
])
def test_unused_settings_warn_once(tmp_path, overrides, warning):
    rp = validate_run(load_config(None, [*overrides, f'run_dir="{tmp_path / "run"}"']), 1)
    if warning is None:
        assert rp.warnings == []
    else:
        assert len(rp.warnings) == 1 and warning in rp.warnings[0], rp.warnings
        assert rp.warnings[0].startswith("warning: ") and "\n" not in rp.warnings[0]
    assert not (tmp_path / "run").exists()


def test_unused_fields_are_not_identity():
    base = identity(load_config(None, ["task.name=classifier"]))
    assert identity(load_config(None, ["task.name=classifier", "gpt.n_layer=2", "gpt.n_embd=64"])) == base
    assert identity(load_config(None, ["task.name=classifier", "classifier.hidden=32"])) != base  # the MLP reads it
    mine = ["task.name=classifier", "task.model=_user_models:wide_mlp"]
    assert identity(load_config(None, [*mine, "classifier.hidden=32"])) == identity(load_config(None, mine))
    assert identity(load_config(None, [*mine, "task.model_args={width=8}"])) != identity(load_config(None, mine))


def old_identity(cfg: RunConfig, global_batch: int) -> dict:
    """The identity as dptrain wrote it into checkpoints before unused fields were left out (every field)."""
    defaults = _flat_identity(RunConfig())
    ident = {k: v for k, v in _flat_identity(cfg).items() if not (k.startswith(ADDED_LATER) and v == defaults.get(k))}
    ident["train.global_batch_size"] = global_batch
    return ident


def old_checkpoint(run_dir, overrides: list[str]) -> None:
    """A checkpoint's files as the code before this change wrote them: meta.json with the old identity."""
    ident = old_identity(load_config(None, overrides), 32)
    meta = {"identity": json.loads(json.dumps(ident)), "identity_hash": identity_hash(ident), "global_batch_size": 32,
            "world_size": 1}
    save_checkpoint(run_dir, 10, {"model.pt": {}, "optimizer.pt": {}, "trainer.pt": {}}, meta)


@pytest.mark.parametrize("written, now", [
    (["task.name=classifier"], ["task.name=classifier"]),
    (["task.name=classifier", "gpt.n_layer=2"], ["task.name=classifier"]),
    (["task.name=classifier"], ["task.name=classifier", "gpt.n_layer=2"]),
    (["gpt.corpus_bytes=20000"], ["gpt.corpus_bytes=20000"]),
    (["gpt.corpus_bytes=20000", "classifier.hidden=3"], ["gpt.corpus_bytes=20000"]),
])
def test_checkpoints_written_before_resume(tmp_path, written, now):
    old_checkpoint(tmp_path, written)
    rp = validate_run(load_config(None, [*now, f'run_dir="{tmp_path}"']), 1)
    assert rp.resume_from == tmp_path / "checkpoints" / "step_00000010"
    if written == now:
        assert rp.identity_hash != rp.resume_meta["identity_hash"]  # new hash, old checkpoint: resumes anyway


@pytest.mark.parametrize("written, now, named", [
    (["task.name=classifier"], ["task.name=classifier", "train.lr=0.01"], "train.lr: 0.002 -> 0.01"),
    (["task.name=classifier"], ["task.name=classifier", "classifier.hidden=32"], "classifier.hidden: 64 -> 32"),
    (["gpt.corpus_bytes=20000"], ["gpt.corpus_bytes=20000", "gpt.n_layer=2"], "gpt.n_layer: 4 -> 2"),
])
def test_old_checkpoints_still_refuse_a_changed_run(tmp_path, written, now, named):
    old_checkpoint(tmp_path, written)
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        validate_run(load_config(None, [*now, f'run_dir="{tmp_path}"']), 1)


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """A two-step classifier run with a checkpoint at its end."""
    root = tmp_path_factory.mktemp("prelaunch")
    proc = dptrain("run", "--run-dir", "out", *CLASSIFIER, "--set", "train.steps=2", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root


def test_classifier_run_resumes_with_gpt_settings(classifier_run):
    """Issue 26: `--set gpt.n_layer=2` no longer blocks resuming a classifier run (it warns instead)."""
    meta = json.loads(next((classifier_run / "out" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert identity_hash(meta["identity"]) == meta["identity_hash"]  # the stored identity is what was hashed
    assert not any(k.startswith(("gpt.", "task.model_args")) for k in meta["identity"])
    proc = dptrain("run", "--run-dir", "out", *CLASSIFIER, "--set", "train.steps=3", "--set", "gpt.n_layer=2",
                   cwd=classifier_run)
    assert proc.returncode == 0, proc.stderr
    assert "resum" in (proc.stdout + proc.stderr).lower()
    assert proc.stderr.count("warning: gpt.n_layer=2 is not used by this run") == 1  # said once, before launch
    assert torch.load(classifier_run / "out" / "checkpoints" / "step_00000003" / "trainer.pt",
                      weights_only=True)["step"] == 3


def _checkpoint(run_dir, fmt: str, files: dict, sharded=None) -> None:
    """A checkpoint of this config's identity in ``fmt``, its ``sharded/`` written by ``sharded(path)``."""
    cfg = load_config(None, ["task.name=classifier", f'run_dir="{run_dir}"'])
    ident = identity(cfg)
    ident["train.global_batch_size"] = 32
    if sharded is not None:
        staging_dir(run_dir, 10).mkdir(parents=True)
        sharded(staging_dir(run_dir, 10) / "sharded")
    meta = {"identity": ident, "identity_hash": identity_hash(ident), "global_batch_size": 32, "world_size": 2,
            "format": fmt}
    save_checkpoint(run_dir, 10, files, meta, staged=sharded is not None)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_checkpoint_in_the_older_sharded_format_is_refused_before_launch(tmp_path, strategy):
    from test_zero_checkpoint import write_old_format

    _checkpoint(tmp_path, "sharded", {"trainer.pt": {}}, lambda p: write_old_format(p, {"w": torch.ones(2, 3)}))
    with pytest.raises(CheckpointError, match="in the sharded format dptrain wrote before DTensor checkpoints.*"
                                              "dptrain consolidate"):
        validate_run(load_config(None, ["task.name=classifier", f'run_dir="{tmp_path}"', f"distributed.strategy={strategy}"]), 2)


def test_an_index_keyed_optimizer_resumes_ddp_and_is_refused_by_zero_before_launch(tmp_path):
    """optimizer.pt as dptrain saved it before checkpoints named the parameters: optimizer.state_dict()."""
    index_keyed = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    _checkpoint(tmp_path, "replicated", {"model.pt": {}, "optimizer.pt": index_keyed, "trainer.pt": {}})
    settings = ["task.name=classifier", f'run_dir="{tmp_path}"']
    assert validate_run(load_config(None, settings), 2).resume_from is not None
    with pytest.raises(CheckpointError, match=r"keyed by parameter index.*Resume it once with "
                                              r"distributed.strategy=\"ddp\" until it saves a checkpoint"):
        validate_run(load_config(None, [*settings, "distributed.strategy=zero3"]), 2)
