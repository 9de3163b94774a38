"""The one interface of every transport, and what the optimizer wires each one with."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["Transport", "Wiring"]


@dataclass
class Wiring:
    """Everything a transport may need, built once by the optimizer (:mod:`hvdcomp.assembly`);
    each transport's ``build`` function takes what it uses.

    Attributes:
        group: the :class:`hvdcomp.comm.group.Group` the gradients are averaged over.
        timer: the optimizer's :class:`hvdcomp.metrics.PhaseTimer`.
        compression: the optimizer's method.
        units: the optimizer's :class:`hvdcomp.transports.units.Units`.
        prefix: the optimizer's prefix for collective names (unique per optimizer, the same on
            every rank).
        op_sum: ``op=hvd.Sum`` (results are sums over ranks, not means).
        predivide: Horovod's ``gradient_predivide_factor``.
        gatherer: the variable-size allgather (:class:`hvdcomp.comm.allgatherv.Allgatherer`), or
            None where no route needs one.
        buckets: unit indices per bucket of the bucketed route, in launch order.
        names: the parameters' names in launch order (step-wide transports).
        step_comm: the collectives a step-wide method may run
            (:class:`hvdcomp.comm.stepcomm.StepComm`), or None.
        direct: every unit is one gradient whose payload is the gradient itself (``none`` with
            ``granularity="tensor"``): reduced in place as stock Horovod does, charged to compute.
        units_of_route: route name -> the units it carries (a transport on a group that matches
            collectives by issue order launches them in this order).
    """

    group: Any
    timer: Any
    compression: Any
    units: Any
    prefix: str
    op_sum: bool = False
    predivide: float = 1.0
    gatherer: Any = None
    buckets: List[List[int]] = field(default_factory=list)
    names: List[str] = field(default_factory=list)
    step_comm: Optional[Any] = None
    direct: bool = False
    units_of_route: Dict[str, List[int]] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """Factor from the mean a transport computes to what ``op`` asks for (Sum: × size)."""
        return float(self.group.size) if self.op_sum else 1.0


class Transport(abc.ABC):
    """Carries the payloads of the compression units routed to it.

    The optimizer calls :meth:`start` once per unit and step (from backward's hook when the
    unit's gradients are ready, or from ``synchronize()`` for the rest, in the same order on
    every rank), then :meth:`finish`, which writes every averaged result into its unit's target
    (:meth:`hvdcomp.transports.units.Units.target`, then ``p.grad``). Compression happens here:
    the transport asks the method to encode the unit when it starts it.
    """

    @abc.abstractmethod
    def start(self, u: int) -> None:
        """Compress unit ``u`` and start (or queue) its collective."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Wait for the collectives of every started unit and write the results into their
        targets; counts the bytes."""

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """Whether payloads are queued or collectives in flight."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the step in progress (its results will not be used)."""

    def in_place_units(self) -> List[int]:
        """Units whose inputs this step's collectives overwrite in place (none by default)."""
        return []

    def overflowed_units(self) -> List[int]:
        """Units of the last :meth:`finish` whose method reported an overflow (their targets read
        NaN on every rank: the step's agreement skips it); none by default."""
        return []

    # ---- buckets (the allgather transport's; the allreduce transport's under the DDP hook) ------------
    def _bucketed(self, buckets: List[List[int]]) -> None:
        """Start with ``buckets`` (unit indices per bucket, in launch order)."""
        self.buckets, self.waiting, self.next_bucket = [], [], 0
        self.bucket_of: List[int] = []  # per unit, its bucket (-1: none)
        for members in buckets:
            self.add_bucket(members)

    def add_bucket(self, members: List[int]) -> None:
        """Append a bucket of units, sent in one go once all its units are started, after every
        bucket before it (the DDP hook appends each bucket as DDP hands it over: they are known
        only during backward; every rank appends the same buckets in the same order)."""
        for u in members:
            self.bucket_of += [-1] * (u + 1 - len(self.bucket_of))
            self.bucket_of[u] = len(self.buckets)
        self.buckets.append(list(members))
        self.waiting.append(len(members))

    def _ready(self, u: int):
        """Unit ``u`` is compressed: yields the buckets now complete, in bucket order."""
        self.waiting[self.bucket_of[u]] -= 1
        while self.next_bucket < len(self.buckets) and not self.waiting[self.next_bucket]:
            self.next_bucket += 1
            yield self.next_bucket - 1

    def _rewind(self) -> None:
        """Every bucket waits for its units again (a new step)."""
        self.waiting, self.next_bucket = [len(b) for b in self.buckets], 0

    def close(self) -> None:
        """Release what the transport holds beyond a step (threads); no-op by default."""
