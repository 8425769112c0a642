"""Benchmark: live recovery against restarts from checkpoints, with a worker killed every ``--kill-every`` seconds.

Four emulated hosts (``dptrain cluster``'s network namespaces, every link limited to
``--rate`` Gbit/s), one worker each, train the built-in character GPT for ``--steps``
committed steps in four variants, one after another:

- ``live-kills``: ``live.enabled``, started by the cluster launcher as a live-recovery job
  (:func:`~dptrain.cluster.run_on_cluster` with ``live_restarts``): each host runs its worker
  under its own torchrun (``--standalone --max-restarts``, one launcher per replica, as
  torchft runs one per replica group) with ``DPTRAIN_REPLICA_ID``; the live store is served
  on host 0 by a process of its own (``python -m dptrain.live.store``). Every ``--kill-every`` seconds one
  worker is SIGKILLed (hosts 1, 2, 3, 0 in turn); its torchrun restarts it, and it is
  healed by a peer;
- ``restart-kills``: the same training without live recovery, one torchrun job across
  the hosts (``--max-restarts``), a checkpoint every ``--checkpoint-every`` steps; every
  kill restarts every worker, which resumes from the newest checkpoint;
- ``live``, ``ddp``: both without failures (the reference loss, and live recovery's cost);
- ``loop-kills``, ``loop``: live recovery in a user's own loop (:mod:`dptrain.bench.live_loop`: ``prepare()``
  and ``dptrain.Live`` over the same GPT and data), started and killed as ``live-kills`` is;
- ``local-live-kills``: ``dptrain run --nproc 4`` on this machine (loopback, no link
  limit), its launcher serving the store and restarting a killed worker from its fork
  server (the pid each worker's heartbeat file names is killed).

The kill clock starts at each variant's launch. Reported per variant: its wall time, the
kills, the attempted and committed steps (live: the rounds that attempted a step;
restarts: the committed steps plus the steps redone after each restart, the step each
kill interrupted less the step resumed from), the final validation loss, and for live
recovery, per kill: the seconds from the kill to the survivors' next commit in a round
formed after it (the round in flight may still commit, if the victim had voted), and from
the restarted worker's process start to its first commit, with the bytes its heal received.
The step time without failures (``live`` against ``ddp``) is measured separately by
``--overhead-pairs`` pairs of short runs, alternated (ABBA), each the median wall time per
step between rank 0's metrics records after its first 10 steps.

Needs root.

    python -m dptrain.bench.live --rate 1 --steps 1000 --kill-every 60 --out bench_results/live
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from dptrain.cli.bench_group import bench_command
from dptrain.cluster import Network, check_root, run_on_cluster
from dptrain.launch.heartbeat import read_heartbeats

__all__ = ["main", "summarize"]

VICTIMS = (1, 2, 3, 0)
LOOP = "dptrain.bench.live_loop"  # the loop variants' worker: a user's loop on prepare() and dptrain.Live


def _worker_pid(network: Network | None, host: int, run_dir: Path, marker: bytes = b"dptrain.run") -> int | None:
    """The training worker's pid on ``host`` (not its torchrun agent, not the live store; its command line holds
    ``marker``: ``dptrain.run``, or the loop variants' module); without a network (one machine, ``dptrain run``'s
    forked workers), the pid worker ``host``'s heartbeat file names."""
    if network is None:
        pid = read_heartbeats(run_dir, host + 1).get(host, {}).get("pid")
        return pid if isinstance(pid, int) and Path(f"/proc/{pid}").exists() else None
    out = subprocess.run(["ip", "netns", "pids", network.host(host)], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmd and b"torch.distributed.run" not in cmd:
            return int(pid)
    return None


class Killer(threading.Thread):
    """SIGKILLs one worker every ``every_s`` seconds, hosts in turn, recording each kill (time, host, step reached)."""

    def __init__(self, network: Network | None, hosts: int, every_s: float, run_dir: Path, out: Path,
                 marker: bytes = b"dptrain.run"):
        super().__init__(daemon=True)
        self.network, self.hosts, self.every_s, self.run_dir, self.out = network, hosts, every_s, run_dir, out
        self.marker = marker
        self.stopped = threading.Event()
        self.kills: list[dict] = []

    def run(self) -> None:
        n = 0
        while not self.stopped.wait(self.every_s):
            host = VICTIMS[n % len(VICTIMS)] % self.hosts
            pid = _worker_pid(self.network, host, self.run_dir, self.marker)
            if pid is None:
                continue
            step = _step_reached(self.run_dir, self.hosts)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kill = {"time": time.time(), "host": host, "pid": pid, "step": step}
            self.kills.append(kill)
            with open(self.out, "a") as f:
                f.write(json.dumps(kill) + "\n")
            n += 1


def _step_reached(run_dir: Path, ranks: int) -> int | None:
    """The most steps any rank's heartbeat says it has begun (a restart redoes those since the checkpoint)."""
    steps = [b["step"] for b in read_heartbeats(run_dir, ranks).values() if isinstance(b.get("step"), int)]
    return max(steps) if steps else None


def run_variant(name: str, out: Path, *, hosts: int, rate: float, steps: int, kill_every: float | None,
                checkpoint_every: int, settings: list[str], timeout: float) -> dict:
    """One variant's run (see the module docstring); its row."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    live = name.startswith(("live", "local-live", "loop"))
    sets = [*settings, f"train.steps={steps}", f"checkpoint.every={checkpoint_every}",
            f"live.enabled={'true' if live else 'false'}"]
    if name.startswith("local-"):  # one machine, `dptrain run --nproc N`: workers restarted from its fork server
        return _local_variant(name, out, run_dir, hosts, sets, kill_every, timeout, steps)
    args = ["-m", "dptrain.run", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    marker, env = b"dptrain.run", None
    if name.startswith("loop"):  # a user's own loop on prepare() and dptrain.Live (dptrain.bench.live_loop)
        args, marker, env = ["-m", LOOP, "--steps", str(steps)], LOOP.encode(), {"DPTRAIN_RUN_DIR": str(run_dir)}
    with Network(hosts, rate * 1000) as network:
        killer = Killer(network, hosts, kill_every, run_dir, out / f"{name}.kills.jsonl", marker) \
            if kill_every else None
        t0 = time.time()
        if killer is not None:
            killer.start()
        try:
            restarts = ["--max-restarts", "1000"] if kill_every and not live else []
            with open(run_dir / "job.out", "w") as f:
                code = run_on_cluster(network, 1, [*restarts, *args], timeout=timeout, stdout=f, stderr=f,
                                      env=env, live_restarts=1000 if live else None)
        finally:
            if killer is not None:
                killer.stopped.set()
        wall = time.time() - t0
    row = {"variant": name, "exit": code, "wall_s": wall, "kills": killer.kills if killer else [], "t0": t0}
    row.update(_outcome(run_dir, steps, live, row["kills"]))
    return row


def _local_variant(name: str, out: Path, run_dir: Path, nproc: int, sets: list[str], kill_every: float | None,
                   timeout: float, steps: int) -> dict:
    """``dptrain run --nproc N`` with live recovery on this machine (loopback, no link limit), kills as above."""
    killer = Killer(None, nproc, kill_every, run_dir, out / f"{name}.kills.jsonl") if kill_every else None
    t0 = time.time()
    if killer is not None:
        killer.start()
    try:
        with open(run_dir.parent / f"{name}.out", "w") as f:
            code = subprocess.run([sys.executable, "-m", "dptrain.cli", "run", "--nproc", str(nproc), "--run-dir",
                                   str(run_dir), *[a for s in sets for a in ("--set", s)]], stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
    finally:
        if killer is not None:
            killer.stopped.set()
    row = {"variant": name, "exit": code, "wall_s": time.time() - t0, "kills": killer.kills if killer else [],
           "t0": t0}
    row.update(_outcome(run_dir, steps, True, row["kills"], nproc))
    return row


def final_val_loss(run_dir: Path, replicas: int) -> float | None:
    """The run's final weights (``model.safetensors``) evaluated on the validation samples a run of ``replicas``
    ranks evaluates (``log.eval_batches`` micro-batches each): every variant on the same samples."""
    from dptrain.config import load_config
    from dptrain.models.hf import load_weights_file
    from dptrain.runner.outputs import val_metrics, val_sums
    from dptrain.runner.validate import validate_run

    if not (run_dir / "model.safetensors").is_file():
        return None
    cfg = load_config(run_dir / "config.toml", [])
    rp = validate_run(cfg, replicas, check_forward=False)
    model = rp.task.build_model()
    load_weights_file(model, run_dir / "model.safetensors")
    sums = val_sums(model, rp.task, rp.plan.micro_batch_size, cfg.log.eval_batches * replicas)
    return val_metrics(sums)["val_loss"]


def _outcome(run_dir: Path, steps: int, live: bool, kills: list[dict], replicas: int = 4) -> dict:
    """Final validation loss, attempted and committed steps, and (live) per-kill recovery and rejoin times."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").is_file() else []
    evals = [m for m in metrics if m.get("kind") == "eval" and m.get("step") == steps]
    row: dict = {"val_loss": evals[-1]["val_loss"] if evals else None,
                 "val_loss_same_samples": final_val_loss(run_dir, replicas)}
    if (run_dir / "final.json").is_file():  # a loop variant's replica 0: the loss on the study's samples
        row["val_loss"] = row["val_loss_same_samples"] = json.loads((run_dir / "final.json").read_text())["val_loss"]
    if not live:
        resumed = _resumed_steps(run_dir)
        redone = sum(max(0, (k["step"] or 0) - r) for k, r in zip(kills, resumed, strict=False))
        row.update(committed=steps, attempted=steps + redone, resumed_from=resumed)
        return row
    logs = {int(p.stem[4:]): [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
            for p in (run_dir / "logs").glob("live*.jsonl")}
    rounds = {}
    for records in logs.values():
        for r in records:
            if "round" in r:
                rounds.setdefault(r["round"], r["commit"])
    row.update(committed=sum(rounds.values()), attempted=len(rounds))
    per_kill = []
    for k in kills:
        # the round in flight at the kill may commit (the victim had voted): count from the first round begun after
        # it (its log says when it began; an older log: the round after the one in flight, a step's rule)
        before = max((r["round"] for records in logs.values() for r in records
                      if "round" in r and r["time"] < k["time"]), default=-1)
        others = [r for host, records in logs.items() if host != k["host"] for r in records
                  if r.get("commit") and (r["time"] - r["round_s"] > k["time"] if "round_s" in r
                                          else r["round"] > before + 1)]
        next_commit = min((r["time"] for r in others), default=None)
        starts = [r for r in logs.get(k["host"], []) if r.get("event") == "start" and r["time"] > k["time"]]
        rejoin = None
        if starts:
            start = starts[0]
            later = [r for r in logs[k["host"]] if r.get("commit") and r["time"] > start["time"]]
            healed = [r for r in logs[k["host"]] if r.get("heal_received") and r["time"] > start["time"]]
            if later:
                rejoin = {"process_to_commit_s": later[0]["time"] - start["process_start"],
                          "built_to_commit_s": later[0]["time"] - start["time"],
                          "heal_bytes": healed[0]["heal_received"] if healed else 0,
                          "heal_s": healed[0].get("heal_s") if healed else None,
                          "kill_to_process_s": start["process_start"] - k["time"]}
        sizes = [len(r["members"]) for r in others if r["time"] <= (next_commit or 0)]
        first = min(others, key=lambda r: r["time"]) if others else None
        # the survivors' seconds in that round, from its begin (its quorum's wait) to its close: what the kill cost
        # them there, beside a round's usual (``round_s``); steps they took before it were their own, not a wait
        wait = max((r.get("round_s", 0.0) for r in others if first is not None and r["round"] == first["round"]),
                   default=None)
        per_kill.append({"host": k["host"], "kill_to_next_commit_s": None if next_commit is None
                         else next_commit - k["time"], "first_quorum": sizes[0] if sizes else None,
                         "next_round_s": wait, "rejoin": rejoin})
    usual = sorted(r["round_s"] for records in logs.values() for r in records
                   if r.get("commit") and "round_s" in r and not r.get("heal_sent") and not r.get("heal_received"))
    row["round_s_median"] = usual[len(usual) // 2] if usual else None
    row["per_kill"] = per_kill
    return row


def _resumed_steps(run_dir: Path) -> list[int]:
    """The steps each restart resumed from, in order (rank 0's log)."""
    out = []
    for path in sorted((run_dir / "logs").glob("rank0.log")):
        for line in path.read_text().splitlines():
            if "resumed from" in line and " at step " in line:
                out.append(int(line.rsplit(" at step ", 1)[1].split()[0]))
    return out


def measure_overhead(out: Path, pairs: int, *, hosts: int, rate: float, steps: int, settings: list[str],
                   timeout: float) -> list[dict]:
    """``pairs`` pairs of short failure-free runs, live and not, alternated ABBA; each run's median step time."""
    rows = []
    for i in range(pairs):
        order = ("live", "ddp") if i % 2 == 0 else ("ddp", "live")
        pair = {}
        for name in order:
            row = run_variant(f"overhead{i}-{name}", out, hosts=hosts, rate=rate, steps=steps, kill_every=None,
                              checkpoint_every=0, settings=settings, timeout=timeout)
            metrics = [json.loads(x) for x in (out / f"overhead{i}-{name}" / "metrics.jsonl").read_text()
                       .splitlines() if x.strip()]
            train = [m for m in metrics if m.get("kind") == "train" and m["step"] > 10]
            # wall seconds per step between two records of rank 0 (a record's step_ms is the slowest rank's under
            # DDP and replica 0's own under live recovery: not the same measure)
            per_step = [(b["time"] - a["time"]) / (b["step"] - a["step"]) * 1000
                        for a, b in zip(train, train[1:], strict=False)]
            pair[name] = {"median_step_ms": statistics.median(per_step), "wall_s": row["wall_s"], "exit": row["exit"]}
        pair["ratio"] = pair["live"]["median_step_ms"] / pair["ddp"]["median_step_ms"]
        rows.append(pair)
    return rows


def summarize(result: dict) -> str:
    """The study's tables, as docs/reliability.md shows them."""
    lines = ["| variant | exit | wall s | kills | attempted | committed | committed % | final val loss (the run's "
             "evaluation) | on the same samples |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["variants"]:
        pct = 100 * row["committed"] / row["attempted"] if row.get("attempted") else float("nan")
        loss, same = (f"{row[k]:.4f}" if row.get(k) is not None else "-" for k in ("val_loss", "val_loss_same_samples"))
        lines.append(f"| {row['variant']} | {row['exit']} | {row['wall_s']:.0f} | {len(row['kills'])} | "
                     f"{row.get('attempted')} | {row.get('committed')} | {pct:.1f} | {loss} | {same} |")
    for row in result["variants"]:
        if row.get("per_kill"):
            lines += ["", f"{row['variant']}: per kill", "",
                      "| host | kill to next commit s | survivors' seconds in that round | first quorum | kill to restart "
                      "s | restart to first commit s | of which after the model was built s | heal MB | heal s |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for k in row["per_kill"]:
                j = k["rejoin"] or {}
                nxt = k["kill_to_next_commit_s"]
                wait = k.get("next_round_s")
                lines.append(f"| {k['host']} | {'-' if nxt is None else f'{nxt:.2f}'} | "
                             f"{'-' if wait is None else f'{wait:.2f}'} | {k['first_quorum']} | "
                             f"{j.get('kill_to_process_s', float('nan')):.2f} | "
                             f"{j.get('process_to_commit_s', float('nan')):.2f} | "
                             f"{j.get('built_to_commit_s', float('nan')):.2f} | "
                             f"{j.get('heal_bytes', 0) / 1e6:.2f} | {j.get('heal_s') or float('nan'):.3f} |")
            if row.get("round_s_median") is not None:
                lines.append(f"\na committed round without a heal: median {row['round_s_median']:.2f} s from its "
                             "begin to its close")
    if result.get("overhead"):
        lines += ["", "| pair | live median step ms | ddp median step ms | live / ddp |", "|---|---|---|---|"]
        for i, p in enumerate(result["overhead"]):
            lines.append(f"| {i} | {p['live']['median_step_ms']:.1f} | {p['ddp']['median_step_ms']:.1f} | "
                         f"{p['ratio']:.3f} |")
        ratios = sorted(p["ratio"] for p in result["overhead"])
        lines.append(f"\nmedian live / ddp: {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="where the runs and results go")
@click.option("--rate", type=float, default=1.0, help="each link's rate, Gbit/s")
@click.option("--hosts", type=int, default=4)
@click.option("--steps", type=int, default=1000, help="committed steps of each variant")
@click.option("--kill-every", type=float, default=60.0, help="seconds between two kills")
@click.option("--checkpoint-every", type=int, default=100, help="the restart variant's checkpoint interval")
@click.option("--variants", default="live-kills,restart-kills,live,ddp", help="which, comma-separated, in order")
@click.option("--overhead-pairs", type=int, default=0, help="pairs of failure-free runs for the step-time ratio")
@click.option("--overhead-steps", type=int, default=150)
@click.option("--set", "settings", multiple=True, help="config overrides for every run (KEY=VALUE)")
@click.option("--timeout", type=float, default=3600.0, help="a run's limit, seconds")
def main(out: Path, rate: float, hosts: int, steps: int, kill_every: float, checkpoint_every: int, variants: str,
         overhead_pairs: int, overhead_steps: int, settings: tuple[str, ...], timeout: float) -> None:
    check_root()
    out.mkdir(parents=True, exist_ok=True)
    settings = ["log.trace_steps=0", "log.plots=false", "log.progress=lines", *settings]
    result: dict = {"rate_gbit": rate, "hosts": hosts, "steps": steps, "kill_every_s": kill_every,
                    "checkpoint_every": checkpoint_every, "settings": settings, "variants": []}
    earlier = out / "live_study.json"  # a run into the same --out adds its variants (a same name replaces one)
    if earlier.is_file():
        kept = json.loads(earlier.read_text())
        names = {v for v in variants.split(",") if v}
        result["variants"] = [row for row in kept.get("variants", []) if row["variant"] not in names]
        result["overhead"] = kept.get("overhead", [])
    for name in [v for v in variants.split(",") if v]:
        kills = kill_every if name.endswith("-kills") else None
        row = run_variant(name, out, hosts=hosts, rate=rate, steps=steps, kill_every=kills,
                          checkpoint_every=checkpoint_every if name.startswith("restart") else 0,
                          settings=settings, timeout=timeout)
        result["variants"].append(row)
        (out / "live_study.json").write_text(json.dumps(result, indent=1))
        print(f"{name}: exit {row['exit']}, {row['wall_s']:.0f} s", flush=True)
    if overhead_pairs:
        result["overhead"] = result.get("overhead", []) + measure_overhead(out, overhead_pairs, hosts=hosts, rate=rate, steps=overhead_steps,
                                            settings=settings, timeout=timeout)
        (out / "live_study.json").write_text(json.dumps(result, indent=1))
    (out / "live_study.md").write_text(summarize(result) + "\n")
    print(summarize(result))


if __name__ == "__main__":
    main()
