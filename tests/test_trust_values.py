"""Bad values are refused before anything runs (issue 56, items 6-8): one line, exit 2, nothing written.

A strategy's section checks its own values (``[diloco]``, ``[localsgd]``, ``[zero]``), so
``dptrain run`` refuses them before it launches a worker or writes the run directory;
``dptrain tune`` refuses its own bad options before it probes a link or creates ``--out``.
And the fault kinds ``dptrain run --help`` and docs/run.md list are every kind there is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _cli import dptrain

DOCS = Path(__file__).parent.parent / "docs"

# The classifier, so that validation is quick; --nproc 2, as the runs.
SMALL = ["--nproc", "2", "--set", "task.name=classifier", "--set", "train.steps=4", "--set", "train.warmup_steps=1"]


def assert_one_line(proc, *words: str) -> None:
    """Exit 2 and one line on stderr that holds each of ``words``, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert all(word in lines[0] for word in words), (words, lines[0])


@pytest.mark.parametrize("strategy, setting, fix", [
    ("diloco", "diloco.period=0", "--set diloco.period=50"),
    ("diloco", "diloco.period=-1", "--set diloco.period=50"),
    ("diloco", "diloco.outer_lr=-1", "--set diloco.outer_lr=0.7"),
    ("diloco", "diloco.fragments=3", "--set diloco.fragments=1"),
    ("diloco", "diloco.outer_momentum=5", "--set diloco.outer_momentum=0.7"),
    ("diloco", "diloco.outer_momentum=-0.5", "--set diloco.outer_momentum=0.7"),
    ("diloco", "diloco.warmup_steps=-3", "--set diloco.warmup_steps=0"),
    ("localsgd", "localsgd.period=0", "--set localsgd.period=8"),
    ("localsgd", "localsgd.period=-2", "--set localsgd.period=8"),
    ("localsgd", "localsgd.warmup_steps=-2", "--set localsgd.warmup_steps=0"),
    ("zero3", "zero.min_unit_numel=-3", "0 lets zero.unit_classes choose"),
    ("zero3", "zero.shard_size=-1", "0 shards over all ranks"),
    ("zero3", "zero.unit_classes=[3]", "zero.unit_classes=[\"Block\"]"),
])
def test_a_strategy_value_is_refused_before_launch(tmp_path, strategy, setting, fix):
    proc = dptrain("run", *SMALL, "--run-dir", "out", "--set", f"distributed.strategy={strategy}", "--set", setting,
                   cwd=tmp_path)
    key, value = setting.split("=")
    assert_one_line(proc, f"error: {key} must", f"got {value}", fix)
    assert not (tmp_path / "out").exists()  # no config.toml, no logs/


def test_a_strategy_section_is_checked_whichever_strategy_runs(tmp_path):
    proc = dptrain("run", "--run-dir", "out", "--set", "diloco.period=0", cwd=tmp_path)
    assert_one_line(proc, "diloco.period", "got 0")
    assert not (tmp_path / "out").exists()


# Each would run something on the old code (a link probe, a calibration) if it got past the checks: the trial
# timeout of 10 ms, valid, makes that something fail at once instead of running for minutes.
FAST = ["--trial-timeout", "0.01"]


@pytest.mark.parametrize("args, words", [
    (["--memory-gib", "nan", *FAST], ["--memory-gib", "got nan", "e.g. --memory-gib 20"]),
    (["--memory-gib", "inf", *FAST], ["--memory-gib", "got inf", "e.g. --memory-gib 20"]),
    (["--memory-gib", "-1", *FAST], ["--memory-gib", "got -1", "e.g. --memory-gib 20"]),
    (["--memory-gib", "0", *FAST], ["--memory-gib", "got 0", "e.g. --memory-gib 20"]),
    (["--out", "/proc/x", *FAST], ["--out /proc/x cannot be created", "give another --out"]),
    (["--out", "tiny.toml/x", *FAST], ["--out tiny.toml/x cannot be created", "is a file", "give another --out"]),
    (["--trial-timeout", "0"], ["--trial-timeout", "got 0", "e.g. --trial-timeout 600"]),
    (["--trial-timeout", "-5"], ["--trial-timeout", "got -5", "e.g. --trial-timeout 600"]),
    (["--trial-timeout", "nan"], ["--trial-timeout", "got nan", "e.g. --trial-timeout 600"]),
    (["--trials", "0", *FAST], ["--trials must be at least 1", "got 0", "e.g. --trials 3"]),
    (["--trials", "-1", *FAST], ["--trials must be at least 1", "got -1", "e.g. --trials 3"]),
    (["--rounds", "0", *FAST], ["--rounds must be at least 1", "got 0", "e.g. --rounds 1"]),
    (["--rounds", "4", "--max-rounds", "2", *FAST], ["--max-rounds (2) must be at least --rounds (4)", "e.g. --max-rounds 3"]),
    (["--steps", "4", "--warmup", "4", *FAST], ["--steps (4) must exceed --warmup (4)", "e.g. --steps 12"]),
    (["--probe-steps", "2", *FAST], ["--probe-steps must be more than the 2 warm-up steps", "got 2",
                                     "e.g. --probe-steps 6"]),
    (["--probe-rounds", "0", *FAST], ["--probe-rounds must be at least 1", "got 0", "e.g. --probe-rounds 2"]),
    (["--probe-rounds", "2", "--calibration", "c.json", *FAST], ["--probe-steps and --probe-rounds", "--calibration",
                                                                 "leave them out"]),
    (["--buckets", "-1", *FAST], ["--buckets must be positive sizes in MiB", "'-1'", "e.g. --buckets 1,4,25"]),
    (["--buckets", "nan", *FAST], ["--buckets must be positive sizes in MiB", "'nan'", "e.g. --buckets 1,4,25"]),
    (["--buckets", "abc", *FAST], ["--buckets must be comma-separated sizes", "'abc'", "e.g. --buckets 1,4,25"]),
    (["--global-batch", "0", *FAST], ["--global-batch must be at least 1", "got 0"]),
    (["--nproc", "0", *FAST], ["--nproc must be at least 1, got 0"]),
])
def test_dptrain_tune_refuses_a_bad_option_before_anything_runs(tmp_path, args, words):
    (tmp_path / "tiny.toml").write_text("")
    if "--nproc" not in args:
        args = ["--nproc", "2", *args]
    proc = dptrain("tune", *args, cwd=tmp_path)
    assert_one_line(proc, "dptrain tune: ", *words)
    assert not (tmp_path / "tune").exists()


def test_dptrain_tune_refuses_a_bad_link_rate_before_the_cluster_is_up(tmp_path):
    for rate in ("0", "-1", "nan", "inf"):
        proc = dptrain("tune", "--cluster", "2x2", "--bandwidth-gbit", rate, *FAST, cwd=tmp_path)
        assert_one_line(proc, "--bandwidth-gbit", f"got {rate}", "e.g. --bandwidth-gbit 1")
        assert not (tmp_path / "tune").exists()


def test_the_fault_kinds_in_help_and_docs_are_every_kind():
    from dptrain.cli import main
    from dptrain.runner.faults import KINDS

    fault = next(p for p in main.commands["run"].params if p.name == "fault")
    listed = re.search(r"\(([^)]*)\)", fault.help).group(1).split(", ")
    assert sorted(listed) == sorted(KINDS), fault.help
    docs = " ".join((DOCS / "run.md").read_text().split())
    paragraph = docs[docs.index("`DPTRAIN_FAULT=<rank>:<step>:<kind>` injects"):]
    paragraph = paragraph[:paragraph.index("rehearse yours")]
    assert sorted(set(re.findall(r"`([a-z-]+)`", paragraph)) & set(KINDS)) == sorted(KINDS), paragraph
