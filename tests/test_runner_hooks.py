"""The job runner's step hooks (dptrain.runner.hooks): the order of their moments, and the small ones' logic.

Pure logic, no process group: the hooks are driven by hand with fake steps, as the loop drives them.
The end-to-end behaviour of each (metrics, trace, checkpoints, faults, divergence) is tested through
the real CLI in test_cli_run.py, test_restart.py, test_divergence.py and test_watchdog.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from dptrain.api.engine import StepInfo
from dptrain.pages.finish import plot_title
from dptrain.runner.hooks import Hooks, StepHook
from dptrain.runner.hooks.guard import SkipHook, StragglerHook
from dptrain.runner.metrics import StepTimes
from dptrain.runner.skips import NonFiniteRun
from dptrain.runner.straggler import Straggler


class Recorder(StepHook):
    """Writes each moment it sees into a shared list, under its name."""

    def __init__(self, name: str, seen: list[str]):
        self.name, self.seen = name, seen

    def begin_step(self, step: int) -> None:
        self.seen.append(f"{self.name}.begin {step}")

    @contextlib.contextmanager
    def _around(self):
        self.seen.append(f"{self.name}.enter")
        yield
        self.seen.append(f"{self.name}.exit")

    def measuring(self, step: int):
        return self._around() if step == 2 else None

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        self.seen.append(f"{self.name}.after {step}")

    def at_end(self, step: int) -> None:
        self.seen.append(f"{self.name}.end {step}")

    def close(self) -> None:
        self.seen.append(f"{self.name}.close")


class Inside(Recorder):
    """Also needs the moment after the step's first forward (as a straggler does)."""

    def after_first_forward(self) -> None:
        self.seen.append(f"{self.name}.first_forward")


def _drive(hooks: Hooks, steps: int) -> None:
    """The loop's body, without the step."""
    info = StepInfo(0, 1.0, 1.0, 0.1, False)
    try:
        for step in range(1, steps + 1):
            hooks.begin_step(step)
            with hooks.measuring(step):
                if hooks.first_forward is not None:
                    hooks.first_forward()
            hooks.after_step(step, info, StepTimes())
        hooks.at_end(steps)
    finally:
        hooks.close()


def test_hooks_run_in_their_order_at_each_moment_and_close_last() -> None:
    seen: list[str] = []
    _drive(Hooks([Recorder("a", seen), Recorder("b", seen)]), 2)
    assert seen == ["a.begin 1", "b.begin 1", "a.after 1", "b.after 1",
                    "a.begin 2", "b.begin 2", "a.enter", "b.enter", "b.exit", "a.exit", "a.after 2", "b.after 2",
                    "a.end 2", "b.end 2", "a.close", "b.close"]


def test_only_a_hook_that_needs_the_first_forward_is_called_inside_the_step() -> None:
    assert Hooks([StepHook(), StepHook()]).first_forward is None  # timed_step then checks nothing per micro-step
    seen: list[str] = []
    _drive(Hooks([Recorder("a", seen), Inside("b", seen)]), 1)
    assert seen.count("b.first_forward") == 1 and "a.first_forward" not in seen


def test_a_failing_step_still_closes_every_hook_and_skips_the_end() -> None:
    seen: list[str] = []

    class Fails(StepHook):
        def after_step(self, step, info, times):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _drive(Hooks([Recorder("a", seen), Fails(), Recorder("b", seen)]), 3)
    assert seen == ["a.begin 1", "b.begin 1", "a.after 1", "a.close", "b.close"]


def test_the_skip_hook_ends_a_run_that_skips_every_step() -> None:
    engine = SimpleNamespace(skipped_steps=0)
    hook = SkipHook(3, engine, start_step=0)
    info, times = StepInfo(0, float("nan"), float("nan"), 0.1, True), StepTimes()
    for step in (1, 2):
        engine.skipped_steps += 1
        hook.after_step(step, info, times)
    engine.skipped_steps += 1
    with pytest.raises(NonFiniteRun, match="steps 1-3: 3 steps in a row"):
        hook.after_step(3, info, times)


def test_the_straggler_hook_measures_forward_and_backward_less_its_sleep() -> None:
    straggler = Straggler(3.0)
    hook = StragglerHook(straggler)
    times = StepTimes(forward=[(0.0, 0.25)], backward=[(0.25, 1.0)], optimizer=(1.0, 1.5))
    hook.after_step(1, StepInfo(1, 1.0, 1.0, 0.1, False), times)
    assert straggler.last_compute_s == pytest.approx(1.0)  # the optimizer's half second is not compute here


def test_the_plots_title_says_what_ran() -> None:
    from dataclasses import replace

    from dptrain.runner.facts import RunFacts

    facts = RunFacts(run_dir="r", task="chargpt", parameters=1, world_size=4, device="cpu", backend="gloo",
                     global_batch_size=64, micro_batch_size=16, grad_accum_steps=1, lr_rule="", peak_lr=1e-3,
                     start_step=0, steps=1, restarts=0, wall_s=1.0, strategy="ddp")
    assert plot_title(facts) == "chargpt on 4 rank(s), global batch 64"
    ps = replace(facts, strategy="ps", layout="parameter server (async), 3 workers")  # as the ps program says it
    assert plot_title(ps) == "chargpt, parameter server (async), 3 workers"
