"""After a collective fails: which ranks report the failure too, and which are silent.

A timeout or a lost connection says that *some* peer is missing, not which one: gloo names
an address at best, and a hung rank's peers all see the same timeout. So every rank whose
collective failed writes where it was into the job's store (the rendezvous key-value
server, beside the collective transport, served from rank 0's process), then waits a few
seconds for the others. The ranks that wrote nothing stopped calling collectives or died.

This names the culprit on every surviving rank under torchrun and Slurm too, where
dptrain's local launcher (which sees which processes are still running) is not there.
If rank 0's process died, its store went with it: the roll call says so and names nobody.
If rank 0 is stopped (SIGSTOP, a frozen machine), a store access can block for good (torch's
store client retries past its own timeout): so the roll call runs in a thread of its own, and
the failing rank waits for it at most ``wait_s`` + ``STORE_GRACE_S``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from dptrain.launch.rendezvous import restart_count
from dptrain.launch.supervise import PEER_LOST

__all__ = ["roll_call", "RollCall", "is_collective_failure", "STORE_GRACE_S"]

STORE_GRACE_S = 2.0  # beyond the roll call's wait, for its store accesses to answer

# How a backend says that a collective waited too long: gloo, the c10d error types, NCCL's watchdog.
_BACKEND_TIMEOUT = re.compile(r"Timed out waiting \d+ms|DistBackendError|DistNetworkError|"
                              r"Watchdog caught collective operation timeout", re.IGNORECASE)


def is_collective_failure(error: BaseException) -> bool:
    """A peer went missing (the backend's timeout, a closed connection), not this rank's own error.

    Only the backend's own messages count: a ``TimeoutError`` from user code (a slow data
    source, say) is this rank's problem, and a roll call would blame the ranks waiting for it."""
    text = f"{type(error).__name__}: {error}"
    return bool(PEER_LOST.search(text) or _BACKEND_TIMEOUT.search(text))


@dataclass(frozen=True)
class RollCall:
    """The ranks that reported nothing (hung or dead), and the line that says so."""

    silent: list[int]
    note: str


def roll_call(step: int, wait_s: float = 3.0, store: dist.Store | None = None,
              rank: int | None = None, world_size: int | None = None) -> RollCall:
    """Report this rank's failure at ``step``; return the ranks that reported none, and a line naming them."""
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    answer: list = []
    caller = threading.Thread(target=lambda: answer.append(_call(store, rank, world_size, step, wait_s)),
                              daemon=True, name="dptrain-roll-call")
    caller.start()
    caller.join(wait_s + STORE_GRACE_S)  # a daemon blocked on a stopped store host is left behind
    if not answer or isinstance(answer[0], Exception):
        why = type(answer[0]).__name__ if answer else f"no answer within {wait_s + STORE_GRACE_S:g} s"
        return RollCall([], f"roll call: the job's store did not answer ({why}); rank 0, its host, is probably "
                            "gone or stopped")
    where = answer[0]
    silent = [r for r in range(world_size) if r not in where]
    if not silent:
        return RollCall([], f"roll call: every rank reported a failed collective ({where}): no rank is silent")
    return RollCall(silent, f"roll call: rank(s) {silent} reported nothing within {wait_s:g} s of rank {rank}'s failed "
                            f"collective at step {step}: they stopped calling collectives (a hang) or died; rank(s) "
                            f"{sorted(where)} reported failing ({', '.join(f'rank {r} at {w}' for r, w in where.items())})")


def _call(store: dist.Store, rank: int, world_size: int, step: int, wait_s: float) -> dict[int, str] | Exception:
    """Write this rank's step; wait up to ``wait_s`` for the others'; return {rank: where} of those that wrote."""
    try:
        store = dist.PrefixStore(f"dptrain/roll_call/{restart_count()}/", store)  # fresh keys after a restart
        store.set(str(rank), f"step {step}")
        deadline = time.monotonic() + wait_s
        while True:
            reported = [r for r in range(world_size) if store.check([str(r)])]
            if len(reported) == world_size or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return {r: store.get(str(r)).decode() for r in reported}
    except Exception as e:  # the store went away with its host
        return e
