"""The allgather transport: non-summable payloads (sparse, quantized) gathered in buckets by a
variable-size allgather (:mod:`hvdcomp.comm.allgather`), then aggregated on every rank."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from .units import Units

__all__ = ["AllgatherTransport"]


class AllgatherTransport:
    """Carries ``allgather``-route units: each bucket's payloads go out in one collective as soon
    as the bucket is complete, in the fixed bucket order (identical on every rank).

    Args:
        gatherer: an :class:`hvdcomp.comm.allgather.Allgatherer` (mpi4py or Horovod).
        timer: the optimizer's :class:`hvdcomp.metrics.PhaseTimer`.
        compression: the optimizer's :class:`hvdcomp.Compressor` (``aggregate_into``).
        units: the optimizer's :class:`Units`.
        buckets: unit indices per bucket, in launch order.
        prefix: the optimizer's prefix for collective names.
        encode: ``f(u) -> (payload, ctx)``: compress unit ``u`` (for units a flush must send).
        scale: the group size for ``op=Sum``, else 1 (the aggregate is a mean).
    """

    def __init__(self, gatherer, timer, compression, units: Units, buckets: List[List[int]], prefix: str,
                 encode: Callable[[int], tuple], scale: float):
        self.gatherer, self.timer, self.compression, self.units = gatherer, timer, compression, units
        self.buckets, self.prefix, self.encode, self.scale = buckets, prefix, encode, scale
        self.bucket_of: List[int] = [-1] * len(units)  # -1: not on this route
        for b, members in enumerate(buckets):
            for u in members:
                self.bucket_of[u] = b
        self.bucket_dense = [sum(units.dense_bytes[u] for u in b) for b in buckets]
        self.reset()

    @property
    def busy(self) -> bool:
        """Whether payloads are queued or allgathers in flight."""
        return bool(self.encoded or self.handles)

    def reset(self) -> None:
        """Forget the step in progress (its results will not be used)."""
        self.encoded: Dict[int, tuple] = {}  # unit -> (payload, ctx) waiting for or in its bucket
        self.handles: Dict[int, object] = {}  # bucket -> launched allgather
        self.next_bucket = 0
        self.waiting = [len(b) for b in self.buckets]  # units each bucket still waits for

    def queue(self, u: int, payload: Sequence, ctx) -> None:
        """Queue unit ``u``'s payload; start every bucket that is now complete."""
        self.encoded[u] = (payload, ctx)
        self.waiting[self.bucket_of[u]] -= 1
        self.start(flush=False)

    def start(self, flush: bool) -> None:
        """Start the allgather of each complete bucket, in the fixed bucket order; ``flush``
        starts the rest too, compressing the units backward did not reach (unused parameters, or
        fewer backward passes: zeros or the current gradient)."""
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if self.waiting[self.next_bucket] and not flush:
                return
            for u in bucket:
                if u not in self.encoded:
                    with self.timer.phase("compress"):
                        self.encoded[u] = self.encode(u)
            tensors = [t for u in bucket for t in self.encoded[u][0]]
            with self.timer.phase("communicate"):
                handle = self.gatherer.start(tensors, f"{self.prefix}.bucket{self.next_bucket}")
            self.handles[self.next_bucket] = handle
            self.next_bucket += 1

    def finish(self) -> None:
        """Wait for every bucket (started with :meth:`start`), aggregate each unit's gathered
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
            start = 0
            for u in bucket:
                payload, ctx = self.encoded.pop(u)
                stop = start + len(payload)
                target = self.units.target(u)
                self.compression.aggregate_into(target, [rank_tensors[start:stop] for rank_tensors in gathered], ctx)
                if self.scale != 1.0:
                    target.mul_(self.scale)
                self.units.write_back(u)
                start = stop
        self.timer.add_bytes(sent=handle.bytes_sent, received=handle.bytes_received, dense=self.bucket_dense[index])
        self.waiting[index] = len(bucket)
