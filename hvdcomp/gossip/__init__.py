"""Decentralized training with compressed gossip over graph topologies (:mod:`.topology`): each
rank talks only to its neighbours, so its traffic per step stays constant as the job grows.
Methods (one rank's state each): :class:`ChocoGossip`, :class:`DCDGossip`, :class:`ECDGossip`,
:class:`PowerGossip`; :class:`GossipOptimizer` runs them through
:class:`hvdcomp.transports.neighbor.NeighborTransport`. User guide: ``docs/gossip.md``.
"""
from .base import GossipMethod, compressor_kind, gossip_compressor
from .choco import ChocoGossip
from .dcd import DCDGossip, ECDGossip
from .optimizer import METHODS, GossipOptimizer, make_method
from .powergossip import PowerGossip
from .topology import (TOPOLOGIES, Topology, complete, exponential, from_adjacency, from_weights,
                       make_topology, ring, torus)

__all__ = ["GossipOptimizer", "GossipMethod", "ChocoGossip", "DCDGossip", "ECDGossip", "PowerGossip",
           "METHODS", "make_method", "compressor_kind", "gossip_compressor", "Topology",
           "TOPOLOGIES", "ring", "torus", "exponential", "complete", "from_adjacency", "from_weights",
           "make_topology"]
