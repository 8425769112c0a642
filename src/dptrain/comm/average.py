"""One model out of a group's replicas: the state dict a strategy calls *the* model, the same on every rank.

Asked for the model (``dptrain.get_state_dict``), every strategy answers with one state dict
that is the same on every rank, computed on copies so that training goes on untouched:

- gossip, local SGD and DiLoCo let each rank's replica drift between synchronisations: the
  trained parameters are their mean over the ranks (one flat all-reduce), as ``finish()``
  leaves them (``average=True``);
- the buffers (BatchNorm's running statistics) are rank 0's (one flat broadcast): ZeRO and the
  DDP engine broadcast rank 0's before each forward, and each rank's own forward then moves
  them apart again, as in torch's DDP; at the end of training (``finish()``) every strategy
  broadcasts rank 0's (``broadcast_buffers_``). Rank 0's are what a run exports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["consensus_state_dict", "broadcast_buffers_"]


@torch.no_grad()
def consensus_state_dict(module: nn.Module, group: dist.ProcessGroup | None = None, *,
                         average: bool = True) -> dict[str, torch.Tensor]:
    """Collective: ``module.state_dict()``, trained parameters averaged over ``group`` (or kept, ``average=False``),
    every other floating tensor rank 0's. Changed entries are copies; the module is left as it is."""
    live = module.state_dict(keep_vars=True)
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    first: dict[int, str] = {}  # one key per tensor: a tied weight is reduced once, its aliases share the result
    for k, v in live.items():
        if torch.is_tensor(v) and v.is_floating_point():
            first.setdefault(id(v), k)
    mean = [k for k in first.values() if id(live[k]) in trained] if average else []
    rest = [k for k in first.values() if id(live[k]) not in trained]
    out = {k: v.detach() if torch.is_tensor(v) else v for k, v in live.items()}
    if dist.get_world_size(group) == 1:
        return {k: v.clone() if torch.is_tensor(v) and k in rest + mean else v for k, v in out.items()}
    out.update({k: out[k].clone() for k in mean + rest})
    _flat(out, mean, lambda flat: _mean_(flat, group))
    _flat(out, rest, lambda flat: _from_rank0_(flat, group))
    for k, v in live.items():
        if torch.is_tensor(v) and first.get(id(v), k) != k:
            out[k] = out[first[id(v)]]
    return out


@torch.no_grad()
def broadcast_buffers_(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Collective: rank 0's floating buffers into every rank's module (one flat broadcast)."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if buffers and dist.get_world_size(group) > 1:
        state = dict(enumerate(buffers))
        _flat(state, list(state), lambda flat: _from_rank0_(flat, group))


def _mean_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))


def _from_rank0_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    dist.broadcast(flat, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)


def _flat(state: dict, keys: list, collective) -> None:
    """Run ``collective`` on ``state[k] for k in keys`` packed into one buffer (their promoted dtype), copied back."""
    if not keys:
        return
    flat = torch.cat([state[k].reshape(-1) for k in keys])
    collective(flat)
    for k, piece in zip(keys, flat.split([state[k].numel() for k in keys]), strict=True):
        state[k].copy_(piece.view_as(state[k]))
