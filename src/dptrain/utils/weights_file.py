"""A model's state dict as one safetensors file: the one rule for ``model.safetensors`` and ``dptrain consolidate``.

The file holds exactly the keys of ``model.state_dict()``: every parameter under each of
its names (a tied one, the GPT's ``wte.weight`` and ``lm_head.weight``, under both),
persistent buffers and frozen parameters. So the plain call loads it strictly, whatever
strategy trained the model::

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))   # strict=True

The trade-off: a tied tensor is stored once per name (safetensors keeps no shared
storage); ``safetensors.torch.save_model`` keeps one name per tied tensor instead, and
its ``load_model`` refuses a file with both (it reports the second as unexpected). The
first name would depend on a tie-break (``save_model`` keeps the alphabetically first,
ZeRO the first it met), and a file that loads only with ``strict=False`` or one
library's loader is not the model's own state dict. Hugging Face's directory (``hf/``)
keeps Hugging Face's rule: ``save_pretrained`` drops the copies its model lists in
``_tied_weights_keys`` and ``from_pretrained`` ties them back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dptrain.utils.atomic import replacing

__all__ = ["own_storage", "save_state_file"]


def own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with a storage of its own: safetensors refuses shared ones (tied weights, views
    of one flat buffer). A tensor is copied only when its storage is shared or larger than itself."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_state_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (a state dict's keys; see the module docstring) to ``path`` atomically, readable by everyone.

    Written beside ``path`` under a temporary name and renamed over it: a reader sees the
    old file or the new one.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        save_file(own_storage(tensors), str(tmp), metadata=metadata or {"format": "pt"})
    path.chmod(0o644)  # safetensors creates it owner-only
    return path


def save_replica_weights(module: torch.nn.Module, path: Path) -> Path | None:
    """A replicated strategy's weights file: rank 0 writes ``module``'s state dict, the other ranks nothing (None)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    return save_state_file(module.state_dict(), Path(path))
