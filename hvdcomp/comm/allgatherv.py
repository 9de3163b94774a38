"""Variable-size allgather of payloads (lists of 1-D tensors), rank by rank: every rank's
int64 element count per tensor (the header), then every rank's tensors' raw bytes end to end in
one variable-size allgather (no padding), cut by the counts and viewed in their dtypes. Once per
bucket: :class:`MPIAllgatherer` (mpi4py on a duplicate communicator, on a background thread) or
:class:`HorovodAllgatherer` (``hvd.allgather_async``, no MPI); CUDA payloads are staged through
host memory, one copy per call (docs/transports.md, "Buckets" and "The message layers").
"""
from __future__ import annotations

import abc
import logging
import math
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["Allgatherer", "MPIAllgatherer", "HorovodAllgatherer", "poll"]

COUNT_BYTES = 8  # one int64 element count per payload tensor
MAX_COUNT = 2**31 - 1  # MPI counts and displacements are C ints


def poll(done: Callable[[], bool], deadline: float = math.inf) -> bool:
    """Call ``done()`` until it is true, sleeping 0.05 ms growing to 1 ms between calls (so a
    waiting thread leaves the cores to compute), or until ``time.monotonic()`` passes ``deadline``;
    returns whether it is done."""
    pause = 5e-5
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(1e-3, pause * 2)
    return True


def plan_rounds(byte_counts: Sequence[int], limit: int = MAX_COUNT) -> List[List[tuple]]:
    """Split a variable-size allgather whose counts or displacements would overflow an ``int``.

    Args:
        byte_counts: bytes each rank contributes (any size, as Python ints).
        limit: the largest count/displacement one MPI call may use.

    Returns:
        One list per round; each holds, per rank, ``(src_offset, count, dst_offset)``: the round
        gathers ``count`` bytes starting at ``src_offset`` of that rank's buffer into
        ``dst_offset`` of the full receive buffer. Within a round the counts add up to at most
        ``limit`` (so every count and displacement of the round fits), and the rounds together
        cover every byte exactly once. A single round when nothing overflows.
    """
    size = len(byte_counts)
    per_rank = max(1, limit // max(1, size))
    base = [0]
    for c in byte_counts[:-1]:
        base.append(base[-1] + int(c))
    if sum(int(c) for c in byte_counts) <= limit:
        return [[(0, int(c), b) for c, b in zip(byte_counts, base)]]
    rounds = []
    for start in range(0, max(int(c) for c in byte_counts), per_rank):
        rounds.append([(start, max(0, min(per_rank, int(c) - start)), b + start)
                       for c, b in zip(byte_counts, base)])
    return rounds


def _stage(payload: Sequence[torch.Tensor], pinned_async: bool = True):
    """Lay the payload tensors' raw bytes end to end in one host buffer.

    Returns ``(uint8 numpy array, ready)``: for CUDA payloads the buffer is pinned host memory
    filled by one non-blocking device-to-host copy, and ``ready`` is the CUDA event to wait on
    before reading it (so the caller's thread never blocks on the device); otherwise ``None``.
    One copy per call, whatever the number of tensors (a bucket is one call).
    """
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in payload]
    if not parts:
        return np.empty(0, dtype=np.uint8), None
    buf = parts[0] if len(parts) == 1 else torch.cat(parts)
    if buf.device.type != "cuda":
        return buf.numpy(), None
    if not pinned_async:
        return buf.cpu().numpy(), None
    host = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host.numpy(), ready


def _split(buf: torch.Tensor, counts: np.ndarray, dtypes, device) -> List[List[torch.Tensor]]:
    """Cut a gathered uint8 buffer into per-rank payloads using counts[rank, i] elements.

    The buffer moves to ``device`` once (one host-to-device copy per call); pieces are views
    where their offset is aligned for their dtype, copies otherwise.
    """
    buf = buf.to(device)
    out, pos = [], 0
    for r in range(counts.shape[0]):
        payload = []
        for c, dt in zip(counts[r], dtypes):
            nbytes = int(c) * dt.itemsize
            piece = buf[pos:pos + nbytes]
            if nbytes == 0:  # an empty slice may have a stride a dtype view refuses
                payload.append(torch.empty(0, dtype=dt, device=buf.device))
                continue
            if pos % dt.itemsize:  # a dtype view needs an aligned offset
                piece = piece.clone()
            payload.append(piece.view(dt))
            pos += nbytes
        out.append(payload)
    return out


class Allgatherer(abc.ABC):
    """Interface: start a variable-size allgather of one payload, finish it later.

    ``start(payload, name)`` returns a handle; ``finish(handle)`` returns the list (one entry per
    rank, rank order) of payloads. ``bytes_sent`` / ``bytes_received`` of the handle are the exact
    numbers of bytes this rank contributed / obtained, counts exchange included. A payload is
    any list of 1-D tensors, e.g. the concatenated payloads of a bucket of gradients.
    """

    kind = "abstract"

    @abc.abstractmethod
    def start(self, payload: Sequence[torch.Tensor], name: str) -> Any:
        """Start gathering ``payload`` (1-D tensors) from every rank; returns a handle."""

    @abc.abstractmethod
    def finish(self, handle: Any) -> List[List[torch.Tensor]]:
        """Wait for the gather; one payload per rank, in rank order."""

    @abc.abstractmethod
    def probe(self, nbytes: int) -> None:
        """Blocking allgather of ``nbytes`` bytes per rank (for timing, e.g. the cost model)."""

    @abc.abstractmethod
    def agree(self, values: np.ndarray) -> np.ndarray:
        """Rank 0's copy of ``values`` (float64) on every rank."""

    @abc.abstractmethod
    def allgather_ints(self, values: Sequence[int]) -> List[List[int]]:
        """Every rank's ``values`` (a few int64, the same count on every rank; blocking), in
        rank order."""

    def close(self) -> None:
        """Release background resources (idempotent)."""


class _Handle:
    __slots__ = ("request", "recv", "counts", "dtypes", "device", "bytes_sent", "bytes_received",
                 "send", "ready", "future")


class MPIAllgatherer(Allgatherer):
    """mpi4py path: per call, one ``Allgather`` of the per-tensor element counts, then one
    ``Allgatherv`` of the payload bytes, on a duplicate of ``comm``. With ``MPI_THREAD_MULTIPLE``
    the exchange runs on one background thread (:func:`poll`; calls in the same order on every
    rank), else in ``start``; a failure on that thread prints the traceback and aborts the job
    (``MPI_Abort``) rather than leave the other ranks waiting (docs/transports.md, "The message
    layers").

    Args:
        comm: communicator to duplicate (``MPI.COMM_WORLD`` by default; a process set's
            communicator for training inside a sub-group).
        max_count: largest MPI count per call (lowered by tests to exercise the >2 GiB rounds).
        threaded: force the background thread on/off (default: on with ``MPI_THREAD_MULTIPLE``).

    Raises:
        RuntimeError: from :meth:`finish`, if the exchange failed on the background thread and
            the job was not aborted (inline exchanges raise directly).
    """

    kind = "mpi4py"

    def __init__(self, comm=None, max_count: int = MAX_COUNT, threaded=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.max_count = max_count
        if threaded is None:
            threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="hvdcomp-allgather")
                          if threaded else None)

    @property
    def size(self) -> int:
        """Number of ranks in the (duplicated) communicator."""
        return self.comm.Get_size()

    @property
    def threaded(self) -> bool:
        """Whether exchanges run on the background thread."""
        return self._executor is not None

    def _wait(self, request) -> None:
        """Complete ``request`` (on the background thread: :func:`poll` its ``Test``)."""
        if self._executor is None:
            request.Wait()
        else:
            poll(request.Test)

    def start(self, payload, name):
        h = _Handle()
        h.dtypes = [t.dtype for t in payload]
        h.device = payload[0].device if payload else torch.device("cpu")
        counts = np.array([t.numel() for t in payload], dtype=np.int64)
        h.send, h.ready = _stage(payload)
        h.bytes_sent = len(payload) * COUNT_BYTES + h.send.nbytes
        h.future = None
        if self._executor is not None:
            h.future = self._executor.submit(self._exchange_or_abort, h, counts)
        else:
            self._exchange(h, counts)
        return h

    def _exchange_or_abort(self, h, counts) -> None:
        """:meth:`_exchange` on the background thread: a failure aborts the job (see class doc)."""
        try:
            self._exchange(h, counts)
        except BaseException:
            sys.stderr.write(f"hvdcomp: the allgather thread failed on rank {self.comm.Get_rank()} "
                             f"of {self.size}; aborting the job so that no rank waits forever:\n")
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            self.comm.Abort(1)
            raise

    def _exchange(self, h, counts) -> None:
        if h.ready is not None:
            h.ready.synchronize()
        h.counts = self._gather_counts(counts)
        byte_counts = (h.counts * np.array([d.itemsize for d in h.dtypes], dtype=np.int64)).sum(axis=1)
        h.recv = self._gather_bytes(h, byte_counts.tolist())
        h.bytes_received = h.counts.size * COUNT_BYTES + h.recv.nbytes

    def _gather_counts(self, counts: np.ndarray) -> np.ndarray:
        """Every rank's int64 ``counts`` (the same size on every rank), one row per rank."""
        all_counts = np.empty((self.size, counts.size), dtype=np.int64)
        self._wait(self.comm.Iallgather(counts, all_counts))
        return all_counts

    def _gather_bytes(self, h, byte_counts: List[int]) -> np.ndarray:
        """Every rank's ``h.send`` (``byte_counts[r]`` bytes from rank r), in rank order, in
        :func:`plan_rounds`' rounds."""
        MPI = self.MPI
        recv = np.empty(sum(byte_counts), dtype=np.uint8)
        rounds = plan_rounds(byte_counts, self.max_count)
        for rnd in rounds:  # one round unless the total overflows a C int
            cnts = [c for _, c, _ in rnd]
            offsets = np.concatenate([[0], np.cumsum(cnts)[:-1]]).astype(np.int64).tolist()
            src, mine, _ = rnd[self.comm.Get_rank()]
            single = len(rounds) == 1
            tmp = recv if single else np.empty(sum(cnts), dtype=np.uint8)
            self._wait(self.comm.Iallgatherv(h.send[src:src + mine], [tmp, cnts, offsets, MPI.BYTE]))
            if not single:
                for (_, c, dst), off in zip(rnd, offsets):
                    recv[dst:dst + c] = tmp[off:off + c]
        return recv

    def finish(self, h):
        if h.future is not None:
            try:
                h.future.result()
            except Exception as exc:
                raise RuntimeError(f"hvdcomp allgather failed on the background thread: {exc!r}") from exc
        return _split(torch.from_numpy(h.recv), h.counts, h.dtypes, h.device)

    def probe(self, nbytes):
        """Blocking ``Allgather`` of ``nbytes`` zero bytes per rank (cost-model timing)."""
        send = np.zeros(int(nbytes), dtype=np.uint8)
        self.comm.Allgather(send, np.empty(int(nbytes) * self.size, dtype=np.uint8))

    def agree(self, values):
        """Rank 0's ``values`` (float64) on every rank, by ``Bcast``."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        self.comm.Bcast(values, root=0)
        return values

    def allgather_ints(self, values):
        """Every rank's ``values`` (one int64 ``Allgather``), in rank order."""
        mine = np.asarray(values, dtype=np.int64)
        out = np.empty((self.size, mine.size), dtype=np.int64)
        self.comm.Allgather(mine, out)
        return out.tolist()

    def close(self):
        """Stop the background thread (waits for queued exchanges); idempotent. The duplicated
        communicator is left to ``MPI_Finalize`` (docs/transports.md, "The message layers")."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class HorovodAllgatherer(Allgatherer):
    """Horovod path (no MPI, e.g. ``horovodrun --gloo``): ``hvd.allgather_async`` of counts and
    bytes; Horovod's own background thread moves them, so this overlaps with backward too. Its
    fixed collectives are named ``prefix.probe``, ``prefix.ints``, ``prefix.agree``: one object's
    (:func:`hvdcomp.comm.group.instance_prefix`), since two objects' may run at once.

    Args:
        group: the :class:`~hvdcomp.comm.group.HorovodGroup` the payloads travel in.
        prefix: names the fixed collectives.
    """

    kind = "horovod"

    def __init__(self, group, prefix: str = "hvdcomp"):
        self.group, self.hvd, self.process_set, self.prefix = group, group.hvd, group.process_set, prefix

    def start(self, payload, name):
        hvd = self.hvd
        counts = torch.tensor([[t.numel() for t in payload]], dtype=torch.int64)
        h = _Handle()
        h.dtypes = [t.dtype for t in payload]
        h.device = payload[0].device if payload else torch.device("cpu")
        send, _ = _stage(payload, pinned_async=False)  # Horovod reads it later on its own thread
        h.send = torch.from_numpy(send)
        h.counts = hvd.allgather_async(counts, name=f"hvdcomp.counts.{name}", process_set=self.process_set)
        h.request = hvd.allgather_async(h.send, name=f"hvdcomp.data.{name}", process_set=self.process_set)
        h.bytes_sent = len(payload) * COUNT_BYTES + h.send.numel()
        return h

    def finish(self, h):
        counts = self.hvd.synchronize(h.counts).numpy()
        buf = self.hvd.synchronize(h.request)
        h.bytes_received = counts.size * COUNT_BYTES + buf.numel()
        return _split(buf, counts, h.dtypes, h.device)

    def probe(self, nbytes):
        """Blocking ``hvd.allgather`` of ``nbytes`` zero bytes per rank."""
        self.hvd.allgather(torch.zeros(int(nbytes), dtype=torch.uint8), name=f"{self.prefix}.probe",
                           process_set=self.process_set)

    def allgather_ints(self, values):
        """Every rank's ``values`` (:meth:`~hvdcomp.comm.group.HorovodGroup.allgather_ints`)."""
        return self.group.allgather_ints(values, f"{self.prefix}.ints")

    def agree(self, values):
        """Rank 0's ``values`` on every rank, by the group's broadcast."""
        t = torch.as_tensor(np.asarray(values, dtype=np.float64))
        return self.group.broadcast(t, 0, f"{self.prefix}.agree").numpy()
