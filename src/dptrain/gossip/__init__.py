"""Gossip (decentralized) SGD, D-PSGD: parameters mixed with neighbours, no global all-reduce (:mod:`~dptrain.gossip.module`)."""

from dptrain.gossip.module import TOPOLOGIES, GossipDataParallel, mixing_peers

__all__ = ["GossipDataParallel", "TOPOLOGIES", "mixing_peers"]
