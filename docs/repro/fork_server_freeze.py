"""What ``gc.freeze()`` in the fork server (``dptrain.launch.frozen``) saves a run: tiny runs with and without it.

    python docs/repro/fork_server_freeze.py [--rounds 6] [--runs 5]

Each round starts one fresh process per variant, in alternating order (ABBA...): its fork server preloads what the
test suite's does (``tests/conftest.py``: the launcher's list, pytest, the test helpers and transformers), with or
without ``dptrain.launch.frozen`` last; the process runs one ``dptrain run`` of the suite's tiny GPT (2 workers, 20
steps) to start its server, then ``--runs`` more in process, as the tests do, and reports their median wall time and
the machine's CPU seconds per run (``/proc/stat``: the forked workers are not this process's children). Prints each
variant's medians over the rounds and the per-round ratios' median (frozen / not). First, what the collector walks:
the objects the preload leaves tracked, and the CPU a full collection and a scan for tensors take, before and after
``gc.freeze()``. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import importlib.util, json, multiprocessing, multiprocessing.forkserver, statistics, sys, time
from pathlib import Path

def busy():
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(v) - v[3] - v[4]) / 100

def main():
    sys.path.insert(0, sys.argv[3])
    from dptrain.launch.workers import PRELOAD, FROZEN
    hf = ["transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [*PRELOAD, "pytest", "_models", "_cli", *hf, *([FROZEN] if sys.argv[1] == "frozen" else [])])
    multiprocessing.forkserver.ensure_running()
    from _cli import dptrain, tiny_gpt_config
    cwd = Path(sys.argv[2]); config = str(tiny_gpt_config(cwd)); walls, cpus = [], []
    for i in range(int(sys.argv[4]) + 1):
        t, c = time.perf_counter(), busy()
        done = dptrain("run", "--nproc", "2", "--config", config, "--run-dir", str(cwd / f"run{i}"), cwd=cwd)
        assert done.returncode == 0, done.stderr
        if i:  # the first started the fork server
            walls.append(time.perf_counter() - t); cpus.append(busy() - c)
    print(json.dumps({"wall": statistics.median(walls), "cpu": statistics.median(cpus)}))

if __name__ == "__main__":
    main()
"""


OBJECTS = r"""
import gc, importlib, importlib.util, sys, time
sys.path.insert(0, sys.argv[1])
from dptrain.launch.workers import PRELOAD
from dptrain.runner.tensor_peak import reachable_tensors
hf = ["transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []
for name in [*PRELOAD, "pytest", "_models", "_cli", *hf]:
    importlib.import_module(name)

def cpu(f):
    t = time.process_time()
    for _ in range(3):
        f()
    return (time.process_time() - t) / 3

for when in ("before gc.freeze()", "after"):
    print(f"the fork server's preload, {when}: {len(gc.get_objects()):,} objects tracked; gc.collect() "
          f"{cpu(gc.collect):.3f} s of CPU, reachable_tensors() {cpu(reachable_tensors):.3f} s")
    gc.freeze()
"""


def main() -> None:
    subprocess.run([sys.executable, "-c", OBJECTS, str(ROOT / "tests")], check=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"plain": [], "frozen": []}
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        for r in range(a.rounds):
            order = ["plain", "frozen"] if r % 2 == 0 else ["frozen", "plain"]
            for variant in order:
                cwd = Path(tmp) / f"{variant}{r}"
                cwd.mkdir()
                out = subprocess.run([sys.executable, str(child), variant, str(cwd), str(ROOT / "tests"), str(a.runs)],
                                     capture_output=True, text=True, cwd=cwd)
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-3000:])
                results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(r, variant, results[variant][-1], flush=True)
    for key in ("wall", "cpu"):
        ratios = sorted(f[key] / p[key] for f, p in zip(results["frozen"], results["plain"], strict=True))
        print(f"{key} per run: plain {statistics.median(x[key] for x in results['plain']):.3f} s, frozen "
              f"{statistics.median(x[key] for x in results['frozen']):.3f} s; frozen / plain per round: median "
              f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
