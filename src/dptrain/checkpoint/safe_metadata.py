"""Reading a DCP checkpoint without running code from it: a restricted unpickler for ``.metadata``.

``torch.distributed.checkpoint`` (DCP) writes a checkpoint's index, ``.metadata``, with
plain ``pickle`` and its ``FileSystemReader.read_metadata`` reads it back with plain
``pickle.load``: a crafted ``.metadata`` (an object whose ``__reduce__`` returns
``os.system``) runs its payload the moment a checkpoint is opened, before any check
of ours. A checksum in ``meta.json`` does not help, since whoever can write the file
can rewrite the checksum. And DCP's default planner reads each non-tensor entry (an
optimizer's hyperparameters) with ``torch.load(weights_only=False)``, plain pickle again.

So dptrain reads DCP checkpoints only through :func:`dcp_load` and
:func:`read_metadata`, which swap in

- :class:`SafeReader`: ``read_metadata`` unpickles with :class:`MetadataUnpickler`,
  whose ``find_class`` admits only the globals DCP's ``Metadata`` pickles (recorded by
  unpickling a real zero2 checkpoint and noting every ``find_class`` call: the
  dataclasses of ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``,
  ``torch.Size``, torch dtypes, ``torch.serialization._get_layout`` and ``PosixPath``);
  anything else is refused with :class:`UnsafeCheckpointError` naming the file and
  the global, before it is called;
- :class:`SafeLoadPlanner`: non-tensor entries are read with ``weights_only=True``
  (plain numbers, strings, tuples, lists, dicts and tensors: all dptrain saves there).

Tensors themselves are already read by DCP with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "MetadataUnpickler",
    "SafeLoadPlanner",
    "SafeReader",
    "UnsafeCheckpointError",
    "dcp_load",
    "read_metadata",
]

_METADATA_MODULE = dcp_metadata.__name__
_ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # a dataclass: file, offset, length
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that names a global the restricted unpickler does not admit (it may run code)."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of DCP's ``Metadata``; ``source`` names the file."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if _admitted(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source} names the global {module}.{name}, which a DCP checkpoint's metadata never holds and "
            "which could run code when read; refusing to open it. Use a checkpoint written by dptrain (or torch's "
            "DCP), or delete this one")


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _ADMITTED:
        return True
    if module == _METADATA_MODULE:  # its own dataclasses and enums, not what it imports
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) and value.__module__ == _METADATA_MODULE
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class SafeReader(dcp.FileSystemReader):
    """DCP's file system reader with ``read_metadata`` through :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``torch.load(weights_only=True)``.

    The entry is loaded safely here, saved again and handed to DefaultLoadPlanner's
    ``load_bytes`` (which loads with ``weights_only=False``): what it loads then is our
    own pickle of plain data, not the file's. The entries are a few bytes each.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn} is not plain data and could "
                                        f"run code when read; refusing it ({str(e).splitlines()[0]})") from None
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def read_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The DCP checkpoint ``path``'s ``Metadata``, read without running code (:class:`UnsafeCheckpointError`)."""
    return SafeReader(str(Path(path))).read_metadata()


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.load(state_dict, checkpoint_id=path, **kwargs)`` through :class:`SafeReader` and :class:`SafeLoadPlanner`."""
    dcp.load(state_dict, checkpoint_id=str(path), storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
             **kwargs)
