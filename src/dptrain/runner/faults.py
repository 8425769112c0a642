"""Injected faults for tests of failure handling: ``DPTRAIN_FAULT=<rank>:<step>:<kind>``.

At the start of that (1-based) step, in every strategy's loop, that rank:

- ``kill``: SIGKILLs itself (a crashed worker);
- ``kill-in-backward``: SIGKILLs itself in that step's backward, when its last gradient
  is ready, so its earlier buckets' all-reduces are in flight (a crash inside a collective);
- ``delay``: sleeps ``DPTRAIN_FAULT_DELAY_S`` seconds (default 3) before the step (a
  transient stall: the others wait in their next collective, then go on);
- ``raise``: raises an exception (a bug);
- ``stop``: stops itself with SIGSTOP (a frozen machine: its threads, heartbeats included,
  stop with it);
- ``kill-before-vote``: under live recovery, SIGKILLs itself after the step's all-reduce and
  before the commit vote (elsewhere nothing happens);
- ``kill-in-heal``: under live recovery, SIGKILLs itself (as ``kill``), and its restarted self
  again as its heal arrives (the header read, the sender still sending): a worker lost in
  the middle of a heal (elsewhere only the first kill happens);
- ``hang``: stops, without exiting (a deadlock, a stuck device): the others wait in their
  next collective until ``distributed.timeout_s``;
- ``flip``: flips the lowest bit of its first parameter's first element (silent data
  corruption: the run goes on, and the replicas differ; ``[divergence]`` finds it);
- ``nan``: makes this step's gradient of its first parameter NaN (a numerical blow-up on
  one rank: the all-reduce spreads it, and the step is skipped on every rank);
- ``mismatch``: calls one extra all-reduce, of one element, before the step (a branch that
  depends on the rank: the others are in their gradient collectives). It goes through the
  DDP or ZeRO engine's collective check when there is one (``distributed.check_collectives``): with
  ``every`` each rank raises a ``CollectiveMismatchError`` naming the call; with ``first``
  (after step 1) this rank waits at the check and the others in gloo, until the timeout;
  with ``off`` gloo sees sizes that differ and aborts the process (SIGABRT).

A parameter server (``distributed.strategy = "ps"``: the last ``ps.servers`` ranks) has no steps of
its own: its STEP is the logged one, the rounds it applied in sync and backup, the
gradients it applied divided by the number of workers in async and ssp. The fault fires
once, before its first update of that step, and only kill, raise, hang and delay apply.

A fault fires in a job's first attempt only (``kill-in-heal``: its first two): after a
restart (torchrun's ``TORCHELASTIC_RESTART_COUNT`` > 0) the resumed run goes past that
step, as it would after a real, one-off failure. ``DPTRAIN_FAULT_EVERY_ATTEMPT=1`` makes it fire after every
restart too (a permanent fault, to test running out of restarts).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from dptrain.launch.rendezvous import restart_count

__all__ = ["parse_fault", "fault_spec", "inject_fault", "KINDS"]

KINDS = ("kill", "kill-in-backward", "raise", "hang", "delay", "flip", "nan", "mismatch", "stop", "kill-before-vote",
         "kill-in-heal")


def fault_spec(spec: str) -> tuple[int, int, str]:
    """``RANK:STEP:KIND`` as ``(rank, step, kind)``; a ValueError that shows the expected form otherwise."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in KINDS:
        raise ValueError(f"{spec!r}: expected RANK:STEP:KIND with KIND one of {', '.join(KINDS)}, e.g. 1:12:kill")
    return int(parts[0]), int(parts[1]), parts[2]


def parse_fault(spec: str) -> tuple[int, int, str] | None:
    """The fault of ``DPTRAIN_FAULT`` for this attempt: None when unset, or after a restart (see above)."""
    restarts = restart_count()
    again = restarts == 1 and spec.endswith(":kill-in-heal")  # its second part: the restarted worker's heal
    if not spec or (restarts > 0 and not again and not os.environ.get("DPTRAIN_FAULT_EVERY_ATTEMPT")):
        return None
    try:
        return fault_spec(spec)
    except ValueError as e:
        raise ValueError(f"DPTRAIN_FAULT={e}") from None


def inject_fault(kind: str, rank: int, step: int, model: torch.nn.Module | None = None) -> None:
    record = os.environ.get("DPTRAIN_FAULT_LOG")  # for studies: when the fault struck (dptrain bench faults)
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"rank": rank, "step": step, "kind": kind, "time": time.time()}) + "\n")
    if kind == "kill" or (kind == "kill-in-heal" and restart_count() == 0):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "kill-in-heal":  # restarted: the live gate fires it as the heal arrives
        return
    if kind == "kill-before-vote":  # the live loop fires it at its moment (dptrain.runner.live_gate)
        return
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "raise":
        raise RuntimeError(f"fault injected by DPTRAIN_FAULT on rank {rank} at step {step}")
    if kind == "hang":
        while True:
            time.sleep(60)
    if kind == "delay":
        time.sleep(float(os.environ.get("DPTRAIN_FAULT_DELAY_S", "3")))
        return
    if model is None:
        raise ValueError(f"DPTRAIN_FAULT kind {kind!r} needs the rank's model, and rank {rank} (a parameter server) "
                         "has none: use kill or raise there")
    if kind == "mismatch":
        extra = torch.ones(1, device=next(model.parameters()).device)
        check = getattr(model, "collective_check", None)  # DDP's and ZeRO's, when checking is on
        if check is not None:
            check.verify("all_reduce", [extra], f"a metric only rank {rank} computes")
        torch.distributed.all_reduce(extra)
        return
    first = next(model.parameters())
    if kind == "flip":
        with torch.no_grad():
            first.view(-1)[:1].view(torch.int32 if first.element_size() == 4 else torch.int16).bitwise_xor_(1)
        return
    handle = None

    def poison(grad: torch.Tensor) -> torch.Tensor:  # once: the next backward's gradient of this parameter
        handle.remove()
        if kind == "kill-in-backward":  # the first parameter's gradient comes last: earlier buckets are in flight
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full_like(grad, float("nan"))
    handle = first.register_hook(poison)
