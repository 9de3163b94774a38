"""The DDP hook's bucket exchange, a :class:`~hvdcomp.transports.base.Transport` over the hook's
:class:`~hvdcomp.comm.torchdist.TorchDistGroup`: its units are the DDP buckets of the step in
progress. :meth:`BucketTransport.start` compresses a bucket and starts its collectives (a summed
``all_reduce`` in place, or the variable-size allgather every front-end uses,
:class:`~hvdcomp.comm.torchdist.TorchDistAllgatherer`); :meth:`BucketTransport.finish`, at the
step's last bucket, waits, sends a saturated summed payload again by the resend every front-end
uses (:func:`hvdcomp.transports.allreduce.resend_saturated`) and decompresses every bucket into its
buffer, or hands the whole step to a step-wide method's ``reduce_batch``
(:func:`hvdcomp.transports.stepwide.reduce_step`, as the Horovod front-end's
:class:`~hvdcomp.transports.stepwide.StepTransport`).

How a bucket travels this step, read from the method in one place (:func:`bucket_kind`): its
:attr:`Bucket.kind` is the method's :class:`~hvdcomp.compressors.base.PayloadKind`, or None for a
step-wide method, and :attr:`Bucket.raw` says that the bucket's gradients travel as they are:

==================  ===========================================================  ====================
kind                collectives on the group                                     methods
==================  ===========================================================  ====================
``MEAN``, raw       the bucket itself, as DDP's own path: ÷N, then a summed      ``none`` (float32,
                    ``all_reduce`` in place (bit-identical to DDP without a      float64)
                    hook); a half-precision bucket (the first backward of
                    granularity ``"bucket"``) as float32, summed, then ÷N
``MEAN``            summed ``all_reduce`` of the payload (one per dtype), then   fp16, random-k, ...
                    ÷N (Horovod's ``op=Average``); ``decode`` of the mean
``SUM``             summed ``all_reduce``; ``decode`` receives the sum (votes)   signsgd
``GATHERED``        the group's allgatherer (counts, then every rank's payload   top-k, DGC, bf16, ...
                    padded to the largest rank's row); aggregated on every rank
                    (:func:`hvdcomp.transports.allgather.aggregate_gathered`)
None                the method's own step-wide collectives (the group's          PowerSGD, gtopk, ...
                    ``StepComm``) once per step, at the last bucket, after the
                    step's agreement (:attr:`BucketTransport.deferred`), or
                    with it riding on the first allreduce (PowerSGD:
                    :attr:`BucketTransport.verdict_rides`)
==================  ===========================================================  ====================

Bytes are counted as everywhere in hvdcomp (docs/architecture.md). All collectives of a step are
issued from the thread that runs DDP's communication hooks, in bucket order, so every rank issues
them in the same order (issuing them from future callbacks, which run on gloo's worker threads in
completion order, is what makes collectives mismatch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..assembly import step_comm_of
from ..compressors.base import PayloadKind
from ..compressors.segments import needs_draw_order
from ..plan import step_route_of
from ..transports.allgather import aggregate_gathered
from ..transports.allreduce import IN_PLACE_DTYPES, resend_saturated
from ..transports.base import Transport
from ..transports.stepwide import StepMethod, reduce_step
from .layout import BucketLayout

__all__ = ["Bucket", "BucketTransport", "bucket_kind", "describe"]


def bucket_kind(compression) -> Optional[PayloadKind]:
    """How ``compression``'s payloads travel: its :class:`~hvdcomp.compressors.base.PayloadKind`,
    or None for a step-wide method (its own collectives, once per step)."""
    return None if isinstance(compression, StepMethod) else compression.payload_kind


def describe(compression) -> str:
    """How ``compression``'s payloads travel (one phrase, for logs and results files)."""
    kind = bucket_kind(compression)
    if kind is None:
        return f"the method's own collectives ({step_route_of(compression).collective}) once per step"
    if getattr(compression, "payload_is_gradient", False):
        return "all_reduce of the bucket (DDP's arithmetic)"
    return {PayloadKind.MEAN: "summed all_reduce of the payload, then 1/N",
            PayloadKind.SUM: "summed all_reduce of the payload (votes)",
            PayloadKind.GATHERED: "counts exchange + padded all_gather_into_tensor, aggregated on every rank"}[kind]


@dataclass
class Bucket:
    """One bucket of the step in progress (a unit of :class:`BucketTransport`).

    Attributes:
        buffer: the bucket's flat 1-D gradient buffer; the averaged result is written into it.
        layout: its :class:`~hvdcomp.ddp.layout.BucketLayout`.
        future: the ``torch.futures.Future`` returned to DDP.
        kind: how it travels this step: a :class:`~hvdcomp.compressors.base.PayloadKind`, or
            None for a step-wide method (see the module docstring).
        raw: its gradients travel as they are, not encoded (:attr:`in_place` on float32 and
            float64 buffers, else as a float32 copy averaged like a ``MEAN`` payload).
        handles: its summed allreduces in flight (the group's handles, in place on the payload
            flats, one per dtype; ``dtypes``: the dtype of each).
        gather: its gather in flight (the allgatherer's handle), or None.
        ctxs, lengths: per unit, its decoding context and its payload's tensor count.
        placed: summable: per payload tensor, ``(dtype, start, numel)`` in the reduced flat of
            its dtype.
    """

    buffer: torch.Tensor
    layout: BucketLayout
    future: Any
    kind: Optional[PayloadKind]
    raw: bool = False
    handles: List[Any] = field(default_factory=list)
    dtypes: List[torch.dtype] = field(default_factory=list)
    gather: Any = None
    ctxs: List[Any] = field(default_factory=list)
    lengths: List[int] = field(default_factory=list)
    placed: List[tuple] = field(default_factory=list)

    @property
    def in_place(self) -> bool:
        """Reduced in place with DDP's arithmetic (÷N, then summed): a raw float32/float64 bucket."""
        return self.raw and self.buffer.dtype in IN_PLACE_DTYPES

    @property
    def summed(self) -> bool:
        """Its payload is reduced by a summed ``all_reduce`` and decoded (not in place)."""
        return self.kind in (PayloadKind.MEAN, PayloadKind.SUM) and not self.in_place


class BucketTransport(Transport):
    """Carries the DDP buckets of a step: unit ``u`` is :attr:`buckets` ``[u]`` (the hook appends
    each bucket as DDP hands it over, then starts it).

    Args:
        compression: the method (its ``encode`` / ``decode_into`` / ``aggregate_into``, or a
            step-wide method's ``reduce_batch``).
        group: the :class:`~hvdcomp.comm.torchdist.TorchDistGroup` averaged over.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / communicate / decompress, and
            the bytes).
        order: parameter names in the expected backward order (a step-wide method reduces the
            step's gradients in this order, whatever DDP's bucket layout).
        granularity: ``"tensor"`` or ``"bucket"`` (:mod:`hvdcomp.ddp.layout`).

    Attributes:
        buckets: the :class:`Bucket` s of the step in progress.
        kind: the method's payload kind (:func:`bucket_kind`); ``plan``: one line saying how
            gradients travel, for logs and results.
        fused: the method compresses several gradients of a bucket in one call (segmentable, and
            drawing no random numbers at each call: those compress one gradient per call in the
            expected backward order, so they draw what the Horovod front-end draws).
        deferred: a step-wide method: nothing travels before :meth:`finish`, which the hook calls
            after the step's agreement (a skipped step runs no collective), or with the agreement
            riding on its first allreduce (:attr:`verdict_rides`: a skipped step runs that one).
        overflowed: after :meth:`finish`, ``(bucket position, NaN view)`` per unit the method
            reported overflowed (the views are for the non-finite guard).
    """

    def __init__(self, compression, group, timer, order: List[str], granularity: str = "tensor"):
        self.compression, self.group, self.timer, self.order = compression, group, timer, order
        self.kind = bucket_kind(compression)
        self.deferred = self.kind is None
        self.fused = getattr(compression, "segmentable", False) and not needs_draw_order(compression)
        self.plan = (f"torch.distributed {group.backend}: {describe(compression)}; per DDP bucket, "
                     f"granularity {granularity}")
        self.gatherer = group.allgatherer()
        self._step_comm = None
        self.reset()

    @property
    def busy(self) -> bool:
        return any(b.handles or b.gather is not None for b in self.buckets)

    def reset(self) -> None:
        self.buckets: List[Bucket] = []
        self.overflowed: List[tuple] = []
        self.sent = self.received = 0

    def in_place_units(self) -> List[int]:
        return [u for u, b in enumerate(self.buckets) if b.in_place]

    def overflowed_units(self) -> List[int]:
        return sorted({u for u, _ in self.overflowed})

    def _allreduce(self, tensors: List[torch.Tensor], kind, average: bool = False) -> List[Any]:
        """Start a summed in-place allreduce of each tensor (``average``: as DDP, ÷N then summed;
        ``MEAN``: summed, then × 1/N, as Horovod's ``op=Average``); counts its bytes."""
        post = 1.0 / self.group.size if kind is PayloadKind.MEAN and not average and self.group.size > 1 else 1.0
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.sent, self.received = self.sent + nbytes, self.received + nbytes
        return [self.group.allreduce_async_(t, "", average=average, postscale=post) for t in tensors]

    # ---- during backward -----------------------------------------------------------------------------
    def start(self, u: int) -> None:
        """Compress bucket ``u`` and start its collectives (a step-wide method: nothing before the
        last bucket; a gather's data starts once its counts are in, at the next gather or the
        last bucket: :class:`~hvdcomp.comm.torchdist.TorchDistAllgatherer`)."""
        entry = self.buckets[u]
        if entry.in_place:
            with self.timer.phase("communicate"):
                entry.handles = self._allreduce([entry.buffer], entry.kind, average=True)
        elif entry.summed:
            with self.timer.phase("compress"):
                payload = [entry.buffer.to(torch.float32)] if entry.raw else self._encode(entry)
                by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
                for t in payload:
                    group = by_dtype.setdefault(t.dtype, [])
                    entry.placed.append((t.dtype, sum(x.numel() for x in group), t.numel()))
                    group.append(t)
                flats = [ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])
                         for ts in by_dtype.values()]
            with self.timer.phase("communicate"):
                entry.handles, entry.dtypes = self._allreduce(flats, entry.kind), list(by_dtype)
        elif entry.kind is PayloadKind.GATHERED:
            with self.timer.phase("compress"):
                payload = self._encode(entry)
            with self.timer.phase("communicate"):
                entry.gather = self.gatherer.start(payload)

    def _encode(self, entry: Bucket) -> List[torch.Tensor]:
        """Compress the bucket's units; returns the payload tensors of all units, in order."""
        payload: List[torch.Tensor] = []
        for unit in entry.layout.units:
            p, ctx = self.compression.encode(unit.view(entry.buffer), unit.name, unit.segments)
            entry.ctxs.append(ctx)
            entry.lengths.append(len(p))
            payload += p
        return payload

    # ---- at the last bucket ----------------------------------------------------------------------------
    @property
    def verdict_rides(self) -> bool:
        """The step's verdict rides on the step-wide method's first allreduce (``finish(riding)``)
        instead of an allgather before it (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`)."""
        return self.deferred and self.compression.verdict_rides

    def finish(self, riding=None) -> None:
        """Write every bucket's averaged result into its buffer and count the step's bytes (and
        the dense fp32 equivalent): wait for every collective, reduce a saturated summed payload
        again (:meth:`_resend_saturated`; an overflowed unit reads NaN, listed in
        :attr:`overflowed`), decode or aggregate each unit into its view of the buffer. A
        step-wide method reduces every gradient of the step at once instead (``riding``:
        ``f(allreduce_mean) -> allreduce_mean`` carrying the step's verdict, where it rides)."""
        buckets = self.buckets
        if self.deferred:
            self._reduce_step(buckets, riding)
        else:
            gathered, reduced = [], []
            with self.timer.phase("communicate"):
                for b in buckets:
                    reduced.append([self.group.synchronize(h) for h in b.handles])
                    gathered.append(None if b.gather is None else self.gatherer.finish(b.gather))
                    if b.gather is not None:
                        self.sent += b.gather.bytes_sent
                        self.received += b.gather.bytes_received
                    b.handles, b.gather = [], None
            units = self._resend_saturated(buckets, reduced)
            with self.timer.phase("decompress"):
                for b, per_rank, flats in zip(buckets, gathered, reduced):
                    if per_rank is not None:
                        aggregate_gathered(self.compression, per_rank, [
                            (unit.view(b.buffer), ctx, n) for unit, ctx, n in zip(b.layout.units, b.ctxs, b.lengths)])
                    elif b.raw and b.summed:  # (the float32 copy, averaged)
                        b.buffer.copy_(flats[0])
                for b, unit, outputs, ctx in units:
                    if outputs is not None:
                        self.compression.decode_into(unit.view(b.buffer), outputs, ctx)
        self.timer.add_bytes(sent=self.sent, received=self.received, dense=4 * sum(b.layout.numel for b in buckets))

    def _resend_saturated(self, buckets: List[Bucket], reduced: List[List[torch.Tensor]]) -> List[tuple]:
        """Each encoded summable unit's reduced payload (``× 1/N`` for ``MEAN``), after the
        method's saturation check where it can saturate (fp16's scaled steps): a replacement
        payload is reduced now (a summed ``all_reduce`` per tensor, bucket and unit order, from
        the hook's thread) and decoded with its new context instead; no replacement (fp16's
        ``on_saturation="skip"``): the unit is overflowed, its view of the buffer reads NaN (in
        :attr:`overflowed`). Returns ``(bucket, unit, reduced payload or None, ctx)`` per unit."""
        units, entries = [], []
        for u, (b, flats) in enumerate(zip(buckets, reduced)):
            if not b.summed or b.raw:
                continue
            flat = dict(zip(b.dtypes, flats))
            outputs = [flat[dtype][start:start + n] for dtype, start, n in b.placed]
            pos = 0
            for unit, ctx, length in zip(b.layout.units, b.ctxs, b.lengths):
                units.append((u, unit))
                entries.append((outputs[pos:pos + length], ctx))
                pos += length

        def resend(k: int, payload: List[torch.Tensor]):
            handles = self._allreduce(payload, buckets[units[k][0]].kind)
            return lambda: [self.group.synchronize(h) for h in handles]

        with self.timer.phase("communicate"):
            overflowed = set(resend_saturated(self.compression, entries, resend))
        for k in sorted(overflowed):  # (after every resend: a check may read this rank's gradient)
            u, unit = units[k]
            self.overflowed.append((u, unit.view(buckets[u].buffer).fill_(float("nan"))))
        return [(buckets[u], unit, None if k in overflowed else entries[k][0], entries[k][1])
                for k, (u, unit) in enumerate(units)]

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
        comm = self._step_comm
        if riding is not None:
            riding = riding(comm.allreduce_mean)
            comm = comm.replaced(riding)
        reduce_step(self.compression, names, [views[n] for n in names], comm, self.timer)
        if riding is not None:
            riding.settle()
