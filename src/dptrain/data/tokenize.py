"""Text to token ids: one token per byte, or a Hugging Face ``tokenizer.json`` the user has.

- ``bytes``: the UTF-8 bytes themselves, vocabulary 256, no file needed. A file's bytes
  are taken as they are (nothing is decoded), as the built-in ``chargpt`` task does.
- a path to a ``tokenizer.json`` (what ``tokenizer.save(...)`` or a model directory's
  ``save_pretrained`` writes), loaded with the ``tokenizers`` library (the ``hf`` extra).
  Nothing is downloaded: only a file on this machine is read. Batches of text are
  encoded by ``encode_batch``, which runs on every core (the library's Rust threads).

Documents are joined into one stream. A tokenizer with an end-of-text token
(``<|endoftext|>``, ``</s>``, ``<eos>``...) gets it between documents, as nanoGPT's
OpenWebText preparation does; bytes are joined as they are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

from dptrain.config import ConfigError
from dptrain.config.extras import require

__all__ = ["Tokenizer", "ByteTokenizer", "FileTokenizer", "load_tokenizer", "describe_tokenizer"]

_END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer(Protocol):
    vocab_size: int
    separator: int | None  # a token id placed after each document, or None

    def encode_bytes(self, data: bytes, where: str) -> np.ndarray: ...

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    vocab_size = 256
    separator = None

    def encode_bytes(self, data: bytes, where: str) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class FileTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``."""

    def __init__(self, path: Path):
        tokenizers = require("tokenizers", f"data.tokenizer {str(path)!r}")
        if not path.is_file():
            raise ConfigError(f"data.tokenizer {path} does not exist: it must be 'bytes' or the path of a "
                              "tokenizer.json on this machine (nothing is downloaded)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types for a file it cannot parse
            raise ConfigError(f"data.tokenizer {path} does not load as a Hugging Face tokenizer.json "
                              f"({type(e).__name__}: {e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.separator = next((i for i in map(self._tok.token_to_id, _END_OF_TEXT) if i is not None), None)

    def encode_bytes(self, data: bytes, where: str) -> np.ndarray:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where} is not UTF-8 text (byte {e.start:,}: {data[e.start:e.start + 8]!r}); "
                              "a tokenizer.json needs UTF-8 (data.tokenizer = \"bytes\" takes any bytes)") from None
        pieces = _pieces(text)
        return np.concatenate(self.encode_texts(pieces)) if pieces else np.zeros(0, dtype=np.int64)

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def _pieces(text: str, size: int = 1 << 16) -> list[str]:
    """``text`` cut after a newline about every ``size`` characters, so that encode_batch can run the pieces in
    parallel. A newline is a pre-tokenization boundary for byte-level BPE tokenizers (GPT-2's among them), so the
    cuts change no token there."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` or the path of a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if not spec:
        raise ConfigError("data.tokenizer is empty: use \"bytes\" or the path of a tokenizer.json")
    return FileTokenizer(Path(spec))


def describe_tokenizer(spec: str) -> dict:
    """What identifies a tokenizer in a token directory's meta.json: 'bytes', or the file's path and sha256."""
    if spec == "bytes":
        return {"kind": "bytes"}
    path = Path(spec)
    return {"kind": "tokenizer.json", "path": str(path.resolve()),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None}
