"""The run config: strict TOML, overrides, did-you-mean, identity."""

import pytest

from dptrain.config import ConfigError, RunConfig, identity, identity_hash, load_config, to_toml


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_and_file_and_override(tmp_path):
    path = write(tmp_path, "[train]\nlr = 1e-3\nsteps = 50\n[task]\nname = \"classifier\"\n")
    cfg = load_config(path, ["train.steps=7", "classifier.hidden=32", "train.betas=[0.8, 0.95]"])
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 7 and cfg.task.name == "classifier"
    assert cfg.classifier.hidden == 32 and cfg.train.betas == [0.8, 0.95]
    assert load_config().train == RunConfig().train


@pytest.mark.parametrize("override, expected", [
    ("train.lrr=1", "did you mean 'train.lr'"),
    ("train.learning_rate=1", "did you mean 'train.lr'"),
    ("train.batch_size=8", "did you mean 'train.global_batch_size'"),
    ("lr=1", "did you mean 'train.lr'"),
    ("trian.lr=1", "did you mean 'train'"),
])
def test_unknown_keys_suggest(override, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(None, [override])
    assert f"--set {override}" in str(info.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "[train]\nwarmup = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.warmup' in .*run.toml; did you mean 'train.warmup_steps'"):
        load_config(path)


def test_malformed_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML.*line 2"):
        load_config(write(tmp_path, "[train]\nlr = = 3\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_types_and_choices_are_checked():
    with pytest.raises(ConfigError, match=r"'train.steps' .* must be int, got 'ten'"):
        load_config(None, ["train.steps=ten"])
    with pytest.raises(ConfigError, match="must be one of fp32, bf16, fp16; got 'bf61'; did you mean 'bf16'"):
        load_config(None, ["train.precision=bf61"])
    with pytest.raises(ConfigError, match="must be a section"):
        load_config(None, ["train=3"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.lr"])
    assert load_config(None, ["train.micro_batch_size=none"]).train.micro_batch_size is None
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0 and isinstance(load_config(None, ["train.lr=1"]).train.lr, float)


def test_to_toml_round_trips(tmp_path):
    cfg = load_config(None, ["train.micro_batch_size=4", "task.model_args={ width = 3 }", "run_dir=\"r\""])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_identity_ignores_what_does_not_change_a_step():
    base = load_config()
    tuned = load_config(None, ["train.steps=9", "log.every=3", "ddp.bucket_cap_mb=4", "checkpoint.every=5",
                               "run_dir=\"elsewhere\""])
    changed = load_config(None, ["train.lr=1e-4"])
    assert identity_hash(identity(base)) == identity_hash(identity(tuned))
    assert identity_hash(identity(base)) != identity_hash(identity(changed))
    assert "train.lr" in identity(base) and "train.steps" not in identity(base)


def test_docs_run_md_holds_the_config_reference_as_the_schema_prints_it():
    from pathlib import Path

    from dptrain.config.schema import reference_markdown

    doc = (Path(__file__).parents[1] / "docs" / "run.md").read_text()
    assert reference_markdown().strip() in doc, "regenerate docs/run.md's table: dptrain run --config-reference"


def test_a_field_added_after_checkpoints_were_written_is_out_of_the_identity_at_its_default():
    from dptrain.config import identity, load_config

    assert "train.onebit_freeze_step" not in identity(load_config())  # older checkpoints keep resuming
    assert identity(load_config(None, ["train.onebit_freeze_step=5"]))["train.onebit_freeze_step"] == 5


@pytest.mark.parametrize("optimizer, lr", [("adamw", 2e-3), ("adam", 2e-3), ("onebit_adam", 2e-3), ("lamb", 2e-2),
                                           ("lars", 2.0)])
def test_an_unset_lr_is_the_optimizers_default_and_a_set_one_is_kept(tmp_path, optimizer, lr):
    from dptrain.config.schema import DEFAULT_LR

    assert load_config(None, [f"train.optimizer={optimizer}"]).train.lr == lr == DEFAULT_LR[optimizer]
    path = write(tmp_path, f"[train]\noptimizer = \"{optimizer}\"\n")
    assert load_config(path).train.lr == lr  # from a file as from --set
    assert load_config(path, ["train.lr=5e-3"]).train.lr == 5e-3  # set explicitly: kept, whichever comes first
    assert load_config(None, ["train.lr=5e-3", f"train.optimizer={optimizer}"]).train.lr == 5e-3
    resolved = load_config(write(tmp_path, to_toml(load_config(path))))  # config.toml holds the rate used
    assert resolved.train.lr == lr


def test_a_warmup_as_long_as_the_run_is_a_warning_before_launch(tmp_path):
    from dptrain.optim.schedule import schedule_warnings
    from dptrain.runner.validate import validate_run

    tiny = ["gpt.n_layer=1", "gpt.n_embd=16", "gpt.n_head=2", "gpt.block_size=8", "gpt.corpus_bytes=20000"]
    config = load_config(None, [*tiny, "train.steps=20", f'run_dir="{tmp_path / "run"}"'])
    [warning] = [w for w in validate_run(config, 1).warnings
                 if "warmup" in w]  # the default warm-up, 30 steps, in a 20-step run
    assert warning.startswith("warning: train.warmup_steps 30 is not below train.steps 20")
    assert "20/30 = 67% of its peak at the last step" in warning and "e.g. 2" in warning
    assert "reaches its peak only at the last step" in schedule_warnings(30, 30)[0]
    assert schedule_warnings(300, 30) == [] and schedule_warnings(1, 0) == []
