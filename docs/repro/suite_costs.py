"""Where an end-to-end test's time goes: one tiny ``dptrain run``, taken apart.

    python docs/repro/suite_costs.py [--rounds 3] [--steps 4] [--connections 300]

The suite's end-to-end tests each run ``dptrain run`` on the tiny GPT of tests/_cli.py
(2 workers). This script times the pieces such a run is made of, interleaved over
``--rounds`` rounds, and prints medians (docs/testing.md quotes them):

- interpreters: ``python -c pass``; importing torch; importing what a worker imports
  (``launch.workers.PRELOAD``); importing the CLI;
- the multi-process harness: ``run_on_ranks`` on 2 and 4 ranks with nothing to do;
- one run three ways: a fresh ``python -m dptrain.cli`` with exec workers (how every test
  ran it before), a fresh CLI with forked workers (the default now), and the CLI called
  in a process that has run one before (how the tests run it now);
- a run whose rank 1 raises at step 2, with the roll call's default wait (3 s) and 1 s;
- inside the run: the training wall time the summary reports; the plots, drawn again
  from the run directory; the last checkpoint, written again;
- the rendezvous store: ``--connections`` TCPStore client connections, with and without
  ``RES_OPTIONS=timeout:1``: a connection looks its peer's address up in the DNS, and a
  dropped query costs the C library's resolver timeout (5 s by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from _cli import tiny_gpt_config  # noqa: E402
from dptrain.bench.runs import run_cli  # noqa: E402
from dptrain.launch.workers import PRELOAD  # noqa: E402


def _seconds(args: list[str], env: dict | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def _imports() -> dict[str, float]:
    py = sys.executable
    return {"python -c pass": _seconds([py, "-c", "pass"]),
            "import torch": _seconds([py, "-c", "import torch"]),
            "import a worker's modules": _seconds([py, "-c", "import " + ", ".join(PRELOAD)]),
            "import dptrain.cli": _seconds([py, "-c", "import dptrain.cli"])}


def _noop(rank: int, world_size: int) -> int:
    return rank


def _ranks() -> dict[str, float]:
    """run_on_ranks with nothing to do: the harness's own cost per call (forked ranks, a FileStore, gloo)."""
    from dptrain.testing import run_on_ranks

    out = {}
    for n in (2, 4):
        t0 = time.perf_counter()
        run_on_ranks(_noop, n)
        out[f"run_on_ranks, {n} ranks doing nothing (in process)"] = time.perf_counter() - t0
    return out


def _run_args(directory: Path, name: str, steps: int) -> list[str]:
    return ["run", "--nproc", "2", "--config", str(tiny_gpt_config(directory)), "--run-dir", str(directory / name),
            "--set", f"train.steps={steps}", "--set", f"checkpoint.every={steps}"]


def _runs(directory: Path, steps: int, r: int) -> dict[str, float]:
    py, out = sys.executable, {}
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
    out["run: fresh CLI, exec workers"] = _seconds(
        [py, "-m", "dptrain.cli", *_run_args(directory, f"exec{r}", steps), "--start-method", "exec"], env, directory)
    out["run: fresh CLI, forked workers"] = _seconds(
        [py, "-m", "dptrain.cli", *_run_args(directory, f"fork{r}", steps)], env, directory)
    t0 = time.perf_counter()
    done = run_cli(_run_args(directory, f"inproc{r}", steps), directory, env)
    out["run: in process, forked workers"] = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    out["  of which training (summary's wall time)"] = _summary_wall(directory / f"inproc{r}")
    out["  of which a checkpoint save (its files written again)"] = _checkpoint_s(directory / f"inproc{r}")
    for wait in (3, 1):  # rank 1 raises at step 2: rank 0's all-reduce loses its peer, and it calls the roll
        t0 = time.perf_counter()
        done = run_cli([*_run_args(directory, f"fail{wait}-{r}", steps), "--set", f"distributed.roll_call_s={wait}"],
                       directory, dict(env, DPTRAIN_FAULT="1:2:raise"))
        out[f"a run whose rank 1 fails, roll call {wait} s (in process)"] = time.perf_counter() - t0
        assert done.returncode == 1, done.stderr[-2000:]
    from dptrain.pages.plots import plot_run
    t0 = time.perf_counter()
    plot_run(directory / f"inproc{r}")
    out["plots of a run (in a process that drew before)"] = time.perf_counter() - t0
    out["plots of a run (fresh python -m dptrain.pages.plots)"] = _seconds(
        [py, "-m", "dptrain.pages.plots", str(directory / f"inproc{r}")])
    return out


def _summary_wall(run_dir: Path) -> float:
    import json

    return json.loads((run_dir / "summary.json").read_text())["wall_s"]


def _checkpoint_s(run_dir: Path) -> float:
    """The run's last checkpoint written again by ``save_checkpoint`` (torch.save, sha256, fsync, rename)."""
    import torch

    from dptrain.checkpoint.files import find_latest, save_checkpoint

    latest = find_latest(run_dir)
    files = {f.name: torch.load(f, weights_only=True) for f in latest.glob("*.pt")}
    t0 = time.perf_counter()
    save_checkpoint(run_dir / "again", 1, files, {})
    return time.perf_counter() - t0


def _stalls(n: int) -> dict[str, str]:
    code = ("import time, sys\nfrom datetime import timedelta\nimport torch.distributed as dist\n"
            "m = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))\n"
            "ts = []\n"
            f"for _ in range({n}):\n"
            "    t = time.perf_counter()\n"
            "    c = dist.TCPStore('127.0.0.1', m.port, is_master=False, timeout=timedelta(seconds=30))\n"
            "    c.set('x', '1'); ts.append(time.perf_counter() - t); del c\n"
            "ts.sort(); print(f'{1e3 * ts[len(ts) // 2]:.1f} {ts[-1]:.2f} {sum(t > 0.5 for t in ts)} {sum(ts):.1f}')\n")
    out = {}
    for label, extra in (("default resolver", {}), ("RES_OPTIONS=timeout:1", {"RES_OPTIONS": "timeout:1"})):
        env = {k: v for k, v in os.environ.items() if k != "RES_OPTIONS"} | extra
        median_ms, worst, slow, total = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                                       text=True, check=True).stdout.split()
        out[label] = (f"{n} connections: median {median_ms} ms, {slow} over 0.5 s, the worst {worst} s, "
                      f"{total} s in all")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--connections", type=int, default=300)
    a = parser.parse_args()
    os.environ.setdefault("RES_OPTIONS", "timeout:1")  # as the suite sets it (conftest.py): no 5 s stalls here
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for k, v in {**_imports(), **_ranks(), **_runs(Path(tmp), a.steps, r)}.items():
                samples.setdefault(k, []).append(v)
            print(f"round {r + 1} of {a.rounds} done", file=sys.stderr)
    print(f"median of {a.rounds} rounds (tiny GPT, 2 workers, {a.steps} steps; seconds of wall time)")
    for k, v in samples.items():
        print(f"  {k:56s} {statistics.median(v):6.2f}   ({', '.join(f'{x:.2f}' for x in v)})")
    print("the rendezvous store's client connections")
    for k, v in _stalls(a.connections).items():
        print(f"  {k:24s} {v}")


if __name__ == "__main__":
    main()
