"""``cltk``: cyclic-leader top-k, a top-k whose values travel by ordinary allreduce.

Chen, Ni, Agrawal, Zhang, Cui, Venkataramani, El Maghraoui, Srinivasan and Gopalakrishnan,
"ScaleCom: Scalable Sparsified Gradient Compression for Communication-Efficient Distributed
Training", NeurIPS 2020 (CLT-k: cyclic local top-k).

At step t the leader, rank t mod p, selects the k = ceil(ρ·n) positions of largest magnitude of
its error-compensated gradient (the whole model as one vector); the positions are broadcast;
every rank sends its own values at those positions through one allreduce (average). The result
has the leader's k positions, with the exact mean of every rank's values there; each rank keeps
the rest of its compensated gradient as residual (error feedback), so nothing is lost. ScaleCom's
low-pass filter on the residual is not applied (plain error feedback).

Wire per rank and step: a broadcast of k int32 indices and an allreduce of k float32 values —
the same whatever the number of ranks (a top-k allgather receives (p − 1)·k entries).
"""
from __future__ import annotations

import torch

from ..compressors.registry import register
from ..compressors.selection import exact_topk
from ..compressors.topk import num_kept
from ..plan import StepRoute, register_step_route
from .stepwide import SparseStepMethod, StepTransport

__all__ = ["CyclicLeaderTopKCompressor"]


@register("cltk")
class CyclicLeaderTopKCompressor(SparseStepMethod):
    """Cyclic-leader top-k (ScaleCom's CLT-k) with error feedback; see the module docstring.

    Args:
        density: ρ in (0, 1] of the whole model's entries.

    State: ``step`` (shared: it picks the leader) and ``residual`` per parameter name (per rank).

    Raises:
        ValueError: ``density`` not in (0, 1].
    """

    name = "cltk"
    shared_state_keys = ("step",)

    def __init__(self, density: float = 0.01):
        super().__init__(density)
        self.counters = {"step": 0}

    @property
    def step(self) -> int:
        """Steps reduced so far (committed); the next leader is ``step % size``."""
        return self.counters["step"]

    def reduce_batch(self, named_grads, comm, timer):
        """As :meth:`FlatStepMethod.reduce_batch`; the leader of this step is rank
        ``step % size`` (the same for every device's vector), and the step counter advances once."""
        step = self._get("counters", "step", 0)
        self._put("counters", "step", step + 1)
        self._leader = step % comm.size
        return super().reduce_batch(named_grads, comm, timer)

    def reduce_sparse(self, acc, k, comm, timer):
        leader = self._leader
        with timer.phase("compress"):
            if comm.rank == leader:
                idx = exact_topk(acc, k, magnitudes=False).to(torch.int32 if acc.numel() < 2**31 else torch.int64)
            else:
                idx = torch.zeros(k, dtype=torch.int32 if acc.numel() < 2**31 else torch.int64, device=acc.device)
        if comm.size > 1:
            idx = comm.broadcast(idx, leader, "cltk.indices")
        idx = idx.long()
        with timer.phase("compress"):
            values = acc[idx]
        values = comm.allreduce_mean(values, "cltk.values")
        with timer.phase("decompress"):
            mean = torch.zeros_like(acc)
            mean[idx] = values
        return mean, idx

    def state_dict(self):
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state):
        self.counters = {"step": int(state.get("step", 0))}
        super().load_state_dict({k: v for k, v in state.items() if k != "step"})


def _collectives(method, numels, p, bucket_bytes):
    """The leader's k int32 positions by broadcast, every rank's k float32 values by allreduce."""
    k = num_kept(sum(numels), method.density)
    return [("broadcast", 4.0 * k, 1), ("allreduce", 4.0 * k, 1)]


def _alternative(compression):
    """The leader's top-k at the same density, for top-k with error feedback (``transport="auto"``)."""
    desc = compression.describe()
    if desc.get("name") == "topk" and desc.get("ef", False):
        return CyclicLeaderTopKCompressor(density=desc["density"])
    return None


register_step_route(StepRoute(CyclicLeaderTopKCompressor, "broadcast+allreduce", _collectives,
                              alternative=_alternative, build=StepTransport))
