"""The allgather transport: ``GATHERED`` payloads (sparse, quantized) gathered in buckets by a
variable-size allgather (:mod:`hvdcomp.comm.allgatherv`), then aggregated on every rank."""
from __future__ import annotations

from typing import Dict

from ..compressors.base import PayloadKind
from ..plan import Route, make_buckets, register_route
from .base import Transport, Wiring

__all__ = ["AllgatherTransport"]


class AllgatherTransport(Transport):
    """Carries ``allgather``-route units: each bucket's payloads go out in one collective as soon
    as the bucket is complete, in the fixed bucket order (identical on every rank).

    Args:
        wiring: the optimizer's :class:`~hvdcomp.transports.base.Wiring`: its ``gatherer`` (an
            :class:`hvdcomp.comm.allgatherv.Allgatherer`: mpi4py, Horovod or torch.distributed),
            ``buckets`` (unit indices per bucket, in launch order; more by
            :meth:`~hvdcomp.transports.base.Transport.add_bucket`), timer, method, units and prefix; with
            ``op_sum`` the aggregate (a mean) is multiplied by the group size.
    """

    def __init__(self, wiring: Wiring):
        w = wiring
        self.gatherer, self.timer, self.compression, self.units = w.gatherer, w.timer, w.compression, w.units
        self.prefix, self.scale = w.prefix, w.scale
        self._bucketed(w.buckets)
        self.reset()

    @property
    def busy(self) -> bool:
        return bool(self.encoded or self.handles)

    def reset(self) -> None:
        self.encoded: Dict[int, tuple] = {}  # unit -> (payload, ctx) waiting for or in its bucket
        self.handles: Dict[int, object] = {}  # bucket -> launched allgather
        self._rewind()

    def start(self, u: int) -> None:
        """Compress unit ``u`` (timed as ``compress``) and queue its payload; start every bucket
        that is now complete, in the fixed bucket order."""
        with self.timer.phase("compress"):
            self.encoded[u] = self.compression.encode(self.units.tensor(u), self.units.names[u],
                                                      self.units.segments[u])
        for b in self._ready(u):
            tensors = [t for v in self.buckets[b] for t in self.encoded[v][0]]
            with self.timer.phase("communicate"):
                self.handles[b] = self.gatherer.start(tensors, f"{self.prefix}.bucket{b}")

    def finish(self) -> None:
        """Wait for every bucket (all started: every unit was), aggregate each unit's gathered
        payloads into its target and count the bytes."""
        for index in range(len(self.buckets)):
            self._finish_bucket(index)
        self._rewind()

    def _finish_bucket(self, index: int) -> None:
        bucket = self.buckets[index]
        handle = self.handles.pop(index)
        with self.timer.phase("communicate"):
            gathered = self.gatherer.finish(handle)
        with self.timer.phase("decompress"):
            start = 0  # (per rank, the bucket's payload tensors: every unit's, back to back)
            for u in bucket:
                payload, ctx = self.encoded.pop(u)
                self.compression.aggregate_into(self.units.target(u), [tensors[start:start + len(payload)]
                                                                       for tensors in gathered], ctx)
                start += len(payload)
                if self.scale != 1.0:
                    self.units.target(u).mul_(self.scale)
                self.units.write_back(u)
        self.timer.add_bytes(sent=handle.bytes_sent, received=handle.bytes_received,
                             dense=sum(self.units.dense_bytes[u] for u in bucket))


def _bucketed_allgather(payload_bytes, dense_bytes, bucket_bytes):
    """One allgather of the payloads plus a counts exchange per bucket of ``bucket_bytes`` dense
    bytes."""
    if not payload_bytes:
        return []
    buckets = make_buckets(list(dense_bytes), bucket_bytes)
    return [("allgather", float(sum(payload_bytes)), 2 * len(buckets))]


register_route(Route("allgather", carries=lambda m: m.payload_kind is PayloadKind.GATHERED,
                     collectives=_bucketed_allgather, bucketed=True, build=AllgatherTransport))
