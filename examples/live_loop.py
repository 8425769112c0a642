"""Your own training loop with live recovery: a worker lost mid-run is restarted alone and healed, the others go on.

    dptrain launch --nproc 3 --live-restarts 5 examples/live_loop.py
    dptrain launch --nproc 3 --live-restarts 5 examples/live_loop.py --kill 1:20   # see a recovery

The model and optimizer are prepared as in examples/prepare_loop.py; dptrain.Live then runs
the steps in rounds: each round's members (r.size of the job's workers) take their shares
of the step's samples, their gradients are averaged over the round, and the vote commits
the step on every member or on none. With --kill R:S, worker R kills itself at step S
after its all-reduce and before its vote (the worst moment: its gradients are in the
others' average); the round aborts, the others retry the step without it, and the
launcher restarts it; its next round heals it from a peer. The log of every attempt is
RUN_DIR/logs/live<r>.jsonl. See docs/api.md, "Live recovery in your own loop".
"""

import argparse
import os
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dptrain


def clusters(samples: int, seed: int) -> TensorDataset:
    """Points around 8 Gaussian centres in 16 dimensions, labelled by centre (generated, no download)."""
    centres = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 2
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 8, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, 16, generator=g), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill", metavar="R:S", help="worker R kills itself before its vote at step S (once)")
    parser.add_argument("--check-every", type=int, default=10,
                        help="every N steps the replicas' state hashes are compared (a diverged one is healed)")
    args = parser.parse_args()

    device = dptrain.init_distributed()    # under --live-restarts: this worker alone; Live's rounds span the job
    torch.manual_seed(0)                   # every worker starts from the same weights (a restarted one is healed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = dptrain.prepare(model, optimizer, device=device)

    live = dptrain.Live(model, optimizer, steps=args.steps, dataset=clusters(4096, seed=1), batch_size=32,
                        check_every=args.check_every)
    kill = tuple(map(int, args.kill.split(":"))) if args.kill else None
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for r in live:                         # one attempt at step r.step by r.size workers
        for x, y in r.batches():           # this member's share of the step's samples
            loss = F.cross_entropy(model(x), y)
            loss.backward()                # averaged over the round's members
        if kill == (live.replica, r.step) and first_life:
            os.kill(os.getpid(), signal.SIGKILL)
        r.commit()                         # the vote: every member steps, or none does and the step is retried
        if live.replica == 0 and r.committed and r.step % 10 == 0:
            print(f"step {r.step}  loss {loss.item():.4f}  round of {r.size}/{r.replicas}", flush=True)

    val = clusters(1024, seed=2)
    with torch.no_grad():
        accuracy = (model(val.tensors[0].to(device)).argmax(-1).cpu() == val.tensors[1]).float().mean()
    print(f"replica {live.replica}: {live.step} steps, val accuracy {accuracy:.3f}", flush=True)
    if live.replica == 0:
        totals = live.totals()
        print(f"{totals.get('committed')} of {totals.get('attempted')} attempted steps committed", flush=True)


if __name__ == "__main__":
    main()
