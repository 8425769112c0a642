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
