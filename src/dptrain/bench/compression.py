"""Study: what each gradient codec costs in loss and saves in bytes, with and without error feedback.

Every variant is one ``dptrain run`` of the default task (the character GPT on 2
workers, same seed, same data order, same steps), differing only in ``[ddp]
compression`` and ``error_feedback``. Reported per variant: the bytes a rank's
buckets would take uncompressed and the bytes its payloads take (per step, from the
run's metrics), their ratio, the final validation loss (``dptrain run``'s end-of-run
evaluation) and its ratio to the uncompressed run's.

    python -m dptrain.bench.compression --steps 150
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dptrain.bench.results import save_result
from dptrain.bench.runs import dptrain_run, with_overrides

__all__ = ["VARIANTS", "run", "main"]

# (name, [ddp] settings)
VARIANTS = [
    ("none", {"compression": "none"}),
    ("fp16", {"compression": "fp16", "error_feedback": False}),
    ("bf16", {"compression": "bf16", "error_feedback": False}),
    ("int8", {"compression": "int8", "error_feedback": False}),
    ("int8+EF", {"compression": "int8", "error_feedback": True}),
    ("topk 1%", {"compression": "topk", "topk_fraction": 0.01, "error_feedback": False}),
    ("topk 1%+EF", {"compression": "topk", "topk_fraction": 0.01, "error_feedback": True}),
    ("powersgd r4 (no EF)", {"compression": "powersgd", "powersgd_rank": 4, "error_feedback": False}),
    ("powersgd r4", {"compression": "powersgd", "powersgd_rank": 4, "error_feedback": True}),
]


def _one(settings: dict, steps: int, nproc: int, directory: Path, overrides: list[str]) -> dict:
    base = {"train.steps": steps, "log.every": max(1, steps // 10), "log.progress": "lines", "log.plots": False,
            "checkpoint.every": 0, **{f"ddp.{k}": v for k, v in settings.items()}}
    done = dptrain_run(nproc, with_overrides(base, overrides), directory / "run")
    summary, last = done["summary"], done["train"][-1]
    return {"val_loss": summary["val_loss"], "final_train_loss": summary["final_train_loss"],
            "raw_bytes_per_step": last["comm_bytes_per_step"],
            "payload_bytes_per_step": last.get("comm_compressed_bytes_per_step") or last["comm_bytes_per_step"],
            "sent_bytes_per_step": last.get("comm_sent_bytes_per_step", 0), "wall_s": done["wall_s"]}


def run(steps: int, nproc: int, variants: list[str] | None = None, overrides: list[str] | None = None) -> dict:
    rows = []
    chosen = [(n, s) for n, s in VARIANTS if variants is None or n in variants]
    for name, settings in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            result = _one(settings, steps, nproc, Path(tmp), overrides or [])
        rows.append({"variant": name, "settings": settings, **result})
        print(f"{name}: val loss {result['val_loss']:.4f}, {result['payload_bytes_per_step'] / 2**20:.3f} MiB/step",
              flush=True)
    return {"steps": steps, "nproc": nproc, "overrides": overrides or [], "rows": rows}


def table(result: dict) -> str:
    base = next((r for r in result["rows"] if r["variant"] == "none"), None)
    lines = ["| variant | MiB per step per rank (payload) | compression ratio | final val loss | vs uncompressed |",
             "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = r["raw_bytes_per_step"] / r["payload_bytes_per_step"]
        rel = f"{r['val_loss'] / base['val_loss']:.4f}" if base else "-"
        lines.append(f"| {r['variant']} | {r['payload_bytes_per_step'] / 2**20:.3f} | {ratio:.1f}x | "
                     f"{r['val_loss']:.4f} | {rel} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=[n for n, _ in VARIANTS])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a dptrain run setting for every variant, e.g. train.optimizer=sgd (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/compression.json"))
    a = parser.parse_args(argv)
    result = run(a.steps, a.nproc, a.variants, a.overrides)
    print(table(result))
    save_result(a.out, result)


if __name__ == "__main__":
    main()
