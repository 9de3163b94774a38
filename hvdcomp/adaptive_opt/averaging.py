"""The collectives of a compressed adaptive optimizer after its warm-up: compressed allreduces of
a whole model's worth of tensors (:data:`ONEBIT_SPEC`, one per quantity averaged, each with its
own worker and server residuals; Tang et al. 2021, "1-bit Adam", Algorithm 2), the full-precision
allreduce, the step agreement, and the non-finite verdict on averaged results.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..agreement import averaged_verdict, check_same_start, parameters_digest
from ..spec import get_compressor
from ..step import Lifecycle

__all__ = ["Averaging", "ONEBIT_SPEC"]

#: the compressed allreduce every optimizer of this package uses (1-bit Adam's)
ONEBIT_SPEC = "twophase:base=efsignsgd"


class Averaging:
    """The averages of an :class:`~hvdcomp.adaptive_opt.base.AdaptiveOptimizer` ``owner`` (its
    ``comm``, ``timer``, ``order``, parameter names, ``nonfinite``, ``step_count()`` and
    ``skipped_steps``).

    Tensors passed in are one per parameter of ``owner.order``, in that order, float32 or
    float64, each in its parameter's shape; results have the same shapes and dtypes.
    """

    def __init__(self, owner):
        self.owner = owner
        self.reducers: Dict[str, object] = {}
        self.agreed = False
        self.fresh = True  # no checkpoint loaded since construction: the parameters must agree

    def reducer(self, key: str):
        """The compressed allreduce ``key`` (its own worker and server residuals), made on first use."""
        if key not in self.reducers:
            self.reducers[key] = get_compressor(ONEBIT_SPEC)
            self.reducers[key].bind_group(self.owner.comm.size)
        return self.reducers[key]

    def rejoin(self) -> None:
        """Elastic Horovod, the first step of a new world (on every rank alike): every compressed
        allreduce averages over the new size; worker residuals are kept, and a server residual
        (this rank's chunk of a partition by the old size) is dropped at its first step there
        (:class:`~hvdcomp.transports.twophase.TwoPhaseCompressor`'s ``server_chunk``)."""
        for red in self.reducers.values():
            red.bind_group(self.owner.comm.size)
        self.agreed = False

    def agree_step(self) -> None:
        """Once after construction or loading (:attr:`agreed` reset), in one small collective:
        every rank is at the same step and, at the first step after construction where no rank
        loaded a checkpoint, holds the same parameters (:func:`hvdcomp.agreement.check_same_start`:
        ``hvd.broadcast_parameters`` may run after construction; after a load they may differ,
        0/1 Adam's between synchronisations).

        Raises:
            RuntimeError: on every rank, where ranks are at different steps or start from
                different parameters (naming the ranks and the fix).
        """
        if self.agreed:
            return
        self.agreed = True
        o = self.owner
        comm, step, fresh = o.comm, o.step_count(), self.fresh
        self.fresh = False
        if comm.size == 1:
            return
        digest = parameters_digest({o._names[p]: p for p in o.order}) if fresh else [0] * 32
        every = self.allgather_ints([step, int(not fresh), *digest], "agree.start")
        steps = [row[0] for row in every]
        if len(set(steps)) > 1:
            raise RuntimeError(f"ranks are at different optimizer steps ({steps} by rank): load the checkpoint on "
                               "every rank, or on rank 0 followed by hvd.broadcast_parameters(...) and "
                               "hvd.broadcast_optimizer_state(opt, root_rank=0)")
        if not any(row[1] for row in every):
            check_same_start([row[2:] for row in every], f"{type(o).__name__} training")

    def allgather_ints(self, values: Sequence[int], name: str) -> List[List[int]]:
        """Every rank's ``values`` (non-negative integers below 2^50, the same count on every rank),
        in rank order, by one float64 mean allreduce of a (ranks, count) matrix in which each rank
        fills its own row (exact: the mean times the ranks, rounded)."""
        comm = self.owner.comm
        rows = torch.zeros(comm.size, len(values), dtype=torch.float64)
        rows[comm.rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
        mean = comm.allreduce_mean(rows, name)
        return (mean * comm.size).round().long().tolist()

    def verdict(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether averaged results (identical on every rank, so no collective) go ahead:
        :func:`averaged_verdict`; counts a skipped step on the owner otherwise.

        Raises:
            FloatingPointError: ``nonfinite="raise"`` and a non-finite value.
        """
        if averaged_verdict(tensors, self.owner.nonfinite):
            return True
        self.owner.skipped_steps += 1
        return False

    def compressed(self, key: str, tensors: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """The mean over ranks of ``tensors`` through the compressed allreduce ``key`` (about n/8
        bytes per rank for n elements); None (its residuals unchanged) where it is not finite."""
        o, red = self.owner, self.reducer(key)
        staging = Lifecycle(red, "ignore")
        staging.stage()
        try:
            out = red.reduce_batch([(o._names[p], t) for p, t in zip(o.order, tensors)], o.comm, o.timer)
            ok = self.verdict(out)
        except BaseException:
            staging.rollback()
            raise
        if not ok:
            staging.rollback()
            return None
        staging.commit()
        return out

    def full(self, tensors: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """The mean over ranks of ``tensors`` by one float32 allreduce (4 bytes per element);
        None where it is not finite."""
        comm = self.owner.comm
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        mean = comm.allreduce_mean(flat, "full") if comm.size > 1 else flat
        if not self.verdict([mean]):
            return None
        out, start = [], 0
        for t in tensors:
            out.append(mean[start:start + t.numel()].view(t.shape).to(t.dtype))
            start += t.numel()
        return out
