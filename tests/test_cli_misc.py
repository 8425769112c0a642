"""`dptrain env`, `--show-config` and `--config-reference`, in process."""

import json

from click.testing import CliRunner

from dptrain.cli import main
from dptrain.config import load_config


def test_env_reports_versions_backends_and_cores():
    result = CliRunner().invoke(main, ["env", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["packages"]["torch"].startswith("2.") and info["distributed"]["gloo"] is True
    assert info["cpu"]["logical_cores"] >= 1 and "available" in info["cuda"]
    text = CliRunner().invoke(main, ["env"]).output
    assert "backends" in text and "gloo" in text and "torch" in text


def test_show_config_prints_a_config_that_loads_back(tmp_path):
    result = CliRunner().invoke(main, ["run", "--show-config", "--set", "train.lr=5e-4", "--set", "gpt.n_layer=2"])
    assert result.exit_code == 0, result.output
    (tmp_path / "c.toml").write_text(result.output)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.train.lr == 5e-4 and cfg.gpt.n_layer == 2


def test_config_reference_lists_every_section():
    result = CliRunner().invoke(main, ["run", "--config-reference"])
    assert result.exit_code == 0
    for section in ("[task]", "[gpt]", "[classifier]", "[train]", "[ddp]", "[checkpoint]", "[log]"):
        assert f"**{section}**" in result.output
    assert "| `lr_scaling` | `\"none\"` |" in result.output
