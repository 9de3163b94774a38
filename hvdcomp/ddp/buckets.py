"""One DDP bucket's path through the hook: compress its units, start its collectives
(:mod:`hvdcomp.transports.torchdist`), and at the step's last bucket wait, check summed payloads
for saturation (sending a saturated one again, or reporting it overflowed), then decompress every
bucket into its buffer (or hand the whole step to a step-wide method's ``reduce_batch``).

How a bucket travels this step (:attr:`Bucket.kind`): one of
:data:`hvdcomp.transports.torchdist.KINDS`, or ``"plain"``: the bucket as float32, summed and
``× 1/N``, uncompressed (the first backward of granularity ``"bucket"`` on half-precision
gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..plan import step_route_of
from ..transports.torchdist import Exchange, TorchDistTransport
from .layout import BucketLayout

__all__ = ["Bucket", "BucketPath"]


@dataclass
class Bucket:
    """One bucket of the step in progress.

    Attributes:
        index: ``bucket.index()``.
        buffer: the bucket's flat 1-D gradient buffer; the averaged result is written into it.
        layout: its :class:`~hvdcomp.ddp.layout.BucketLayout`.
        future: the ``torch.futures.Future`` returned to DDP.
        kind: how it travels this step (see the module docstring).
        exchange: its collectives in flight (:class:`~hvdcomp.transports.torchdist.Exchange`).
        ctxs, lengths: per unit, its decoding context and its payload's tensor count.
        placed: summable: per payload tensor, ``(dtype, start, numel)`` in the reduced flat of
            its dtype; ``dtypes``: the dtype of each reduced flat.
        reduced: summable, once the collectives are in (:meth:`BucketPath.check_saturation`): per
            unit, its reduced payload (averaged for ``"average"``) to decode with its entry of
            ``ctxs``; None where the method reported the unit overflowed (its view reads NaN).
    """

    index: int
    buffer: torch.Tensor
    layout: BucketLayout
    future: Any
    kind: str
    exchange: Optional[Exchange] = None
    ctxs: List[Any] = field(default_factory=list)
    lengths: List[int] = field(default_factory=list)
    placed: List[tuple] = field(default_factory=list)
    dtypes: List[torch.dtype] = field(default_factory=list)
    reduced: List[Optional[List[torch.Tensor]]] = field(default_factory=list)


class BucketPath:
    """Compression, collectives and decompression of the hook's buckets.

    Args:
        compression: the method (its ``encode`` / ``decode_into`` / ``aggregate_into``, or a
            step-wide method's ``reduce_batch``).
        transport: the :class:`~hvdcomp.transports.torchdist.TorchDistTransport` of the group.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / communicate / decompress).
        order: parameter names in the expected backward order (a step-wide method reduces the
            step's gradients in this order, whatever DDP's bucket layout).
    """

    def __init__(self, compression, transport: TorchDistTransport, timer, order: List[str]):
        self.compression, self.transport, self.timer, self.order = compression, transport, timer, order
        self.group = transport.group
        self._step_comm = None

    # ---- during backward -----------------------------------------------------------------------------
    def start(self, entry: Bucket, previous: Optional[Bucket]) -> None:
        """Compress ``entry`` and start its collectives (a step-wide method: nothing before the
        last bucket); start ``previous``'s gather data, its counts being in by now (or soon)."""
        size = self.group.size
        if entry.kind == "gradient":
            with self.timer.phase("communicate"):
                if size > 1:
                    entry.buffer.mul_(1.0 / size)
                entry.exchange = self.transport.allreduce([entry.buffer])
        elif entry.kind in ("average", "sum", "plain"):
            self._start_allreduce(entry)
        elif entry.kind == "gather":
            self._start_gather(entry)
        if previous is not None and previous.kind == "gather" and not previous.exchange.data_started:
            with self.timer.phase("communicate"):
                self.transport.start_gather_data(previous.exchange)

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
        """Summable payloads: one summed all_reduce per payload dtype (``"plain"``: the bucket
        as float32)."""
        with self.timer.phase("compress"):
            payload = [entry.buffer.to(torch.float32)] if entry.kind == "plain" else self._encode(entry)
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for t in payload:
                group = by_dtype.setdefault(t.dtype, [])
                entry.placed.append((t.dtype, sum(x.numel() for x in group), t.numel()))
                group.append(t)
            flats = [ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])
                     for ts in by_dtype.values()]
        with self.timer.phase("communicate"):
            entry.exchange = self.transport.allreduce(flats)
        entry.dtypes = list(by_dtype)

    def _start_gather(self, entry: Bucket) -> None:
        """Variable-size payloads: encode, then start the counts exchange."""
        with self.timer.phase("compress"):
            payload = self._encode(entry)
            base = entry.buffer.untyped_storage().data_ptr()
            # results are written into the buffer while this rank's own payload is read
            payload = [t.clone() if t.numel() and t.untyped_storage().data_ptr() == base else t for t in payload]
        with self.timer.phase("communicate"):
            entry.exchange = self.transport.start_gather(payload)

    # ---- at the last bucket ----------------------------------------------------------------------------
    def wait(self, buckets: List[Bucket]) -> None:
        """Start what is still to start (gather data), then wait for every collective."""
        with self.timer.phase("communicate"):
            for b in buckets:
                if b.kind == "gather":
                    self.transport.start_gather_data(b.exchange)
            for b in buckets:
                if b.exchange is not None:
                    b.exchange.wait()

    def check_saturation(self, buckets: List[Bucket]) -> List[torch.Tensor]:
        """After :meth:`wait`, before the step's agreement: each summable bucket's reduced payload
        per unit (``× 1/N`` for ``"average"``, as Horovod's ``op=Average``; into
        :attr:`Bucket.reduced`), then, where the method can saturate (fp16's scaled steps, with or
        without error feedback), its check: a saturated payload is never decoded as is.

        The method reads from the reduced payload whether some rank's values left its window
        (``compression.saturation(payload, ctx)``: the same on every rank, since every rank reads
        the same reduced payload) and decides, as under the Horovod front-end
        (:meth:`hvdcomp.transports.allreduce.AllreduceTransport.resend_saturated`): a replacement
        payload is reduced now (a summed ``all_reduce`` per tensor, ``× 1/N`` as the first; bucket
        and unit order, from the hook's thread, so every rank issues the same ones) and decoded
        with the new context instead; no replacement (fp16's ``on_saturation="skip"``): the unit
        is overflowed, its view of the buffer reads NaN.

        Returns:
            The NaN views of overflowed units, for the non-finite guard (the step is then skipped
            on every rank, or raises, by ``nonfinite``); the resends' bytes are added to their
            bucket's :class:`~hvdcomp.transports.torchdist.Exchange`.
        """
        size = self.group.size
        summed = [b for b in buckets if b.kind in ("average", "sum")]
        with self.timer.phase("decompress"):
            for b in summed:
                flats = dict(zip(b.dtypes, b.exchange.outputs))
                if b.kind == "average" and size > 1:
                    for flat in flats.values():
                        flat.mul_(1.0 / size)
                outputs = [flats[dtype][start:start + n] for dtype, start, n in b.placed]
                pos = 0
                for length in b.lengths:
                    b.reduced.append(outputs[pos:pos + length])
                    pos += length
        check = getattr(self.compression, "saturation", None)
        if check is None:
            return []
        overflowed, resends = [], []
        with self.timer.phase("communicate"):
            for b in summed:
                for i, ctx in enumerate(b.ctxs):
                    action = check(b.reduced[i], ctx)
                    if action is None:
                        continue
                    if action.payload is None:
                        b.reduced[i] = None
                        overflowed.append(b.layout.units[i].view(b.buffer))
                        continue
                    ex = self.transport.allreduce(list(action.payload))
                    b.exchange.sent += ex.sent
                    b.exchange.received += ex.received
                    b.ctxs[i] = action.ctx
                    resends.append((b, i, ex))
            for b, i, ex in resends:
                ex.wait()
                if b.kind == "average" and size > 1:
                    for t in ex.outputs:
                        t.mul_(1.0 / size)
                b.reduced[i] = ex.outputs
        for view in overflowed:  # (after every resend: a check may read this rank's gradient)
            view.fill_(float("nan"))
        return overflowed

    def decompress(self, buckets: List[Bucket]) -> None:
        """Write every bucket's averaged result into its buffer (summable buckets: after
        :meth:`check_saturation`; an overflowed unit keeps its NaN)."""
        gathered = {}
        with self.timer.phase("communicate"):
            for b in buckets:
                if b.kind == "gather":
                    gathered[b.index] = self.transport.gathered(b.exchange)
        size = self.group.size
        with self.timer.phase("decompress"):
            for b in buckets:
                if b.kind == "gather":
                    self._aggregate(b, gathered[b.index])
                elif b.kind == "plain":
                    flat = b.exchange.outputs[0]
                    b.buffer.copy_(flat.mul_(1.0 / size) if size > 1 else flat)
                elif b.kind in ("average", "sum"):
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
        layout), over the group's :class:`~hvdcomp.comm.step.StepComm` (made once)."""
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
            if b.exchange is not None:
                self.timer.add_bytes(sent=b.exchange.sent, received=b.exchange.received)
            self.timer.add_bytes(dense=4 * b.layout.numel)
