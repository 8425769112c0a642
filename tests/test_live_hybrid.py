"""Live recovery for hybrid ZeRO: each shard group one replica (dptrain.live.layout, dptrain.live.shard_group).

A round takes the whole groups; each position averages its shard with the same position of
the other groups and is healed from it; a group with a worker gone ends, is started again and
healed whole; state checks compare equal positions only.
"""

from __future__ import annotations

import json

import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.live.layout import ShardGroupLost, ShardGroups, WholeReplicas
from dptrain.live.quorum import Member, Quorum
from dptrain.live.trust import _diverged


class _Seen:
    """A liveness view: the stale replicas and each one's incarnation."""

    def __init__(self, stale=(), incarnations=None):
        self._stale, self._inc = set(stale), incarnations or {}

    def stale(self, replica: int) -> bool:
        return replica in self._stale

    def incarnation_of(self, replica: int) -> int:
        return self._inc.get(replica, 1)


def _quorum(replicas, me, steps=None):
    members = tuple(Member(r, (steps or {}).get(r, 7), incarnation=1) for r in replicas)
    return Quorum(5, members, list(replicas).index(me))


def test_a_round_takes_whole_groups_and_each_position_meets_its_own():
    # groups of 2 over 6 workers: {0,1} {2,3} {4,5}; worker 4 is late, so group 2 sits the round out
    layout = ShardGroups(2, 3, (1, 1))
    split = layout.split(_quorum([0, 1, 2, 3, 5], 3), _Seen())
    assert split.voters.replicas == (0, 1, 2, 3) and split.voters.index == 3  # the data's slice: 4th of 4
    assert split.peers.replicas == (1, 3) and split.peers.index == 1  # position 1 of groups 0 and 1
    assert layout.group_prefix(5) == "pg/5/1/" and WholeReplicas().group_prefix(5) == "pg/5/"
    late = ShardGroups(2, 5, (1, 1))
    assert late.split(_quorum([0, 1, 2, 3, 5], 5), _Seen()) is None  # its group is not whole: the next round
    healed = ShardGroups(2, 2, (1, 1)).split(_quorum([0, 1, 2, 3], 2, {2: -1, 3: -1}), _Seen())
    assert healed.peers.heal_plan() == [(0, 1)]  # position 0 of group 0 sends position 0 of group 1 its shards


@pytest.mark.parametrize("seen, why", [
    (_Seen(stale={4}), "worker 4 of this worker's shard group 2 stopped beating"),
    (_Seen(incarnations={4: 2}), r"worker 4 of this worker's shard group 2 was started again \(1 -> 2\)"),
])
def test_a_worker_of_a_group_whose_sibling_is_gone_ends(seen, why):
    with pytest.raises(ShardGroupLost, match=why):
        ShardGroups(2, 5, (1, 1)).split(_quorum([0, 1, 2, 3, 5], 5), seen)


def test_state_checks_compare_the_same_position_only():
    def m(replica, check):
        return Member(replica, 4, check=check)
    # positions 0 and 1 hold different shards: no divergence between them; within position 1, replica 5 differs
    members = [m(0, "4:0/aa"), m(1, "4:1/bb"), m(2, "4:0/aa"), m(3, "4:1/bb"), m(4, "4:0/aa"), m(5, "4:1/cc")]
    assert list(_diverged(members, 4)) == [5]
    assert "differs from replica 1's (hash cc vs bb)" in _diverged(members, 4)[5]
    assert _diverged([m(0, "4:aa"), m(1, "4:aa"), m(2, "4:dd")], 4).keys() == {2}  # whole replicas, as before


LIVE = "\n[live]\nenabled = true\nheartbeat_timeout_s = 1.0\ncheck_every = 1\n"


@pytest.mark.parametrize("fault", ["1:5:kill-before-vote", "1:4:kill-in-heal"])
def test_a_broken_group_is_started_again_whole_and_healed(tmp_path, fault):
    """ZeRO-3 over 2 groups of 2 workers; worker 1 (of the group that keeps the records) killed after its all-reduce,
    before its vote (or killed, and killed again as its heal arrives): the round aborts, worker 0 ends with its
    group, the other group steps on alone, and the group returns (a generation later), healed shard by shard; after
    every committed step each position's shards hash alike in every group, and every step is committed once."""
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "4", "--config", str(tiny_gpt_config(tmp_path, LIVE)), "--run-dir", str(run_dir),
                   "--strategy", "zero3", "--set", "zero.shard_size=2", "--set", "train.steps=10",
                   "--set", "log.trace_steps=0", "--set", "log.eval_every=0", cwd=tmp_path,
                   env={"DPTRAIN_FAULT": fault})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 exited with signal SIGKILL" in proc.stderr
    assert "error: a collective of shard group 0 (workers [0, 1]) failed" in proc.stderr \
        or "worker 1 of this worker's shard group 0" in proc.stderr  # its sibling ends, in one line
    assert "worker 0 exited with exit code 1" in proc.stderr
    if fault.endswith("kill-in-heal"):  # its group broke again in the heal: both ended once more
        assert "worker 1 exited with signal SIGKILL; restarting it (2 of" in proc.stderr
        assert "worker 0 exited with exit code 1; restarting it (2 of" in proc.stderr
    logs = {r: [json.loads(line) for line in (run_dir / "logs" / f"live{r}.jsonl").read_text().splitlines()
                if line.endswith("}")] for r in range(4)}
    hashes: dict[tuple[int, int], set] = {}
    for replica, records in logs.items():
        for r in records:
            if "hash" in r:
                hashes.setdefault((r["step"], replica % 2), set()).add(r["hash"])
    assert sorted({step for step, _ in hashes}) == list(range(1, 11))
    assert all(len(h) == 1 for h in hashes.values()), hashes
    assert all(any(r.get("heal_received") for r in logs[v]) for v in (0, 1))  # both healed, each its own shards
    step = int(fault.split(":")[1])
    assert [r["members"] for r in logs[2] if r.get("step") == step and "round" in r][0] == [0, 1, 2, 3]  # aborted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["live"]["committed"] == 10
    assert (run_dir / "model.safetensors").is_file()
