"""The allgather transport: ``GATHERED`` payloads (sparse, quantized) gathered in buckets by a
variable-size allgather (:mod:`hvdcomp.comm.allgatherv`), then aggregated on every rank."""
from __future__ import annotations

from typing import Dict, List

from ..compressors.base import PayloadKind
from ..plan import Route, make_buckets, register_route
from .base import Transport, Wiring

__all__ = ["AllgatherTransport", "aggregate_gathered"]


def aggregate_gathered(compression, gathered, units) -> None:
    """Aggregate one gathered bucket unit by unit (every front-end's allgather ends here).

    Args:
        compression: the method (its ``aggregate_into``).
        gathered: per rank, the bucket's payload tensors (every unit's, back to back).
        units: per unit, in payload order, ``(target, ctx, n)``: where its mean is written, its
            decoding context, and how many payload tensors it has.
    """
    start = 0
    for target, ctx, n in units:
        compression.aggregate_into(target, [rank_tensors[start:start + n] for rank_tensors in gathered], ctx)
        start += n


class AllgatherTransport(Transport):
    """Carries ``allgather``-route units: each bucket's payloads go out in one collective as soon
    as the bucket is complete, in the fixed bucket order (identical on every rank).

    Args:
        wiring: the optimizer's :class:`~hvdcomp.transports.base.Wiring`: its ``gatherer`` (an
            :class:`hvdcomp.comm.allgatherv.Allgatherer`: mpi4py, Horovod or torch.distributed),
            ``buckets`` (unit indices per bucket, in launch order; more by :meth:`add_bucket`), timer, method, units and prefix; with
            ``op_sum`` the aggregate (a mean) is multiplied by the group size.
    """

    def __init__(self, wiring: Wiring):
        w = wiring
        self.gatherer, self.timer, self.compression, self.units = w.gatherer, w.timer, w.compression, w.units
        self.prefix, self.scale = w.prefix, w.scale
        self.buckets: List[List[int]] = []
        self.bucket_of: Dict[int, int] = {}  # unit -> its bucket (units of this route only)
        self.bucket_dense: List[int] = []
        self.waiting: List[int] = []  # per bucket, units it still waits for
        for members in w.buckets:
            self.add_bucket(members)
        self.reset()

    def add_bucket(self, members: List[int]) -> None:
        """Append a bucket of units, launched after every bucket before it (a front-end whose
        buckets are known only during backward, the DDP hook, appends each as it comes, the same
        buckets in the same order on every rank)."""
        for u in members:
            self.bucket_of[u] = len(self.buckets)
        self.buckets.append(list(members))
        self.bucket_dense.append(sum(self.units.dense_bytes[u] for u in members))
        self.waiting.append(len(members))

    @property
    def busy(self) -> bool:
        return bool(self.encoded or self.handles)

    def reset(self) -> None:
        self.encoded: Dict[int, tuple] = {}  # unit -> (payload, ctx) waiting for or in its bucket
        self.handles: Dict[int, object] = {}  # bucket -> launched allgather
        self.next_bucket = 0
        self.waiting = [len(b) for b in self.buckets]

    def start(self, u: int) -> None:
        """Compress unit ``u`` (timed as ``compress``) and queue its payload; start every bucket
        that is now complete, in the fixed bucket order."""
        with self.timer.phase("compress"):
            self.encoded[u] = self.compression.encode(self.units.tensor(u), self.units.names[u],
                                                      self.units.segments[u])
        self.waiting[self.bucket_of[u]] -= 1
        while self.next_bucket < len(self.buckets) and not self.waiting[self.next_bucket]:
            bucket = self.buckets[self.next_bucket]
            tensors = [t for v in bucket for t in self.encoded[v][0]]
            with self.timer.phase("communicate"):
                handle = self.gatherer.start(tensors, f"{self.prefix}.bucket{self.next_bucket}")
            self.handles[self.next_bucket] = handle
            self.next_bucket += 1

    def finish(self) -> None:
        """Wait for every bucket (all started: every unit was), aggregate each unit's gathered
        payloads into its target and count the bytes."""
        for index in range(len(self.buckets)):
            self._finish_bucket(index)
        self.next_bucket = 0

    def _finish_bucket(self, index: int) -> None:
        bucket = self.buckets[index]
        handle = self.handles.pop(index)
        with self.timer.phase("communicate"):
            gathered = self.gatherer.finish(handle)
        with self.timer.phase("decompress"):
            encoded = [self.encoded.pop(u) for u in bucket]
            aggregate_gathered(self.compression, gathered, [(self.units.target(u), ctx, len(payload))
                                                            for u, (payload, ctx) in zip(bucket, encoded)])
            for u in bucket:
                if self.scale != 1.0:
                    self.units.target(u).mul_(self.scale)
                self.units.write_back(u)
        self.timer.add_bytes(sent=handle.bytes_sent, received=handle.bytes_received, dense=self.bucket_dense[index])
        self.waiting[index] = len(bucket)


def _bucketed_allgather(payload_bytes, dense_bytes, bucket_bytes):
    """One allgather of the payloads plus a counts exchange per bucket of ``bucket_bytes`` dense
    bytes."""
    if not payload_bytes:
        return []
    buckets = make_buckets(list(dense_bytes), bucket_bytes)
    return [("allgather", float(sum(payload_bytes)), 2 * len(buckets))]


register_route(Route("allgather", carries=lambda m: m.payload_kind is PayloadKind.GATHERED,
                     collectives=_bucketed_allgather, bucketed=True, build=AllgatherTransport))
