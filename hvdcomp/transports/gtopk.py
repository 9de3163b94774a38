"""``gtopk``: global top-k sparsification through a sparse allreduce (recursive doubling).

Shi, Wang, Chu, Li and Liu, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", ICDCS 2019.

Each rank's k = ceil(ρ·n) entries of largest magnitude of its error-compensated gradient (the
whole model as one vector) are combined by :func:`hvdcomp.comm.sparse_allreduce.global_topk`
(or, ``hierarchical=true``, :func:`~hvdcomp.comm.sparse_allreduce.hierarchical_topk`); the
result divided by p is the averaged gradient (≤ k non-zeros). A rank keeps as residual every
entry of its own not inside the result, so error feedback loses nothing. Needs point-to-point
messages: MPI (``mpirun`` / ``horovodrun --mpi`` with mpi4py).
"""
from __future__ import annotations

import torch

from ..checks import check_bool
from ..comm.sparse_allreduce import global_topk, hierarchical_topk
from ..compressors.registry import register
from ..compressors.selection import exact_topk
from ..compressors.topk import num_kept
from ..plan import StepRoute, register_step_route
from .stepwide import SparseStepMethod, StepTransport

__all__ = ["GlobalTopKCompressor"]


@register("gtopk")
class GlobalTopKCompressor(SparseStepMethod):
    """Global top-k (gTop-k) with error feedback; see the module docstring.

    Args:
        density: ρ in (0, 1] of the whole model's entries (0.01: "50x" by the seed study's
            convention of 8 bytes per kept entry).
        hierarchical: merge inside each node first; only one rank per node sends between nodes.

    State: ``residual`` per parameter name (per rank).

    Raises:
        ValueError: ``density`` not in (0, 1].
        RuntimeError: from :meth:`reduce_batch`, if the ranks cannot exchange point-to-point
            messages (Horovod started with gloo: no MPI).
    """

    name = "gtopk"

    def __init__(self, density: float = 0.01, hierarchical: bool = False):
        super().__init__(density)
        self.hierarchical = check_bool(hierarchical, "hierarchical")

    def describe(self):
        return {**super().describe(), **({"hierarchical": True} if self.hierarchical else {})}

    def reduce_sparse(self, acc, k, comm, timer):
        p2p = getattr(comm, "point_to_point", None)
        if p2p is None and comm.size > 1:
            raise RuntimeError("gtopk exchanges entries point to point through MPI: launch with mpirun "
                               "or horovodrun --mpi (mpi4py installed); Horovod's gloo controller has "
                               "no point-to-point messages. Or use cltk or topk instead.")
        with timer.phase("compress"):
            idx = exact_topk(acc, k, magnitudes=False)
            if acc.numel() < 2**31:
                idx = idx.to(torch.int32)
            values = acc[idx]
        if comm.size == 1:
            return torch.zeros_like(acc).index_copy_(0, idx.long(), values), idx.long()
        sent0, received0 = getattr(p2p, "bytes_sent", 0), getattr(p2p, "bytes_received", 0)
        with timer.phase("communicate"):
            nodes = getattr(p2p, "nodes", None)
            if self.hierarchical and nodes is not None:
                g_idx, g_val, kept = hierarchical_topk(idx, values, k, p2p, nodes)
            else:
                g_idx, g_val, kept = global_topk(idx, values, k, p2p)
        timer.add_bytes(sent=getattr(p2p, "bytes_sent", 0) - sent0,
                        received=getattr(p2p, "bytes_received", 0) - received0)
        with timer.phase("decompress"):
            mean = torch.zeros_like(acc)
            mean[g_idx.long()] = g_val / comm.size
        return mean, kept.long()


def _collectives(method, numels, p, bucket_bytes):
    """One sparse allreduce of the whole model's k entries of 8 bytes (recursive doubling; the
    hierarchical variant's stages inside a node are counted as between nodes)."""
    return [("sparse-allreduce", 8.0 * num_kept(sum(numels), method.density), 1)]


def topk_alternative(cls):
    """``transport="auto"``'s alternative to top-k with error feedback: ``cls`` at the same density."""
    def alternative(compression):
        desc = compression.describe()
        return cls(density=desc["density"]) if desc.get("name") == "topk" and desc.get("ef", False) else None
    return alternative


register_step_route(StepRoute(GlobalTopKCompressor, "sparse-allreduce", _collectives, needs_point_to_point=True,
                              needs_messages=True, alternative=topk_alternative(GlobalTopKCompressor),
                              build=StepTransport))
