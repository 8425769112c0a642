"""Injected faults for tests of failure handling: ``DPTRAIN_FAULT=<rank>:<step>:<kill|raise>``.

That rank SIGKILLs itself or raises at the start of that (1-based) step, in every strategy's loop.
A fault fires in a job's first attempt only: after a restart (torchrun's
``TORCHELASTIC_RESTART_COUNT`` > 0) the resumed run goes past that step, as it would after
a real, one-off failure. ``DPTRAIN_FAULT_EVERY_ATTEMPT=1`` makes it fire after every
restart too (a permanent fault, to test running out of restarts).
"""

from __future__ import annotations

import os
import signal

__all__ = ["parse_fault", "inject_fault"]


def parse_fault(spec: str) -> tuple[int, int, str] | None:
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not spec or (restarted and not os.environ.get("DPTRAIN_FAULT_EVERY_ATTEMPT")):
        return None
    rank, step, kind = spec.split(":")
    if kind not in ("kill", "raise"):
        raise ValueError(f"DPTRAIN_FAULT={spec!r}: the kind must be kill or raise")
    return int(rank), int(step), kind


def inject_fault(kind: str, rank: int, step: int) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"fault injected by DPTRAIN_FAULT on rank {rank} at step {step}")
