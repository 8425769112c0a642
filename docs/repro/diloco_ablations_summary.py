"""The table of docs/localsgd.md's DiLoCo ablations, from docs/repro/diloco_ablations.sh's records: each variant's
final validation loss (the exported weights), its ratio to DDP's at the same steps, its evaluations on the way.

    python docs/repro/diloco_ablations_summary.py bench_results/diloco_ablations
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OLD = "--set distributed.strategy=diloco --set diloco.period=30 --set diloco.outer_lr=0.6"
BASES = (OLD + " --set diloco.outer_momentum=0.9", OLD)  # the records from before 0.7 was the default: 0.9 by default


def _change(settings: str) -> str:
    """A variant's settings as its change from DDP, or from the DiLoCo run every ablation starts from."""
    if not settings:
        return "(DDP)"
    for base in BASES:
        if settings.startswith(base):
            rest = settings[len(base):].strip()
            return "DiLoCo H=30, outer lr 0.6, momentum 0.9" + (f", then {rest}" if rest else "")
    return settings


def main(out: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    # each variant against the DDP run of the same steps and model, and of the same change where DDP has it too
    # (momentum0.5-batch64 against ddp-batch64)
    ddp = {(r["variant"], r["steps"], r.get("model", ""), r.get("replicas", 2)): r["val_loss"] for r in rows
           if r["variant"].startswith("ddp")}

    def reference(r: dict) -> float | None:
        tags = [v[4:] for v, *_ in ddp if v != "ddp" and r["variant"].endswith("-" + v[4:])]
        return ddp.get((f"ddp-{tags[0]}" if tags else "ddp", r["steps"], r.get("model", ""), r.get("replicas", 2)))

    lines = ["| variant | model | replicas | steps | the change (`--set`) | final val loss | / DDP | evaluations on the way "
             "(step: loss) |", "|---|---|---:|---:|---|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r.get("model", ""), r.get("replicas", 2), r["steps"], r["variant"] != "ddp",
                                         r["val_loss"])):
        ref = reference(r)
        ratio = f"{r['val_loss'] / ref:.3f}" if ref else "-"
        evals = ", ".join(f"{s}: {v:.4f}" for s, v in sorted(r["evals"].items(), key=lambda kv: int(kv[0]))
                          if int(s) < r["steps"])
        model = f"{r['model']} ({r['parameters']:,})" if r.get("model") else "default GPT"
        lines.append(f"| {r['variant']} | {model} | {r.get('replicas', 2)} | {r['steps']} | {_change(r['settings'])} | "
                     f"{r['val_loss']:.4f} | {ratio} | {evals} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
