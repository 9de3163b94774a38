"""The neighbour transport: each rank's payload to its neighbours in a graph, point to point.

Decentralized methods (:mod:`hvdcomp.gossip`) exchange only along the edges of a topology, so a
rank's traffic per step is its degree times its payload, whatever the number of ranks. Horovod has
no point-to-point or neighbourhood collectives; this transport uses mpi4py on a duplicate of the
job's (or the process set's) communicator, so its messages never mix with Horovod's or the
allgather transport's.

Per exchange and edge, one message: an int64 header (the number of tensors, then each tensor's
element count) followed by the tensors' raw bytes, end to end. The receiver learns the size with
a matched probe (``Improbe``), so variable-size payloads (top-k of data-dependent density) need no
separate counts round. It sends with ``Isend`` and receives with ``Mprobe``/``Irecv`` per edge
rather than with a neighbourhood collective (``Neighbor_alltoallv`` on a
``Create_dist_graph_adjacent`` communicator) because per-edge requests

* let each edge carry its own payload (PowerGossip sends a different vector to every neighbour),
* follow a time-varying graph (a different peer each step) without one communicator per round,
* tell which neighbour is missing: a wait past ``timeout`` raises :class:`NeighborTimeoutError`
  naming the rank(s) that sent nothing, instead of hanging the job.

As :class:`hvdcomp.comm.allgather.MPIAllgatherer` does, the exchange runs on one background
thread when MPI provides ``MPI_THREAD_MULTIPLE`` (what Horovod asks for), so it proceeds while the
next forward and backward compute; the thread polls its requests with short sleeps (0.05 ms
growing to 1 ms) instead of spinning. Without ``MPI_THREAD_MULTIPLE`` the exchange runs inside
:meth:`NeighborTransport.start`. Exchanges complete in the order they were started.

Bytes are counted exactly at the wire: a handle's ``bytes_sent`` / ``bytes_received`` are the
message sizes, header included, summed over its edges.

Cost in the α-β model (:func:`neighbor_terms`): sending m bytes to each of d neighbours through
one network interface takes ``d·α + d·m·β`` per exchange (receives overlap the sends on a
full-duplex link): constant in the number of ranks p for a fixed degree, against the ring
allgather's ``(p−1)·α + (p−1)·m·β``.
"""
from __future__ import annotations

import logging
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["NeighborTransport", "NeighborTimeoutError", "CollectiveTimeoutError", "neighbor_terms", "message_bytes", "HEADER_ITEM_BYTES"]

HEADER_ITEM_BYTES = 8  # int64: the tensor count, then one element count per tensor
TAG_SPACE = 1 << 15    # MPI guarantees tags up to 32767


class NeighborTimeoutError(TimeoutError):
    """A neighbour sent nothing (or did not take this rank's message) within the timeout.

    Attributes:
        rank: this rank (in the transport's communicator).
        missing: the neighbours whose message did not arrive.
        unsent: the neighbours that did not receive this rank's message.
    """

    def __init__(self, rank: int, missing: Sequence[int], unsent: Sequence[int], timeout: float, exchange: int):
        self.rank, self.missing, self.unsent = rank, list(missing), list(unsent)
        parts = []
        if self.missing:
            parts.append(f"no message from neighbour rank(s) {self.missing}")
        if self.unsent:
            parts.append(f"neighbour rank(s) {self.unsent} did not receive rank {rank}'s message")
        super().__init__(f"hvdcomp gossip: rank {rank}, exchange {exchange}: {'; '.join(parts)} within {timeout:g} s. "
                         "That rank is dead, stalled or not calling step(); every rank must step the same number of "
                         "times (raise timeout= for very slow steps)")


class CollectiveTimeoutError(TimeoutError):
    """A small collective of every rank (:meth:`NeighborTransport.allgather_ints`) did not
    complete within the timeout. Unlike :class:`NeighborTimeoutError` it cannot name the rank:
    an allgather does not say whose part is missing."""

    def __init__(self, rank: int, size: int, timeout: float, what: str):
        self.rank = rank
        super().__init__(f"hvdcomp gossip: rank {rank}: {what} (an allgather over the {size} ranks) did not complete "
                         f"within {timeout:g} s: some rank is dead, stalled or not calling step(), and an allgather "
                         "cannot say which. Every rank must step the same number of times; with nonfinite='ignore' "
                         "no such collective runs and a neighbour that sends nothing is named (raise timeout= for "
                         "very slow steps)")


def message_bytes(numels: Sequence[int], itemsizes: Sequence[int]) -> int:
    """Exact bytes of one message: header ``8·(1 + tensors)`` plus the tensors' bytes."""
    return HEADER_ITEM_BYTES * (1 + len(numels)) + sum(int(n) * int(s) for n, s in zip(numels, itemsizes))


def neighbor_terms(degree: int, nbytes: float, exchanges: int = 1) -> Tuple[float, float]:
    """``(latency terms, byte terms)`` of a rank's neighbour exchanges in one step: time is
    ``latency_terms·α + byte_terms·β``. Each exchange sends ``nbytes`` (header included) to each of
    ``degree`` neighbours through one full-duplex interface: ``degree`` messages and
    ``degree·nbytes`` bytes out, the same in concurrently. Constant in the number of ranks.

    Raises:
        ValueError: a negative degree, byte count or number of exchanges.
    """
    if degree < 0 or nbytes < 0 or exchanges < 0:
        raise ValueError(f"degree, nbytes and exchanges must be >= 0, got {degree}, {nbytes}, {exchanges}")
    return float(exchanges * degree), float(exchanges * degree * nbytes)


class _Handle:
    __slots__ = ("index", "peers", "send", "dtypes", "device", "future", "received", "bytes_sent",
                 "bytes_received", "error", "done")


Payloads = Union[Sequence[torch.Tensor], Dict[int, Sequence[torch.Tensor]]]


def _pack(payload: Sequence[torch.Tensor]) -> np.ndarray:
    """Header and raw bytes of ``payload`` in one new uint8 array (a copy: the caller may reuse
    its tensors at once)."""
    header = torch.tensor([len(payload)] + [t.numel() for t in payload], dtype=torch.int64)
    parts = [header.view(torch.uint8)] + [t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
                                           for t in payload]
    return torch.cat(parts).numpy()


def _unpack(buf: np.ndarray, dtypes: Sequence[torch.dtype], device, source: int) -> List[torch.Tensor]:
    raw = torch.from_numpy(buf)
    if raw.numel() < HEADER_ITEM_BYTES:
        raise ValueError(f"hvdcomp gossip: a {raw.numel()}-byte message from rank {source} has no header")
    count = int(raw[:HEADER_ITEM_BYTES].view(torch.int64)[0])
    if count != len(dtypes):
        raise ValueError(f"hvdcomp gossip: rank {source} sent {count} tensors where this rank expected {len(dtypes)}: "
                         "the ranks run different models, methods or compressors")
    head = HEADER_ITEM_BYTES * (1 + count)
    numels = raw[HEADER_ITEM_BYTES:head].view(torch.int64).tolist()
    out, pos = [], head
    for n, dt in zip(numels, dtypes):
        nbytes = n * torch.empty((), dtype=dt).element_size()
        piece = raw[pos:pos + nbytes]
        if piece.numel() != nbytes:
            raise ValueError(f"hvdcomp gossip: a truncated message from rank {source}")
        t = piece.clone().view(dt) if nbytes else torch.empty(0, dtype=dt)
        out.append(t.to(device))
        pos += nbytes
    return out


class NeighborTransport:
    """Exchanges payloads with the neighbours of this rank (see the module docstring).

    Args:
        comm: the mpi4py communicator to duplicate (``MPI.COMM_WORLD`` by default; for a Horovod
            process set, ``hvdcomp.comm.group.Group(process_set).mpi_comm()``). Ranks and peers
            are ranks in this communicator. Collective over it (the duplication).
        timeout: seconds an exchange may wait for any one neighbour before
            :class:`NeighborTimeoutError` (default 300; a neighbour's step may be slow); a Python
            or numpy number.
        threaded: force the background thread on/off (default: on with ``MPI_THREAD_MULTIPLE``).

    Attributes:
        rank, size: this rank and the number of ranks of the communicator.
        bytes_sent, bytes_received: totals over every finished exchange (bytes, headers included).

    Interface: ``start(payload, peers) -> handle`` (``payload``: a list of 1-D tensors sent to
    every peer, or a dict peer -> list); ``finish(handle) -> {peer: list of tensors}`` (each
    neighbour's payload has the dtypes of the payload this rank sent it, on its device);
    ``busy``; ``reset()``; ``close()``; the small collectives ``allgather_object`` and
    ``allgather_ints`` (the gossip front-end's set-up and per-step agreement). Every rank must call ``start`` in the same order with
    matching peers (j is in i's peers at an exchange iff i is in j's).

    Raises:
        ValueError: ``timeout`` not positive; from :meth:`start`, a peer outside the communicator
            or this rank itself.
    """

    kind = "mpi4py-neighbor"

    def __init__(self, comm=None, timeout: float = 300.0, threaded: Optional[bool] = None):
        from mpi4py import MPI

        if isinstance(timeout, bool) or not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(timeout)
        if threaded is None:
            threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hvdcomp-neighbor") if threaded else None
        self._count = 0
        self._open: List[_Handle] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    def __str__(self) -> str:
        return f"neighbor (mpi4py Isend/Mprobe per edge, {'background thread' if self.threaded else 'inline'})"

    @property
    def threaded(self) -> bool:
        """Whether exchanges run on the background thread."""
        return self._executor is not None

    @property
    def busy(self) -> bool:
        """Whether an exchange was started and not finished."""
        return bool(self._open)

    # ---- exchange -----------------------------------------------------------------------------
    def start(self, payload: Payloads, peers: Sequence[int]) -> _Handle:
        """Start sending ``payload`` to ``peers`` and receiving theirs; returns a handle.

        Raises:
            ValueError: a peer outside ``0..size-1``, this rank, a peer listed twice, or a dict
                payload without an entry for every peer.
        """
        peers = [int(j) for j in peers]
        if len(set(peers)) != len(peers) or any(j == self.rank or not 0 <= j < self.size for j in peers):
            raise ValueError(f"rank {self.rank}: peers {peers} must be distinct ranks in 0..{self.size - 1}, "
                             "not this rank")
        if isinstance(payload, dict):
            missing = [j for j in peers if j not in payload]
            if missing:
                raise ValueError(f"rank {self.rank}: no payload for peer(s) {missing}")
            per_peer = {j: list(payload[j]) for j in peers}
        else:
            shared = list(payload)
            per_peer = {j: shared for j in peers}
        h = _Handle()
        h.index = self._count
        self._count += 1
        h.peers = peers
        packed = {}
        h.send = {}
        for j in peers:  # one packed buffer per distinct payload
            key = id(per_peer[j])
            if key not in packed:
                packed[key] = _pack(per_peer[j])
            h.send[j] = packed[key]
        h.dtypes = {j: [t.dtype for t in per_peer[j]] for j in peers}
        h.device = {j: (per_peer[j][0].device if per_peer[j] else torch.device("cpu")) for j in peers}
        h.bytes_sent = sum(int(h.send[j].nbytes) for j in peers)
        h.received, h.error, h.done, h.bytes_received, h.future = None, None, False, 0, None
        self._open.append(h)
        if self._executor is not None:
            h.future = self._executor.submit(self._exchange_safely, h)
        else:
            self._exchange_safely(h)
        return h

    def _exchange_safely(self, h: _Handle) -> None:
        try:
            self._exchange(h)
        except BaseException as exc:  # reported by finish() on the caller's thread
            h.error = exc

    def _exchange(self, h: _Handle) -> None:
        MPI = self.MPI
        tag = h.index % TAG_SPACE
        sends = {j: self.comm.Isend([h.send[j], MPI.BYTE], dest=j, tag=tag) for j in h.peers}
        waiting = set(h.peers)     # no message matched yet
        recvs: Dict[int, object] = {}
        buffers: Dict[int, np.ndarray] = {}
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        status = MPI.Status()
        while waiting or recvs or sends:
            progressed = False
            for j in sorted(waiting):
                msg = self.comm.Improbe(source=j, tag=tag, status=status)
                if msg is not None:
                    buffers[j] = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                    recvs[j] = msg.Irecv([buffers[j], MPI.BYTE])
                    waiting.discard(j)
                    progressed = True
            for j in list(recvs):
                if recvs[j].Test():
                    del recvs[j]
                    progressed = True
            for j in list(sends):
                if sends[j].Test():
                    del sends[j]
                    progressed = True
            if not (waiting or recvs or sends):
                break
            if progressed:
                pause = 5e-5
                continue
            if time.monotonic() > deadline:
                raise NeighborTimeoutError(self.rank, sorted(waiting | set(recvs)), sorted(sends), self.timeout,
                                           h.index)
            time.sleep(pause)
            pause = min(1e-3, pause * 2)
        h.received = {j: _unpack(buffers[j], h.dtypes[j], h.device[j], j) for j in h.peers}
        h.bytes_received = sum(int(buffers[j].nbytes) for j in h.peers)

    def finish(self, h: _Handle) -> Dict[int, List[torch.Tensor]]:
        """Wait for exchange ``h``; every peer's payload (``{peer: tensors}``).

        Raises:
            NeighborTimeoutError: a neighbour sent nothing within the timeout (names it).
            ValueError: a message that does not fit this rank's payload (different models).
            RuntimeError: the exchange failed in MPI (the cause chained).
        """
        if h.done:
            raise RuntimeError(f"exchange {h.index} was already finished")
        if h.future is not None:
            h.future.result()
        h.done = True
        self._open.remove(h)
        if h.error is not None:
            if isinstance(h.error, (NeighborTimeoutError, ValueError)):
                raise h.error
            raise RuntimeError(f"hvdcomp gossip: the neighbour exchange failed on rank {self.rank}: {h.error!r}") \
                from h.error
        self.bytes_sent += h.bytes_sent
        self.bytes_received += h.bytes_received
        return h.received

    def exchange(self, payload: Payloads, peers: Sequence[int]) -> Dict[int, List[torch.Tensor]]:
        """:meth:`start` then :meth:`finish` (blocking)."""
        return self.finish(self.start(payload, peers))

    def reset(self) -> None:
        """Complete and drop every exchange in flight (their messages must still move: the
        neighbours expect them); errors of dropped exchanges are logged, not raised."""
        for h in list(self._open):
            try:
                self.finish(h)
            except Exception as exc:  # noqa: BLE001 - dropped on purpose, but worth a line
                log.warning("hvdcomp gossip: dropped exchange %d failed: %s", h.index, exc)

    # ---- small collectives: set-up, and each step's non-finite verdict -------------------------
    def allgather_object(self, obj):
        """Every rank's ``obj`` (picklable; blocking, collective), in rank order."""
        return self.comm.allgather(obj)

    def allgather_ints(self, values: Sequence[int], what: str = "the step's non-finite agreement") -> List[List[int]]:
        """Every rank's ``values`` (a few integers, the same count on every rank), in rank order:
        one int64 ``Iallgather`` (collective), waited for as the exchanges are, with short sleeps,
        on the caller's thread beside the exchange in flight on the transport's
        (``MPI_THREAD_MULTIPLE``; a collective never matches the exchanges' point-to-point
        messages).

        Raises:
            CollectiveTimeoutError: not complete within ``timeout`` (a rank dead, stalled or not
                calling it; the job should end: the collective stays pending).
        """
        mine = np.asarray(list(values), dtype=np.int64)
        out = np.empty((self.size, mine.size), dtype=np.int64)
        request = self.comm.Iallgather(mine, out)
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        while not request.Test():
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(self.rank, self.size, self.timeout, what)
            time.sleep(pause)
            pause = min(1e-3, pause * 2)
        return out.tolist()

    def close(self) -> None:
        """Stop the background thread (waits for exchanges in flight); idempotent. The duplicated
        communicator is left to ``MPI_Finalize`` (see :meth:`hvdcomp.comm.allgather.MPIAllgatherer.close`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
