"""The config layout: ``dptrain run --strategy``, ``[distributed]`` and ``[compression]`` out of ``[ddp]``, the old
keys still read with one deprecation line naming the new key, and errors that name the key to set."""

import pytest
from click.testing import CliRunner

from dptrain.cli.main import main
from dptrain.config import ConfigError, load_config
from dptrain.config.renamed import RENAMED

# A value each renamed key accepts, different from its default, so reading it at the new place is seen.
VALUES = {"strategy": "zero2", "backend": "gloo", "timeout_s": 42.0, "roll_call_s": 2.5, "check_collectives": "every",
          "compression": "powersgd", "error_feedback": False, "topk_fraction": 0.5, "powersgd_rank": 3,
          "momentum_correction": True, "momentum_masking": False, "local_clip": 0.5, "topk_warmup_steps": 7,
          "powersgd_uncompressed_steps": 9, "powersgd_warmup_rank": 5, "powersgd_warmup_steps": 11}


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else str(value)


def _at(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_an_old_key_is_read_at_its_new_place_with_one_line_naming_it(tmp_path, old, new):
    value = VALUES[old.split(".")[1]]
    notes: list[str] = []
    cfg = load_config(None, [f"{old}={_toml(value)}"], notes)
    assert _at(cfg, new) == value
    assert len(notes) == 1 and f"{old} is now {new}" in notes[0] and notes[0].startswith("deprecated: --set ")
    section, key = old.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{key} = {_toml(value)}\n")
    notes = []
    assert _at(load_config(path, [], notes), new) == value
    assert notes == [f"deprecated: {path}: {old} is now {new}"
                     + (" (or dptrain run --strategy NAME)" if new == "distributed.strategy" else "")
                     + "; the old key still works"]


def test_the_new_keys_say_nothing_and_both_names_in_one_file_must_agree(tmp_path):
    notes: list[str] = []
    cfg = load_config(None, ["distributed.strategy=zero3", "compression.method=int8", "ddp.bucket_cap_mb=4"], notes)
    assert (cfg.distributed.strategy, cfg.compression.method, cfg.ddp.bucket_cap_mb, notes) == ("zero3", "int8", 4.0, [])
    path = tmp_path / "both.toml"
    path.write_text('[ddp]\nstrategy = "zero3"\n[distributed]\nstrategy = "ddp"\n')
    with pytest.raises(ConfigError, match=r"sets both ddp.strategy = 'zero3' and distributed.strategy = 'ddp'; "
                                          r"ddp.strategy is the old name of distributed.strategy: keep"):
        load_config(path)
    path.write_text('[ddp]\nstrategy = "zero3"\n[distributed]\nstrategy = "zero3"\n')
    assert load_config(path).distributed.strategy == "zero3"
    # a later --set of either name wins, as any override does
    assert load_config(path, ["ddp.strategy=ddp"]).distributed.strategy == "ddp"


def _run(*args, tmp_path):
    return CliRunner().invoke(main, ["run", "--run-dir", str(tmp_path / "run"), *args])


def test_strategy_flag_sets_distributed_strategy_and_refuses_a_second_choice(tmp_path):
    done = _run("--strategy", "zero2", "--show-config", tmp_path=tmp_path)
    assert done.exit_code == 0 and '[distributed]\nstrategy = "zero2"' in done.stdout, done.output
    assert "deprecated" not in done.stderr
    done = _run("--strategy", "zero2", "--set", "ddp.strategy=zero3", "--show-config", tmp_path=tmp_path)
    assert done.exit_code == 2
    assert done.stderr.strip() == "error: --strategy zero2 and --set ddp.strategy=zero3 both choose the strategy: give one"
    done = _run("--set", "ddp.strategy=zero1", "--show-config", tmp_path=tmp_path)
    assert done.exit_code == 0 and '[distributed]\nstrategy = "zero1"' in done.stdout
    assert done.stderr.count("deprecated: --set ddp.strategy=zero1: ddp.strategy is now distributed.strategy") == 1


@pytest.mark.parametrize("args, message", [
    (["--strategy", "DDP"], "error: distributed.strategy: unknown strategy 'DDP' (did you mean 'ddp'?)"),
    (["--strategy", "ZeRO-3"], "(did you mean 'zero3'?)"),
    (["--set", "ddp.algorithm=RING"], "got 'RING'; did you mean 'ring'?"),
    (["--set", "Train.LR=1e-3"], "unknown key 'Train' in --set Train.LR=1e-3; did you mean 'train'?"),
    (["--set", "train.LR=1e-3"], "did you mean 'train.lr'?"),
    (["--nproc", "3"], "set train.global_batch_size to 30 or 33 (--set train.global_batch_size=30)"),
    (["--nproc", "3", "--set", "live.enabled=true"], "(--set train.global_batch_size=30)"),
])
def test_errors_suggest_values_by_the_key_that_sets_them_case_ignored(tmp_path, args, message):
    done = _run(*args, tmp_path=tmp_path)
    assert done.exit_code == 2 and message in done.stderr, done.output
    assert not (tmp_path / "run").exists()


def test_tunes_chosen_command_names_the_strategy_and_runs_as_written(tmp_path):
    import shlex

    from dptrain.tune.machine import Local
    from dptrain.tune.report import command

    best = tmp_path / "best.toml"
    best.write_text('[distributed]\nstrategy = "zero2"\n[train]\nmicro_batch_size = 8\n')
    line = command(Local(2), best, "zero2")
    assert line.startswith("dptrain run --nproc 2 --strategy zero2 --config ")
    done = CliRunner().invoke(main, [*shlex.split(line)[1:], "--run-dir", str(tmp_path / "run"), "--show-config"])
    assert done.exit_code == 0 and '[distributed]\nstrategy = "zero2"' in done.stdout, done.output
