"""Healing: a worker behind its round's step gets the whole training state from an up-to-date peer.

The state (the runner's: model, optimizer, step counts, learning-rate schedule position,
data position, the strategy's own state through the wrapper protocol) is serialised with
``torch.save`` and sent over the round's process group, point to point: a header (the
payload's length, the payload's SHA-256, and the sender's :func:`state_hash`), then the
payload. The receiver checks the payload's digest, loads it with ``weights_only=True`` (a
peer is trusted, its bytes still never run code), loads it into its engine, and recomputes
:func:`state_hash` on what it now holds: equal to the sender's, or the heal failed. Only
the sender and its receivers take part; the other members go on to the step and meet them
in its first all-reduce. Where the heal follows a meeting's vote (:func:`start_send`), the
sender does not wait for its sends: gloo's threads send them while it takes its next steps.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

__all__ = ["state_hash", "pack", "unpack", "send_state", "start_send", "Sending", "recv_state", "HealError"]

DIGEST = 32
HEADER_TAG, PAYLOAD_TAG = 17, 18
CHUNK = 16 << 20  # bytes per message: each within the group's timeout on any link of a few MB/s or more


class HealError(RuntimeError):
    """The state received does not match what its sender holds (a digest or hash differs)."""


def state_hash(tensors: Iterable[torch.Tensor]) -> bytes:
    """SHA-256 over the bytes of ``tensors`` in order (their dtype and shape included): replicas hold bitwise-equal
    state exactly when their hashes are equal."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def pack(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def unpack(payload: bytes) -> dict:
    return torch.load(io.BytesIO(payload), weights_only=True)


class Sending:
    """A heal's messages under way (:func:`start_send`): the sender goes on while gloo's threads send them."""

    def __init__(self, works: list, pieces: list[torch.Tensor], nbytes: int):
        self.works, self.pieces, self.nbytes = works, pieces, nbytes  # the pieces live until the sends end

    def wait(self, progress: Callable[[], None] = lambda: None) -> int:
        """Wait for every message (raises where one failed: the receiver is gone); the bytes sent."""
        for work in self.works:
            work.wait()
            progress()
        self.works, self.pieces = [], []
        return self.nbytes


def start_send(pg: dist.ProcessGroup, dst: int, payload: bytes, held_hash: bytes) -> Sending:
    """Start sending ``payload`` (and the sender's state hash) to rank ``dst`` of ``pg``: a header (length, digest,
    hash), then :data:`CHUNK` pieces (the group's timeout bounds each message, not the whole state); not waited for."""
    header = torch.zeros(8 + 2 * DIGEST, dtype=torch.uint8)
    header[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    header[8:8 + DIGEST] = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8)
    header[8 + DIGEST:] = torch.frombuffer(bytearray(held_hash), dtype=torch.uint8)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    pieces = [header, *body.split(CHUNK)]
    works = [pg.send([piece], dst, HEADER_TAG if i == 0 else PAYLOAD_TAG) for i, piece in enumerate(pieces)]
    return Sending(works, pieces, header.numel() + body.numel())


def send_state(pg: dist.ProcessGroup, dst: int, payload: bytes, held_hash: bytes,
               progress: Callable[[], None] = lambda: None) -> int:
    """:func:`start_send`, waited for; the bytes sent. ``progress``: called as each message ends."""
    return start_send(pg, dst, payload, held_hash).wait(progress)


def recv_state(pg: dist.ProcessGroup, src: int, progress: Callable[[], None] = lambda: None) -> tuple[bytes, bytes]:
    """The payload and the sender's state hash, from rank ``src`` of ``pg``; HealError on a damaged payload.
    ``progress``: called after the header and after each piece."""
    header = torch.zeros(8 + 2 * DIGEST, dtype=torch.uint8)
    pg.recv([header], src, HEADER_TAG).wait()
    progress()
    length = int(header[:8].view(torch.int64).item())
    body = torch.empty(length, dtype=torch.uint8)
    for piece in body.split(CHUNK):
        pg.recv([piece], src, PAYLOAD_TAG).wait()
        progress()
    payload = body.numpy().tobytes()
    if hashlib.sha256(payload).digest() != bytes(header[8:8 + DIGEST].tolist()):
        raise HealError(f"the state received from rank {src} of the round ({length} bytes) does not match its "
                        "digest")
    return payload, bytes(header[8 + DIGEST:].tolist())
