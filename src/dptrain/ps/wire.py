"""Messages between a worker and a server: a fixed header, then an optional payload.

Every (worker, server) pair talks over a process group of its own, made of those two
ranks. A gloo context whose peer dies fails every later operation on it ("Connection
closed by peer"), so with one shared group a dead worker would take the links between
the living ones down too; with a group per pair it takes down only its own links, and
its server learns of the death at once instead of at a timeout. Within a pair, worker
to server messages use one tag and server to worker messages another, so a server can
receive on its thread for that worker while it answers on its main thread.

A message is ``header = int64[kind, a, b, n, x, cut, saved]`` and, when ``n > 0``, a payload
of ``n`` elements: fp32 for tensors, uint8 for bytes (an error message, the server's report,
a worker's packed state). ``x`` carries one float64 (its bits): a gradient's training loss,
or the sum of the losses of the gradients the last step applied (see :class:`Kind`).
``cut`` and ``saved`` carry the checkpoint protocol's labels (:mod:`dptrain.ps.snapshot`).
"""

from __future__ import annotations

import enum
import io
import json
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Kind", "Message", "Link", "Outbox", "UP", "DOWN", "PSError", "pair_groups", "describe_failure", "pack",
           "unpack"]

UP, DOWN = 1, 2  # tags: worker -> server, server -> worker


class PSError(RuntimeError):
    """A parameter-server job cannot go on: a peer died, timed out, or aborted the run."""


class Kind(enum.IntEnum):
    GRAD = 1     # worker -> server: a = the worker's clock (gradients pushed, this one included), b = 1 to skip,
    #              x = the loss the gradient was computed from
    DONE = 2     # worker -> server: the worker leaves (after a STOP, or at its end)
    PARAMS = 3   # server -> worker: a = version, payload = the shard's parameters, b and x = how many gradients
    #              the last step applied and the sum of their losses (the run's logged loss is their mean);
    #              cut = the newest checkpoint cut begun (the first server's marker), saved = the newest complete
    STOP = 4     # server -> worker: PARAMS, and the training budget is spent
    FINAL = 5    # server -> rank 0: the final shard, after every worker left; saved as in PARAMS
    REPORT = 6   # server -> rank 0: its statistics as JSON text
    ABORT = 7    # either way: the run cannot go on; payload = the reason
    MARK = 8     # worker -> server: a = the worker's clock, cut = the newest cut it marks (every one up to it),
    #              payload = its packed state (random streams, buffers; dptrain.ps.snapshot)


BYTE_KINDS = (Kind.REPORT, Kind.ABORT, Kind.MARK)


@dataclass
class Message:
    kind: Kind
    a: int = 0
    b: int = 0
    payload: torch.Tensor | None = None
    x: float = 0.0
    cut: int = 0
    saved: int = 0

    def text(self) -> str:
        return bytes(self.payload.tolist()).decode() if self.payload is not None else ""

    def json(self):
        return json.loads(self.text())


class Link:
    """One end of a (worker, server) pair's channel."""

    def __init__(self, group: dist.ProcessGroup, peer: int, send_tag: int, recv_tag: int):
        self.group, self.peer = group, peer
        self.send_tag, self.recv_tag = send_tag, recv_tag
        self._header = torch.zeros(7, dtype=torch.int64)

    def send(self, kind: Kind, a: int = 0, b: int = 0, payload: torch.Tensor | None = None, x: float = 0.0,
             cut: int = 0, saved: int = 0) -> None:
        n = 0 if payload is None else payload.numel()
        header = torch.tensor([int(kind), a, b, n, _float_bits(x), cut, saved], dtype=torch.int64)
        dist.send(header, self.peer, group=self.group, tag=self.send_tag)
        if n:
            dist.send(payload.contiguous(), self.peer, group=self.group, tag=self.send_tag)

    def send_text(self, kind: Kind, text: str) -> None:
        self.send(kind, payload=_text(text))

    def recv(self, into: torch.Tensor | None = None) -> Message:
        """The next message; a tensor payload goes into ``into`` when given (its size must match)."""
        dist.recv(self._header, self.peer, group=self.group, tag=self.recv_tag)
        kind, a, b, n, bits, cut, saved = self._header.tolist()
        kind = Kind(kind)
        payload = None
        if n:
            if kind in BYTE_KINDS:
                payload = torch.empty(n, dtype=torch.uint8)
            elif into is not None and into.numel() == n:
                payload = into
            else:
                payload = torch.empty(n, dtype=torch.float32)
            dist.recv(payload, self.peer, group=self.group, tag=self.recv_tag)
        return Message(kind, a, b, payload, _bits_float(bits), cut, saved)


def pack(obj) -> torch.Tensor:
    """``obj`` (tensors, numbers, strings, lists and dicts of them) as uint8 bytes, for a message payload."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor):
    """What :func:`pack` packed; ``weights_only``: no code runs from a payload or a checkpoint."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


class Outbox:
    """A link's outgoing messages, sent in order by a thread of their own: posting never waits for the peer.

    A send blocks until the peer receives, and a worker receives from its servers in order.
    So with several servers, one whose event loop blocks answering worker ``w`` while ``w``
    still waits for another server, which waits for the first in a round's all-reduce, never
    gets out: the job hangs (a backup round that two servers see differently did). Posting
    instead copies the payload (the shard changes with the next update) and goes on.
    ``on_failure`` gets the exception of a send that failed; later messages are not sent.
    """

    def __init__(self, link: Link, on_failure: Callable[[Exception], None]):
        self.link, self.on_failure = link, on_failure
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"ps-send-{link.peer}")
        self._thread.start()

    def send(self, kind: Kind, a: int = 0, b: int = 0, payload: torch.Tensor | None = None, x: float = 0.0,
             cut: int = 0, saved: int = 0) -> None:
        self._queue.put((kind, a, b, None if payload is None else payload.clone(), x, cut, saved))

    def send_text(self, kind: Kind, text: str) -> None:
        self._queue.put((kind, 0, 0, _text(text), 0.0, 0, 0))

    def close(self) -> None:
        """Return once every posted message is sent, or a send failed."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self.link.send(*message)
            except Exception as e:
                self.on_failure(e)
                return


def _text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def pair_groups(workers: list[int], servers: list[int],
                timeout: timedelta | None = None) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A two-rank group for every (worker, server) pair; every rank must call this (it is collective).

    ``timeout`` bounds every wait on a link: a group's own, which ``new_group`` otherwise sets to torch's
    default (30 minutes with gloo), not the job's."""
    return {(w, s): dist.new_group([w, s], timeout=timeout) for w in workers for s in servers}


def describe_failure(e: Exception) -> str:
    """What a failed send or receive says about the peer, in words."""
    text = str(e)
    if "Connection closed" in text or "Connection reset" in text:
        return "its process died (connection closed)"
    if "Timed out" in text:
        return f"it sent nothing within the timeout ({text.split('Timed out', 1)[1].strip()[:80]})"
    return f"{type(e).__name__}: {text[:200]}"
