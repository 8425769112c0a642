"""`dptrain env`, `--show-config`, `--config-reference` (in process) and a `dptrain bench comm` smoke run."""

import json

import pytest
from click.testing import CliRunner

from _cli import dptrain
from dptrain.cli import main
from dptrain.comm.cost import busbw_factor
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


def test_bench_comm_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "comm.json"
    proc = dptrain("bench", "comm", "--world-size", "2", "--min-size", "4K", "--max-size", "16K", "--reps", "2",
                   "--collectives", "all_reduce", "broadcast", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    cells = {(r["collective"], r["algorithm"], r["bytes"]) for r in result["rows"]}
    assert cells == {(c, a, s) for c in ("all_reduce", "broadcast") for a in ("native", "ring", "tree", "naive")
                     for s in (4096, 16384)}
    for r in result["rows"]:
        assert r["median_s"] > 0 and r["predicted_s"] > 0 and len(r["samples_s"]) == 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * busbw_factor(r["collective"], 2))
    assert result["link"]["beta_Bps"] > 0 and "| 4 KiB |" in proc.stdout
