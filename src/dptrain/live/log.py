"""``logs/live<r>.jsonl``: every worker's attempts under live recovery, one JSON line each (what
:mod:`dptrain.live.records` totals for the run's summary, and the study reads)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dptrain.live.manager import Attempt, LiveManager
from dptrain.utils.files import open_file
from dptrain.utils.process import peak_rss_mb, process_start

__all__ = ["LiveLog"]


class LiveLog:
    """This worker's ``live<r>.jsonl``, appended to; an earlier life's torn last line (it was killed while writing)
    is ended first, so that it does not swallow this life's first line."""

    def __init__(self, path: Path):
        self.f = open_file(path, "a")
        if self.f.tell() > 0:
            with open_file(path, "rb") as previous:
                previous.seek(-1, 2)
                if previous.read(1) != b"\n":
                    self.f.write("\n")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps({**record, "time": time.time()}) + "\n")
        self.f.flush()

    def start(self, replica: int, restart: int, step: int) -> None:
        self.write({"event": "start", "replica": replica, "restart": restart, "step": step,
                    "process_start": process_start()})

    def attempt(self, attempt: Attempt, step: int, committed: bool, recovery: float | None, manager: LiveManager,
                held_hash: bytes | None, meeting: bool = False) -> None:
        """The attempt, its round and decision, its seconds from the round's begin (the quorum's wait included), a
        heal's bytes and seconds, the error that aborted it, the recovery
        it ended, (every ``live.check_every`` steps) the state's hash, and this worker's peak resident MiB so far
        (the summary's memory of every replica: they share no process group to gather it in)."""
        quorum = attempt.quorum
        record = {"round": quorum.round, "step": step, "members": list(quorum.replicas), "commit": committed,
                  "round_s": round(time.monotonic() - attempt.began, 4), "peak_rss_mb": round(peak_rss_mb(), 1)}
        if attempt.heal_sent or attempt.heal_received:
            record.update(heal_sent=attempt.heal_sent, heal_received=attempt.heal_received,
                          heal_s=round(attempt.heal_s, 4))
            if attempt.heal_after:  # after the vote, with the state it committed (a sender: its sends started)
                record["healed_after_vote"] = True
        error = attempt.error or (f"{type(manager.group.error).__name__}: {manager.group.error}"
                                  if manager.group.error is not None else "")
        if error:
            record["error"] = error[:300]
        if attempt.notes:
            record["left_out"] = list(attempt.notes)
        if recovery is not None:
            record["recovery_s"] = round(recovery, 4)
        if held_hash is not None:
            record["hash"] = held_hash.hex()
        if meeting:  # a round at a meeting of replicas that step alone between (its step: the steps met)
            record["meeting"] = True
        self.write(record)

    def healed_at_end(self, attempt: Attempt) -> None:
        """A worker that joined after the last step: healed to the end, nothing attempted."""
        self.write({"event": "healed at the end", "members": list(attempt.quorum.replicas),
                    "step": attempt.quorum.step, "heal_received": attempt.heal_received,
                    "heal_s": round(attempt.heal_s, 4)})

    def close(self) -> None:
        self.f.close()
