"""Live recovery: quorums, the commit vote, heals, the data stream, and whole runs with a worker killed, stopped or
raising at a random step (dptrain.live, dptrain.runner.live_gate, dptrain.launch.local)."""

from __future__ import annotations

import io
import json
import random
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from _cli import dptrain, tiny_gpt_config
from dptrain.config import ConfigError, load_config
from dptrain.data.stream import SampleStream
from dptrain.live.group import RoundGroup
from dptrain.live.heal import HealError, pack, recv_state, send_state, state_hash, unpack
from dptrain.live.liveness import Liveness
from dptrain.live.quorum import Member, Quorum, TooFewWorkers, form_quorum, latest_round
from dptrain.live.records import live_rows, live_totals, read_live_logs
from dptrain.live.store import connect_store, serve_store
from dptrain.live.vote import commit_vote
from dptrain.runner.validate import validate_run

TIMEOUT = 0.4  # heartbeat timeout of the in-process tests (beats every 0.05 s)


@pytest.fixture
def address():
    server = serve_store("127.0.0.1", 0)
    yield ("127.0.0.1", server.port)
    del server


def _liveness(address, replica: int, replicas: int) -> Liveness:
    live = Liveness(lambda: connect_store(address, 10), replica, replicas, 0.05, TIMEOUT)
    live.start()
    return live


def _quorum(address, replica: int, replicas: int, round_: int, step: int = 0, out: dict | None = None, **kw):
    live = _liveness(address, replica, replicas)
    try:
        settings = dict(min_workers=1, on_too_few="stop", start_timeout_s=5.0, join_timeout_s=5.0, wait_timeout_s=5.0,
                        absent=set())
        settings.update(kw)
        result = form_quorum(connect_store(address, 10), live, Member(replica, step), round_, replicas, **settings)
    except Exception as e:  # noqa: BLE001 - handed to the test
        result = e
    finally:
        live.stop()
    if out is not None:
        out[replica] = result
    return result


def _together(address, replicas, *args, **kw) -> dict:
    """:func:`_quorum` of each of ``replicas`` at once, in threads; what each returned or raised, by replica."""
    out: dict = {}
    threads = [threading.Thread(target=_quorum, args=(address, r, *args), kwargs=dict(kw, out=out))
               for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_worker_reads_the_same_quorum(address):
    out = _together(address, range(3), 3, 0)
    assert {q.replicas for q in out.values()} == {(0, 1, 2)}
    assert [out[r].index for r in range(3)] == [0, 1, 2]
    assert all(q.new_group for q in out.values())  # nobody holds a group yet
    assert latest_round(connect_store(address, 10)) == 0  # advanced once, by the one worker that closed it


def test_a_round_closes_without_a_replica_that_never_beats(address):
    t0 = time.monotonic()
    out = _together(address, range(2), 3, 1)  # replica 2 of 3 never starts
    assert {q.replicas for q in out.values()} == {(0, 1)}
    assert time.monotonic() - t0 < 5.0  # its staleness closed the round, not the join timeout


def test_too_few_workers_stop_with_the_missing_named(address):
    out = _together(address, range(2), 3, 1, min_workers=3)
    assert all(isinstance(e, TooFewWorkers) for e in out.values())
    assert "gone: [2]" in str(out[0]) and "live.min_workers = 3" in str(out[0])


def test_a_late_worker_takes_the_next_round(address):
    first = _together(address, range(2), 3, 1)
    assert {q.replicas for q in first.values()} == {(0, 1)}
    assert _quorum(address, 2, 3, 1) is None  # round 1 closed without it
    out = _together(address, range(3), 3, 2)
    assert {q.replicas for q in out.values()} == {(0, 1, 2)}


def test_heal_plan_and_group_reuse():
    members = (Member(0, 5, 3, 3), Member(1, -1, -1, 0), Member(2, 5, 3, 3), Member(3, 4, 3, 3))
    q = Quorum(7, members, 0)
    assert q.step == 5
    assert q.heal_plan() == [(0, 1), (2, 3)]  # round robin over the up-to-date members
    assert q.new_group  # a joiner holds no group
    same = Quorum(8, (Member(0, 5, 3, 2), Member(2, 5, 3, 2)), 1)
    assert not same.new_group and same.heal_plan() == []
    assert Quorum(8, (Member(0, 5, 3, 2), Member(2, 5, 3, 2, ok=False)), 1).new_group  # an error: a new group


def _vote(address, index: int, replicas: tuple[int, ...], ok: dict, out: dict, round_: int = 0,
          incarnations: tuple[int, ...] | None = None):
    live = _liveness(address, replicas[index], max(replicas) + 1)
    members = tuple(Member(r, 0, incarnation=incarnations[i] if incarnations else 0) for i, r in enumerate(replicas))
    try:
        out[index] = commit_vote(connect_store(address, 10), round_, index, members, ok[index], live, 5.0)
    finally:
        live.stop()


@pytest.mark.parametrize("oks, expected", [((True, True, True), True), ((True, False, True), False)])
def test_the_vote_is_the_same_for_every_member(address, oks, expected):
    out: dict = {}
    threads = [threading.Thread(target=_vote, args=(address, i, (0, 1, 2), dict(enumerate(oks)), out))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: expected, 1: expected, 2: expected}


def test_a_member_gone_before_voting_aborts_the_step_for_every_survivor(address):
    dead = Liveness(lambda: connect_store(address, 10), 2, 3, 0.05, TIMEOUT)
    dead.start()  # it beats, then dies before its vote (the failure between the all-reduce and the vote)
    dead.stop()
    out: dict = {}
    t0 = time.monotonic()
    threads = [threading.Thread(target=_vote, args=(address, i, (0, 1, 2), {0: True, 1: True}, out)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: False, 1: False}
    assert time.monotonic() - t0 < 3.0  # its staleness decided, within the heartbeat timeout (not the vote's 5 s)


def test_a_member_started_again_aborts_the_step_at_once(address):
    """Replica 2 was killed and its launcher started it again at once: it beats (fresh), but as a new incarnation,
    so the round formed with the old one aborts without waiting for the heartbeat timeout."""
    old = Liveness(lambda: connect_store(address, 10), 2, 3, 0.05, 5.0)
    old.start()
    old.stop()  # incarnation 1, killed
    new = Liveness(lambda: connect_store(address, 10), 2, 3, 0.05, 5.0)
    new.start()  # incarnation 2, beating
    out: dict = {}
    t0 = time.monotonic()
    try:
        threads = [threading.Thread(target=_vote, args=(address, i, (0, 1, 2), {0: True, 1: True}, out),
                                    kwargs={"incarnations": (1, 1, old.incarnation)}) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        new.stop()
    assert out == {0: False, 1: False}
    assert time.monotonic() - t0 < 2.0  # not the 5 s timeout


def test_a_vote_in_after_the_decision_reads_it(address):
    store = connect_store(address, 10)
    store.set("q/3/decision", "commit")
    live = _liveness(address, 0, 1)
    try:
        assert commit_vote(store, 3, 0, (Member(0, 0), Member(1, 0)), False, live, 1.0)  # decided before it voted
    finally:
        live.stop()


def test_heal_payload_checked_and_never_runs_code(address):
    state = {"model": {"w": torch.randn(3, 4)}, "position": 96}
    assert torch.equal(unpack(pack(state))["model"]["w"], state["model"]["w"])
    assert state_hash([torch.ones(3)]) != state_hash([torch.ones(3, 1)])  # the shape counts
    buffer = io.BytesIO()
    torch.save({"x": Fraction(1, 3)}, buffer)
    with pytest.raises(Exception, match="[Ww]eights only"):
        unpack(buffer.getvalue())

    out: dict = {}

    def member(rank: int):
        store = connect_store(address, 10)
        group = RoundGroup(store, 5.0)
        group.configure(0, rank, 2)
        if rank == 0:
            header = torch.zeros(72, dtype=torch.uint8)
            header[:8] = torch.tensor([4], dtype=torch.int64).view(torch.uint8)  # a digest of zeros: wrong
            group.pg.send([header], 1, 17).wait()
            group.pg.send([torch.ones(4, dtype=torch.uint8)], 1, 18).wait()
            send_state(group.pg, 1, pack(state), b"h" * 32)
        else:
            with pytest.raises(HealError, match="digest"):
                recv_state(group.pg, 0)
            out["payload"], out["hash"] = recv_state(group.pg, 0)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert unpack(out["payload"])["position"] == 96 and out["hash"] == b"h" * 32


def test_sample_stream_slices_take_each_sample_once_per_epoch():
    stream = SampleStream(list(range(10)), seed=3, collate_fn=list)
    taken = [x for b in stream.micro_batches(0, 2, 5) for x in b]
    assert sorted(taken) == list(range(10))
    # the same positions read as two members' slices of a step, then the next: the same samples in the same order
    again = SampleStream(list(range(10)), seed=3, collate_fn=list)
    assert [x for start in (0, 4, 8) for b in again.micro_batches(start, 2, 1 if start == 8 else 2) for x in b] == taken
    crossing = [e for e, _ in stream.indices(8, 4)]
    assert crossing == [0, 0, 1, 1]


@pytest.mark.parametrize("settings, message", [
    (['distributed.strategy="gossip"'], "strategy 'gossip' cannot"),
    # ZeRO: only hybrid sharding's groups, each a replica (dptrain.live.layout)
    (['distributed.strategy="zero2"'], r"zero.shard_size = 0 over 2 workers: sharded over every worker"),
    (['distributed.strategy="zero3"', "zero.shard_size=1", 'compression.method="int8"'],
     "ZeRO's compressed reduce-scatter is not run over live recovery's rounds"),
    (['compression.method="powersgd"'], "PowerSGD's Q is a warm start shared by a fixed set of ranks"),
    (['train.optimizer="onebit_adam"'], "onebit_adam would claim"),
    (["live.min_workers=3"], "more than the job's 2 worker"),
])
def test_what_live_recovery_cannot_run_with(tmp_path, settings, message):
    cfg = load_config(tiny_gpt_config(tmp_path), ["live.enabled=true", *settings])
    with pytest.raises(ConfigError, match=message):
        validate_run(cfg, 2, check_forward=False)


def test_live_totals_count_each_round_once_and_skip_a_torn_line(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    a = [{"event": "start", "step": 0}, {"round": 0, "step": 1, "members": [0, 1], "commit": True},
         {"round": 1, "step": 2, "members": [0, 1], "commit": False},
         {"round": 2, "step": 2, "members": [0], "commit": True, "recovery_s": 5.5},
         {"round": 3, "step": 3, "members": [0, 1], "commit": True, "heal_sent": 900}]
    b = [{"event": "start", "step": 0}, {"round": 0, "step": 1, "members": [0, 1], "commit": True},
         {"round": 1, "step": 2, "members": [0, 1], "commit": False}, {"event": "start", "step": -1},
         {"round": 3, "step": 3, "members": [0, 1], "commit": True, "heal_received": 800, "heal_s": 0.5}]
    (logs / "live0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a))
    (logs / "live1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b) + '{"round": 4, "st')
    totals = live_totals(read_live_logs(tmp_path))
    assert (totals["attempted"], totals["committed"], totals["aborted"], totals["failures"]) == (4, 3, 1, 1)
    assert totals["steps_by_quorum_size"] == {"2": 2, "1": 1} and totals["joins"] == 1
    assert (totals["heals"], totals["heal_bytes"], totals["recovery_s"]) == (1, 800, [5.5])
    assert "3 of 4 attempted steps committed (75.0%); 1 failure(s)" in live_rows(totals)[0][1]
    for records in (a, b):  # rounds held at meetings (local SGD, DiLoCo) are counted as meetings
        for r in records:
            if "round" in r:
                r["meeting"] = True
    (logs / "live0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a))
    (logs / "live1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b))
    assert "3 of 4 attempted meetings committed" in live_rows(live_totals(read_live_logs(tmp_path)))[0][1]


def _logs(run_dir: Path) -> dict[int, list[dict]]:
    logs = {}
    for path in sorted((run_dir / "logs").glob("live*.jsonl")):
        logs[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines()]
    return logs


def _check_survivors(run_dir: Path, steps: int, victim: int, fault_step: int, healed: bool) -> dict:
    """After every committed step all members hold the same state (hash); every round's decision is the same for
    every member that logged it; each step 1..steps is committed once per worker's life; the victim was healed (or,
    ``healed`` False, dropped: some steps committed without it). The logs, by replica."""
    logs = _logs(run_dir)
    hashes, decisions = {}, {}
    for replica, records in logs.items():
        committed = [r["step"] for r in records if r.get("commit")]
        assert committed == sorted(set(committed)), f"replica {replica} committed a step twice"
        for r in records:
            if "round" in r:
                decisions.setdefault(r["round"], set()).add(r["commit"])
            if "hash" in r:
                hashes.setdefault(r["step"], set()).add(r["hash"])
    where = f"(fault at step {fault_step})"
    assert set(hashes) >= set(range(1, steps)) and steps in hashes, where
    assert all(len(h) == 1 for h in hashes.values()), \
        f"replicas differ at steps {[s for s, h in hashes.items() if len(h) > 1]} {where}"
    assert all(len(d) == 1 for d in decisions.values()), f"a round committed on some members and not others {where}"
    assert any(r.get("commit") is False for records in logs.values() for r in records), f"no attempt failed {where}"
    if healed:
        assert any(r.get("heal_received") for r in logs[victim]), f"replica {victim} was not healed {where}"
    else:
        assert any(victim not in r["members"] for r in logs[0] if r.get("commit")), where
    return logs


LIVE = "\n[live]\nenabled = true\nheartbeat_timeout_s = 1.0\ncheck_every = 1\n"


@pytest.mark.parametrize("nproc, victim, kind, step", [(3, 1, "kill", None), (3, 0, "raise", None),
                                                       (4, 2, "stop", None), (4, 3, "kill-before-vote", None),
                                                       (3, 0, "kill", 16), (3, 2, "kill-in-heal", None)])
def test_survivors_go_on_and_the_victim_is_healed(tmp_path, nproc, victim, kind, step):
    """A worker killed, raising, stopped (SIGSTOP), killed between its all-reduce and its vote, or killed and then
    killed again in the middle of its heal, at a random step
    (and replica 0, which writes the run's files, killed at the last step: the others finish it, then heal it);
    the launcher restarts it (a stopped one once its heartbeat is stale: the run is over by then)."""
    step = step or random.Random().randrange(3, 12)
    steps = 16
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", str(nproc), "--config", str(tiny_gpt_config(tmp_path, LIVE)), "--run-dir",
                   str(run_dir), "--set", f"train.steps={steps}", "--set", f"train.global_batch_size={2 * nproc}",
                   "--set", "log.trace_steps=0", "--set", "log.eval_every=0", cwd=tmp_path,
                   env={"DPTRAIN_FAULT": f"{victim}:{step}:{kind}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if kind != "stop":
        assert f"worker {victim} exited" in proc.stderr and "the others go on" in proc.stderr
    if kind == "kill-in-heal":  # killed again as its heal arrived: the round aborted, a third start was healed
        assert "restarting it (2 of live.max_restarts" in proc.stderr
    logs = _check_survivors(run_dir, steps, victim, step, healed=kind != "stop")
    assert (run_dir / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # replica 0 writes the records: restarted after the others took the last steps, it is healed at the end, and the
    # steps it missed are a gap at the end of metrics.jsonl (its final evaluation is still there)
    at_end = any(r.get("event") == "healed at the end" for r in logs[0])
    last = [m["step"] for m in metrics if "loss" in m][-1]
    assert last == steps or (victim == 0 and at_end), f"metrics end at step {last} (fault at step {step})"
    assert any(m.get("kind") == "eval" and m["step"] == steps for m in metrics)
    live = json.loads((run_dir / "summary.json").read_text())["live"]
    assert live["committed"] == steps and live["attempted"] > steps and live["failures"] >= 1
    assert "live recovery" in proc.stdout + proc.stderr


def test_too_few_workers_end_the_job_and_it_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """Worker 1 fails at step 9 and may not restart; with live.min_workers = 3 the others stop (exit 3: the launcher
    ends the job). Started again, the run resumes from replica 0's checkpoint at step 6, at the data position its
    meta.json recorded, and ends with the uninterrupted run's weights."""
    config = str(tiny_gpt_config(tmp_path, LIVE.replace("check_every = 1", "check_every = 0")))
    common = ["--config", config, "--set", "train.global_batch_size=6", "--set", "log.trace_steps=0",
              "--set", "log.eval_every=0", "--set", "checkpoint.every=6", "--set", "train.steps=12"]
    straight = dptrain("run", "--nproc", "3", *common, "--run-dir", str(tmp_path / "a"), cwd=tmp_path)
    stopped = dptrain("run", "--nproc", "3", *common, "--set", "live.min_workers=3", "--set", "live.max_restarts=0",
                      "--run-dir", str(tmp_path / "b"), cwd=tmp_path, env={"DPTRAIN_FAULT": "1:9:raise"})
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert stopped.returncode == 1 and "fewer than live.min_workers = 3" in stopped.stderr, stopped.stderr[-2000:]
    meta = json.loads((tmp_path / "b" / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["live_position"] == 6 * 6
    again = dptrain("run", "--nproc", "3", *common, "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
