"""A stand-in for the tuner's machine: two ranks on one host whose jobs are a test's function."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dptrain.tune.machine import Machine


class TestMachine(Machine):
    """``job(args, timeout)`` is ``run(args)``; ``probes_in_one_job`` as the test needs."""

    __test__ = False  # not a test class

    def __init__(self, run: Callable[[list[str]], tuple[int, str]], probes_in_one_job: bool = False):
        super().__init__(1, 2)
        self._run, self.probes_in_one_job = run, probes_in_one_job

    @property
    def where(self) -> str:
        return "a test machine"

    def job(self, args: list[str], timeout: float, errors: Path | None = None) -> tuple[int, str]:
        return self._run(args)
