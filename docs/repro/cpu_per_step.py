"""Where a step's CPU goes on the emulated cluster: the machine's cores, every rank's threads, per step (docs/tune.md).

    python docs/repro/cpu_per_step.py OUT ROUNDS [LABEL[@SRC]=OVERRIDES ...]      # needs root (dptrain cluster)

Each LABEL runs ``dptrain cluster --hosts 4 --bandwidth-gbit 10 -- -m dptrain.run`` with its overrides (``;``
between ``--set`` values; ``@SRC``: dptrain imported from the tree SRC, e.g. an older commit's), with ``OMP_NUM_THREADS=1`` and the logging of the tuner's trials, ROUNDS times, the labels' order rotated
each round. Beside each run a sampler reads, every 0.2 s, the machine's CPU counters (``/proc/stat``: user, system,
softirq, idle, steal) and every thread of every rank (``/proc/PID/task/TID/stat`` and ``schedstat``: the CPU each
used, and ``run_delay``, the time it was ready to run but waited for a core). Over the steps after the fourth (from
the metrics' ``time`` of step 4 to that of the last), per step: the step's wall time; the cores' time busy and idle
(2 cores x the step: a step whose cores are never idle is bound by CPU, not by the link or by waiting); each rank's
main thread (forward, backward, optimizer, the engine's Python) and its other threads (gloo's, the engine's progress
thread) in CPU and in waiting for a core; the kernel's softirq time (the loopback network's packet work).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
TRIAL = ["checkpoint.every=0", "log.every=1", "log.eval_every=0", "log.eval_batches=1", "log.plots=false",
         "log.trace_steps=0"]  # as the tuner's trials (dptrain.tune.trials)


def machine() -> dict:
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return {"user": (user + nice) / TICK, "system": (system + irq) / TICK, "softirq": softirq / TICK,
            "idle": (idle + iowait) / TICK, "steal": steal / TICK}


def ranks() -> dict[int, dict[int, tuple[float, float]]]:
    """Every process running ``dptrain.run`` (a rank): each thread's (CPU s, run_delay s)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if b"dptrain.run" not in argv or b"cluster" in argv or b"exec" in argv:  # a rank, not its wrappers
                continue
            threads = {}
            for t in (p / "task").iterdir():
                stat = (t / "stat").read_text().rsplit(")", 1)[1].split()
                _, delay, _ = (t / "schedstat").read_text().split()
                threads[int(t.name)] = ((int(stat[11]) + int(stat[12])) / TICK, int(delay) / 1e9)
            out[int(p.name)] = threads
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def sample(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        samples.append((time.time(), machine(), ranks()))
        stop.wait(0.2)


def nearest(samples: list, t: float):
    return min(samples, key=lambda s: abs(s[0] - t))


def window(run: Path, samples: list) -> dict:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if line.startswith('{"kind": "train"')]
    first, last = next(s for s in steps if s["step"] == 4), steps[-1]
    n = last["step"] - first["step"]
    (t0, m0, r0), (t1, m1, r1) = nearest(samples, first["time"]), nearest(samples, last["time"])
    per = {k: 1000 * (m1[k] - m0[k]) / n for k in m0}
    main_cpu, main_wait, other_cpu, other_wait = [], [], [], []
    for pid, threads in r1.items():
        before = r0.get(pid, {})
        for tid, (cpu, delay) in threads.items():
            c0, d0 = before.get(tid, (0.0, 0.0))
            (main_cpu if tid == pid else other_cpu).append(cpu - c0)
            (main_wait if tid == pid else other_wait).append(delay - d0)
    wall = 1000 * (t1 - t0) / n
    return {"step_ms": statistics.median(s["step_ms"] for s in steps[4:]), "wall_ms": wall,
            "busy_ms": per["user"] + per["system"] + per["softirq"] + per["steal"], **{f"{k}_ms": v for k, v in per.items()},
            "main_cpu_ms": 1000 * sum(main_cpu) / n, "main_wait_ms": 1000 * sum(main_wait) / n,
            "other_cpu_ms": 1000 * sum(other_cpu) / n, "other_wait_ms": 1000 * sum(other_wait) / n,
            "ranks": len(r1)}


def main(out: Path, rounds: int, configs: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    labels = [c.split("=", 1) for c in configs]
    rows = []
    for r in range(rounds):
        for i in range(len(labels)):
            label, overrides = labels[(i + r) % len(labels)]
            label, _, src = label.partition("@")  # LABEL@SRC: the run imports dptrain from SRC (an old tree's src)
            env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": src} if src else {})}
            run = out / f"{label}-r{r}"
            sets = [a for o in overrides.split(";") if o for a in ("--set", o)]
            cmd = ["dptrain", "cluster", "--hosts", "4", "--bandwidth-gbit", "10", "--", "-m", "dptrain.run",
                   *sets, *[a for o in TRIAL for a in ("--set", o)], "--set", f'run_dir="{run}"']
            samples, stop = [], threading.Event()
            sampler = threading.Thread(target=sample, args=(samples, stop), daemon=True)
            sampler.start()
            try:
                with open(f"{run}.log", "w") as log:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            finally:
                stop.set()
                sampler.join()
            if rc:
                raise SystemExit(f"{label} round {r} failed (rc {rc}); see {run}.log")
            w = window(run, samples)
            rows.append({"label": label, "round": r, **w})
            print(json.dumps(rows[-1]), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    keys = ["step_ms", "busy_ms", "idle_ms", "softirq_ms", "steal_ms", "main_cpu_ms", "main_wait_ms", "other_cpu_ms",
            "other_wait_ms"]
    print(f"\n{'config':24s} runs " + " ".join(f"{k[:-3]:>10s}" for k in keys) + "   (ms per step, medians over the runs)")
    for label in dict.fromkeys(label.partition("@")[0] for label, _ in labels):
        mine = [row for row in rows if row["label"] == label]
        print(f"{label:24s} {len(mine):4d} " + " ".join(f"{statistics.median(m[k] for m in mine):10.0f}" for k in keys))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
