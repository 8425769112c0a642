"""The GPU check's one-screen summary (docs/repro/gpu_check.sh): steps, tests, dptrain/torch DDP, profile.

    python docs/repro/gpu_check_summary.py RESULTS STEPS_FILE JUNIT_XML ELAPSED_S

Exits 1 when a step failed, timed out or was skipped for the deadline.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _steps(path: Path) -> tuple[list[str], bool]:
    lines, ok = [], True
    for row in path.read_text().splitlines():
        name, rc, seconds = row.split("|")
        good = rc == "0" or rc == "skipped: dry run"
        ok &= good
        lines.append(f"  {name:26s} {'ok' if rc == '0' else rc:28s} {seconds:>4s} s")
    return lines, ok


def _tests(path: Path) -> list[str]:
    if not path.exists() or path.stat().st_size == 0:
        return ["  no test report"]
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [c for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    n, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    lines = [f"  {n - skipped - len(failed)} passed, {len(failed)} failed, {skipped} skipped of {n}"]
    lines += [f"  FAILED {c.get('name')}" for c in failed]
    return lines


def _bench(results: Path) -> list[str]:
    lines, first = [], results / "bench_1.json"
    rehearsal = first.exists() and json.loads(first.read_text())["device"].startswith("cpu")  # bench_1 alone
    for name in ("bench_1", "bench_2", "bench_3", "bench_small"):
        path = results / f"{name}.json"
        if not path.exists():
            if not rehearsal and name not in ("bench_2", "bench_3"):  # on a device, steps say why these are missing
                lines.append(f"  {name}: no result")
            continue
        r = json.loads(path.read_text())
        o, parity = r["overhead"], r["parity"]
        ratio, views = o["dptrain_vs_torch_ddp"], o["dptrain_views_vs_torch_ddp"]
        ms = o["median_ms"]
        worst = max(p["max_relative_param_diff"] for p in parity)
        lines.append(f"  {name:11s} {o['model']['params'] / 1e6:5.1f}M batch {o['model']['batch']}x{o['model']['block']}: "
                     f"dptrain/torch DDP {ratio['median']:.3f} (90% CI {ratio['ci90'][0]:.3f}-{ratio['ci90'][1]:.3f}), "
                     f"views {views['median']:.3f}; ms plain {ms['plain']:.2f} torch {ms['torch_ddp']:.2f} "
                     f"dptrain {ms['dptrain_ddp']:.2f}; parity worst {worst:.2g}")
    return lines


def _profile(results: Path) -> list[str]:
    path = results / "profile.json"
    if not path.exists():
        return ["  no profile"]
    r = json.loads(path.read_text())
    w = r["wrappers"]
    return [f"  self CPU per step: dptrain {w['dptrain']['self_cpu_ms_per_step']:.2f} ms, torch DDP "
            f"{w['torch']['self_cpu_ms_per_step']:.2f} ms; per parameter tensor ({w['torch']['param_tensors']}): "
            f"dptrain {w['dptrain']['self_cpu_us_per_param_per_step']:.1f} us, torch "
            f"{w['torch']['self_cpu_us_per_param_per_step']:.1f} us "
            f"({r['dptrain_minus_torch_cpu_us_per_param_per_step']:+.1f})"]


def main() -> int:
    results, steps, junit, elapsed = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    step_lines, ok = _steps(steps)
    device = next((json.loads(p.read_text())["device"] for p in sorted(results.glob("bench_*.json"))), "?")
    print(f"GPU check on {device}, {elapsed} s in all; results in {results}")
    print("steps:", *step_lines, sep="\n")
    print("gpu tests:", *_tests(junit), sep="\n")
    print("dptrain bench gpu (goal: dptrain/torch DDP at most 1.00 on the 85.6M GPT):", *_bench(results), sep="\n")
    print("profile:", *_profile(results), sep="\n")
    print("ALL STEPS OK" if ok else "SOME STEPS FAILED: see check.log")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
