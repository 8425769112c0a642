"""The job's live store: a ``TCPStore`` that no worker hosts, so that it outlives any of them.

torchft keeps its quorum in a lighthouse beside the replica groups for the same reason: the
default rendezvous store lives in rank 0, and rank 0 may be the worker that dies. The local
launcher serves it (``dptrain run --nproc N`` with ``live.enabled``); on several machines
whoever starts the job serves it (``python -m dptrain.live.store --port P`` on a machine
every worker reaches), and each worker finds it in ``DPTRAIN_LIVE_STORE=HOST:PORT``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from dptrain.utils.collector import freeze_imports
from dptrain.utils.worker_exit import exit_worker

__all__ = ["LIVE_STORE_ENV", "connect_store", "serve_store", "store_address", "unreachable"]

RETRY_S = 0.1
ANSWER_S = 0.05  # how long a connection to a dying store takes to be reset (microseconds, once its RST is seen)

LIVE_STORE_ENV = "DPTRAIN_LIVE_STORE"


def store_address(environ: dict[str, str] | None = None) -> tuple[str, int]:
    """``DPTRAIN_LIVE_STORE`` as (host, port); a ValueError naming the variable and the fix otherwise."""
    value = (os.environ if environ is None else environ).get(LIVE_STORE_ENV, "")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"live.enabled needs the job's live store in {LIVE_STORE_ENV}=HOST:PORT (got {value!r}): "
                         "dptrain run --nproc N serves one itself; on several machines start python -m "
                         "dptrain.live.store --port PORT where every worker reaches it")
    return host, int(port)


def connect_store(address: tuple[str, int], timeout_s: float) -> dist.TCPStore:
    """A client of the live store at ``address`` (each thread that blocks on it takes its own)."""
    host, port = address
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)


def unreachable(address: tuple[str, int], timeout_s: float) -> str:
    """Why the live store at ``address`` cannot be reached within ``timeout_s`` (a TCP connection, retried), or ""
    when it can. ``TCPStore``'s own client retries for its whole timeout, with a traceback at the end: a worker
    asks this first, so that a store that is gone ends it in one line within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=max(RETRY_S, deadline - time.monotonic())) as s:
                _answers(s)
            return ""
        except OSError as e:
            if time.monotonic() >= deadline:
                return e.strerror or type(e).__name__
        time.sleep(RETRY_S)


def _answers(s: socket.socket) -> None:
    """Raise unless the connection ``s`` reached a store that is serving. A process being killed still completes a
    connection in its listening socket's backlog until the kernel closes it (then resets it), and a connect to a free
    local port can meet itself (TCP's simultaneous open); a serving store sends nothing unasked, so a read that times
    out says it is there."""
    if s.getsockname() == s.getpeername():
        raise ConnectionRefusedError(111, "Connection refused")
    s.settimeout(ANSWER_S)
    try:
        data = s.recv(1)
    except TimeoutError:
        return
    raise ConnectionResetError(104, "Connection reset by peer") if not data else OSError(0, "unexpected bytes")


def serve_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """The live store, served by this process on ``host:port`` only (port 0: a free one; ``.port`` tells which).

    ``TCPStore(is_master=True)`` listens on every interface whatever host it is given; handed a
    socket already bound (``master_listen_fd``) it listens there instead.
    """
    listener = socket.socket(socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise ValueError(f"the live store cannot listen on {host}:{port} ({e.strerror}); choose another port") \
            from None
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=listener.detach())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dptrain.live.store",
                                     description="Serve a live-recovery job's store until interrupted.")
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    store = serve_store(args.host, args.port)
    print(f"live store at {args.host}:{store.port}: set {LIVE_STORE_ENV}=<this host>:{store.port} for the workers",
          flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    freeze_imports()  # its exit walks none of torch's objects (dptrain.utils.collector)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    exit_worker(main())  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
