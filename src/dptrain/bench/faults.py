"""Study: every injected fault, what the user saw, how fast it was caught, and whether the result survived.

Each scenario is one ``dptrain run`` of a small job (the classifier task, 2 ranks, 20
steps, a checkpoint every 5) with one fault from ``DPTRAIN_FAULT`` (``runner/faults.py``),
beside a fault-free run of the same job:

- ``kill`` + ``--max-restarts 1``: torchrun restarts the job, it resumes from step 10;
- ``delay`` (3 s): the others wait, and the job goes on unchanged;
- ``kill`` (also inside the gradient all-reduces), ``raise``, ``hang`` without
  restarts: the job must end, on every rank, with
  an error that names the cause (``hang`` within ``distributed.timeout_s`` = 10 s);
- ``flip`` (one bit of a parameter on rank 1) with ``divergence.every = 5``: stopped, or
  repaired with ``divergence.repair``;
- ``nan`` (one rank's gradient): the step is skipped on every rank;
- ``mismatch`` (rank 1 makes one extra all-reduce): with ``distributed.check_collectives`` every,
  first (the default) and off: a named error on every rank, a named timeout, or gloo's
  SIGABRT;
- resize: a checkpoint of N ranks resumed on M, against the uninterrupted run on N.

Time to detection is from the fault (``DPTRAIN_FAULT_LOG``'s timestamp) to the first
error recorded by a rank other than the faulty one (for a restarted job: in its first
attempt), and for the divergence check also in steps; "-" where no rank failed (the job
repaired or skipped and went on).
The final state is compared with the fault-free run's ``model.safetensors``.

    python -m dptrain.bench.faults
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import click
import torch
from safetensors.torch import load_file

from dptrain.bench.results import save_result
from dptrain.bench.runs import dptrain_command
from dptrain.cli.bench_group import bench_command

__all__ = ["SCENARIOS", "run", "table", "main"]

BASE = {"task.name": "classifier", "train.steps": 20, "checkpoint.every": 5, "log.every": 1,
        "log.progress": "lines", "log.plots": False, "distributed.timeout_s": 10}
# (name, fault, extra settings, max restarts)
SCENARIOS = [
    ("kill rank 1 at step 12, --max-restarts 1", "1:12:kill", {}, 1),
    ("kill rank 1 at step 12", "1:12:kill", {}, 0),
    ("kill rank 1 inside step 12's gradient all-reduces", "1:12:kill-in-backward", {}, 0),
    ("delay rank 1 by 3 s at step 12", "1:12:delay", {}, 0),
    ("raise on rank 1 at step 12", "1:12:raise", {}, 0),
    ("hang rank 1 at step 12 (timeout 10 s)", "1:12:hang", {}, 0),
    ("flip a bit on rank 1 at step 12, check every 5", "1:12:flip", {"divergence.every": 5}, 0),
    ("the same, with repair", "1:12:flip", {"divergence.every": 5, "divergence.repair": True}, 0),
    ("NaN gradient on rank 0 at step 12", "0:12:nan", {}, 0),
    ("rank 1 calls an extra all-reduce at step 12, check every call", "1:12:mismatch",
     {"distributed.check_collectives": "every"}, 0),
    ("the same, check first calls (default)", "1:12:mismatch", {}, 0),
    ("the same, check off", "1:12:mismatch", {"distributed.check_collectives": "off"}, 0),
]
RESIZES = [(2, 1), (1, 2), (4, 2)]


def _dptrain(run_dir: Path, nproc: int, settings: dict, fault: str = "", restarts: int = 0,
             fault_log: Path | None = None) -> dict:
    args = dptrain_command(nproc, settings, run_dir)
    if restarts:
        args += ["--max-restarts", str(restarts)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTRAIN_FAULT")}
    if fault:
        env.update(DPTRAIN_FAULT=fault, DPTRAIN_FAULT_LOG=str(fault_log))
    t0 = time.time()
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    return {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "start": t0, "end": time.time()}


def _saw(done: dict) -> str:
    """The line a user would read first: the error, a warning, or how the run ended."""
    text = re.sub(r"\[/\S+\.cc:\d+\] ", "", done["stderr"] + done["stdout"])  # gloo's source locations
    text = re.sub(r"/tmp/\S+/(s\d+|cut\w+)/", "<run>/", text)
    seen = []
    for pattern in (r"DivergenceError: [^\n]*", r"warning: replicas diverged[^\n]*", r"RuntimeError: fault[^\n]*",
                    r"CollectiveMismatchError: [^\n]*?(?=\. Every rank)", r"CollectiveTimeoutError: [^;\n]*",
                    r"RuntimeError: [^\n]*Timed out[^\n]*", r"error: rank \d+ failed first:\n[^;\n]*",
                    r"resumed from [^\n]*", r"skipped steps[^\n]*"):
        found = re.search(pattern, text)
        if found:
            seen.append(" ".join(found.group(0).split()))
            break
    for pattern in (r"roll call: rank\(s\) \[[\d, ]+\] reported nothing[^:]*",  # the workers' own roll call
                    r"rank\(s\) \[[\d, ]+\] were still running[^.]*"):  # the local launcher's guess at a hang
        culprit = re.search(pattern, text)
        if culprit:
            seen.append(" ".join(culprit.group(0).split()))
    return "; ".join(seen) if seen else f"exit {done['code']}"


def _detection_s(run_dir: Path, fault_log: Path, faulty: int, done: dict) -> float | None:
    if not fault_log.exists():
        return None
    struck = json.loads(fault_log.read_text().splitlines()[0])["time"]
    times = [json.loads(p.read_text())["time"] for p in (run_dir / "logs").glob("rank*.error.json")
             if p.name != f"rank{faulty}.error.json"]
    if not times:  # no rank other than the faulty one failed: the job went on (repaired, skipped, restarted)
        return None if done["code"] == 0 else done["end"] - struck
    return min(times) - struck


def _compare(a: Path, b: Path) -> str:
    if not (a.exists() and b.exists()):
        return "no final state (the job stopped)"
    x, y = load_file(a), load_file(b)
    diff = max((x[k] - y[k]).abs().max().item() for k in x)
    return "bitwise equal" if all(torch.equal(x[k], y[k]) for k in x) else f"differs, max abs {diff:.2e}"


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind", "train") == "train" and "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def run(directory: Path) -> dict:
    reference = directory / "reference"
    _dptrain(reference, 2, BASE)
    rows = []
    for i, (name, fault, extra, restarts) in enumerate(SCENARIOS):
        run_dir, log = directory / f"s{i}", directory / f"s{i}.faults"
        done = _dptrain(run_dir, 2, {**BASE, **extra}, fault, restarts, log)
        detection = _detection_s(run_dir, log, int(fault.split(":")[0]), done)
        caught = re.search(r"diverged at step (\d+)", done["stderr"] + done["stdout"])
        rows.append({"fault": name, "exit": done["code"], "saw": _saw(done), "detection_s": detection,
                     "caught_after_steps": int(caught.group(1)) - int(fault.split(":")[1]) if caught else None,
                     "final": _compare(run_dir / "model.safetensors", reference / "model.safetensors")})
        print(f"{name}: exit {done['code']}, {rows[-1]['saw'][:100]} | {rows[-1]['final']}", flush=True)
    resizes = []
    for n, m in RESIZES:
        whole, cut = directory / f"whole{n}", directory / f"cut{n}to{m}"
        _dptrain(whole, n, BASE)
        _dptrain(cut, n, BASE, fault="0:11:raise", fault_log=directory / f"cut{n}to{m}.faults")  # ends at step 10
        done = _dptrain(cut, m, BASE)
        a, b = _losses(whole), _losses(cut)
        resumed = [s for s in b if s > 10]
        worst = max(abs(a[s] - b[s]) for s in resumed) if resumed and done["code"] == 0 else None
        resizes.append({"from": n, "to": m, "exit": done["code"], "steps_compared": len(resumed),
                        "max_abs_loss_diff": worst})
        print(f"resize {n}->{m}: exit {done['code']}, max |loss difference| over steps 11-20: {worst}", flush=True)
    return {"scenarios": rows, "resizes": resizes, "settings": BASE}


def table(result: dict) -> str:
    lines = ["| fault | exit | what the user saw | time to detection | final state vs fault-free |",
             "|---|---:|---|---:|---|"]
    for r in result["scenarios"]:
        t = "-" if r["detection_s"] is None else f"{r['detection_s']:.1f} s"
        if r["caught_after_steps"] is not None:
            t += f" ({r['caught_after_steps']} steps)"
        lines.append(f"| {r['fault']} | {r['exit']} | {r['saw'].replace('|', '/')} | {t} | {r['final']} |")
    lines += ["", "| resume | exit | steps compared | max abs loss difference vs the uninterrupted run |",
              "|---|---:|---:|---:|"]
    for r in result["resizes"]:
        d = "-" if r["max_abs_loss_diff"] is None else f"{r['max_abs_loss_diff']:.2e}"
        lines.append(f"| {r['from']} -> {r['to']} ranks at step 10 | {r['exit']} | {r['steps_compared']} | {d} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/faults.json"),
              help="the JSON result to write")
def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp))
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    main()
