"""Every command in README.md is checked here, so that none goes stale (docs/testing.md).

The README's commands are read by ``tests/_readme.py`` (its ```bash blocks, continuation lines
joined, comments dropped). The first two, which set up a fresh machine and run the main job,
then the tests, are run by CI itself (``.ci/run``): here they must come first, exactly as
written, and ``.ci/run`` must run them. Every other command is checked through the real
command line, cheaply and in this process:

- ``dptrain run ...``: parsed by click and its config resolved with ``--show-config`` (nothing
  is launched), in a temporary directory; every ``--set`` key must be where the resolved config
  has it, with the value given, and no deprecation may be printed (an old key still works, with
  a warning: the README must not teach it);
- ``dptrain launch ...``: parsed by click; every launcher flag must be one of its options (an
  unknown one would be taken for the script); a script under ``examples/`` must exist;
- ``dptrain tune|plan|simulate|explore|consolidate|prepare-data|env|bench ...``: parsed by the
  command's click parser; a ``--config``/``--set`` it takes is resolved as for ``dptrain run``;
- ``torchrun ...``: parsed by torch's own parser; a ``-m dptrain.run`` worker's arguments by
  ``dptrain.run``'s and its config resolved; ``srun ...``: the command it starts, checked so;
- inline code spans that begin with ``dptrain`` or ``torchrun``: their flags must be the
  command's (a placeholder such as ``--strategy NAME`` is not resolved);
- ```python blocks are compiled; ```toml blocks are loaded as a run's config.

A command none of these knows fails ``test_every_readme_command_has_a_check``, by name: a new
kind of command in the README needs a check here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import _readme

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the package's own dependency, tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# The two fresh-machine commands, as the README has always written them; CI runs them.
FIRST = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
         "dptrain run --nproc 2")
SECOND = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]" && '
          "ruff check src tests && lint-imports && python -m pytest")

COMMANDS = _readme.bash_commands()
OTHERS = COMMANDS[2:]
SUBCOMMANDS = ("run", "launch", "tune", "plan", "simulate", "explore", "consolidate", "prepare-data", "env", "bench")


# ----------------------------------------------------------------------------- helpers

def _cli():
    from dptrain.cli import main

    return main


def _resolve(args: list[str], tmp_path: Path, monkeypatch, world_size: int | None = None) -> dict:
    """``dptrain run ARGS --show-config`` in tmp_path: the resolved config, after checking what ARGS asked for."""
    from click.testing import CliRunner

    monkeypatch.chdir(tmp_path)  # relative paths (runs/, data/, job.toml) resolve here, never in the checkout
    _job_toml(tmp_path)
    result = CliRunner().invoke(_cli(), ["run", *args, "--show-config"])
    assert result.exit_code == 0, f"dptrain run {shlex.join(args)} --show-config: exit {result.exit_code}\n{result.output}"
    assert "deprecated" not in result.output, result.output
    resolved = tomllib.loads(result.stdout)
    for key, value in _overrides(args):
        assert _lookup(resolved, key) == value, (key, value, _lookup(resolved, key))
    (tmp_path / "resolved.toml").write_text(result.stdout)
    _check_rules(tmp_path / "resolved.toml", world_size if world_size is not None else _nproc(args))
    return resolved


def _check_rules(path: Path, world_size: int) -> None:
    """The rules ``dptrain run`` checks before launch that need no model or data: the strategy is a registered one,
    each section's own values, and what each feature asks of the strategy and the other sections."""
    from dptrain.config import load_config
    from dptrain.strategies import get_strategy
    from dptrain.strategies.requirements import check_features

    cfg = load_config(path)
    entry = get_strategy(cfg.distributed.strategy)
    cfg.check()
    check_features(cfg, entry, world_size, entry.data_ranks(cfg, world_size))


def _nproc(args: list[str]) -> int:
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--nproc":
            return int(value)
    return 1


def _overrides(args: list[str]) -> list[tuple[str, object]]:
    """Each ``--set key=value`` (and ``--strategy NAME``) of ARGS as (key, the value TOML reads)."""
    out = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--strategy":
            out.append(("distributed.strategy", value))
        elif flag == "--set":
            key, _, text = value.partition("=")
            try:
                parsed = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                parsed = text  # a bare word is a string
            out.append((key.strip(), parsed))
    return out


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"{key}: not a key of the resolved config (renamed?)"
        node = node[part]
    return node


def _job_toml(tmp_path: Path) -> None:
    """``job.toml``, which the README's commands name: the README's own config block, where it has one."""
    blocks = _readme.blocks_of("toml")
    (tmp_path / "job.toml").write_text(blocks[0][0] + "\n" if blocks else "")


def _config_args(params: dict) -> list[str]:
    """A parsed command's --config and --set, as ``dptrain run`` arguments."""
    args = ["--config", str(params["config_path"])] if params.get("config_path") else []
    for override in params.get("overrides") or ():
        args += ["--set", override]
    return args


def _launch_target(args: list[str]) -> None:
    from dptrain.cli.launch import launch

    ctx = launch.make_context("launch", list(args))
    script = ctx.params["script"]
    assert not script.startswith("-"), f"dptrain launch does not take {script} (it would run it as the script)"
    if script.startswith("examples/"):
        assert (ROOT / script).is_file(), f"{script} does not exist"


# ----------------------------------------------------------------------------- the checks, by command

def check_dptrain(words: list[str], tmp_path: Path, monkeypatch) -> None:
    name, args = words[1], words[2:]
    if name == "run":
        if "--config-reference" in args:
            from click.testing import CliRunner

            result = CliRunner().invoke(_cli(), ["run", *args])
            assert result.exit_code == 0, result.output
            assert "distributed.strategy" in result.output
        else:
            _resolve(args, tmp_path, monkeypatch)
        return
    if name == "launch":
        _launch_target(args)
        return
    if name == "bench":
        import importlib

        from dptrain.cli.bench_group import BENCHMARKS

        importlib.import_module(BENCHMARKS[args[0]]).main.make_context("bench", args[1:])
        return
    command = _cli().commands[name]
    ctx = command.make_context(name, list(args))  # parses and converts every value; runs nothing
    if ctx.params.get("config_path") or ctx.params.get("overrides"):
        _resolve(_config_args(ctx.params), tmp_path, monkeypatch, ctx.params.get("nproc") or 1)


def check_torchrun(words: list[str], tmp_path: Path, monkeypatch) -> None:
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(words[1:])
    if ns.module:
        assert ns.training_script == "dptrain.run", f"torchrun -m {ns.training_script}: no check for that module"
        nodes, per_node = ns.nnodes.split(":")[-1], ns.nproc_per_node
        world = int(nodes) * int(per_node) if nodes.isdigit() and str(per_node).isdigit() else 1
        check_worker(ns.training_script_args, tmp_path, monkeypatch, world)
    elif ns.training_script.startswith("examples/"):
        assert (ROOT / ns.training_script).is_file(), ns.training_script


def check_worker(args: list[str], tmp_path: Path, monkeypatch, world_size: int = 1) -> None:
    """``python -m dptrain.run ARGS``: its own parser, then the config it would resolve."""
    from dptrain.run import parse_args

    ns = parse_args(list(args))
    resolved = ["--config", ns.config] if ns.config else []
    for override in ns.overrides:
        resolved += ["--set", override]
    if ns.run_dir:
        resolved += ["--run-dir", ns.run_dir]
    _resolve(resolved, tmp_path, monkeypatch, world_size)


def check_python(words: list[str], tmp_path: Path, monkeypatch) -> None:
    if words[1:3] == ["-m", "dptrain.run"]:
        check_worker(words[3:], tmp_path, monkeypatch)
    elif words[1:3] == ["-m", "pytest"]:
        for path in [w for w in words[3:] if not w.startswith("-")]:
            assert (ROOT / path.split("::")[0]).exists(), path
    else:
        raise AssertionError(f"no check for python {shlex.join(words[1:])}")


def check_srun(words: list[str], tmp_path: Path, monkeypatch) -> None:
    """Slurm's own flags are Slurm's; the command it starts is checked as it would be alone."""
    rest = _after_launcher(words)
    checker = _checker(rest)
    assert checker is not None, f"srun starts {shlex.join(rest)}: no check for it"
    checker(rest, tmp_path, monkeypatch)


def _after_launcher(words: list[str]) -> list[str]:
    for i, word in enumerate(words[1:], 1):
        if word in ("dptrain", "torchrun", "python", "python3"):
            return words[i:]
    return []


def _checker(words: list[str]):
    """The check for a command's words, or None where there is none."""
    if not words:
        return None
    if words[0] == "dptrain" and len(words) > 1 and words[1] in SUBCOMMANDS:
        return check_dptrain
    if words[0] == "torchrun":
        return check_torchrun
    if words[0] in ("python", "python3") and len(words) > 2 and (words[1:3] == ["-m", "dptrain.run"]
                                                                  or words[1:3] == ["-m", "pytest"]):
        return check_python
    if words[0] == "srun" and _checker(_after_launcher(words)) is not None:
        return check_srun
    return None


# ----------------------------------------------------------------------------- the tests

def test_the_two_fresh_machine_commands_come_first_as_written():
    assert COMMANDS[:2] == [FIRST, SECOND]


def test_readme_py_prints_them_for_ci():
    for which, expected in (("first", FIRST), ("second", SECOND)):
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_readme.py"), which], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip("\n") == expected


def test_ci_runs_the_two_fresh_machine_commands():
    """``.ci/run`` holds each verbatim, or runs it from the README (``tests/_readme.py first`` / ``second``)."""
    ci = (ROOT / ".ci" / "run").read_text()
    for which, command in (("first", FIRST), ("second", SECOND)):
        assert command in ci or re.search(rf"tests/_readme\.py\s+{which}\b", ci), \
            f".ci/run does not run the README's {which} command: {command}"


def test_the_first_commands_run_resolves(tmp_path, monkeypatch):
    """The main job the first command starts: its `dptrain run` part, resolved."""
    words = shlex.split(FIRST.rsplit("&&", 1)[1])
    check_dptrain(words, tmp_path, monkeypatch)


def test_every_readme_command_has_a_check():
    unchecked = [c for c in OTHERS if _checker(shlex.split(c)) is None]
    assert unchecked == [], "README commands with no check in tests/test_readme_commands.py (add one):\n" + \
        "\n".join(unchecked)


@pytest.mark.parametrize("command", OTHERS, ids=[f"{i + 3}:{c[:60]}" for i, c in enumerate(OTHERS)])
def test_readme_command(command, tmp_path, monkeypatch):
    words = shlex.split(command)
    checker = _checker(words)
    if checker is None:
        pytest.fail(f"no check for {command!r}: add one to tests/test_readme_commands.py")
    checker(words, tmp_path, monkeypatch)


INLINE = [c for c in _readme.inline_code() if re.match(r"(dptrain|torchrun) -?-?\w", c)
          and (c.split()[0] == "torchrun" or (len(c.split()) > 1 and c.split()[1] in SUBCOMMANDS))]


@pytest.mark.parametrize("span", sorted(set(INLINE)))
def test_readme_inline_command_flags(span):
    """An inline `dptrain ...` or `torchrun ...`: the command exists, and every flag it shows is one it takes."""
    import click

    words = shlex.split(span)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args(words[1:])  # torch's own parser: an unknown flag exits 2
        return
    assert words[1] in _cli().commands, f"{span}: dptrain has no command {words[1]}"
    if not any(w.startswith("-") for w in words[2:]):
        return
    if words[1] == "launch":  # a launcher flag it did not know would be taken for the script
        _launch_target(words[2:])
        return
    command = _cli().commands[words[1]]
    known = {s for p in command.params if isinstance(p, click.Option) for s in p.opts + p.secondary_opts}
    for word in words[2:]:
        if word.startswith("-"):
            assert word.split("=", 1)[0] in known, f"{span}: dptrain {words[1]} has no {word.split('=', 1)[0]}"


@pytest.mark.parametrize("block", _readme.blocks_of("python"), ids=lambda b: f"line {b[1]}")
def test_readme_python_compiles(block):
    compile(block[0], f"README.md, line {block[1]}", "exec")


@pytest.mark.parametrize("block", _readme.blocks_of("toml"), ids=lambda b: f"line {b[1]}")
def test_readme_toml_is_a_config(block, tmp_path, monkeypatch):
    path = tmp_path / "readme.toml"
    path.write_text(block[0] + "\n")
    resolved = _resolve(["--config", str(path)], tmp_path, monkeypatch)
    for section, table in tomllib.loads(block[0]).items():
        for key, value in table.items() if isinstance(table, dict) else [(None, table)]:
            dotted = section if key is None else f"{section}.{key}"
            assert _lookup(resolved, dotted) == value, dotted
