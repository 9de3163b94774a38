"""The DDP hook's bucket exchange, a :class:`~hvdcomp.transports.base.Transport` whose units are
the DDP buckets of the step, carried by the transport of the route the Reducer's plan gives the
method (:func:`hvdcomp.plan.route_of`): a bucket's compression units (:mod:`hvdcomp.ddp.layout`)
become :class:`BucketUnits` (views of its buffer), and the bucket a bucket of that transport
(``add_bucket``). A step-wide method (route ``"batched"``) reduces the whole step at the last
bucket (:func:`hvdcomp.transports.stepwide.reduce_step`), after the step's agreement or with it
riding on its first allreduce. A *raw* bucket (``none``; the first backward of granularity
``"bucket"``) travels whole by an allreduce of ``none``, in place with DDP's arithmetic on
float32/float64 buffers (÷N, then summed: bit-identical to DDP without a hook).

Bytes are counted by the transports (docs/architecture.md). Every collective of a step is issued
from the thread that runs DDP's communication hooks, in bucket order, never from future
callbacks (gloo runs those on worker threads in completion order), so every rank issues the same
sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ..assembly import step_comm_of
from ..compressors.base import PayloadKind
from ..compressors.none import NoneCompressor
from ..plan import BATCHED, fuses, in_place, route_of, routes, step_route_of
from ..transports.allreduce import AllreduceTransport
from ..transports.base import Transport, Wiring
from ..transports.stepwide import reduce_step
from .layout import BucketLayout, Unit

__all__ = ["Bucket", "BucketUnits", "BucketTransport", "describe"]

_NONE = NoneCompressor()  # (what a raw bucket travels by)


def describe(compression) -> str:
    """How ``compression``'s payloads travel under the DDP hook (one phrase, for logs and results)."""
    route = route_of(compression)
    if route == BATCHED:
        return f"the method's own collectives ({step_route_of(compression).collective}) once per step"
    if compression.payload_is_gradient:
        return "all_reduce of the bucket (DDP's arithmetic)"
    if route == "allgather":
        return "counts exchange + padded all_gather_into_tensor, aggregated on every rank"
    votes = compression.payload_kind is PayloadKind.SUM
    return "summed all_reduce of the payload" + (" (votes)" if votes else ", then 1/N")


@dataclass
class Bucket:
    """One bucket of the step in progress (a unit of :class:`BucketTransport`).

    Attributes:
        buffer: the bucket's flat 1-D gradient buffer; the averaged result is written into it.
        layout: its :class:`~hvdcomp.ddp.layout.BucketLayout`.
        future: the ``torch.futures.Future`` returned to DDP.
        raw: its gradients travel as they are, by ``none`` (:attr:`in_place` on float32 and
            float64 buffers, else as a float32 copy averaged like a ``MEAN`` payload).
    """

    buffer: torch.Tensor
    layout: BucketLayout
    future: Any
    raw: bool = False

    @property
    def in_place(self) -> bool:
        """Reduced in place with DDP's arithmetic (÷N, then summed): a raw float32/float64 bucket."""
        return self.raw and in_place(_NONE, self.buffer.dtype)


class BucketUnits:
    """The step's buckets as the units of a core transport (the interface of
    :class:`hvdcomp.transports.units.Units` the transports use): unit ``u`` is one compression
    call of a bucket (:class:`hvdcomp.ddp.layout.Unit`), a view of its buffer, compressed and
    written where it lies (no copy, no write-back). Units are added as DDP hands the buckets over."""

    def __init__(self):
        self.views: List[torch.Tensor] = []
        self.names: List[Optional[str]] = []
        self.segments: List[Any] = []
        self.dense_bytes: List[int] = []  # fp32 size of each unit
        self.grad_bytes: List[int] = []  # its size in the bucket's dtype
        self.members: List[List[int]] = []  # (one tensor each: a view)
        self.wire_name: List[str] = []

    def add(self, entry: "Bucket") -> List[int]:
        """Add a bucket's units (compression order; a raw bucket is one unit: it travels whole, as
        DDP reduces it); returns their indices."""
        first, numel = len(self.views), entry.layout.numel
        for unit in [Unit(None, 0, numel, (numel,))] if entry.raw else entry.layout.units:
            self.views.append(unit.view(entry.buffer))
            self.names.append(unit.name)
            self.segments.append(unit.segments)
            self.dense_bytes.append(4 * (unit.stop - unit.start))
            self.grad_bytes.append((unit.stop - unit.start) * entry.buffer.element_size())
            self.members.append([len(self.members)])
            self.wire_name.append(f"hvdcomp.ddp.bucket{entry.layout.index}")
        return list(range(first, len(self.views)))

    def tensor(self, u: int) -> torch.Tensor:
        """Unit ``u``'s view of its bucket's buffer: what it compresses, and where its result goes."""
        return self.views[u]

    target = tensor

    def write_back(self, u: int) -> None:
        """Nothing to copy: results are written into the bucket's buffer, DDP's ``p.grad`` source."""


class BucketTransport(Transport):
    """Carries the DDP buckets of a step: unit ``u`` is :attr:`buckets` ``[u]`` (the hook appends
    each bucket as DDP hands it over, then starts it).

    Args:
        compression: the method.
        group: the :class:`~hvdcomp.comm.torchdist.TorchDistGroup` averaged over.
        timer: a :class:`hvdcomp.metrics.PhaseTimer`.
        order: parameter names in the expected backward order (a step-wide method reduces the
            step's gradients in this order, whatever DDP's bucket layout).
        granularity: ``"tensor"`` or ``"bucket"`` (:mod:`hvdcomp.ddp.layout`).

    Attributes:
        buckets: the :class:`Bucket` s of the step in progress; ``units``: their
            :class:`BucketUnits`.
        route: the plan's route for the method (:func:`hvdcomp.plan.route_of`); ``plan``: one
            line saying how gradients travel, for logs and results.
        fused: several gradients of a bucket compressed in one call (:func:`hvdcomp.plan.fuses`,
            without a draw order: a method drawing at each call compresses one gradient per call
            in the expected backward order, drawing what the Horovod front-end draws).
        deferred: a step-wide method: nothing travels before :meth:`finish`.
        overflowed: after :meth:`finish`, the views of the units the method reported overflowed
            (they read NaN; for the non-finite guard).
    """

    def __init__(self, compression, group, timer, order: List[str], granularity: str = "tensor"):
        self.compression, self.group, self.timer, self.order = compression, group, timer, order
        self.route = route_of(compression)
        self.deferred = self.route == BATCHED
        self._build = None if self.deferred else routes()[self.route].build
        self.fused = fuses(compression, draw_order=False)
        self.plan = (f"torch.distributed {group.backend}: {describe(compression)}; per DDP bucket, "
                     f"granularity {granularity}")
        self.gatherer = group.allgatherer()
        self._step_comm = None
        self.reset()

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self._carriers)

    def reset(self) -> None:
        """A new step: no bucket, and new core transports over its units (theirs are this step's)."""
        self.buckets: List[Bucket] = []
        self.overflowed: List[torch.Tensor] = []
        self.units = BucketUnits()
        wiring = Wiring(self.group, self.timer, self.compression, self.units, "hvdcomp.ddp", gatherer=self.gatherer)
        self.carrier = None if self.deferred else self._build(wiring)
        wiring.compression = _NONE
        self.raw = AllreduceTransport(wiring)  # (the raw buckets)
        self._carriers = [self.raw] + ([self.carrier] if self.carrier is not None else [])

    # ---- during backward -----------------------------------------------------------------------------
    def start(self, u: int) -> None:
        """Start bucket ``u``: its units added to :attr:`units`, compressed and sent as one bucket
        of the core transport (a step-wide method: nothing before the last bucket)."""
        entry = self.buckets[u]
        carrier = self.raw if entry.raw else self.carrier
        if carrier is not None:
            members = self.units.add(entry)
            carrier.add_bucket(members)
            for v in members:
                carrier.start(v)

    # ---- at the last bucket ----------------------------------------------------------------------------
    @property
    def verdict_rides(self) -> bool:
        """The step's verdict rides on the step-wide method's first allreduce (``finish(riding)``)
        instead of an allgather before it (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`)."""
        return self.deferred and self.compression.verdict_rides

    def finish(self, riding=None) -> None:
        """Write every bucket's averaged result into its buffer and count the step's bytes (and
        the dense fp32 equivalent): the core transports finish (wait, reduce a saturated summed
        payload again or read it NaN, listed in :attr:`overflowed`, decode or aggregate each unit
        into its view of the buffer). A step-wide method reduces every gradient of the step at
        once instead (``riding``: ``f(allreduce_mean) -> allreduce_mean`` carrying the step's
        verdict, where it rides)."""
        if self.deferred:
            self._reduce_step(self.buckets, riding)
            self.timer.add_bytes(dense=4 * sum(b.layout.numel for b in self.buckets))
            return
        for carrier in self._carriers:
            if carrier.buckets:
                carrier.finish()
        self.overflowed = [self.units.tensor(u) for c in self._carriers for u in c.overflowed_units()]

    def _reduce_step(self, buckets: List[Bucket], riding=None) -> None:
        """A step-wide method reduces every gradient of the step at once, in the expected
        backward order (so the same as under the Horovod front-end, whatever DDP's bucket
        layout), over the group's :class:`~hvdcomp.comm.stepcomm.StepComm` (made at the first
        such step: point-to-point set-up is collective)."""
        views: Dict[str, torch.Tensor] = {}
        for b in buckets:
            views.update(zip(b.layout.names, b.layout.views(b.buffer)))
        names = [name for name in self.order if name in views]
        if self._step_comm is None:
            self._step_comm = step_comm_of(self.compression, self.group, self.timer, None, "hvdcomp.ddp")
        reduce_step(self.compression, names, [views[n] for n in names], self._step_comm, self.timer, riding=riding)
