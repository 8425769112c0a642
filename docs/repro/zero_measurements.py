"""The exact figures behind docs/zero.md's test summaries (the tests assert bounds; this prints values).

    python docs/repro/zero_measurements.py

1. Memory: live tensor bytes per rank / the ZeRO formula, DDP and stages 1-3, 4 ranks.
2. Traffic: bytes sent per step / DDP's, stages 1-3 (and stage 3 without resharding), 2 and 4 ranks.
3. Why the GPT parity cases use SGD: worst relative parameter difference from the DDP
   engine per step, 3 ranks, stage 3, Adam against SGD.
4. Hybrid sharding, 4 ranks as 2 x 2: a bf16 reduce's distance from fp32 after 4 SGD
   steps (plain ZeRO-3 beside it), and the bytes sent across hosts in one step, summed
   over ranks, against ZeRO-3's over all 4 ranks.
"""

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402

from _models import build, global_batch, loss_fn  # noqa: E402
from dptrain import DistributedDataParallel  # noqa: E402
from dptrain.models.gpt import Block  # noqa: E402
from dptrain.testing import run_on_ranks  # noqa: E402
from dptrain.zero import ZeRO  # noqa: E402
from dptrain.zero.memory import zero_formula  # noqa: E402
from test_zero_hybrid import _bf16_reduce_gap, _cross_host_bytes  # noqa: E402
from test_zero_memory import _measure  # noqa: E402
from test_zero_traffic import _bytes_per_step  # noqa: E402


def _drift(rank: int, world_size: int, optimizer: str) -> list[float]:
    torch.manual_seed(0)
    model = build("gpt")
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0004)
    zero = ZeRO(model, stage=3, unit_classes=(Block,))
    make = ((lambda p: torch.optim.Adam(p, lr=0.01)) if optimizer == "adam"
            else (lambda p: torch.optim.SGD(p, lr=0.1)))
    opts = [make(ddp.parameters()), make(zero.parameters())]
    out = []
    for step in range(10):
        x, y = global_batch("gpt", step, 3 * world_size)
        for wrapper, opt in zip((ddp, zero), opts, strict=True):
            opt.zero_grad()
            loss_fn("gpt", wrapper(x[3 * rank:3 * rank + 3]), y[3 * rank:3 * rank + 3]).backward()
            opt.step()
        got = zero.gathered_state()
        out.append(max(((got[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
                       for n, p in ddp.module.named_parameters()))
    return out


if __name__ == "__main__":
    for stage in (0, 1, 2, 3):
        r = run_on_ranks(_measure, 4, stage, timeout=120)[1]
        print(f"memory, stage {stage} (0 = DDP), 4 ranks: {r['live']:,} bytes live, "
              f"{r['live'] / zero_formula(stage, r['numel'], 4) - 1:+.4%} against the formula")
    for ws in (2, 4):
        ddp = run_on_ranks(_bytes_per_step, ws, 0, True)[0][1]
        for stage, reshard in ((1, True), (2, True), (3, True), (3, False)):
            sent = run_on_ranks(_bytes_per_step, ws, stage, reshard)[0][1]
            print(f"traffic, {ws} ranks, stage {stage}{'' if reshard else ' (kept after forward)'}: "
                  f"{sent / ddp:.3f}x DDP")
    for optimizer in ("adam", "sgd"):
        drift = run_on_ranks(_drift, 3, optimizer, timeout=120)[0]
        print(f"GPT stage 3 vs DDP, 3 ranks, {optimizer}: " + " ".join(f"{d:.1e}" for d in drift))
    hsdp, plain = (run_on_ranks(_bf16_reduce_gap, 4, k, timeout=120)[0] for k in (2, 4))
    print(f"bf16 reduce after 4 SGD steps, 4 ranks, from fp32: hybrid 2 x 2 {hsdp:.2%}, plain ZeRO-3 {plain:.2%}")
    hybrid, zero3 = (sum(r["cross"] for r in run_on_ranks(_cross_host_bytes, 4, k, timeout=120)) for k in (2, None))
    print(f"bytes across hosts per step, all ranks: hybrid 2 x 2 {hybrid:,}, ZeRO-3 over 4 ranks {zero3:,} "
          f"({hybrid / zero3:.2f}x)")
