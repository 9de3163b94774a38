"""The neighbour transport: each rank's payload to its neighbours in a graph, point to point
(docs/gossip.md, "Transport and failures").

Three edge layers, each on a communicator or group of its own: mpi4py (:class:`MPIEdges`: mpirun,
horovodrun; matched-probe receives), ``torch.distributed`` on a gloo group (:class:`TorchDistEdges`:
torchrun, srun) and Horovod's alltoall (:class:`HorovodEdges`: elastic Horovod, ``horovodrun
--gloo``). One message per exchange and edge, in the package's payload codec
(:func:`hvdcomp.comm.exchange.pack_payload`); bytes are the message sizes, header included. A wait
past ``timeout`` raises :class:`NeighborTimeoutError` naming the silent rank(s). The exchange runs
on a background thread where MPI provides ``MPI_THREAD_MULTIPLE``; exchanges complete in the order
they were started. Cost (:func:`neighbor_terms`): ``d·α + d·m·β`` per exchange for m bytes to each
of d neighbours, constant in the number of ranks.
"""
from __future__ import annotations

import logging
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..comm.allgatherv import poll
from ..comm.exchange import message_bytes, pack_payload, unpack_payload  # noqa: F401
from .base import Transport

log = logging.getLogger(__name__)

__all__ = ["NeighborTransport", "NeighborTimeoutError", "CollectiveTimeoutError", "neighbor_terms", "neighbor_edges"]

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
    __slots__ = ("index", "unit", "peers", "send", "counts", "device", "future", "received", "bytes_sent",
                 "bytes_received", "error", "done")


Payloads = Union[Sequence[torch.Tensor], Dict[int, Sequence[torch.Tensor]]]


def _unpack(buf: np.ndarray, count: int, device, source: int) -> List[torch.Tensor]:
    """The ``count`` tensors of one message (:func:`hvdcomp.comm.exchange.unpack_payload`)."""
    out = unpack_payload(torch.from_numpy(buf), device)
    if len(out) != count:
        raise ValueError(f"hvdcomp gossip: rank {source} sent {len(out)} tensors where this rank expected {count}: "
                         "the ranks run different models, methods or compressors")
    return out


class MPIEdges:
    """The neighbour transport's messages over mpi4py (a duplicate of ``comm``): ``Isend`` per
    edge, received after a matched probe (``Improbe`` + ``Irecv``: one message per edge and
    exchange), polled with short sleeps; a neighbour silent past the timeout is named."""

    kind, how = "mpi4py-neighbor", "mpi4py Isend/Mprobe"

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def exchange(self, send: Dict[int, np.ndarray], peers: Sequence[int], tag: int, timeout: float,
                 index: int) -> Dict[int, np.ndarray]:
        """Send ``send[j]`` to every peer j and receive one message from each; returns the
        received bytes by peer.

        Raises:
            NeighborTimeoutError: within ``timeout`` seconds a peer sent nothing or did not take
                this rank's message (naming them).
        """
        MPI = self.MPI
        sends = {j: self.comm.Isend([send[j], MPI.BYTE], dest=j, tag=tag) for j in peers}
        waiting, recvs, buffers = set(peers), {}, {}  # (waiting: no message matched yet)
        deadline, pause, status = time.monotonic() + timeout, 5e-5, MPI.Status()
        while waiting or recvs or sends:
            progressed = False
            for j in sorted(waiting):
                msg = self.comm.Improbe(source=j, tag=tag, status=status)
                if msg is not None:
                    buffers[j] = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                    recvs[j] = msg.Irecv([buffers[j], MPI.BYTE])
                    waiting.discard(j)
                    progressed = True
            for pending in (recvs, sends):
                for j in [j for j, request in pending.items() if request.Test()]:
                    del pending[j]
                    progressed = True
            if progressed:
                pause = 5e-5
                continue
            if time.monotonic() > deadline:
                raise NeighborTimeoutError(self.rank, sorted(waiting | set(recvs)), sorted(sends), timeout, index)
            time.sleep(pause)
            pause = min(1e-3, pause * 2)
        return buffers

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def iallgather_ints(self, mine: np.ndarray):
        """Start an int64 allgather of ``mine`` (the same size on every rank); returns
        ``(done, out)`` with ``out`` the (size, n) array filled once ``done()``."""
        out = np.empty((self.size, mine.size), dtype=np.int64)
        request = self.comm.Iallgather(mine, out)
        return request.Test, out


class TorchDistEdges:
    """The neighbour transport's messages over ``torch.distributed``
    (:func:`hvdcomp.comm.torchdist.exchange_messages`, tagged by exchange) on a gloo group made for
    them. Gloo's point-to-point work cannot be polled and a wait that times out closes the
    connection, so each wait gets what is left of the timeout: a silent neighbour is named, and the
    job ends. The per-step agreement runs on a second gloo group, apart from the messages."""

    kind, how = "torch.distributed-neighbor", "torch.distributed isend/irecv"
    threaded = True

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.ranks = dist, group.ranks
        self.rank, self.size = group.rank, group.size
        self.group = dist.new_group(group.ranks, backend="gloo", use_local_synchronization=True)
        self.agreement = dist.new_group(group.ranks, backend="gloo", use_local_synchronization=True)
        self.collectives = group

    def exchange(self, send: Dict[int, np.ndarray], peers: Sequence[int], tag: int, timeout: float,
                 index: int) -> Dict[int, np.ndarray]:
        """As :meth:`MPIEdges.exchange` (:func:`hvdcomp.comm.torchdist.exchange_messages`).

        Raises:
            NeighborTimeoutError: naming the first neighbour found missing and those not yet heard.
        """
        from ..comm.torchdist import exchange_messages

        def late(missing, unsent):
            raise NeighborTimeoutError(self.rank, list(missing), list(unsent), timeout, index)

        got = exchange_messages(self.dist, self.group, self.ranks, {j: torch.from_numpy(send[j]) for j in peers},
                                peers, tag, time.monotonic() + timeout, late)
        return {j: b.numpy() for j, b in got.items()}

    def allgather_object(self, obj):
        return self.collectives.allgather_object(obj)

    def iallgather_ints(self, mine: np.ndarray):
        values = torch.from_numpy(mine)
        out = torch.empty(self.size * values.numel(), dtype=torch.int64)
        from ..comm.retain import retain

        retain(values, out)
        work = self.dist.all_gather_into_tensor(out, values, group=self.agreement, async_op=True)
        return work.is_completed, out.view(self.size, values.numel()).numpy()


class HorovodEdges:
    """The neighbour transport's messages through Horovod's collectives, where Horovod has no
    usable MPI world (elastic Horovod's Gloo controller; ``horovodrun --gloo``): per exchange one
    ``hvd.alltoall`` of the whole job (:class:`~hvdcomp.comm.exchange.HorovodExchange`), whose
    part for rank j is this rank's message to j, empty for a non-neighbour. Bytes: the messages,
    as over MPI. A silent rank is reported by Horovod's stall check, not named here; Horovod's
    errors (``HorovodInternalError`` at an elastic reset) reach the caller unchanged."""

    kind, how, threaded = "horovod-neighbor", "Horovod alltoall", True

    def __init__(self, group, prefix: str = "hvdcomp.gossip"):
        from ..comm.exchange import HorovodExchange

        if not group.is_global:
            raise RuntimeError("gossip on a Horovod process set exchanges through MPI, which this job lacks: "
                               "launch with mpirun or horovodrun --mpi, or train over every rank")
        self.hvd, self.group, self.prefix = group.hvd, group, prefix
        self.rank, self.size = group.rank, group.size
        self.x = HorovodExchange(group.hvd, group.rank, group.size, f"{prefix}.exchange")

    def exchange(self, send: Dict[int, np.ndarray], peers: Sequence[int], tag: int, timeout: float,
                 index: int) -> Dict[int, np.ndarray]:
        """As :meth:`MPIEdges.exchange`, by one ``hvd.alltoall`` (an empty part to every other rank)."""
        empty = np.empty(0, dtype=np.uint8)
        got = self.x.alltoall([torch.from_numpy(send.get(j, empty)) for j in range(self.size)])
        return {j: got[j].numpy() for j in peers}

    def allgather_object(self, obj):
        return self.group.allgather_object(obj, f"{self.prefix}.setup")

    def iallgather_ints(self, mine: np.ndarray):
        handle = self.hvd.allgather_async(torch.from_numpy(mine).view(1, -1), name=f"{self.prefix}.agree",
                                          process_set=self.group.process_set)
        out = np.empty((self.size, mine.size), dtype=np.int64)

        def done() -> bool:
            if not self.hvd.poll(handle):
                return False
            out[:] = self.hvd.synchronize(handle).numpy()
            return True
        return done, out


def neighbor_edges(group, prefix: str = "hvdcomp.gossip"):
    """The edge layer of ``group`` (:class:`~hvdcomp.comm.group.ProcessGroup`): mpi4py over a
    Horovod process set, ``torch.distributed`` over a ``torch.distributed`` group (each on a
    communicator or group of its own).

    Under elastic Horovod, or where mpi4py is unusable or its world differs from Horovod's
    (``horovodrun --gloo``), Horovod's own collectives (:class:`HorovodEdges`), named ``prefix.*``
    (one optimizer's: :func:`hvdcomp.comm.group.instance_prefix`).
    """
    if getattr(group, "hvd", None) is None:
        return TorchDistEdges(group)
    from ..launch import elastic_launch

    if not elastic_launch():  # (elastic: no MPI world, mpi4py is not even imported)
        try:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() == group.hvd.size():
                return MPIEdges(group.mpi_comm())
        except ImportError:
            pass
    return HorovodEdges(group, prefix)


class NeighborTransport(Transport):
    """Exchanges payloads with the neighbours of this rank: a
    :class:`~hvdcomp.transports.base.Transport` whose units are the gossip rounds of a step
    (:meth:`start`, :meth:`finish`). Below that, any payloads: :meth:`post` ``(payload, peers) ->
    handle`` (a list of 1-D tensors for every peer, or a dict peer -> list), :meth:`wait`
    ``(handle) -> {peer: tensors}`` (each on the device of the payload sent to that peer),
    :meth:`exchange` both. Every rank posts in the same order with matching peers (j in i's peers
    iff i in j's).

    Args:
        edges: the edge layer (:func:`neighbor_edges`), or an mpi4py communicator to duplicate
            (``MPI.COMM_WORLD`` when None; collective). Peers are ranks in it.
        timeout: seconds an exchange may wait for a neighbour before :class:`NeighborTimeoutError`
            (default 300).
        threaded: force the background thread on/off (default: the edge layer's).
        method, params, timer: the :class:`~hvdcomp.gossip.base.GossipMethod`, the parameters it
            updates and the :class:`~hvdcomp.metrics.PhaseTimer` (for :meth:`start` only).

    Attributes:
        rank, size: this rank and the edge layer's size.
        previous: the parameters before this step's local update (set before :meth:`start`, for
            a method that ``needs_previous``).
        bytes_sent, bytes_received: totals over every finished exchange (headers included).
        unapplied: ``{"sent", "received", "dense"}`` bytes of the rounds absorbed since the caller
            last took them (dense: fp32 parameters per neighbour).

    Raises:
        ValueError: ``timeout`` not positive; from :meth:`post`, a peer outside the edge layer,
            repeated, or this rank.
    """

    def __init__(self, edges=None, timeout: float = 300.0, threaded: Optional[bool] = None, method=None,
                 params=None, timer=None):
        if isinstance(timeout, bool) or not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.edges = edges if hasattr(edges, "exchange") else MPIEdges(edges)
        self.kind = self.edges.kind
        self.rank, self.size = self.edges.rank, self.edges.size
        self.timeout = float(timeout)
        if threaded is None:
            threaded = self.edges.threaded
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hvdcomp-neighbor") if threaded else None
        self.method, self.params, self.timer, self.previous = method, params, timer, None
        self._count = 0
        self._open: List[_Handle] = []
        self.bytes_sent = self.bytes_received = 0
        self.unapplied = {"sent": 0, "received": 0, "dense": 0}

    def __str__(self) -> str:
        return f"neighbor ({self.edges.how} per edge, {'background thread' if self.threaded else 'inline'})"

    @property
    def threaded(self) -> bool:
        """Whether exchanges run on the background thread."""
        return self._executor is not None

    @property
    def busy(self) -> bool:
        """Whether an exchange was started and not finished."""
        return bool(self._open)

    # ---- the Transport interface: the gossip method's rounds ------------------------------------
    def start(self, u: int) -> None:
        """Round ``u`` of this step: the method's payload for its peers (``compress``), its
        exchange started (``communicate``)."""
        with self.timer.phase("compress"):
            out = self.method.outgoing(self.params, self.previous, u)
        with self.timer.phase("communicate"):
            self.post(out, self.method.peers()).unit = u

    def finish(self) -> None:
        """Wait for every started round (in order) and absorb each into the method's state
        (``decompress``); their bytes go to :attr:`unapplied`."""
        dense = 4 * sum(p.numel() for p in self.params)
        while self._open:
            h = self._open[0]
            with self.timer.phase("communicate"):
                received = self.wait(h)
            with self.timer.phase("decompress"):
                self.method.absorb(self.params, received, h.unit)
            moved = (h.bytes_sent, h.bytes_received, dense * len(h.peers))
            self.unapplied = {k: v + m for (k, v), m in zip(self.unapplied.items(), moved)}

    def reset(self) -> None:
        """Complete and drop every exchange in flight (their messages must still move: the
        neighbours expect them); errors of dropped exchanges are logged, not raised."""
        for h in list(self._open):
            try:
                self.wait(h)
            except Exception as exc:  # noqa: BLE001 - dropped on purpose, but worth a line
                log.warning("hvdcomp gossip: dropped exchange %d failed: %s", h.index, exc)

    # ---- payload exchange ---------------------------------------------------------------------
    def post(self, payload: Payloads, peers: Sequence[int]) -> _Handle:
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
        h.index, h.unit, h.peers = self._count, None, peers
        self._count += 1
        packed = {}
        for j in peers:  # one packed buffer (a copy: the caller may reuse its tensors) per payload
            key = id(per_peer[j])
            if key not in packed:
                packed[key] = pack_payload(per_peer[j]).numpy()
        h.send = {j: packed[id(per_peer[j])] for j in peers}
        h.counts = {j: len(per_peer[j]) for j in peers}
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
            buffers = self.edges.exchange(h.send, h.peers, h.index % TAG_SPACE, self.timeout, h.index)
            h.received = {j: _unpack(buffers[j], h.counts[j], h.device[j], j) for j in h.peers}
            h.bytes_received = sum(int(buffers[j].nbytes) for j in h.peers)
        except BaseException as exc:  # reported by wait() on the caller's thread
            h.error = exc

    def wait(self, h: _Handle) -> Dict[int, List[torch.Tensor]]:
        """Wait for exchange ``h``; every peer's payload (``{peer: tensors}``).

        Raises:
            NeighborTimeoutError: a neighbour sent nothing within the timeout (names it).
            ValueError: a message that does not fit this rank's payload (different models).
            RuntimeError: the exchange failed in the edge layer (the cause chained).
        """
        if h.done:
            raise RuntimeError(f"exchange {h.index} was already finished")
        if h.future is not None:
            h.future.result()
        h.done = True
        self._open.remove(h)
        if h.error is not None:
            if isinstance(h.error, (NeighborTimeoutError, ValueError)) or "horovod" in type(h.error).__module__:
                raise h.error  # (Horovod's own errors unchanged: elastic Horovod recovers from them)
            raise RuntimeError(f"hvdcomp gossip: the neighbour exchange failed on rank {self.rank}: {h.error!r}") \
                from h.error
        self.bytes_sent += h.bytes_sent
        self.bytes_received += h.bytes_received
        return h.received

    def exchange(self, payload: Payloads, peers: Sequence[int]) -> Dict[int, List[torch.Tensor]]:
        """:meth:`post` then :meth:`wait` (blocking)."""
        return self.wait(self.post(payload, peers))

    # ---- small collectives: set-up, and each step's non-finite verdict -------------------------
    def allgather_object(self, obj):
        """Every rank's ``obj`` (picklable; blocking, collective), in rank order."""
        return self.edges.allgather_object(obj)

    def allgather_ints(self, values: Sequence[int], what: str = "the step's non-finite agreement") -> List[List[int]]:
        """Every rank's ``values`` (a few integers, the same count on every rank), in rank order:
        one int64 allgather (collective) polled on the caller's thread beside the exchange in flight.

        Raises:
            CollectiveTimeoutError: not complete within ``timeout`` (a rank dead, stalled or not
                calling it; the job should end: the collective stays pending).
        """
        mine = np.asarray(list(values), dtype=np.int64)
        done, out = self.edges.iallgather_ints(mine)
        if not poll(done, time.monotonic() + self.timeout):
            raise CollectiveTimeoutError(self.rank, self.size, self.timeout, what)
        return out.tolist()

    def close(self) -> None:
        """Stop the background thread (waits for exchanges in flight); idempotent. The duplicated
        communicator is left to ``MPI_Finalize`` (see :meth:`hvdcomp.comm.allgatherv.MPIAllgatherer.close`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
