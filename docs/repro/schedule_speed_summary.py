"""Issue 38's tables from docs/repro/schedule_speed.sh's results (OUT, default /tmp/schedule_speed).

A. Old (835b2e4) against new: dptrain/torch per run at each cap (torch's code is the same in both, so the
   ratio cancels the machine's drift), and ZeRO's step times new/old.
B. dptrain/torch per run, plain and with the scheduling options (dptrain_ddp_sched: last bucket 1 MiB +
   optimizer in backward), with their 90% intervals; the communication overhead above the no-communication
   floor as a fraction of torch's, (sched - floor) / (torch - floor); the held-out pairs protocol per run.
"""
import json
import os
import re
import statistics
from pathlib import Path

d = Path(os.environ.get("OUT", "/tmp/schedule_speed"))


def load(name: str) -> dict:
    return json.loads((d / f"{name}.json").read_text())


def runs(prefix: str, suffix: str) -> list[str]:
    return sorted(m.group(1) for p in d.glob(f"{prefix}*_{suffix}.json")
                  if (m := re.match(rf"({prefix}\d+)_{suffix}\.json$", p.name)))


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs) + f" (median {statistics.median(xs):.3f})"


print("## A. hot path, old against new")
for prefix in ("mlp", "sp"):
    names = [n for n in runs(prefix, "new") if (d / f"{n}_old.json").exists()]
    if not names:
        continue
    caps = [k.split("/")[1] for k in load(f"{names[0]}_old")["ratios"] if k.startswith("dptrain_ddp/")]
    for cap in caps:
        old = [load(f"{n}_old")["ratios"][f"dptrain_ddp/{cap}"]["median"] for n in names]
        new = [load(f"{n}_new")["ratios"][f"dptrain_ddp/{cap}"]["median"] for n in names]
        print(f"{prefix} cap {cap:>3} MiB: dptrain/torch old {fmt(old)}; new {fmt(new)}")
names = [n for n in runs("zero", "new") if (d / f"{n}_old.json").exists()]
for v in ("dptrain_zero1", "dptrain_zero2", "dptrain_zero3"):
    if names:
        r = [load(f"{n}_new")["median_step_s"][v] / load(f"{n}_old")["median_step_s"][v] for n in names]
        print(f"{v}: step new/old per run {fmt(r)}")

print("\n## B. dptrain/torch, plain and scheduled; overhead above the floor vs torch's")
for prefix, label in (("sched_mlp", "15.9M MLP (8 x Linear(1408)), micro-batch 32"),
                      ("sched_ffn", "16.8M MLP (8 x FFN(512, 2048)), micro-batch 64")):
    names = runs(prefix, "new")
    if not names:
        continue
    print(f"\n{label}: runs {', '.join(names)}")
    print("| bucket MiB | dptrain/torch per run [90% interval] | scheduled/torch per run [90% interval] "
          "| overhead above floor, scheduled / torch, per run |")
    print("|---|---|---|---|")
    caps = [k.split("/")[1] for k in load(f"{names[0]}_new")["ratios"] if k.startswith("dptrain_ddp/")]
    for cap in caps:
        cells = []
        for variant in ("dptrain_ddp", "dptrain_ddp_sched"):
            parts = []
            for n in names:
                r = load(f"{n}_new")["ratios"][f"{variant}/{cap}"]
                parts.append(f"{r['median']:.3f} [{r['ci90'][0]:.2f}, {r['ci90'][1]:.2f}]")
            cells.append("; ".join(parts))
        over = []
        for n in names:
            med = load(f"{n}_new")["median_step_s"]
            over.append((med[f"dptrain_ddp_sched/{cap}"] - med["no_comm"]) / (med[f"torch_ddp/{cap}"] - med["no_comm"]))
        print(f"| {cap} | {cells[0]} | {cells[1]} | {fmt(over)} |")
names = runs("heldout", "new")
if names:
    print(f"\nheld-out pairs protocol (16.8M, pairs built 1, 4, 25 MiB, ABBA): runs {', '.join(names)}")
    caps = list(load(f"{names[0]}_new")["ratios"])
    for cap in caps:
        print(f"cap {cap:>3} MiB: dptrain/torch {fmt([load(f'{n}_new')['ratios'][cap]['median'] for n in names])}")
