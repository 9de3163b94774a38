"""One DDP bucket's path through the hook: compress its units, start its collectives on the
hook's :class:`~hvdcomp.comm.torchdist.TorchDistGroup` (summed ``all_reduce`` in place, and the
one variable-size allgather of payloads, :class:`~hvdcomp.comm.torchdist.TorchDistAllgatherer`,
which the Horovod facade and the training modes use too), and at the step's last bucket wait,
check summed payloads for saturation (sending a saturated one again, or reporting it overflowed),
then decompress every bucket into its buffer (or hand the whole step to a step-wide method's
``reduce_batch``).

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
None                the method's own step-wide collectives (the group's          PowerSGD, gtopk, ...
                    ``StepComm``) once per step, at the last bucket
==================  ===========================================================  ====================

Bytes are counted as everywhere in hvdcomp: an allreduce of B bytes sends and receives B; a
gather sends this rank's counts and row and receives every rank's, its own included. All
collectives of a step are issued from the thread that runs DDP's communication hooks, in bucket
order, so every rank issues them in the same order (issuing them from future callbacks, which run
on gloo's worker threads in completion order, is what makes collectives mismatch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..compressors.base import PayloadKind
from ..plan import step_route_of
from ..transports.allreduce import resend_saturated
from ..transports.stepwide import StepMethod
from .layout import BucketLayout

__all__ = ["Bucket", "BucketPath", "bucket_kind", "describe", "IN_PLACE_DTYPES"]

#: dtypes a raw bucket is reduced in place as DDP does (half-precision gradients travel in
#: float32, as under the Horovod front-end: their sums could overflow)
IN_PLACE_DTYPES = (torch.float32, torch.float64)


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
    """One bucket of the step in progress.

    Attributes:
        buffer: the bucket's flat 1-D gradient buffer; the averaged result is written into it.
        layout: its :class:`~hvdcomp.ddp.layout.BucketLayout`.
        future: the ``torch.futures.Future`` returned to DDP.
        kind: how it travels this step: a :class:`~hvdcomp.compressors.base.PayloadKind`, or
            None for a step-wide method (see the module docstring).
        raw: its gradients travel as they are, not encoded (:attr:`in_place` on float32 and
            float64 buffers, else as a float32 copy averaged like a ``MEAN`` payload).
        handles: its summed allreduces in flight (the group's handles, in place on ``outputs``).
        outputs: what the allreduces reduce (the payload flats, one per dtype).
        gather: its gather in flight (the allgatherer's handle), or None; ``gathered``: every
            rank's payload once it is in.
        sent, received: bytes of its collectives (resends included).
        ctxs, lengths: per unit, its decoding context and its payload's tensor count.
        placed: summable: per payload tensor, ``(dtype, start, numel)`` in the reduced flat of
            its dtype; ``dtypes``: the dtype of each reduced flat.
        reduced: summable, once the collectives are in (:meth:`BucketPath.check_saturation`): per
            unit, its reduced payload (averaged for ``MEAN``) to decode with its entry of
            ``ctxs``; None where the method reported the unit overflowed (its view reads NaN).
    """

    buffer: torch.Tensor
    layout: BucketLayout
    future: Any
    kind: Optional[PayloadKind]
    raw: bool = False
    handles: List[Any] = field(default_factory=list)
    outputs: List[torch.Tensor] = field(default_factory=list)
    gather: Any = None
    gathered: Optional[List[List[torch.Tensor]]] = None
    sent: int = 0
    received: int = 0
    ctxs: List[Any] = field(default_factory=list)
    lengths: List[int] = field(default_factory=list)
    placed: List[tuple] = field(default_factory=list)
    dtypes: List[torch.dtype] = field(default_factory=list)
    reduced: List[Optional[List[torch.Tensor]]] = field(default_factory=list)

    @property
    def in_place(self) -> bool:
        """Reduced in place with DDP's arithmetic (÷N, then summed): a raw float32/float64 bucket."""
        return self.raw and self.buffer.dtype in IN_PLACE_DTYPES

    @property
    def summed(self) -> bool:
        """Its payload is reduced by a summed ``all_reduce`` and decoded (not in place)."""
        return self.kind in (PayloadKind.MEAN, PayloadKind.SUM) and not self.in_place


class BucketPath:
    """Compression, collectives and decompression of the hook's buckets.

    Args:
        compression: the method (its ``encode`` / ``decode_into`` / ``aggregate_into``, or a
            step-wide method's ``reduce_batch``).
        group: the :class:`~hvdcomp.comm.torchdist.TorchDistGroup` averaged over.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / communicate / decompress).
        order: parameter names in the expected backward order (a step-wide method reduces the
            step's gradients in this order, whatever DDP's bucket layout).
    """

    def __init__(self, compression, group, timer, order: List[str]):
        self.compression, self.group, self.timer, self.order = compression, group, timer, order
        self.gatherer = group.allgatherer()
        self._step_comm = None

    def _allreduce(self, entry: Bucket, tensors: List[torch.Tensor], average: bool = False) -> None:
        """Start a summed (``average``: as DDP, ÷N then summed) in-place allreduce of each
        tensor; counts its bytes on ``entry``."""
        for t in tensors:
            entry.handles.append(self.group.allreduce_async_(t, "", average=average))
            nbytes = t.numel() * t.element_size()
            entry.sent += nbytes
            entry.received += nbytes

    # ---- during backward -----------------------------------------------------------------------------
    def start(self, entry: Bucket) -> None:
        """Compress ``entry`` and start its collectives (a step-wide method: nothing before the
        last bucket; a gather's data starts once its counts are in, at the next gather or the
        last bucket: :class:`~hvdcomp.comm.torchdist.TorchDistAllgatherer`)."""
        if entry.in_place:
            with self.timer.phase("communicate"):
                self._allreduce(entry, [entry.buffer], average=True)
                entry.outputs = [entry.buffer]
        elif entry.summed:
            self._start_allreduce(entry)
        elif entry.kind is PayloadKind.GATHERED:
            self._start_gather(entry)

    def _encode(self, entry: Bucket) -> List[torch.Tensor]:
        """Compress the bucket's units; returns the payload tensors of all units, in order."""
        payload: List[torch.Tensor] = []
        for unit in entry.layout.units:
            p, ctx = self.compression.encode(unit.view(entry.buffer), unit.name, unit.segments)
            entry.ctxs.append(ctx)
            entry.lengths.append(len(p))
            payload += p
        return payload

    def _start_allreduce(self, entry: Bucket) -> None:
        """Summable payloads: one summed all_reduce per payload dtype (raw: the bucket as
        float32)."""
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
            self._allreduce(entry, flats)
        entry.outputs, entry.dtypes = flats, list(by_dtype)

    def _start_gather(self, entry: Bucket) -> None:
        """Variable-size payloads: encode, then start the counts exchange."""
        with self.timer.phase("compress"):
            payload = self._encode(entry)
        with self.timer.phase("communicate"):
            entry.gather = self.gatherer.start(payload)

    # ---- at the last bucket ----------------------------------------------------------------------------
    def wait(self, buckets: List[Bucket]) -> None:
        """Wait for every collective of the step: allreduces, and gathers (their per-rank
        payloads into each bucket's ``gathered``)."""
        with self.timer.phase("communicate"):
            for b in buckets:
                for h in b.handles:
                    self.group.synchronize(h)
                b.handles = []
                if b.gather is not None:
                    b.gathered = self.gatherer.finish(b.gather)
                    b.sent += b.gather.bytes_sent
                    b.received += b.gather.bytes_received
                    b.gather = None

    def check_saturation(self, buckets: List[Bucket]) -> List[torch.Tensor]:
        """After :meth:`wait`, before the step's agreement: each summable bucket's reduced payload
        per unit (``× 1/N`` for ``MEAN``, as Horovod's ``op=Average``; into
        :attr:`Bucket.reduced`), then, where the method can saturate (fp16's scaled steps, with or
        without error feedback), its check: a saturated payload is never decoded as is.

        The method reads from the reduced payload whether some rank's values left its window
        and decides, by the resend every front-end uses
        (:func:`hvdcomp.transports.allreduce.resend_saturated`): a replacement payload is reduced
        now (a summed ``all_reduce`` per tensor, ``× 1/N`` as the first; bucket and unit order,
        from the hook's thread) and decoded with the new context instead; no replacement (fp16's
        ``on_saturation="skip"``): the unit is overflowed, its view of the buffer reads NaN.

        Returns:
            The NaN views of overflowed units, for the non-finite guard (the step is then skipped
            on every rank, or raises, by ``nonfinite``); the resends' bytes are added to their
            bucket.
        """
        size = self.group.size
        summed = [b for b in buckets if b.summed]
        with self.timer.phase("decompress"):
            for b in summed:
                flats = dict(zip(b.dtypes, b.outputs))
                if b.kind is PayloadKind.MEAN and size > 1:
                    for flat in flats.values():
                        flat.mul_(1.0 / size)
                outputs = [flats[dtype][start:start + n] for dtype, start, n in b.placed]
                pos = 0
                for length in b.lengths:
                    b.reduced.append(outputs[pos:pos + length])
                    pos += length
        if getattr(self.compression, "saturation", None) is None:
            return []
        units = [(b, i) for b in summed for i in range(len(b.ctxs))]
        reduced = [(b.reduced[i], b.ctxs[i]) for b, i in units]

        def resend(k: int, payload: List[torch.Tensor]):
            b = units[k][0]
            start = len(b.handles)
            self._allreduce(b, payload)
            handles = b.handles[start:]

            def wait() -> List[torch.Tensor]:
                for h in handles:
                    self.group.synchronize(h)
                if b.kind is PayloadKind.MEAN and size > 1:
                    for t in payload:
                        t.mul_(1.0 / size)
                return payload
            return wait

        with self.timer.phase("communicate"):
            overflowed = resend_saturated(self.compression, reduced, resend)
        for (b, i), (outputs, ctx) in zip(units, reduced):
            b.reduced[i], b.ctxs[i], b.handles = outputs, ctx, []
        views = []
        for b, i in (units[k] for k in overflowed):  # (after every resend: a check may read this rank's gradient)
            b.reduced[i] = None
            views.append(b.layout.units[i].view(b.buffer).fill_(float("nan")))
        return views

    def decompress(self, buckets: List[Bucket]) -> None:
        """Write every bucket's averaged result into its buffer (summable buckets: after
        :meth:`check_saturation`; an overflowed unit keeps its NaN)."""
        with self.timer.phase("decompress"):
            for b in buckets:
                if b.kind is PayloadKind.GATHERED:
                    self._aggregate(b, b.gathered)
                elif b.raw and b.summed:  # (the float32 copy, averaged by check_saturation)
                    b.buffer.copy_(b.outputs[0])
                elif b.summed:
                    for unit, ctx, reduced in zip(b.layout.units, b.ctxs, b.reduced):
                        if reduced is not None:
                            self.compression.decode_into(unit.view(b.buffer), reduced, ctx)

    def _aggregate(self, b: Bucket, per_rank: List[List[torch.Tensor]]) -> None:
        pos = 0
        for unit, ctx, length in zip(b.layout.units, b.ctxs, b.lengths):
            self.compression.aggregate_into(unit.view(b.buffer), [tensors[pos:pos + length] for tensors in per_rank],
                                            ctx)
            pos += length

    def reduce_batched(self, buckets: List[Bucket]) -> None:
        """A step-wide method reduces every gradient of the step at once, in the expected
        backward order (so the same as under the Horovod front-end, whatever DDP's bucket
        layout), over the group's :class:`~hvdcomp.comm.stepcomm.StepComm` (made once)."""
        views: Dict[str, torch.Tensor] = {}
        for b in buckets:
            views.update(zip(b.layout.names, b.layout.views(b.buffer)))
        named = [(name, views[name]) for name in self.order if name in views]
        if self._step_comm is None:
            p2p = self.group.point_to_point() if step_route_of(self.compression).needs_point_to_point else None
            self._step_comm = self.group.step_comm(self.timer, "hvdcomp.ddp", p2p if self.group.size > 1 else None)
        grads = self.compression.reduce_batch(named, self._step_comm, self.timer)
        with self.timer.phase("decompress"):
            for (_, view), g in zip(named, grads):
                if g.data_ptr() != view.data_ptr():
                    view.copy_(g)

    def count_bytes(self, buckets: List[Bucket]) -> None:
        """Charge the step's collectives' bytes (and the dense fp32 equivalent) to the timer."""
        for b in buckets:
            self.timer.add_bytes(sent=b.sent, received=b.received, dense=4 * b.layout.numel)
