"""The flat-tensor collectives under the names each torch release has.

torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single`` and warns on the
older ``all_gather_into_tensor`` and ``reduce_scatter_tensor``; earlier releases (the GPU
images dptrain is checked on carry 2.11) have only the older names. Same arguments, same
semantics: one flat output of ``world x`` the input (gather) or one shard of it (scatter).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
