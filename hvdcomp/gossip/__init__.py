"""Decentralized training with compressed gossip over MPI graph topologies.

Each rank talks only to its neighbours in a graph (:mod:`.topology`), so its traffic per step stays
constant as the job grows; the messages are compressed. Methods (one rank's state each, no
communication of their own):

* :class:`ChocoGossip` (:mod:`.choco`): Choco-SGD, any contraction compressor (top-k, sign, ...);
* :class:`DCDGossip`, :class:`ECDGossip` (:mod:`.dcd`): DCD-PSGD and ECD-PSGD, unbiased compressors;
* :class:`PowerGossip` (:mod:`.powergossip`): rank-1 power iteration per edge, no tuning.

:class:`GossipOptimizer` (:mod:`.optimizer`) runs them from a Horovod script through
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
