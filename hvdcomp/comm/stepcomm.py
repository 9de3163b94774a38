"""The collectives a step-wide method (PowerSGD, global top-k, leader top-k, two-phase) runs
during one step's ``reduce_batch``: a :class:`StepComm` among the ranks of the front-end's group
(tests pass simulated ones, ``tests/simworld.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .exchange import moved_bytes

__all__ = ["StepComm", "timed_step_comm"]


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

    def replaced(self, allreduce_mean: Callable[[torch.Tensor, str], torch.Tensor]) -> "StepComm":
        """This step's collectives with another ``allreduce_mean`` (the rest shared)."""
        return StepComm(allreduce_mean, self.rank, self.size, self._broadcast, self.point_to_point)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Rank ``root``'s ``tensor`` (same shape and dtype on every rank) on every rank.

        Raises:
            RuntimeError: no broadcast was provided.
        """
        if self._broadcast is None:
            raise RuntimeError("this StepComm has no broadcast")
        return self._broadcast(tensor, root, name)


def timed_step_comm(allreduce_mean: Callable[[torch.Tensor, str], torch.Tensor],
                    broadcast: Optional[Callable[[torch.Tensor, int, str], torch.Tensor]], rank: int, size: int,
                    timer, point_to_point=None) -> StepComm:
    """A :class:`StepComm` over the given blocking collectives, each charged to ``timer``'s
    ``communicate`` phase and counted by :func:`hvdcomp.comm.exchange.moved_bytes`.

    Args:
        allreduce_mean: ``f(tensor, name) -> mean over ranks`` (one collective, no timing).
        broadcast: ``f(tensor, root, name) -> root's tensor``, or None.
        rank, size: this process's rank in the group and the group's size.
        timer: a :class:`hvdcomp.metrics.PhaseTimer`.
        point_to_point: as for :class:`StepComm` (its own byte counters).
    """

    def mean(tensor: torch.Tensor, name: str) -> torch.Tensor:
        with timer.phase("communicate"):
            out = allreduce_mean(tensor, name)
        timer.add_bytes(*moved_bytes(tensor))
        return out

    def bcast(tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        with timer.phase("communicate"):
            out = broadcast(tensor, root, name)
        timer.add_bytes(*moved_bytes(tensor, rank, root))
        return out

    return StepComm(mean, rank, size, bcast if broadcast is not None else None, point_to_point)
