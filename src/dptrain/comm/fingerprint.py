"""Collective fingerprints, exchanged through the job's store: a mismatched call is an error, not a SIGABRT.

Before a checked collective, each rank writes a fingerprint of the call (the op, then the
dtype and shape of every tensor, and a label saying where it comes from: "bucket 3") into
the rendezvous store under the call's sequence number, and reads every other rank's:

- all equal: the collective goes ahead;
- different: every rank raises :class:`CollectiveMismatchError`, which lists each group of
  ranks with the call it was about to make;
- a rank that writes nothing within the timeout (it hangs, died, or is still in its
  previous collective): the others raise :class:`CollectiveTimeoutError` naming it and the
  last call it did check.

The exchange goes through the store (a key-value server beside the collective transport),
never through the backend, so a rank that is about to call a different collective cannot
make the check itself abort or hang: gloo compares sizes only under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and otherwise aborts the process (SIGABRT) on a mismatch.
Torch's DETAIL mode (``ProcessGroupWrapper``) does the same check before every collective,
through a second gloo group, and must be chosen before the process starts; this one is
chosen per call site. The DDP engine checks the first reduction of each bucket (cheap:
one exchange per bucket per run, which catches a comm hook or bucket layout that differs
across ranks), or every one (``check_collectives="every"``: a rank that takes a different
code path mid-run is named, at four store round trips per collective).

Sequence numbers count checked calls, so every rank must check the same calls: the DDP
engine's "first" rule is per bucket index, which is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CollectiveCheck", "CollectiveMismatchError", "CollectiveTimeoutError", "fingerprint", "job_store",
           "collective_check", "CHECK_MODES"]

CHECK_MODES = ("off", "first", "every")


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to call different collectives (raised on every rank, before any of them)."""


class CollectiveTimeoutError(RuntimeError):
    """Some ranks did not reach a checked collective within the timeout."""


def fingerprint(op: str, tensors: Sequence[torch.Tensor], label: str = "") -> str:
    """``op(dtype[shape], ...)`` and where the call comes from: what must agree across ranks."""
    args = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
    return f"{op}({args})" + (f" for {label}" if label else "")


_made: dict[str, int] = {}  # checks made per group in this process: the same count on every rank


def job_store(group: dist.ProcessGroup | None = None) -> dist.Store:
    """The store the process group was made with, under a prefix of its own for each new check.

    Several checks on one group (two DDP models, say) must not read each other's keys. They
    are made in the same order on every rank, as the models are, so the count names them.
    """
    store = dist.distributed_c10d._get_default_store()  # torch has no public getter
    name = "world" if group in (None, dist.group.WORLD) else group.group_name
    _made[name] = _made.get(name, 0) + 1
    return dist.PrefixStore(f"dptrain/fingerprint/{name}/{_made[name]}/", store)


class CollectiveCheck:
    """Checks that every rank of ``group`` is about to make the same collective call.

    ``store`` defaults to the job's (:func:`job_store`); tests may pass a ``dist.HashStore``
    shared by threads, or a ``dist.TCPStore``.
    """

    def __init__(self, timeout_s: float, group: dist.ProcessGroup | None = None, store: dist.Store | None = None,
                 rank: int | None = None, world_size: int | None = None, every: bool = False):
        self.every = every       # verify_site checks every call, not only each site's first
        self._seen: set = set()
        self.store = store if store is not None else job_store(group)
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.calls = 0           # checked calls so far (the next one's sequence number)

    def verify(self, op: str, tensors: Sequence[torch.Tensor], label: str = "") -> None:
        """Raise on every rank unless every rank's next checked call is ``op`` on the same shapes and dtypes."""
        mine = fingerprint(op, tensors, label)
        seq = self.calls
        self.store.set(f"{seq}/{self.rank}", mine)
        keys = [f"{seq}/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:  # the store's timeout (DistStoreError), or a store that went away
            raise CollectiveTimeoutError(self._missing(seq, keys, mine, e)) from None
        prints = [v.decode() for v in self.store.multi_get(keys)]
        if any(p != mine for p in prints):
            raise CollectiveMismatchError(_mismatch(seq, prints))
        if seq:  # every rank wrote #seq, so every rank has read #seq-1: this rank's key there is spent
            self.store.delete_key(f"{seq - 1}/{self.rank}")
        self.calls += 1

    def verify_site(self, site, op: str, tensors: Sequence[torch.Tensor], label: str = "") -> None:
        """:meth:`verify` on the first call from ``site`` (a bucket, a ZeRO unit), or on every call with ``every``.

        ``site`` must name the same call on every rank, so that all ranks check the same calls."""
        if self.every or site not in self._seen:
            self.verify(op, tensors, label)
            self._seen.add(site)

    def _missing(self, seq: int, keys: list[str], mine: str, error: Exception) -> str:
        try:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            # a missing rank wrote #seq-1 (this rank read it) and deletes it only after #seq: it is still there
            last = {r: f"#{seq - 1}: {self.store.get(f'{seq - 1}/{r}').decode()}" if seq else "none" for r in missing}
        except Exception:  # the store itself is gone: its host (rank 0's process) died
            return (f"collective check #{seq} ({mine}) on rank {self.rank}: the job's store stopped answering "
                    f"({error}); the rank hosting it (rank 0 under torchrun and dptrain run) is probably gone")
        lines = [f"rank {r}'s last checked call was {last[r]}" for r in missing]
        return (f"rank(s) {missing} did not reach collective #{seq} within {self.timeout.total_seconds():g} s: "
                f"they hang, died, or took another path (rank {self.rank} was about to call {mine}); "
                + "; ".join(lines))


def collective_check(mode: str, timeout_s: float, group: dist.ProcessGroup | None = None) -> CollectiveCheck | None:
    """The check for ``mode`` (one of :data:`CHECK_MODES`) on ``group``; None when off or alone."""
    if mode not in CHECK_MODES:
        raise ValueError(f"check_collectives={mode!r}: expected one of {', '.join(CHECK_MODES)}")
    if mode == "off" or dist.get_world_size(group) == 1:
        return None
    return CollectiveCheck(timeout_s, group, every=mode == "every")


def _mismatch(seq: int, prints: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for r, p in enumerate(prints):
        groups.setdefault(p, []).append(r)
    calls = "; ".join(f"rank(s) {ranks}: {p}" for p, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
    return (f"collective #{seq} differs across ranks: {calls}. Every rank must make the same collective calls in "
            "the same order: look for a branch that depends on the rank or its data (a comm hook, a bucket size, "
            "an extra collective)")
