"""Where a calibration's probe time went: before each run began, its steps, and the rest, from the files it left.

For each probe run under TUNE_DIR/calibration/probes: the seconds from its config being written to its run
directory's config.toml (the launch: ranks started, torch imported, the process group joined; in a job of several
probes, only the first pays it), the sum of its logged steps, and the wall from one probe's config to the next's.
For a calibration that ran one job per probe (on the emulated cluster, or on this machine before the fourth pass
of docs/tune.md); a job of several probes writes every config when it starts, so those figures mean nothing there.

    python docs/repro/probe_wall.py bench_results/tune3/local-tuner [more tune directories]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    for tune_dir in map(Path, sys.argv[1:]):
        runs = sorted((d for d in (tune_dir / "calibration" / "probes").iterdir() if (d / "run").is_dir()),
                      key=lambda d: (d / "config.toml").stat().st_mtime)
        starts = [(d / "config.toml").stat().st_mtime for d in runs]
        before = [(d / "run" / "config.toml").stat().st_mtime - t for d, t in zip(runs, starts, strict=True)]
        steps = []
        for d in runs:
            records = []
            for line in (d / "run" / "metrics.jsonl").read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
            steps.append(sum(r["step_ms"] for r in records if r.get("kind") == "train") / 1e3)
        walls = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        print(f"{tune_dir}: {len(runs)} probe runs in {starts[-1] - starts[0]:.0f} s (first to last start); per run: "
              f"wall {statistics.mean(walls):.1f} s, before its run began {statistics.mean(before):.1f} s, "
              f"its steps {statistics.mean(steps):.1f} s")


if __name__ == "__main__":
    main()
