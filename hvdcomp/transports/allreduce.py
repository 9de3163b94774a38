"""The allreduce transports: Horovod ``allreduce_async`` of ``MEAN`` and ``SUM`` payloads
(``allreduce`` route), and of densely decoded gathered payloads where the cost model prefers it
(``decoded-allreduce``)."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from ..comm.group import HOROVOD_ALLREDUCE_DTYPES
from ..compressors.base import PayloadKind
from ..plan import IN_PLACE_DTYPES, Route, register_route
from .base import Transport, Wiring

__all__ = ["AllreduceTransport", "DecodedAllreduceTransport", "IN_PLACE_DTYPES"]


class AllreduceTransport(Transport):
    """Carries units whose payloads Horovod's allreduce averages (``MEAN``) or sums (``SUM``).

    A payload that is the gradient itself (``none`` on float32/float64) is reduced in place, as
    stock Horovod does: no copy, no decode. With ``wiring.direct`` (``none`` per gradient) that
    path is taken without a timer entry: queueing the allreduce is charged to compute, as for
    stock Horovod. Other payloads travel as their tensors (bfloat16 as float32:
    Horovod's allreduce has no bfloat16) and are decoded into the unit's target.

    Buckets (:meth:`~hvdcomp.transports.base.Transport.add_bucket`; the DDP hook's, known only during backward): a bucket's units
    are compressed as they start, and once all are, the bucket goes out in bucket order as one
    summed allreduce per payload dtype of its units' payloads laid end to end, in their own dtype
    (bfloat16 included: ``torch.distributed`` sums it), as PyTorch's hooks reduce a bucket; a
    bucket whose one payload is its gradient is reduced in place (DDP's arithmetic: ÷N, then
    summed).

    Args:
        wiring: the optimizer's :class:`~hvdcomp.transports.base.Wiring` (group, timer, method,
            units, ``op`` and ``gradient_predivide_factor``).
    """

    def __init__(self, wiring: Wiring):
        w = wiring
        self.group, self.timer, self.compression, self.units = w.group, w.timer, w.compression, w.units
        self.sum_votes = w.compression.payload_kind is PayloadKind.SUM
        if w.op_sum or self.sum_votes:
            self.reduce_args = (False, 1.0, 1.0)  # (average, prescale, postscale)
        else:  # op and gradient_predivide_factor as Horovod applies them
            self.reduce_args = (True, 1.0 / w.predivide, w.predivide)
        self.rescale_votes = self.sum_votes and w.op_sum
        self.scale = w.scale
        self.direct = w.direct
        if self.direct:  # (none per gradient: per unit, its one parameter, or None; its tensor's name)
            self.alone = [w.units.order[m[0]] if len(m) == 1 else None for m in w.units.members]
            self.wire_in_place = [name + ".0" for name in w.units.wire_name]
        # a group that matches collectives by issue order (torch.distributed): launch in unit order
        self.sequence = sorted(w.units_of_route.get(self.route, [])) if w.group.ordered and w.group.size > 1 else None
        self._bucketed([])
        self.reset()

    route = "allreduce"

    @property
    def busy(self) -> bool:
        return bool(self.inflight or self.pending or self.encoded)

    def reset(self) -> None:
        self.inflight: Dict[int, tuple] = {}  # unit -> (kind, handles, ctx, bytes sent, payload dtypes)
        self.pending: Dict[int, Callable[[], tuple]] = {}  # ordered group: compressed, launched in unit order
        self.next = 0
        self.overflowed: List[int] = []  # units of the last finish() reported overflowed (NaN)
        self.encoded: Dict[int, tuple] = {}  # a bucket's unit -> (payload, ctx), until the bucket goes out
        self._rewind()

    def _issue(self, u: int, launch: Callable[[], tuple]) -> None:
        """Launch unit ``u``'s collectives now (``launch()`` returns its in-flight record), or, on
        a group that matches collectives by issue order, once every unit before it in unit order
        has launched (the same order on every rank, whatever order backward completes them in)."""
        if self.sequence is None:
            self.inflight[u] = launch()
            return
        self.pending[u] = launch
        while self.next < len(self.sequence) and self.sequence[self.next] in self.pending:
            v = self.sequence[self.next]
            self.inflight[v] = self.pending.pop(v)()
            self.next += 1

    def overflowed_units(self) -> List[int]:
        return self.overflowed

    def in_place_units(self) -> List[int]:
        """Units reduced in place this step (their inputs are gone once reduced)."""
        return [u for u, work in self.inflight.items() if work[0] == "in-place"]

    def start(self, u: int) -> None:
        """Compress unit ``u`` (timed as ``compress``, queueing the allreduce included) and start
        its allreduce (in place where the payload is the gradient itself)."""
        p = self.alone[u] if self.direct else None
        if p is not None:
            grad = p.grad
            if grad is None or grad.is_sparse:
                grad = self.units.gradient(p)
            if grad.dtype in IN_PLACE_DTYPES and grad.is_contiguous():  # (none sends half-precision
                # gradients as float32: their sums would overflow in fp16)
                launch = lambda: ("in-place", [self.group.allreduce_async_(  # noqa: E731
                    grad, self.wire_in_place[u], *self.reduce_args)], None, self.units.grad_bytes[u], None)
                if self.sequence is None:  # (launched now: _issue's test spared, once per gradient)
                    self.inflight[u] = launch()
                else:
                    self._issue(u, launch)
                return
        with self.timer.phase("compress"):
            payload, ctx = self.compression.encode(self.units.tensor(u), self.units.names[u], self.units.segments[u])
            if not self.buckets:  # (the Horovod front-end's units: one by one)
                self._issue(u, lambda: self._launch(u, payload, ctx))
                return
            self.encoded[u] = (payload, ctx)
            for b in self._ready(u):
                self._launch_bucket(self.buckets[b])

    def _launch_bucket(self, bucket: List[int]) -> None:
        """Start a complete bucket's allreduces (see the class docstring); its units' in-flight
        records share them."""
        encoded = [self.encoded.pop(u) for u in bucket]
        if len(bucket) == 1 and self._in_place(bucket[0], encoded[0][0]):
            self.inflight[bucket[0]] = self._launch(bucket[0], *encoded[0])
            return
        average, pre, post = self.reduce_args
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        placed = []  # per unit, per payload tensor: (dtype, start, numel) in its dtype's flat
        for payload, _ in encoded:
            placed.append([])
            for t in payload:
                flat = by_dtype.setdefault(t.dtype, [])
                placed[-1].append((t.dtype, sum(x.numel() for x in flat), t.numel()))
                flat.append(t.reshape(-1))
        flats = {dt: ts[0] if len(ts) == 1 else torch.cat(ts) for dt, ts in by_dtype.items()}
        name = self.units.wire_name[bucket[0]]  # (summed, then scaled: as a payload of Horovod's op=Average)
        reduced = {dt: self.group.allreduce_async_(f, f"{name}.{k}", False, pre, post / self.group.size if average
                                                   else post) for k, (dt, f) in enumerate(flats.items())}
        nbytes = [sum(n * flats[dt].element_size() for dt, _, n in where) for where in placed]
        for u, (payload, ctx), where, sent in zip(bucket, encoded, placed, nbytes):
            self.inflight[u] = ("allreduce", [(reduced[dt], start, n) for dt, start, n in where], ctx, sent,
                                [t.dtype for t in payload])

    def _in_place(self, u: int, payload: Sequence[torch.Tensor]) -> bool:
        """Whether unit ``u``'s payload is its gradient itself, reduced where it lies."""
        target = self.units.target(u)
        return (self.compression.payload_is_gradient and len(payload) == 1
                and payload[0].dtype in HOROVOD_ALLREDUCE_DTYPES and target.is_contiguous()
                and payload[0].data_ptr() == target.data_ptr() and payload[0].numel() == target.numel())

    def _launch(self, u: int, payload: Sequence[torch.Tensor], ctx) -> tuple:
        """Start unit ``u``'s allreduces; returns its in-flight record."""
        average, pre, post = self.reduce_args
        wire_name = self.units.wire_name[u]
        if self._in_place(u, payload):
            handles = [self.group.allreduce_async_(payload[0], wire_name + ".0", average, pre, post)]
            return ("in-place", handles, ctx, self.units.grad_bytes[u], None)
        wire = [t if t.dtype in HOROVOD_ALLREDUCE_DTYPES else t.float() for t in payload]
        handles = [self.group.allreduce_async(t, f"{wire_name}.{k}", average, pre, post) for k, t in enumerate(wire)]
        nbytes = sum(t.numel() * t.element_size() for t in wire)
        return ("allreduce", handles, ctx, nbytes, [t.dtype for t in payload])

    def finish(self) -> None:
        """Wait for every started allreduce (one ``communicate`` slice), then write each averaged
        result into its target (one ``decompress`` slice); counts the bytes."""
        done, nbytes, dense = [], 0, 0
        self.overflowed = []
        if self.pending:  # (every unit is started before finish: a missing one is a bug, not a hang)
            raise AssertionError(f"units {sorted(self.pending)} were compressed but could not be launched in order")
        self.next = 0
        self._rewind()
        with self.timer.phase("communicate"):
            for u in sorted(self.inflight):
                kind, handles, ctx, sent, dtypes = self.inflight.pop(u)
                outputs = [self.group.synchronize(h) if not isinstance(h, tuple)  # (a bucket's slice)
                           else self.group.synchronize(h[0])[h[1]:h[1] + h[2]] for h in handles]
                nbytes += sent
                dense += self.units.dense_bytes[u]
                if kind != "in-place" or len(self.units.members[u]) > 1:  # (a gradient reduced in
                    done.append((u, kind, outputs, ctx, dtypes))         # place is in .grad already)
            nbytes += self.resend_saturated(done)
        with self.timer.phase("decompress"):
            for u, kind, outputs, ctx, dtypes in done:
                if kind == "overflow":  # a saturated payload the method reports as overflowed
                    self.units.target(u).fill_(float("nan"))
                elif kind == "allreduce":
                    target = self.units.target(u)
                    outputs = [o if o.dtype == dt else o.to(dt) for o, dt in zip(outputs, dtypes)]
                    self.compression.decode_into(target, outputs, ctx)
                    if self.rescale_votes:
                        target.mul_(self.scale)
                elif kind == "dense":
                    self.units.target(u).copy_(outputs[0])
                self.units.write_back(u)  # (an in-place result is in its target already)
        self.timer.add_bytes(sent=nbytes, received=nbytes, dense=dense)

    def resend_saturated(self, done: List[tuple]) -> int:
        """The fp16 saturation resend (every front-end's: the DDP hook's buckets travel here too),
        after the step's first allreduce: a method that can saturate reads from each reduced
        payload, identically on every rank, whether some rank's values left its scale's window
        (``compression.saturation(outputs, ctx)``). A replacement payload is allreduced with the
        same op, prescale and postscale (all started, in unit order, before the first is waited
        for) and decoded with its new context; without one (``on_saturation="skip"``) the unit is
        marked ``"overflow"`` (its target reads NaN) and listed in :attr:`overflowed`.

        Args:
            done: ``(unit, kind, reduced outputs, ctx, payload dtypes)`` per finished unit,
                updated in place.

        Returns:
            The bytes this rank sent (and received) in the resends.
        """
        check = getattr(self.compression, "saturation", None)
        if check is None:
            return 0
        average, pre, post = self.reduce_args
        sent, pending = 0, []
        for i, (u, kind, outputs, ctx, dtypes) in enumerate(done):
            action = None if kind != "allreduce" else check(
                [o if o.dtype == dt else o.to(dt) for o, dt in zip(outputs, dtypes)], ctx)
            if action is None:
                continue
            if action.payload is None:
                done[i] = (u, "overflow", None, None, None)
                self.overflowed.append(u)
                continue
            handles = [self.group.allreduce_async(t, f"{self.units.wire_name[u]}.resend.{j}", average, pre, post)
                       for j, t in enumerate(action.payload)]
            sent += sum(t.numel() * t.element_size() for t in action.payload)
            pending.append((i, u, handles, action.ctx))
        for i, u, handles, ctx in pending:
            outputs = [self.group.synchronize(h) for h in handles]
            done[i] = (u, "allreduce", outputs, ctx, [t.dtype for t in outputs])
        return sent


class DecodedAllreduceTransport(AllreduceTransport):
    """Carries ``decoded-allreduce`` units: the payload of a gathered method whose aggregate is the
    mean of its decodes, decoded locally (timed as ``decompress``) and averaged by a dense fp32
    allreduce (``communicate``): the same mean as aggregating the payloads, cheaper where the
    payload is not much smaller than the gradient."""

    route = "decoded-allreduce"

    def __init__(self, wiring: Wiring):
        super().__init__(wiring)
        self.dense_average = not wiring.op_sum

    def start(self, u: int) -> None:
        with self.timer.phase("compress"):
            payload, ctx = self.compression.encode(self.units.tensor(u), self.units.names[u], self.units.segments[u])
        target = self.units.target(u)
        with self.timer.phase("decompress"):
            dense = self.compression.decode_into(
                torch.empty(target.shape, dtype=torch.float32, device=target.device), payload, ctx)
        with self.timer.phase("communicate"):
            self._issue(u, lambda: ("dense", [self.group.allreduce_async(dense, self.units.wire_name[u] + ".dense",
                                                                         self.dense_average)], ctx, dense.numel() * 4, None))


def _fused_allreduce(payload_bytes, dense_bytes, bucket_bytes):
    """One fused allreduce of every payload (Horovod fuses them: one call)."""
    return [("allreduce", float(sum(payload_bytes)), 1)] if payload_bytes else []


def _dense_allreduce(payload_bytes, dense_bytes, bucket_bytes):
    """One fused allreduce of the fp32 decodes."""
    return [("allreduce", float(sum(dense_bytes)), 1)] if dense_bytes else []


register_route(Route("allreduce", carries=lambda m: m.payload_kind in (PayloadKind.MEAN, PayloadKind.SUM),
                     collectives=_fused_allreduce, build=AllreduceTransport))
register_route(Route("decoded-allreduce", preferred=False, collectives=_dense_allreduce,
                     carries=lambda m: m.payload_kind is PayloadKind.GATHERED and m.aggregate_is_mean,
                     take_if=lambda cost, payload, dense, p: cost.choose(payload, dense, p) == "allreduce",
                     build=DecodedAllreduceTransport))
