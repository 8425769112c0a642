"""Checkpoints of a parameter-server run (``distributed.strategy = "ps"``): the servers' files, their publication, resumption.

The cut itself is the snapshot protocol of :mod:`dptrain.ps.snapshot`, taken while training
goes on. This module puts it in the run directory's usual layout::

    checkpoints/step_00000100/
        ps/server<i>.pt    server i's state when it recorded the cut: its shard, optimizer and
                           look-ahead state, version, the workers' clocks, its report's counts
        ps/transit<i>.pt   the gradients server i recorded in flight, and each worker's clock in the cut
        ps/workers.pt      (from the first server) each worker's clock, random streams and buffers
        trainer.pt         step, world size, servers, mode
        meta.json          written last: the config's identity, a checksum of every file, "format": "ps"

Every file goes into the staging directory ``.step_00000100.tmp/`` first. A server writes
``server<i>.pt`` when it records the cut, and ``transit<i>.pt`` (the first server also
``workers.pt``) when every worker has marked it; then it reports the cut complete in its
answers. Rank 0 (worker 0), once every server has reported a cut, writes ``trainer.pt`` and
``meta.json`` and renames the directory into place
(:func:`~dptrain.checkpoint.files.save_checkpoint`). So a checkpoint is complete or absent,
as in every strategy, and is published about one step after it is taken.

A ps checkpoint resumes only on the world size, ``ps.servers`` and ``ps.mode`` it was saved
with: a shard is one server's run of whole tensors, each worker's data position is its own,
and a server's version counts rounds in sync and backup but gradients in async and ssp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dptrain.checkpoint.files import prune_checkpoints, save_checkpoint, staging_dir
from dptrain.ps.snapshot import Cut, CutSchedule, transit_messages
from dptrain.ps.wire import Message, unpack
from dptrain.utils.files import open_file

__all__ = ["CutFiles", "Publisher", "load_server_cut", "load_worker_cut", "PS"]

PS = "ps"  # the checkpoint's subdirectory of server and worker files


class CutFiles:
    """Server ``index``'s :class:`~dptrain.ps.snapshot.CutWriter`: its files in each cut's staging directory."""

    def __init__(self, run_dir: Path, index: int, leader: bool):
        self.run_dir, self.index, self.leader = run_dir, index, leader
        self._clocks: dict[int, dict[int, int]] = {}  # label -> the clocks at this server's snapshot

    def snapshot(self, label: int, state: dict) -> None:
        _save(state, self._dir(label) / f"server{self.index}.pt")
        self._clocks[label] = dict(state["clock"])

    def close(self, cut: Cut) -> None:
        """The marks, and for a worker that died before the cut began (it marked nothing), its last gradient."""
        where = self._dir(cut.label)
        marks = {w: (clock, None) for w, clock in self._clocks.pop(cut.label).items()} | cut.marks
        _save({"clocks": {w: clock for w, (clock, _) in marks.items()}, "transit": cut.transit_state()},
              where / f"transit{self.index}.pt")
        if self.leader:
            _save({w: {"clock": clock, "state": state} for w, (clock, state) in marks.items()}, where / "workers.pt")

    def _dir(self, label: int) -> Path:
        where = staging_dir(self.run_dir, label) / PS
        where.mkdir(parents=True, exist_ok=True)
        return where


def _save(obj, path: Path) -> None:
    with open_file(path, "wb") as f:  # never through a link
        torch.save(obj, f)


class Publisher:
    """Rank 0: each cut that every server reports complete becomes a checkpoint; the newest ``keep_last`` are kept."""

    def __init__(self, rp: Any, schedule: CutSchedule, world_size: int, log: Any, published: int = 0):
        """``rp``: the run's checked plan (its identity, batch, ``[ps]`` and ``[checkpoint]``); ``log``: rank 0's."""
        self.rp, self.schedule, self.world_size, self.log = rp, schedule, world_size, log
        self.published = published
        self.labels: list[int] = []  # published by this session

    def advance(self, saved: int) -> None:
        """Publish every cut up to ``saved``, the oldest newest-complete cut among the servers' reports."""
        rp = self.rp
        for label in self.schedule.due(self.published, saved):
            meta = {"identity": rp.identity, "identity_hash": rp.identity_hash,
                    "global_batch_size": rp.plan.global_batch_size, "world_size": self.world_size,
                    "torch_version": torch.__version__, "format": "ps",
                    "ps": {"servers": rp.cfg.ps.servers, "mode": rp.cfg.ps.mode}, "data": rp.data_identity}
            trainer = {"step": label, "world_size": self.world_size}
            path = save_checkpoint(rp.run_dir, label, {"trainer.pt": trainer}, meta, staged=True)
            deleted = prune_checkpoints(rp.run_dir, rp.cfg.checkpoint.keep_last, saved=path)
            self.log.info(f"checkpoint {path.name} saved" + (f" ({len(deleted)} older deleted)" if deleted else ""),
                          console=False)
            self.published = label
            self.labels.append(label)


def load_server_cut(path: Path, index: int) -> tuple[dict, list[tuple[int, Message]], dict[int, int]]:
    """Server ``index``'s recorded state, its in-flight gradients and the workers' clocks, for ShardServer.restore."""
    state = torch.load(path / PS / f"server{index}.pt", map_location="cpu", weights_only=True)
    transit = torch.load(path / PS / f"transit{index}.pt", map_location="cpu", weights_only=True)
    return state, transit_messages(transit["transit"]), transit["clocks"]


def load_worker_cut(path: Path, rank: int) -> tuple[int, dict | None]:
    """Worker ``rank``'s clock in the cut, and its state (random streams, buffers; None if it had died by then)."""
    mark = torch.load(path / PS / "workers.pt", map_location="cpu", weights_only=True)[rank]
    return mark["clock"], unpack(mark["state"]) if mark["state"] is not None else None
