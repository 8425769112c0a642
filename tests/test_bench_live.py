"""The live study's figures from its logs (dptrain.bench.live): the survivors' next commit after a kill is counted
from the first round begun after it, whether rounds are steps or meetings."""

from __future__ import annotations

import json

from dptrain.bench.live import _outcome


def _write(run_dir, logs: dict[int, list[dict]]) -> None:
    (run_dir / "logs").mkdir(parents=True)
    for host, records in logs.items():
        (run_dir / "logs" / f"live{host}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_next_commit_is_the_first_of_a_round_begun_after_the_kill(tmp_path):
    # a meeting every ~8 s: round 1 ended before the kill at t=100; round 2 began at 105 (a heal in it) and committed
    # at 109; a kill during round 3 (began 118, committed 119 with the victim's vote in): round 4 is the next
    survivor = [{"round": 0, "step": 30, "members": [0, 1], "commit": True, "time": 90.0, "round_s": 0.5},
                {"round": 1, "step": 60, "members": [0, 1], "commit": True, "time": 98.0, "round_s": 0.5},
                {"round": 2, "step": 90, "members": [0, 1], "commit": True, "time": 109.0, "round_s": 4.0},
                {"round": 3, "step": 120, "members": [0, 1], "commit": True, "time": 119.0, "round_s": 1.0},
                {"round": 4, "step": 150, "members": [0], "commit": True, "time": 127.0, "round_s": 6.0}]
    _write(tmp_path, {0: survivor, 1: []})
    kills = [{"time": 100.0, "host": 1, "step": 70}, {"time": 118.5, "host": 1, "step": 121}]
    row = _outcome(tmp_path, 150, True, kills, replicas=2)
    assert [k["kill_to_next_commit_s"] for k in row["per_kill"]] == [9.0, 8.5]
    assert [k["first_quorum"] for k in row["per_kill"]] == [2, 1]
    assert (row["attempted"], row["committed"]) == (5, 5)
