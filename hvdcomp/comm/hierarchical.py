"""Node-aware (hierarchical) variable-size allgather: inside each node the ranks' bytes are
gathered to its leader (its lowest rank), the leaders exchange their nodes' bundles with one
variable-size allgather, and each leader broadcasts the result inside its node. Every rank ends
with exactly what :class:`hvdcomp.comm.allgatherv.MPIAllgatherer` gives (docs/transports.md,
"Node-aware allgather"; Träff, "Relationships between regular and irregular collective
communication operations", 2013).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .allgatherv import COUNT_BYTES, MPIAllgatherer
from .exchange import node_ids

__all__ = ["HierarchicalAllgatherer"]


class HierarchicalAllgatherer(MPIAllgatherer):
    """:class:`~hvdcomp.comm.allgatherv.MPIAllgatherer` whose exchanges go leader to leader
    (see the module docstring); same interface, same results, on the same background thread.

    Args:
        comm: communicator to duplicate (``MPI.COMM_WORLD`` by default).
        nodes: node id of every rank of ``comm`` (default: from ``MPI.Get_processor_name()``,
            ranks on one host sharing one id). Must be the same list on every rank; given
            explicitly to emulate several nodes on one machine (tests, benchmarks).
        threaded: as :class:`MPIAllgatherer`.

    Raises:
        ValueError: ``nodes`` does not have one entry per rank.
    """

    kind = "mpi4py-hierarchical"

    def __init__(self, comm=None, nodes: Optional[Sequence[int]] = None, threaded=None):
        super().__init__(comm=comm, threaded=threaded)
        MPI = self.MPI
        if nodes is None:
            nodes = node_ids(self.comm.allgather(MPI.Get_processor_name()))
        nodes = [int(n) for n in nodes]
        if len(nodes) != self.size:
            raise ValueError(f"nodes must give one node id per rank ({self.size}), got {len(nodes)}")
        self.nodes = nodes
        me = self.comm.Get_rank()
        #: global ranks of each node, ascending; nodes in order of their lowest rank
        self.members: List[List[int]] = []
        for n in dict.fromkeys(nodes):
            self.members.append([r for r in range(self.size) if nodes[r] == n])
        self.my_node = next(i for i, m in enumerate(self.members) if me in m)
        self.node = self.comm.Split(self.my_node, me)          # ranks of my node, by global rank
        self.is_leader = self.node.Get_rank() == 0
        self.leaders = self.comm.Split(0 if self.is_leader else MPI.UNDEFINED, me)

    def _gather_all(self, mine: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
        """Every rank's bytes (``sizes[r]`` from rank r; ``mine`` is this rank's), concatenated in
        rank order, on every rank: gather to the leader, allgather among leaders, broadcast."""
        MPI = self.MPI
        node_ranks = self.members[self.my_node]
        node_sizes = [int(sizes[r]) for r in node_ranks]
        bundle = np.empty(sum(node_sizes), dtype=np.uint8) if self.is_leader else None
        offsets = np.concatenate([[0], np.cumsum(node_sizes)[:-1]]).astype(np.int64).tolist()
        recv = [bundle, node_sizes, offsets, MPI.BYTE] if self.is_leader else None
        self._wait(self.node.Igatherv(mine, recv, root=0))
        total = int(sum(int(s) for s in sizes))
        out = np.empty(total, dtype=np.uint8)
        if self.is_leader:
            bundle_sizes = [sum(int(sizes[r]) for r in m) for m in self.members]
            every = np.empty(total, dtype=np.uint8)
            boff = np.concatenate([[0], np.cumsum(bundle_sizes)[:-1]]).astype(np.int64).tolist()
            self._wait(self.leaders.Iallgatherv(bundle, [every, bundle_sizes, boff, MPI.BYTE]))
            # bundles are node by node; put each rank's bytes at its place in rank order
            starts = np.concatenate([[0], np.cumsum([int(s) for s in sizes])[:-1]]).astype(np.int64)
            pos = 0
            for m in self.members:
                for r in m:
                    n = int(sizes[r])
                    out[starts[r]:starts[r] + n] = every[pos:pos + n]
                    pos += n
        if self.node.Get_size() > 1:
            self._wait(self.node.Ibcast(out, root=0))
        return out

    def _gather_counts(self, counts):
        header = self._gather_all(counts.view(np.uint8), [counts.size * COUNT_BYTES] * self.size)
        return header.view(np.int64).reshape(self.size, counts.size).copy()

    def _gather_bytes(self, h, byte_counts):
        if sum(byte_counts) > self.max_count:  # past a C int: the flat path's rounds
            return super()._gather_bytes(h, byte_counts)
        recv = self._gather_all(h.send, byte_counts)
        if self.is_leader:  # instead of its own payload: its node's bundle, to the other leaders,
            # and (a node of several ranks) the whole result, to its node's ranks
            node_bytes = sum(byte_counts[r] for r in self.members[self.my_node])
            h.bytes_sent += node_bytes - h.send.nbytes + (recv.nbytes if self.node.Get_size() > 1 else 0)
        return recv

    def probe(self, nbytes):
        """Blocking hierarchical allgather of ``nbytes`` zero bytes per rank (cost-model timing)."""
        self._gather_all(np.zeros(int(nbytes), dtype=np.uint8), [int(nbytes)] * self.size)

