"""nanoGPT's ``meta.pkl``, read as plain data: the vocabulary size of a token directory that has no meta.json.

nanoGPT's ``data/*/prepare.py`` writes ``train.bin``, ``val.bin`` (uint16 tokens) and
``meta.pkl``, a pickled dict ``{"vocab_size": 65, "itos": {...}, "stoi": {...}}``. Plain
``pickle.load`` would run whatever a crafted file asks for, so the file is read by an
unpickler that resolves no global at all: every class and function a pickle can name
(``os.system``, ``builtins.open``, numpy's arrays...) goes through ``find_class``, which
here refuses. What remains are the opcodes for dict, list, tuple, str, int, float, bool
and None, and the result is checked to hold nothing else (bytes and sets included).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from dptrain.config import ConfigError

__all__ = ["META_PKL", "read_meta_pkl", "pkl_vocab_size"]

META_PKL = "meta.pkl"
_PLAIN = (dict, list, tuple, str, int, float, bool, type(None))
_MAX_BYTES = 64 << 20  # nanoGPT's is a few kB (a character vocabulary) to a few MB


class _Refused(pickle.UnpicklingError):
    """A pickle that holds more than plain data."""


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that names no global: a pickle needing one (any class or callable) is refused."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"it names {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent reference")


def _check_plain(value, where: str = "the top level", depth: int = 0) -> None:
    """A :class:`_Refused` naming where, if ``value`` holds anything but plain builtins."""
    if type(value) not in _PLAIN:
        raise _Refused(f"{where} is a {type(value).__name__}")
    if depth > 32:
        raise _Refused(f"{where} is nested more than 32 levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"a key in {where}", depth + 1)
            _check_plain(item, f"{where}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", depth + 1)


def read_meta_pkl(path: Path) -> dict:
    """The dict in ``path``, read without running anything; a ConfigError naming the file for anything else."""
    path = Path(path)
    fix = (f"dptrain reads only plain data from {path.name} (a dict of str, int, float, list...); write a "
           f"meta.json beside it ({{\"vocab_size\": N}}) or set gpt.vocab_size")
    if path.stat().st_size > _MAX_BYTES:
        raise ConfigError(f"{path} has {path.stat().st_size:,} bytes, more than a vocabulary needs; {fix}")
    try:
        value = _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
        _check_plain(value)
    except _Refused as e:
        raise ConfigError(f"{path} is refused: {e}; {fix}") from None
    except Exception as e:  # a truncated or garbled file fails in many ways inside the unpickler
        raise ConfigError(f"{path} cannot be read as a pickle ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a {type(value).__name__}, not nanoGPT's dict; {fix}")
    return value


def pkl_vocab_size(directory: Path) -> int:
    """``vocab_size`` from ``directory/meta.pkl``; 0 if there is no meta.pkl. A ConfigError if it is not usable."""
    path = Path(directory) / META_PKL
    if not path.is_file():
        return 0
    vocab = read_meta_pkl(path).get("vocab_size")
    if type(vocab) is not int or vocab < 1:
        raise ConfigError(f"{path} has no positive integer vocab_size (got {vocab!r}); write a meta.json beside it "
                          "({\"vocab_size\": N}) or set gpt.vocab_size")
    return vocab
