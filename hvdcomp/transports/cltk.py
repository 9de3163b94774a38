"""``cltk``: leader top-k, a top-k whose values travel by ordinary allreduce, with a cyclic or a
variance-based leader.

Chen et al., "ScaleCom: Scalable Sparsified Gradient Compression for Communication-Efficient
Distributed Training", NeurIPS 2020 (CLT-k: cyclic local top-k); Tyagi and Swany, "Flexible
Communication for Optimal Distributed Learning over Unpredictable Networks", IEEE BigData 2023
(STAR-Topk, the cyclic leader; VAR-Topk, a variance-based one).

Per step the leader selects the k = ceil(ρ·n) positions of largest magnitude of its
error-compensated gradient (the whole model as one vector), broadcasts them, and every rank's
values there are averaged by one allreduce; each rank keeps the rest as residual (plain error
feedback; ScaleCom's low-pass filter is not applied). ``leader="cyclic"``: rank ``t mod p`` at
step t. ``leader="variance"``: the first rank with the largest
``s = Σ_{j=1..m} (1 − α)^j ‖g(t − j + 1)‖ / Σ_{j=1..m} (1 − α)^j`` (α = ``smoothing``, m =
min(``window``, steps so far); ‖g‖: the L2 norm of the rank's own gradient before error feedback,
the statistic of the authors' ``var_topk.py``), gathered by one allreduce of p float32.

Wire per rank and step: a broadcast of k int32 indices and an allreduce of k float32 values,
whatever the number of ranks; VAR-Topk adds the allreduce of p float32.
"""
from __future__ import annotations

import math

import torch

from ..checks import check_choice, check_count, check_range
from ..compressors.registry import register
from ..compressors.selection import exact_topk
from ..compressors.topk import num_kept
from ..plan import StepRoute, register_step_route
from .gtopk import topk_alternative
from .stepwide import SparseStepMethod, StepTransport

__all__ = ["CyclicLeaderTopKCompressor"]

LEADERS = ("cyclic", "variance")


@register("cltk")
class CyclicLeaderTopKCompressor(SparseStepMethod):
    """Leader top-k with error feedback (CLT-k / STAR-Topk, or VAR-Topk); see the module docstring.

    Args:
        density: ρ in (0, 1] of the whole model's entries.
        leader: ``"cyclic"`` (rank ``step % size``) or ``"variance"`` (the rank whose smoothed
            gradient norm is the largest: VAR-Topk; one more allreduce of ``size`` float32 a step).
            The variance leader follows the rank whose gradients carry the most, at that
            allreduce's latency; the cyclic one costs nothing to choose.
        window: ``leader="variance"``: the steps whose norms are averaged (≥ 1; 1: this step's
            norm alone). Longer windows change leader less often.
        smoothing: ``leader="variance"``: α in [0, 1) of the weights (1 − α)^j (0: the plain mean
            of the window).

    State: ``step`` (shared: it picks the cyclic leader), ``residual`` per parameter name and, with
    ``leader="variance"``, the window of this rank's last norms (per rank).

    Raises:
        ValueError: ``density`` not in (0, 1], an unknown ``leader``, ``window < 1``, ``smoothing``
            not in [0, 1).

    Example::

        opt = hvdcomp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression="cltk:density=0.01,leader=variance")
    """

    name = "cltk"
    shared_state_keys = ("step",)

    def __init__(self, density: float = 0.01, leader: str = "cyclic", window: int = 25, smoothing: float = 0.001):
        super().__init__(density)
        self.leader = check_choice(leader, "cltk: leader", LEADERS, " (leader=variance is VAR-Topk)")
        self.window = check_count(window, "cltk: window", 1)
        self.smoothing = check_range(smoothing, "cltk: smoothing", 0.0, 1.0, high_open=True)
        self.counters = {"step": 0}
        self.norms = {"window": ()}

    def describe(self):
        out = super().describe()
        if self.leader != "cyclic":
            out.update(leader=self.leader, window=self.window, smoothing=self.smoothing)
        return out

    @property
    def step(self) -> int:
        """Steps reduced so far (committed); the next cyclic leader is ``step % size``."""
        return self.counters["step"]

    def statistic(self, norms) -> float:
        """The smoothed norm of the module docstring over ``norms`` (oldest first), 0.0 for none."""
        weights = [(1.0 - self.smoothing) ** j for j in range(1, len(norms) + 1)]
        total = sum(weights)
        return sum(w * x for w, x in zip(weights, reversed(norms))) / total if total else 0.0

    def reduce_batch(self, named_grads, comm, timer):
        """As :meth:`FlatStepMethod.reduce_batch`; the leader of this step (the same for every
        device's vector) is chosen first, and the step counter advances once."""
        step = self._get("counters", "step", 0)
        self._put("counters", "step", step + 1)
        if self.leader == "cyclic":
            self._leader = step % comm.size
        else:
            with timer.phase("compress"):
                sq = sum(float(g.detach().float().square().sum()) for _, g in named_grads)
                norms = (tuple(self._get("norms", "window", ())) + (math.sqrt(sq),))[-self.window:]
                self._put("norms", "window", norms)
                device = named_grads[0][1].device if named_grads else torch.device("cpu")
                stats = torch.zeros(comm.size, dtype=torch.float32, device=device)
                stats[comm.rank] = self.statistic(norms)
            if comm.size > 1:
                stats = comm.allreduce_mean(stats, "cltk.leader")
            self._leader = int(torch.argmax(stats))  # (the first rank of the largest)
        return super().reduce_batch(named_grads, comm, timer)

    def reduce_sparse(self, acc, k, comm, timer):
        leader = self._leader
        itype = torch.int32 if acc.numel() < 2**31 else torch.int64
        with timer.phase("compress"):
            idx = (exact_topk(acc, k, magnitudes=False).to(itype) if comm.rank == leader
                   else torch.zeros(k, dtype=itype, device=acc.device))
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

    def rescale_state(self, factor):
        """The residuals and the kept norms are in gradient units (an AMP loss scale changed)."""
        super().rescale_state(factor)
        self.norms = {"window": tuple(x * abs(factor) for x in self.norms["window"])}

    def state_dict(self):
        out = {**super().state_dict(), "step": self.step}
        if self.leader != "cyclic":
            out["norms"] = list(self.norms["window"])
        return out

    def load_state_dict(self, state):
        self.counters = {"step": int(state.get("step", 0))}
        self.norms = {"window": tuple(float(x) for x in state.get("norms", ()))[-self.window:]}
        super().load_state_dict({k: v for k, v in state.items() if k not in ("step", "norms")})


def _collectives(method, numels, p, bucket_bytes):
    """The leader's k int32 positions by broadcast, every rank's k float32 values by allreduce;
    VAR-Topk first allreduces p float32 (every rank's statistic)."""
    k = num_kept(sum(numels), method.density)
    choose = [("allreduce", 4.0 * p, 1)] if method.leader == "variance" else []
    return choose + [("broadcast", 4.0 * k, 1), ("allreduce", 4.0 * k, 1)]


register_step_route(StepRoute(CyclicLeaderTopKCompressor, "broadcast+allreduce", _collectives,
                              alternative=topk_alternative(CyclicLeaderTopKCompressor), build=StepTransport))
