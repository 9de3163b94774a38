"""The collectives a batched compressor runs during one step (``reduce_batch``).

Batched compressors (PowerSGD, global top-k, cyclic-leader top-k) reduce every gradient of a
step together at ``synchronize()``. The optimizer hands them a :class:`StepComm`: callable as
``allreduce_mean(tensor, name)`` (what PowerSGD needs), plus a broadcast and, under MPI,
point-to-point messages (:class:`hvdcomp.comm.exchange.PointToPoint`) among the ranks of
the optimizer's process set. Tests pass simulated ones (``tests/simworld.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["StepComm", "horovod_step_comm"]


class StepComm:
    """One step's collectives among the ranks of a group.

    Args:
        allreduce_mean: ``f(tensor, name) -> mean over ranks`` (blocking; one collective).
        broadcast: ``f(tensor, root, name) -> root's tensor`` (blocking; ``root`` is a rank in
            the group), or None where unavailable.
        point_to_point: a :class:`~hvdcomp.comm.exchange.PointToPoint`, or None where
            the ranks cannot message each other directly (Horovod's gloo controller).
        rank, size: this process's rank in the group and the group's size.
    """

    def __init__(self, allreduce_mean: Callable[[torch.Tensor, str], torch.Tensor], rank: int = 0,
                 size: int = 1, broadcast: Optional[Callable] = None, point_to_point=None):
        self._allreduce_mean = allreduce_mean
        self._broadcast = broadcast
        self.point_to_point = point_to_point
        self.rank, self.size = int(rank), int(size)

    def __call__(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The mean of ``tensor`` over the ranks (same shape and dtype)."""
        return self._allreduce_mean(tensor, name)

    allreduce_mean = __call__

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Rank ``root``'s ``tensor`` (same shape and dtype on every rank) on every rank.

        Raises:
            RuntimeError: no broadcast was provided.
        """
        if self._broadcast is None:
            raise RuntimeError("this StepComm has no broadcast")
        return self._broadcast(tensor, root, name)


def horovod_step_comm(group, timer, prefix: str, point_to_point=None) -> StepComm:
    """The :class:`StepComm` of a Horovod process set: blocking Horovod allreduce (mean) and
    broadcast within ``group``, each timed as ``communicate`` on ``timer`` and counted there
    (bytes of the tensor sent and received; a broadcast counts as sent on its root only).

    Args:
        group: a :class:`hvdcomp.comm.group.Group`.
        timer: a :class:`hvdcomp.metrics.PhaseTimer`.
        prefix: the caller's collective-name prefix (unique per caller, the same on every rank);
            the collectives are named ``prefix.name``.
        point_to_point: a :class:`~hvdcomp.comm.exchange.PointToPoint` among the group's ranks
            (e.g. :class:`~hvdcomp.comm.exchange.MPIExchange`), or None.
    """
    hvd = group.hvd

    def allreduce_mean(tensor, name):
        with timer.phase("communicate"):
            out = group.allreduce(tensor, f"{prefix}.{name}", hvd.Average)
        nbytes = tensor.numel() * tensor.element_size()
        timer.add_bytes(sent=nbytes, received=nbytes)
        return out

    def broadcast(tensor, root, name):
        with timer.phase("communicate"):
            out = group.broadcast(tensor, root, f"{prefix}.{name}")
        nbytes = tensor.numel() * tensor.element_size()
        timer.add_bytes(sent=nbytes if group.rank == root else 0, received=nbytes)
        return out

    return StepComm(allreduce_mean, group.rank, group.size, broadcast, point_to_point)
