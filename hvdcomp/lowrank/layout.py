"""Where AB-training's ranks sit: the node of every rank, its rank group (the block of ranks
that averages among itself while grouped, docs/ab-training.md), the factor it trains.
:class:`RankLayout` is pure (lists of integers in, lists out); :func:`node_of_ranks` asks MPI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

__all__ = ["RankLayout", "node_of_ranks"]


def node_of_ranks(comm, ranks_per_node: Optional[int]) -> List[int]:
    """Node index of every rank of ``comm``, an mpi4py communicator or a
    :class:`~hvdcomp.comm.torchdist.TorchDistGroup` (nodes numbered by their lowest rank).
    ``ranks_per_node`` R emulates a layout (ranks ``[i·R, (i+1)·R)`` on node i); None asks MPI's
    shared-memory split (``COMM_TYPE_SHARED``), or gathers the host names of a
    ``torch.distributed`` group; collective over ``comm``.

    Raises:
        ValueError: ``ranks_per_node`` does not divide the communicator's size.
    """
    size = comm.size if hasattr(comm, "ranks") else comm.Get_size()
    if ranks_per_node is not None:
        if size % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {size}")
        return [r // ranks_per_node for r in range(size)]
    if hasattr(comm, "ranks"):  # torch.distributed: ranks of one host name share a node
        import socket

        from ..comm.exchange import node_ids

        return node_ids(comm.allgather_object(socket.gethostname()))
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = local.allreduce(comm.Get_rank(), op=MPI.MIN)
    local.Free()
    leaders = comm.allgather(leader)
    order = sorted(set(leaders))
    return [order.index(x) for x in leaders]


@dataclass(frozen=True)
class RankLayout:
    """The rank groups of one AB-training job, seen from rank ``rank``.

    Args (fields):
        nodes: node index of every rank (length = world size).
        rank_group_of: rank group of every rank.
        trainer_of: ``"A"`` or ``"B"``, the factor each rank trains in the grouped stage.
        rank: this process's rank.
    """

    nodes: List[int]
    rank_group_of: List[int]
    trainer_of: List[str]
    rank: int

    @classmethod
    def build(cls, nodes: Sequence[int], rank: int, rank_groups: Union[int, str], mode: str) -> "RankLayout":
        """Rank groups ``"node"`` (one per node) or G contiguous blocks (ranks ``[g·S/G, (g+1)·S/G)``
        form rank group g); mode ``"only-b"``: every rank trains B, ``"ab"``: the first half of the
        rank groups train A, the second half B.

        Raises:
            ValueError: G does not divide the world size S; mode "ab" with fewer than 2 rank groups.
        """
        size = len(nodes)
        if rank_groups == "node":
            group_of = list(nodes)
        else:
            if size % rank_groups:
                raise ValueError(f"rank_groups={rank_groups} must divide the world size {size}")
            group_of = [r * rank_groups // size for r in range(size)]
        n = len(set(group_of))
        if mode == "ab" and n < 2:
            raise ValueError(f"mode='ab' trains A in half the rank groups and B in the other half, but this job "
                             f"has {n} rank group: give rank_groups >= 2 (or ranks_per_node for 2+ nodes)")
        trainer_of = ["B" if mode == "only-b" or g >= n // 2 else "A" for g in group_of]
        return cls(list(nodes), group_of, trainer_of, rank)

    @classmethod
    def local(cls) -> "RankLayout":
        """A process outside the process set: one rank, one node, one rank group, training B."""
        return cls([0], [0], ["B"], 0)

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def n_rank_groups(self) -> int:
        return len(set(self.rank_group_of))

    @property
    def n_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def rank_group_index(self) -> int:
        """This rank's rank group."""
        return self.rank_group_of[self.rank]

    @property
    def trains(self) -> str:
        """The factor this rank trains in the grouped stage: ``"A"`` or ``"B"``."""
        return self.trainer_of[self.rank]

    def rank_group_members(self) -> List[int]:
        """Ranks of this rank's rank group, ascending."""
        return [r for r in range(self.size) if self.rank_group_of[r] == self.rank_group_index]

    def trainers(self, factor: Optional[str] = None) -> List[int]:
        """Ranks training ``factor`` (this rank's by default), ascending."""
        factor = self.trains if factor is None else factor
        return [r for r in range(self.size) if self.trainer_of[r] == factor]

    def trainer_rank_groups(self) -> int:
        """Number of rank groups training this rank's factor."""
        return len({self.rank_group_of[r] for r in self.trainers()})

    def first_trainer(self) -> Dict[str, int]:
        """Lowest rank training each factor that some rank trains."""
        return {f: min(self.trainers(f)) for f in set(self.trainer_of)}
