"""What moving ZeRO's flat shards into DTensor row chunks costs a sharded save (docs/zero.md, Checkpoints).

    python docs/repro/checkpoint_redistribution.py [--world-size 2] [--repeats 5] [--before 7c8c1f6]

The default chargpt GPT (4 layers, n_embd 192, about 1.8 M parameters), AdamW after one
step, on gloo CPU ranks of this machine, stages 2 and 3. Per stage: the median over
``--repeats`` saves of

- the all-to-alls alone (``dptrain.zero.checkpoint``'s moves of each unit's parameters
  and per-element optimizer state into row chunks, what a save adds);
- the whole ``save_sharded`` (the same moves, then ``dcp.save`` writing the files);
- the share of the elements that cross ranks (the rest stay where they are);
- with ``--before REV``: the whole save by ``src/dptrain/zero/checkpoint.py`` as it was at
  git revision ``REV`` (7c8c1f6: ShardedTensor pieces of the flattened parameters, no
  all-to-all), on the same model in the same run.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

from dptrain.models.gpt import GPT, Block
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO
from dptrain.zero.checkpoint import _to_chunks, save_sharded
from dptrain.zero.redistribute import chunk_intervals, transfers, zero_intervals


def _module_at(rev: str, directory: str):
    """``dptrain.zero.checkpoint`` as it was at git revision ``rev``, imported from a copy in ``directory``."""
    source = subprocess.run(["git", "show", f"{rev}:src/dptrain/zero/checkpoint.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parent).stdout
    path = Path(directory) / f"checkpoint_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"checkpoint_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _measure(rank: int, world_size: int, stage: int, repeats: int, directory: str, before: str | None) -> dict:
    torch.manual_seed(0)
    kwargs = {"unit_classes": (Block,)} if stage == 3 else {}
    model = ZeRO(GPT(), stage=stage, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 64))
    torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 256), tokens.reshape(-1)).backward()
    optimizer.step()
    moves, saves, old = [], [], []
    previous = _module_at(before, directory) if before else None
    for i in range(repeats):
        if previous is not None:
            dist.barrier()
            t0 = time.perf_counter()
            previous.save_sharded(f"{directory}/before{i}", model, optimizer)
            old.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for unit in model.units:
            _to_chunks(unit, unit.shard.detach())
            for value in optimizer.state[unit.shard].values():
                if value.dim() == 1:
                    _to_chunks(unit, value)
        dist.barrier()
        t1 = time.perf_counter()
        save_sharded(f"{directory}/ckpt{i}", model, optimizer)
        saves.append(time.perf_counter() - t1)
        moves.append(t1 - t0)
    crossing = total = 0
    for unit in model.units:
        source, target = zero_intervals(unit.numel, world_size), chunk_intervals([r.shape for r in unit.refs],
                                                                                 world_size)
        sends, _ = transfers(source, target, rank)
        crossing += sum(hi - lo for d, per in enumerate(sends) if d != rank for lo, hi in per)
        total += unit.hi - unit.lo
    return {"move_s": statistics.median(moves), "save_s": statistics.median(saves),
            "before_s": statistics.median(old) if old else None, "crossing": crossing,
            "held": total, "params": sum(u.numel for u in model.units)}


@click.command()
@click.option("--world-size", default=2, show_default=True, help="gloo CPU ranks")
@click.option("--repeats", default=5, show_default=True, help="saves per stage; the median is printed")
@click.option("--before", default=None, help="also time the save of zero/checkpoint.py at this git revision")
def main(world_size: int, repeats: int, before: str | None) -> None:
    for stage in (2, 3):
        with tempfile.TemporaryDirectory() as directory:
            out = run_on_ranks(_measure, world_size, stage, repeats, directory, before, timeout=600)
        move, save = max(r["move_s"] for r in out), max(r["save_s"] for r in out)
        crossing = sum(r["crossing"] for r in out) / sum(r["held"] for r in out)
        print(f"stage {stage}, {world_size} ranks, {out[0]['params']:,} parameters + AdamW: all-to-alls "
              f"{1e3 * move:.1f} ms, whole save {1e3 * save:.1f} ms ({100 * move / save:.0f}%); "
              f"{100 * crossing:.1f}% of the elements cross ranks")
        if before:
            print(f"  the save at {before}: {1e3 * max(r['before_s'] for r in out):.1f} ms")


if __name__ == "__main__":
    main()
