"""config.toml loads back: ``load_config(to_toml(cfg)) == cfg`` for any value ``--set`` accepts (issue 26)."""

import dataclasses
import typing
from pathlib import Path

import pytest
from torch import nn

from _cli import dptrain
from dptrain.config import RunConfig, load_config, to_toml
from dptrain.config.loader import _SECTIONS
from dptrain.config.schema import section_fields

# task.model_args is free-form: its keys and values reach the file exactly as given.
ODD = [
    'task.model_args={"my key"="x"}',                    # a space
    'task.model_args={"a.b"=1}',                         # a dot: one key, not a nested table
    """task.model_args={"say \\"hi\\""="it's", 'c:\\path'="a\\\\b"}""",  # quotes and backslashes
    'task.model_args={"größe"="日本語", "emoji"="🙂"}',     # unicode keys and values
    'task.model_args={outer={inner={deep=[1, 2]}, "x y"={}}}',  # nested dicts, an empty one
    'task.model_args={empty_list=[], empty_dict={}, tables=[{a=1}, {b="2"}]}',
    'task.model_args={tiny=1e-9, neg=-0.0, huge=1e300, big=9223372036854775807, small=-9223372036854775808}',
    'task.model_args={"#not a comment"="# nor this", "="="=", ""="empty key"}',
    'task.model_args={multi="line one\\nline two\\ttab"}',
    'train.lr=1e-9',
    'train.betas=[0.5, 0.999999999]',
    'zero.unit_classes=["Block", "My Block", "ü"]',
    'data.text=["a b.txt", "c\\"d.txt"]',
    'run_dir="runs/with space/ünïcode \\"q\\""',
    'train.global_batch_size=64',
    'ddp.bucket_cap_mb=0.5',
    'gpt.corpus_bytes=4000000000',
]


def written(cfg: RunConfig, directory: Path) -> Path:
    path = directory / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


@pytest.mark.parametrize("override", ODD)
def test_set_values_round_trip(tmp_path, override):
    cfg = load_config(None, [override])
    back = load_config(written(cfg, tmp_path))
    assert back == cfg
    assert to_toml(back) == to_toml(cfg)  # and writing it again is stable


def test_dotted_key_stays_one_key(tmp_path):
    cfg = load_config(None, ['task.model_args={"a.b"=1, "my key"="x"}'])
    assert load_config(written(cfg, tmp_path)).task.model_args == {"a.b": 1, "my key": "x"}


def test_every_section_is_one_table_in_schema_order():
    text = to_toml(load_config(None, ['task.model_args={"k"={"n"=1}}']))
    headers = [line for line in text.splitlines() if line.startswith("[")]
    assert [h for h in headers if "." not in h] == [f"[{name}]" for name in _SECTIONS]
    assert "[task.model_args.k]" in headers
    assert text.startswith('run_dir = ""\n')  # the top-level key comes before any table


def optional_fields() -> list[str]:
    found = []
    for section, cls in _SECTIONS.items():
        for name, kind in typing.get_type_hints(cls).items():
            if type(None) in typing.get_args(kind):
                found.append(f"{section}.{name}")
    return found


def test_none_is_a_comment_and_the_default_of_every_optional_field(tmp_path):
    """TOML has no null: None is written as ``# key: none``, which loads back as the default, so that must be None."""
    assert optional_fields(), "the schema has optional fields (the train batch sizes, ddp.bucket_cap_mb)"
    for dotted in optional_fields():  # the declared default: a field may resolve its None after (train.lr)
        section, key = dotted.split(".")
        declared = {f.name: f.default for f in dataclasses.fields(_SECTIONS[section])}[key]
        assert declared is None, f"{dotted}: a None would load back as its default {declared!r}"
    resolved = load_config(None, ["train.optimizer=lamb"])  # written with its resolved lr, loaded back the same
    assert load_config(written(resolved, tmp_path)) == resolved
    cfg = load_config(None, ["train.global_batch_size=none", "train.micro_batch_size=4"])
    text = to_toml(cfg)
    assert "# global_batch_size: none" in text and "# grad_accum_steps: none" in text
    assert "micro_batch_size = 4" in text
    assert load_config(written(cfg, tmp_path)) == cfg


def test_defaults_round_trip_and_all_fields_are_written(tmp_path):
    cfg = RunConfig()
    assert load_config(written(cfg, tmp_path)) == cfg
    text = to_toml(cfg)
    for section, cls in _SECTIONS.items():
        for key in section_fields(cls):
            assert f"\n{key} = " in text or f"# {key}: none" in text or f"[{section}.{key}]" in text, (section, key)


def test_show_config_output_loads_back(tmp_path):
    """Through the real CLI: ``dptrain run --show-config`` with odd ``--set`` values, then ``--config`` on it."""
    # each --set of task.model_args replaces the last: merge the odd tables into one
    merged = "task.model_args={" + ", ".join(o.partition("={")[2][:-1] for o in ODD[:9]) + "}"
    args = ["--set", merged, "--set", "train.lr=1e-9", "--set", "gpt.corpus_bytes=4000000000"]
    shown = dptrain("run", "--show-config", *args, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "shown.toml").write_text(shown.stdout, encoding="utf-8")
    assert load_config(tmp_path / "shown.toml") == load_config(None, [merged, "train.lr=1e-9",
                                                                       "gpt.corpus_bytes=4000000000"])
    again = dptrain("run", "--show-config", "--config", "shown.toml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == shown.stdout


def mlp_any(features: int = 16, classes: int = 8, **ignored) -> nn.Module:
    """A classifier factory that takes (and ignores) any other keyword, so model_args may hold odd keys."""
    return nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes))


def test_run_writes_config_toml_that_loads_back(tmp_path):
    """A real one-step run: its config.toml holds odd model_args and loads back to the config it ran."""
    run_dir = (tmp_path / "run dir ü").resolve()
    overrides = ["task.name=classifier", "classifier.samples=64", "task.model=test_config_roundtrip:mlp_any",
                 'task.model_args={"my key"="x", "a.b"=1, nested={deep={}}, tiny=1e-9, big=9007199254740993, '
                 '"ü"=[]}', "train.steps=1", "train.global_batch_size=8", "checkpoint.every=0",
                 "log.eval_batches=1", "log.trace_steps=0", "log.plots=false", "log.progress=lines"]
    proc = dptrain("run", *[a for o in overrides for a in ("--set", o)], "--run-dir", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    expected = load_config(None, overrides + [f'run_dir="{run_dir}"'])
    back = load_config(run_dir / "config.toml")
    assert back == expected
    assert dataclasses.asdict(back)["task"]["model_args"]["big"] == 9007199254740993  # not through a float
