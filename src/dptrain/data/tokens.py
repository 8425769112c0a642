"""Token files: the nanoGPT convention, memory-mapped, sampled as windows of ``block_size + 1``.

A token directory holds ``train.bin`` and ``val.bin``, each a flat array of token ids
(``uint16`` by default, as nanoGPT's ``prepare.py`` writes them, or ``uint32`` for a
vocabulary above 65,536), and optionally ``meta.json`` (what ``dptrain prepare-data``
writes: the dtype, the vocabulary size, the tokenizer, the token counts). The files are
memory-mapped (``numpy.memmap``): a window is read from the page cache when it is
sampled, and the whole file is never read into memory, whatever its size.

A sample is a window of ``block_size + 1`` consecutive tokens: the model sees the first
``block_size`` and predicts each next one. Two ways to choose windows:

- ``sequential`` (the default): the file cut into non-overlapping windows, item ``i`` at
  offset ``i x block_size`` (consecutive windows share one token, the target of the last
  position), their order shuffled each epoch by the sampler. Every token is trained on
  once per epoch, an epoch means what it says, and a byte corpus gives exactly the
  built-in ``chargpt`` task's samples.
- ``random``: nanoGPT's ``get_batch``, a window at a random offset for every sample, so
  windows overlap and start anywhere. The offset of item ``i`` in epoch ``e`` is a hash of
  ``(seed, e, i)``, so a run resumed at any step reads the same windows as one that was
  never stopped; an epoch is as many windows as ``sequential`` has.

The validation split is always read sequentially, unshuffled, so its loss is comparable
between evaluations and runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dptrain.config import ConfigError

__all__ = ["TokenWindows", "TokenFiles", "open_token_dir", "read_meta", "scan_max_id", "DTYPES", "SPLITS", "META"]

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SPLITS = ("train.bin", "val.bin")
META = "meta.json"
_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens of one token file: item -> (input, target), int64, each ``block_size``."""

    def __init__(self, path: Path, dtype: str, block_size: int, sampling: str = "sequential", seed: int = 0):
        if sampling not in ("sequential", "random"):
            raise ValueError(f"sampling must be 'sequential' or 'random', got {sampling!r}")
        self.path, self.dtype, self.block_size, self.sampling, self.seed = Path(path), dtype, block_size, sampling, seed
        self.num_tokens = self.path.stat().st_size // np.dtype(DTYPES[dtype]).itemsize
        self.epoch = 0
        self._data = None  # opened in the process that reads (a memmap is not sent to another process)

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        return self._data

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None}

    def set_epoch(self, epoch: int) -> None:
        """Called by the loader before each epoch: random windows differ from epoch to epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.block_size)

    def offset(self, i: int) -> int:
        if self.sampling == "sequential":
            return i * self.block_size
        key = _splitmix64(_splitmix64(_splitmix64(self.seed) ^ self.epoch) ^ i)
        return key % (self.num_tokens - self.block_size)  # a window of block_size + 1 fits from every offset

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        start = self.offset(i)
        chunk = torch.from_numpy(self.data[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class TokenFiles:
    """A checked token directory: its files, their dtype, and the vocabulary its meta.json gives (0: not given)."""

    dir: Path
    dtype: str
    vocab_size: int
    meta: dict

    def path(self, split: str) -> Path:
        return self.dir / split

    def tokens(self, split: str) -> int:
        return self.path(split).stat().st_size // np.dtype(DTYPES[self.dtype]).itemsize

    def max_id(self, split: str) -> int:
        """The largest token id in ``split``: meta.json's ``max_token_id`` (``dptrain prepare-data`` records it)
        while the file still holds the token count meta.json gives, else one pass over the whole file."""
        recorded = self.meta.get("max_token_id", {})
        count = self.meta.get(f"{split.split('.')[0]}_tokens")
        if isinstance(recorded, dict) and isinstance(recorded.get(split), int) and count == self.tokens(split):
            return recorded[split]
        return scan_max_id(self.path(split), self.dtype)

    def check_vocab(self, vocab_size: int) -> None:
        """A ConfigError naming the file and the id if any token id is outside the model's vocabulary."""
        for split in SPLITS:
            top = self.max_id(split)
            if top >= vocab_size:
                raise ConfigError(f"{self.path(split)} holds token id {top:,}, but the model's vocabulary has "
                                  f"{vocab_size:,} ids (0 to {vocab_size - 1:,}): the files were made with another "
                                  "tokenizer, or the model's vocabulary size is wrong (gpt.vocab_size, or the "
                                  "Hugging Face config's vocab_size)")


def scan_max_id(path: Path, dtype: str, chunk: int = 1 << 24) -> int:
    """The largest token id in a token file: numpy's max over the memory-mapped file, ``chunk`` tokens at a time
    (no copy of the file in memory; its cost is measured in docs/your-data.md)."""
    data = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    return max((int(data[i:i + chunk].max()) for i in range(0, len(data), chunk)), default=0)


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from None
    return meta if isinstance(meta, dict) else {}


def open_token_dir(directory: str | Path, dtype: str = "auto") -> TokenFiles:
    """Check a token directory (both files there, not empty, sized in whole tokens) and describe it.

    ``dtype`` "auto" takes meta.json's, else uint16 (nanoGPT's files have no meta.json).
    """
    root = Path(directory)
    if not str(directory):
        raise ConfigError("data.dir is not set: it must name the directory holding train.bin and val.bin")
    if not root.is_dir():
        raise ConfigError(f"data.dir {root} is not a directory: it must hold train.bin and val.bin "
                          "(dptrain prepare-data writes them; docs/your-data.md)")
    meta = read_meta(root)
    if dtype == "auto":
        dtype = meta.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise ConfigError(f"the token dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    for split in SPLITS:
        path = root / split
        if not path.is_file():
            raise ConfigError(f"{path} is missing: a token directory holds train.bin and val.bin")
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"{path} is empty")
        if size % itemsize:
            raise ConfigError(f"{path} has {size:,} bytes, not a whole number of {dtype} tokens ({itemsize} bytes "
                              "each): a truncated file, or another dtype (data.dtype)")
    return TokenFiles(root, dtype, int(meta.get("vocab_size", 0)), meta)
