"""Network presets for the simulator: links between GPUs in a node and between nodes, with sources.

A :class:`Network` is two :class:`~dptrain.comm.cost.Link` tiers: ``node`` (between the
devices of one host) and ``net`` (between hosts), and the devices per host. Bandwidths
are the nominal per-direction line rates of the hardware (no efficiency factor: NCCL's
own tests typically reach 70-90% of them as bus bandwidth); latencies are the usual
per-message orders of magnitude. ``loopback`` is this project's reference machine as
fitted by ``dptrain bench comm --world-size 2`` (``bench_results/comm_ws2.json``):
TCP over loopback, half duplex (both directions share one CPU's copies).
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.comm.cost import Link

__all__ = ["Network", "PRESETS", "network", "custom_link"]

GB = 1e9


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


@dataclass(frozen=True)
class Network:
    """``node``: the link inside a host; ``net``: between hosts; ``per_node`` devices per host.

    ``shared_net``: a host's devices share one ``net`` link (one NIC per host, as on the
    emulated cluster) rather than having one each (the InfiniBand presets' NIC per GPU).
    ``backend``: the process group's backend (gloo's reduce-scatter costs an all-reduce).
    """

    name: str
    node: Link
    net: Link
    per_node: int
    source: str
    shared_net: bool = False
    backend: str = "nccl"

    def links(self) -> dict[str, Link]:
        return {"node": self.node, "net": self.net}

    def hosts(self, ranks: int) -> int:
        """How many hosts ``ranks`` consecutive ranks span (a host holds ``per_node``)."""
        return -(-ranks // self.per_node)


_NVLINK = "NVIDIA datasheets: NVLink {gen}, {total} GB/s per GPU in both directions together"
PRESETS: dict[str, Network] = {
    "nvlink3+ib-hdr": Network("nvlink3+ib-hdr", Link(3e-6, 300 * GB), Link(5e-6, _gbit(200)), 8,
                              _NVLINK.format(gen=3, total=600) + " (A100); InfiniBand HDR 200 Gb/s per GPU"),
    "nvlink4+ib-ndr": Network("nvlink4+ib-ndr", Link(3e-6, 450 * GB), Link(5e-6, _gbit(400)), 8,
                              _NVLINK.format(gen=4, total=900) + " (H100 SXM); InfiniBand NDR 400 Gb/s per GPU"),
    "nvlink5+ib-xdr": Network("nvlink5+ib-xdr", Link(3e-6, 900 * GB), Link(5e-6, _gbit(800)), 8,
                              _NVLINK.format(gen=5, total=1800) + " (B200); InfiniBand XDR 800 Gb/s per GPU"),
    "roce-100": Network("roce-100", Link(3e-6, 300 * GB), Link(10e-6, _gbit(100)), 8,
                        "NVLink 3 in the node; RoCE v2 over 100 GbE between nodes"),
    "eth-100": Network("eth-100", Link(3e-6, 300 * GB), Link(50e-6, _gbit(100)), 8,
                       "NVLink 3 in the node; TCP over 100 GbE between nodes"),
    "eth-25": Network("eth-25", Link(3e-6, 300 * GB), Link(50e-6, _gbit(25)), 8,
                      "NVLink 3 in the node; TCP over 25 GbE between nodes"),
    "eth-10": Network("eth-10", Link(3e-6, 300 * GB), Link(50e-6, _gbit(10)), 8,
                      "NVLink 3 in the node; TCP over 10 GbE between nodes"),
    "loopback": Network("loopback", Link(1.41e-3, 1.12 * GB, 2e-10, duplex=False),
                        Link(1.41e-3, 1.12 * GB, 2e-10, duplex=False), 1 << 30,
                        "this machine's gloo over loopback TCP, fitted by dptrain bench comm --world-size 2 "
                        "(bench_results/comm_ws2.json: alpha 1.41 ms, beta 1.12 GB/s, half duplex)", backend="gloo"),
}


def custom_link(gbit_per_s: float, latency_s: float, duplex: bool = True) -> Link:
    """A link of ``gbit_per_s`` gigabits per second and ``latency_s`` seconds per message."""
    if not gbit_per_s > 0:
        raise ValueError(f"bandwidth must be > 0 Gbit/s, got {gbit_per_s}")
    if not latency_s >= 0:
        raise ValueError(f"latency must be >= 0 s, got {latency_s}")
    return Link(latency_s, _gbit(gbit_per_s), duplex=duplex)


def network(name: str) -> Network:
    """A preset by name, or a ValueError listing them."""
    if name not in PRESETS:
        raise ValueError(f"unknown network preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "(or give a bandwidth and latency)")
    return PRESETS[name]
