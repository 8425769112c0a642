"""Who may take part: a replica's job identity checked once per start, and the members' state hashes compared.

A replica that runs another config (another ``train.seed``, another model) would be averaged
into the others' gradients without a word, or break their collectives. So each start of a
worker writes, once, before its first round, what job it runs under ``id/<replica>``: the
config's identity (the fields a checkpoint's ``identity_hash`` covers, by name), the
model's parameter names and shapes, the number of replicas it expects, and, for a worker
that starts with state of its own (not one to be healed), the step and hash of that state.

When a round closes, every member vets the members it has not vetted yet in their current
incarnation (after the first round: only a worker that has just started, so a steady run
pays one set lookup per member, no store call). The job's identity is ``id/job``, set once
(``compare_set`` from empty) to the identity most members of the first round vetted hold
(a tie: the lowest replica's); a member whose identity differs from it is *refused*: it is
named, left out of the round by every member alike (each computes the same verdict from the
same records), and exits 2 (bad input); a launcher that restarts it restarts it into the
same refusal, and the others go on without it.

Every ``live.check_every`` steps each member also carries the hash of its whole state after
that step in its round record (:attr:`~dptrain.live.quorum.Member.check`). In the next
round the members at that step compare them: the hash most hold (a tie: the lowest
replica's) is the job's; a member holding another one has *diverged*: it is named, left out
of the round, drops its state and is healed from a peer in the round after, as a restarted
worker is. A run therefore never averages gradients over replicas that hold different
weights for more than ``check_every`` steps.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace

from dptrain.live.quorum import Member, Quorum

__all__ = ["JobMismatch", "Verdict", "identity_record", "publish", "vet"]

JOB_KEY = "id/job"
SHOWN = 3  # differing config fields named in a refusal


class JobMismatch(RuntimeError):
    """This replica runs another job than the others (config, model or replicas differ): it may not take part."""


def identity_record(config: dict, parameters: list[tuple[str, tuple[int, ...]]], replicas: int) -> dict:
    """What job a replica runs: the config's identity (flat, by dotted name), its parameters' names and shapes, and
    how many replicas it expects."""
    return {"config": config, "parameters": [[name, list(shape)] for name, shape in parameters],
            "replicas": replicas}


def publish(store, replica: int, incarnation: int, identity: dict, step: int, state: bytes | None,
            part: str = "") -> None:
    """This start's identity (and, when it holds state of its own, the step and hash of it, after ``part``: which
    part of a replica it holds, where workers hold parts, :mod:`~dptrain.live.layout`), before its first round."""
    store.set(f"id/{replica}", json.dumps({"incarnation": incarnation, "identity": identity, "step": step,
                                          "state": part + state.hex() if state is not None else None}))


@dataclass(frozen=True)
class Verdict:
    """A closed round, vetted: the members that may take part, and the ones left out with the reason, by replica."""

    quorum: Quorum | None                 # None: this worker is one of those left out
    refused: dict[int, str]               # replica -> why its job differs (it exits)
    diverged: dict[int, str]              # replica -> whose state hash it does not hold (it is healed)


def vet(store, quorum: Quorum, vetted: set[tuple[int, int]], job: list) -> Verdict:
    """Check ``quorum``'s members not yet in ``vetted`` (``(replica, incarnation)`` pairs, updated in place) against
    the job's identity (``job``: a one-element cache of it, filled on first use), and every member's state hash at
    the round's step; the round without the members left out (see the module docstring)."""
    refused: dict[int, str] = {}
    new = [m for m in quorum.members if (m.replica, m.incarnation) not in vetted]
    if new:
        records = {m.replica: json.loads(v) for m, v in
                   zip(new, store.multi_get([f"id/{m.replica}" for m in new]), strict=True)}
        if not job:
            job.append(_job(store, [records[m.replica] for m in sorted(new, key=lambda m: m.replica)]))
        for m in new:
            why = _differs(m.replica, records[m.replica], job[0])
            if why:
                refused[m.replica] = why
            else:
                vetted.add((m.replica, m.incarnation))
    diverged = _diverged([m for m in quorum.members if m.replica not in refused], quorum.step)
    left_out = set(refused) | set(diverged)
    if not left_out:
        return Verdict(quorum, {}, {})
    me = quorum.members[quorum.index].replica
    if me in left_out:
        return Verdict(None, refused, diverged)
    members = tuple(m for m in quorum.members if m.replica not in left_out)
    index = [m.replica for m in members].index(me)
    return Verdict(replace(quorum, members=members, index=index), refused, diverged)


def _job(store, records: list[dict]) -> dict:
    """The job's identity: the stored one, or (the first round vetted) the one most of ``records`` hold, stored."""
    counts = Counter(json.dumps(r["identity"], sort_keys=True) for r in records)
    top = max(counts.values())
    first = next(r for r in records if counts[json.dumps(r["identity"], sort_keys=True)] == top)
    states = [r for r in records if r["identity"] == first["identity"] and r["state"] is not None]
    candidate = json.dumps({"identity": first["identity"], "step": states[0]["step"] if states else None,
                            "state": states[0]["state"] if states else None})
    return json.loads(store.compare_set(JOB_KEY, "", candidate))


def _differs(replica: int, record: dict, job: dict) -> str:
    """Why ``record`` is not the job's ("" when it is), naming the fields, parameters or values that differ."""
    mine, ours = record["identity"], job["identity"]
    if mine["config"] != ours["config"]:
        keys = sorted(set(mine["config"]) | set(ours["config"]))
        diff = [k for k in keys if mine["config"].get(k) != ours["config"].get(k)]
        shown = ", ".join(f"{k}: {mine['config'].get(k)!r} vs {ours['config'].get(k)!r}" for k in diff[:SHOWN])
        more = f" (and {len(diff) - SHOWN} more)" if len(diff) > SHOWN else ""
        return f"replica {replica}'s config differs in {shown}{more}"
    if mine["replicas"] != ours["replicas"]:
        return f"replica {replica} expects {mine['replicas']} replicas (DPTRAIN_REPLICAS), the job {ours['replicas']}"
    if mine["parameters"] != ours["parameters"]:
        theirs = dict((n, s) for n, s in ours["parameters"])
        name, shape = next(((n, s) for n, s in mine["parameters"] if theirs.get(n) != s), (None, None))
        what = (f"parameter {name} has shape {tuple(shape)} vs {tuple(theirs[name])}" if name in theirs else
                f"parameter {name} is not the job's" if name else "it lacks some of the job's parameters")
        return f"replica {replica}'s model differs: {what}"
    mine, ours = record["state"], job["state"]
    if mine is not None and ours is not None and record["step"] == job["step"] and mine != ours \
            and mine.rpartition("/")[0] == ours.rpartition("/")[0]:  # the same part (a hybrid group's position)
        return (f"replica {replica}'s state at step {record['step']} differs (hash {_digest(mine)[:12]} vs "
                f"{_digest(ours)[:12]}): another seed, checkpoint or code")
    return ""


def _diverged(members: list[Member], step: int) -> dict[int, str]:
    """The members whose state hash after ``step`` is not the one most members holding the same part hold (a tie:
    the lowest replica's). A check reads ``<step>:<hash>``, or ``<step>:<part>/<hash>`` where workers hold parts
    of a replica (hybrid sharding's positions, :mod:`~dptrain.live.layout`): only equal parts are compared."""
    tag = f"{step}:"
    parts: dict[str, list[Member]] = {}
    for m in members:
        if m.step == step and m.check.startswith(tag):
            parts.setdefault(m.check.rpartition("/")[0], []).append(m)
    out: dict[int, str] = {}
    for checked in parts.values():
        if len(checked) < 2 or len({m.check for m in checked}) == 1:
            continue
        counts = Counter(m.check for m in checked)
        top = max(counts.values())
        keep = next(m for m in checked if counts[m.check] == top)
        out.update({m.replica: (f"replica {m.replica}'s state after step {step} differs from replica "
                                f"{keep.replica}'s (hash {_digest(m.check)[:12]} vs {_digest(keep.check)[:12]})")
                    for m in checked if m.check != keep.check})
    return out


def _digest(check: str) -> str:
    return check.rpartition(":")[2].rpartition("/")[2]
