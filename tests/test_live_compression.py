"""Live recovery with compression.method on the DDP engine (dptrain.compress.round_hook): the round's members hold the
same compressed mean, bitwise; an aborted round leaves every residual as it was; a healed member starts with none;
and a run with a worker killed before its vote goes on with the replicas' hashes equal after every committed step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from _cli import dptrain, tiny_gpt_config
from dptrain.compress.codecs import make_codec
from dptrain.compress.round_hook import RoundCompression
from dptrain.ddp.comm_hooks import GradBucket
from dptrain.live.group import RoundGroup
from dptrain.testing import run_on_ranks


def _bucket(values: torch.Tensor) -> GradBucket:
    return GradBucket(0, values, [values], [], True)


def _rounds(rank: int, world_size: int, path: str, method: str) -> dict:
    group = RoundGroup(dist.FileStore(path, world_size), 10.0)
    group.configure(0, rank, world_size)
    group.begin_step(0)
    hook = RoundCompression(make_codec(method, topk_fraction=0.25), error_feedback=True).attach(group)
    grads = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    mean = hook(None, _bucket(grads[rank].clone())).wait().clone()
    first = hook.feedback.residuals[0].clone()
    hook.settle(True)
    aborted = hook(None, _bucket(grads[rank] * 3)).wait()  # encoded with the residual: it changes, then goes back
    changed = not torch.equal(hook.feedback.residuals[0], first)
    hook.settle(False)
    restored = torch.equal(hook.feedback.residuals[0], first)
    sent = hook.sent_bytes(world_size)
    hook.reset()
    return {"mean": mean, "exact": torch.stack(grads).mean(0), "changed": changed, "restored": restored,
            "aborted_finite": bool(torch.isfinite(aborted).all()), "residuals_after_heal": len(hook.feedback.residuals),
            "sent": sent}


@pytest.mark.parametrize("method, error", [("int8", 0.05), ("bf16", 0.02), ("topk", 2.0)])
def test_a_compressed_round_gives_every_member_the_same_mean_and_an_abort_restores_the_residual(tmp_path, method,
                                                                                                  error):
    results = run_on_ranks(_rounds, 3, str(tmp_path / "store"), method)
    for r in results:
        assert torch.equal(r["mean"], results[0]["mean"])  # the same sum, in the members' order, on every member
        assert (r["mean"] - r["exact"]).abs().max().item() < error  # the codec's error, not another mean
        assert r["changed"] and r["restored"] and r["aborted_finite"]
        assert r["residuals_after_heal"] == 0
        assert r["sent"] == 0  # settled: the next step counts afresh


@pytest.mark.timeout(240)
def test_a_compressed_live_run_survives_a_kill_before_the_vote_with_equal_replicas(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_gpt_config(tmp_path, "\n[live]\nenabled = true\nheartbeat_timeout_s = 1.0\ncheck_every = 1\n")
    proc = dptrain("run", "--nproc", "3", "--config", str(config), "--run-dir", str(run_dir),
                   "--set", 'compression.method="int8"', "--set", "train.steps=10", "--set", "train.global_batch_size=6",
                   "--set", "log.trace_steps=0", "--set", "log.eval_every=0", "--set", "checkpoint.every=0",
                   cwd=tmp_path, env={"DPTRAIN_FAULT": "1:5:kill-before-vote"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = {r: [json.loads(x) for x in (run_dir / "logs" / f"live{r}.jsonl").read_text().splitlines() if x.strip()]
            for r in range(3)}
    assert any(x.get("commit") is False and x["step"] == 5 for x in logs[0])  # the round the victim died in
    hashes: dict[int, set[str]] = {}
    for records in logs.values():
        for x in records:
            if x.get("commit") and "hash" in x:
                hashes.setdefault(x["step"], set()).add(x["hash"])
    assert sorted(hashes) == list(range(1, 11)) and all(len(h) == 1 for h in hashes.values())
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sent = [x["comm_sent_bytes_per_step"] for x in train if x.get("kind") == "train"]
    raw = [x["comm_bytes_per_step"] for x in train if x.get("kind") == "train"]
    assert sent and all(s < r for s, r in zip(sent, raw, strict=True))  # int8: 2 payloads of a quarter each


def test_live_refuses_the_compression_a_round_cannot_keep(tmp_path):
    config = tiny_gpt_config(tmp_path, "\n[live]\nenabled = true\n")
    for sets, words in ((['compression.method="powersgd"'], "PowerSGD's Q is a warm start"),
                        (['compression.method="topk"', "compression.local_clip=1.0"], "compression.local_clip")):
        proc = dptrain("run", "--nproc", "2", "--config", str(config), "--run-dir", str(tmp_path / "r"),
                       *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "r").exists()
