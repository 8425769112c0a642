"""What each logging backend costs: opening it, and each record it logs (docs/run.md, "Logging backends").

    python docs/repro/log_backend_cost.py [--records 200]

Opens every backend of ``log.backends`` alone in a fresh temporary run directory
(W&B offline, MLflow's default SQLite store), logs ``--records`` records of 20 values
like a train record of ``metrics.jsonl``, and prints the seconds to open, the median
milliseconds per ``log`` call, and the seconds to close.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from dptrain.config import RunConfig
from dptrain.config.loader import to_dict
from dptrain.runner.log_backends import open_backends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    record = {f"value_{i}": 1.0 + i for i in range(18)} | {"kind": "train", "time": time.time()}
    print("| backend | open (s) | per record (ms, median) | close (s) |\n|---|---:|---:|---:|")
    for name in ("jsonl", "csv", "tensorboard", "wandb", "mlflow"):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            sink = open_backends([name], Path(tmp), 0, run_name="cost", config=to_dict(RunConfig()),
                                 wandb_project="dptrain", mlflow_uri="", mlflow_experiment="dptrain")
            opened = time.perf_counter() - t0
            backend = sink.backends[-1]
            times = []
            for step in range(1, args.records + 1):
                t = time.perf_counter()
                backend.log({**record, "step": step}, step)
                times.append(time.perf_counter() - t)
            t = time.perf_counter()
            sink.close()
            print(f"| {name} | {opened:.2f} | {1e3 * statistics.median(times):.3f} | {time.perf_counter() - t:.2f} |")


if __name__ == "__main__":
    main()
