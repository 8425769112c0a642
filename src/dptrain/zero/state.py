"""ZeRO's state as checkpoints, exports and heals read and write it: the wrapper protocol's state members.

A ZeRO model holds each parameter as a rank's flat shard (:mod:`~dptrain.zero.unit`); the
members here turn that into what the rest of dptrain reads: the full parameters gathered by
name (a collective), the module's buffers and frozen parameters, the sharded checkpoint
(DCP, :mod:`~dptrain.zero.checkpoint`), the safetensors export, and a rank's own part with no
collective (what the rank at the same position of another replica holds: live recovery's
heal). :class:`ShardedState` is mixed into :class:`~dptrain.zero.module.ZeRO`, whose
``units``, ``module``, groups and name maps it reads.
"""

from __future__ import annotations

from typing import Any

import torch

from dptrain import comm
from dptrain.comm.average import consensus_state_dict

__all__ = ["ShardedState"]


class ShardedState:
    """The state members of :class:`~dptrain.zero.module.ZeRO` (see the module docstring)."""

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, by its original name (all ranks take part; for tests and export)."""
        out = {}
        for unit in self.units:
            full = torch.empty(unit.numel, dtype=unit.master_dtype, device=unit.device)
            comm.all_gather(full, unit.shard.detach(), algorithm=self.algorithm, group=self.shard_group,
                            nodes=self.nodes, validate=False)
            for ref, (a, b) in zip(unit.refs, unit.offsets(), strict=True):
                out[ref.name] = full[a:b].view(ref.shape).clone()
        return out

    def module_state(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict without its sharded parameters: buffers and frozen parameters, in place."""
        with self._guard.open():
            state = self.module.state_dict()
        return {k: v for k, v in state.items() if k not in self._sharded_names}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the module's whole state dict in its own order, every parameter gathered (each rank a copy)."""
        gathered = self.gathered_state()
        with self._guard.open():  # buffers: rank 0's, as the DDP engine's (comm/average.py)
            state = consensus_state_dict(self.module, self.group, average=False)
        return {k: gathered[self._sharded_names[k]] if k in self._sharded_names else v for k, v in state.items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank, no collective: the shards cut from a full state dict (as :meth:`full_state_dict` gives it)."""
        from dptrain.zero.checkpoint import load_full_state
        load_full_state(self, None, state, None, "the state dict given")

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        return {}  # everything it holds is in its shards (save_sharded)

    def load_checkpoint_state(self, state: dict, optimizer: torch.optim.Optimizer) -> str | None:
        return None

    def export_weights(self, path) -> Any:
        """Collective: every unit gathered; rank 0 writes the model's state dict (:func:`~dptrain.zero.checkpoint.export_safetensors`)."""
        from dptrain.zero.checkpoint import export_safetensors

        return export_safetensors(self, path)

    # ------------------------------------------------------------------ its own shards, for checkpoints (sharded)

    def save_sharded(self, path, optimizer: torch.optim.Optimizer) -> Any:
        """Collective: this rank's row chunks of every parameter and its optimizer state, DCP files under ``path``."""
        from dptrain.zero.checkpoint import save_sharded

        return save_sharded(path, self, optimizer)

    def load_sharded(self, path, optimizer: torch.optim.Optimizer) -> Any:
        """Collective: a sharded checkpoint saved on any number of ranks, resharded by DCP into the shards."""
        from dptrain.zero.checkpoint import load_sharded

        return load_sharded(path, self, optimizer)

    def load_full_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                        source: str) -> None:
        """Every rank, no collective: the shards sliced from full tensors (a replicated checkpoint)."""
        from dptrain.zero.checkpoint import load_full_state

        load_full_state(self, optimizer, model_state, optim_state, source)

    def local_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """No collective: what this rank holds itself (its shards, the module's buffers and frozen parameters, its
        optimizer's state), as the rank at the same position of another replica holds it too (hybrid sharding).
        Live recovery heals a replica's rank from that peer with it."""
        return {"shards": [unit.shard.detach().clone() for unit in self.units],
                "module": {k: v.clone() for k, v in self.module_state().items()},
                "optimizer": optimizer.state_dict()}

    def load_local_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """No collective: :meth:`local_state`'s output of a rank at this rank's position; the next forward gathers the
        loaded shards."""
        shards = state["shards"]
        if [s.numel() for s in shards] != [u.shard.numel() for u in self.units]:
            raise ValueError(f"the state's shards ({[s.numel() for s in shards]} elements) are not this rank's "
                             f"({[u.shard.numel() for u in self.units]}): it was taken at another position or model")
        with torch.no_grad():
            for unit, shard in zip(self.units, shards, strict=True):
                unit.shard.copy_(shard)
                unit.stale = True
            for name, tensor in self.module_state().items():
                tensor.copy_(state["module"][name])
        optimizer.load_state_dict(state["optimizer"])

    def sharded_parameters(self, key: Any) -> list[torch.Tensor]:
        """The flat shards of the units whose parameters ``split_by`` mapped to ``key``."""
        return [unit.shard for unit in self.units if unit.key == key]
