"""The run's live-recovery totals, from every worker's ``logs/live<r>.jsonl`` (one line per attempt at a step).

A round is counted once, whichever members logged it: attempted (it tried a step),
committed, or aborted. A *failure* is a run of aborted rounds between two commits. The
recovery times are the survivors' own (seconds from the start of the first failed round to
the next commit); the heals, the receivers' (bytes and seconds). A torn last line (a worker
killed while writing) is skipped, as every reader of a run's files does.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from dptrain.utils.files import open_file

__all__ = ["read_live_logs", "live_totals", "live_rows"]


def read_live_logs(run_dir: Path) -> dict[int, list[dict]]:
    """Every worker's attempts, by replica (lines that are not whole JSON objects left out)."""
    logs: dict[int, list[dict]] = {}
    for path in sorted((Path(run_dir) / "logs").glob("live*.jsonl")):
        if not path.stem[4:].isdigit():
            continue
        records = []
        with open_file(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
        logs[int(path.stem[4:])] = records
    return logs


def live_totals(logs: dict[int, list[dict]]) -> dict:
    """The totals of the module docstring, for ``summary.json`` (``live``)."""
    rounds: dict[int, dict] = {}
    recoveries, heals = [], []
    joins = 0
    for records in logs.values():
        for r in records:
            if r.get("event") == "start" and r.get("step", 0) == -1:
                joins += 1
            if r.get("heal_received"):
                heals.append((int(r["heal_received"]), float(r.get("heal_s", 0.0))))
            if not isinstance(r.get("round"), int):
                continue
            rounds.setdefault(r["round"], r)
            if "recovery_s" in r:
                recoveries.append(float(r["recovery_s"]))
    ordered = [rounds[k] for k in sorted(rounds)]
    committed = [r for r in ordered if r.get("commit")]
    failures, in_failure = 0, False
    for r in ordered:
        if not r.get("commit") and not in_failure:
            failures += 1
        in_failure = not r.get("commit")
    sizes = Counter(len(r.get("members", [])) for r in committed)
    return {"attempted": len(ordered), "committed": len(committed), "aborted": len(ordered) - len(committed),
            "failures": failures, "joins": joins, "steps_by_quorum_size": {str(k): sizes[k] for k in sorted(sizes)},
            "recovery_s": sorted(recoveries), "heals": len(heals), "heal_bytes": sum(b for b, _ in heals),
            "heal_s": sum(s for _, s in heals), "unit": _unit([bool(r.get("meeting")) for r in ordered])}


def _unit(meetings: list[bool]) -> str:
    """What the rounds were: steps (a round each), meetings (local SGD's, DiLoCo's), or both (a warm-up's steps, then
    meetings)."""
    if all(meetings) and meetings:
        return "meetings"
    return "rounds" if any(meetings) else "steps"


def live_rows(totals: dict) -> list[tuple[str, str]]:
    """The run summary's lines for live recovery."""
    if not totals.get("attempted"):
        return []
    pct = 100 * totals["committed"] / totals["attempted"]
    sizes = ", ".join(f"{k}: {v:,}" for k, v in sorted(totals["steps_by_quorum_size"].items(), reverse=True))
    unit = totals.get("unit", "steps")  # a round per step, or per meeting (local SGD, DiLoCo)
    rows = [("live recovery", f"{totals['committed']:,} of {totals['attempted']:,} attempted {unit} committed "
                              f"({pct:.1f}%); {totals['failures']} failure(s), {totals['joins']} worker(s) "
                              f"rejoined; committed {unit} by workers taking part: {sizes}")]
    if totals["recovery_s"]:
        rec = totals["recovery_s"]
        rows.append(("recovery", f"from a failed attempt to the next commit: median {statistics.median(rec):.2f} s, "
                                 f"max {max(rec):.2f} s (each survivor's)"))
    if totals["heals"]:
        rows.append(("heals", f"{totals['heals']} worker(s) healed from a peer, {totals['heal_bytes'] / 2**20:.1f} "
                              f"MiB received in {totals['heal_s']:.2f} s"))
    return rows
