"""Variable-size allgather of payloads (lists of 1-D tensors), rank by rank.

Two implementations share one protocol:

1. counts: every rank contributes the element count of each payload tensor (int64), gathered on
   all ranks (a rank may send zero elements);
2. data: the payload tensors of a rank are laid end to end as raw bytes and moved with one
   variable-size allgather; receivers cut the buffer by the counts and view each piece in its dtype.

:class:`MPIAllgatherer` uses mpi4py (``Allgather`` then non-blocking ``Iallgatherv``) on a
duplicate of ``MPI.COMM_WORLD`` so its messages never mix with Horovod's. Where MPI is not the
launcher (``horovodrun --gloo``), :class:`HorovodAllgatherer` uses ``hvd.allgather_async``.
Both stage CUDA tensors through host memory for the data exchange when needed and return
tensors on the payload's device.
"""
from __future__ import annotations

import abc
import logging
import os
from typing import Any, List, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["Allgatherer", "MPIAllgatherer", "HorovodAllgatherer", "make_allgatherer"]

COUNT_BYTES = 8  # one int64 element count per payload tensor
MAX_COUNT = 2**31 - 1  # MPI counts and displacements are C ints


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


def _as_bytes(payload: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the payload tensors' raw bytes into one uint8 CPU tensor."""
    parts = [t.detach().contiguous().reshape(-1).cpu().view(torch.uint8) for t in payload]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _split(buf: torch.Tensor, counts: np.ndarray, dtypes, device) -> List[List[torch.Tensor]]:
    """Cut a gathered uint8 buffer into per-rank payloads using counts[rank, i] elements."""
    out, pos = [], 0
    for r in range(counts.shape[0]):
        payload = []
        for c, dt in zip(counts[r], dtypes):
            itemsize = torch.empty((), dtype=dt).element_size()
            piece = buf[pos:pos + int(c) * itemsize]
            if pos % itemsize or piece.numel() == 0:  # a view needs aligned, strided storage
                piece = piece.clone().contiguous() if piece.numel() else torch.empty(0, dtype=torch.uint8)
            payload.append(piece.view(dt).to(device))
            nbytes = piece.numel()
            pos += nbytes
        out.append(payload)
    return out


class Allgatherer(abc.ABC):
    """Interface: start a variable-size allgather of one payload, finish it later.

    ``start(payload, name)`` returns a handle; ``finish(handle)`` returns the list (one entry per
    rank, rank order) of payloads. ``bytes_sent`` / ``bytes_received`` of the handle are the exact
    numbers of bytes this rank contributed / obtained, counts exchange included.
    """

    kind = "abstract"

    @abc.abstractmethod
    def start(self, payload: Sequence[torch.Tensor], name: str) -> Any:
        """Start gathering ``payload`` (1-D tensors) from every rank; returns a handle."""

    @abc.abstractmethod
    def finish(self, handle: Any) -> List[List[torch.Tensor]]:
        """Wait for the gather; one payload per rank, in rank order."""


class _Handle:
    __slots__ = ("request", "recv", "counts", "dtypes", "device", "bytes_sent", "bytes_received", "send")


class MPIAllgatherer(Allgatherer):
    """mpi4py path: ``Allgather`` of counts, then one ``Iallgatherv`` of bytes per payload.

    Calls must be made in the same order on every rank (the optimizer launches sparse payloads in
    a fixed parameter order). Raises ``RuntimeError`` if the MPI world does not match Horovod's.
    """

    kind = "mpi4py"

    def __init__(self, comm=None, max_count: int = MAX_COUNT):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.max_count = max_count  # lowered only by tests, to exercise the multi-round path

    @property
    def size(self) -> int:
        """Number of ranks in the (duplicated) communicator."""
        return self.comm.Get_size()

    def start(self, payload, name):
        MPI = self.MPI
        counts = np.array([t.numel() for t in payload], dtype=np.int64)
        all_counts = np.empty((self.size, len(payload)), dtype=np.int64)
        self.comm.Allgather(counts, all_counts)
        h = _Handle()
        h.dtypes = [t.dtype for t in payload]
        h.device = payload[0].device if payload else torch.device("cpu")
        itemsize = np.array([torch.empty((), dtype=d).element_size() for d in h.dtypes], dtype=np.int64)
        byte_counts = (all_counts * itemsize).sum(axis=1)
        displs = np.concatenate([[0], np.cumsum(byte_counts)[:-1]])
        h.send = _as_bytes(payload).numpy()
        h.recv = np.empty(int(byte_counts.sum()), dtype=np.uint8)
        rounds = plan_rounds(byte_counts.tolist(), self.max_count)
        if len(rounds) == 1:
            h.request = self.comm.Iallgatherv(h.send, [h.recv, byte_counts.tolist(), displs.tolist(), MPI.BYTE])
        else:  # > 2 GiB in all: blocking rounds whose counts fit in a C int
            for rnd in rounds:
                counts = [c for _, c, _ in rnd]
                tmp = np.empty(sum(counts), dtype=np.uint8)
                offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
                src, mine, _ = rnd[self.comm.Get_rank()]
                self.comm.Allgatherv(h.send[src:src + mine], [tmp, counts, offsets, MPI.BYTE])
                for (_, c, dst), off in zip(rnd, offsets):
                    h.recv[dst:dst + c] = tmp[off:off + c]
            h.request = MPI.REQUEST_NULL
        h.counts = all_counts
        h.bytes_sent = len(payload) * COUNT_BYTES + h.send.nbytes
        h.bytes_received = all_counts.size * COUNT_BYTES + h.recv.nbytes
        return h

    def finish(self, h):
        h.request.Wait()
        return _split(torch.from_numpy(h.recv), h.counts, h.dtypes, h.device)


class HorovodAllgatherer(Allgatherer):
    """Horovod path (no MPI, e.g. ``horovodrun --gloo``): ``hvd.allgather_async`` of counts and bytes."""

    kind = "horovod"

    def __init__(self):
        import horovod.torch as hvd

        self.hvd = hvd

    def start(self, payload, name):
        hvd = self.hvd
        counts = torch.tensor([[t.numel() for t in payload]], dtype=torch.int64)
        h = _Handle()
        h.dtypes = [t.dtype for t in payload]
        h.device = payload[0].device if payload else torch.device("cpu")
        h.send = _as_bytes(payload)
        h.counts = hvd.allgather_async(counts, name=f"hvdcomp.counts.{name}")
        h.request = hvd.allgather_async(h.send, name=f"hvdcomp.data.{name}")
        h.bytes_sent = len(payload) * COUNT_BYTES + h.send.numel()
        return h

    def finish(self, h):
        counts = self.hvd.synchronize(h.counts).numpy()
        buf = self.hvd.synchronize(h.request)
        h.bytes_received = counts.size * COUNT_BYTES + buf.numel()
        return _split(buf, counts, h.dtypes, h.device)


def make_allgatherer(prefer: str = "auto") -> Allgatherer:
    """Pick the allgather transport.

    Args:
        prefer: ``"auto"`` (mpi4py when Horovod runs on MPI, else Horovod allgather),
            ``"mpi4py"`` or ``"horovod"``. Overridable with ``HVDCOMP_ALLGATHER``.

    Raises:
        RuntimeError: ``"mpi4py"`` was asked for but Horovod is not running on MPI (e.g. started
            with ``horovodrun --gloo``) or mpi4py's world differs from Horovod's.
        ValueError: unknown ``prefer``.
    """
    import horovod.torch as hvd

    prefer = os.environ.get("HVDCOMP_ALLGATHER", prefer)
    if prefer not in ("auto", "mpi4py", "horovod"):
        raise ValueError(f"allgather transport must be auto, mpi4py or horovod, got {prefer!r}")
    if prefer == "horovod":
        return HorovodAllgatherer()
    if hvd.mpi_enabled():
        try:
            gatherer = MPIAllgatherer()
            if gatherer.size == hvd.size():
                return gatherer
            reason = f"MPI world size {gatherer.size} != Horovod size {hvd.size()}"
        except ImportError as exc:
            reason = f"mpi4py is not importable ({exc})"
    else:
        reason = "Horovod is not running on MPI (e.g. horovodrun --gloo)"
    if prefer == "mpi4py":
        raise RuntimeError(f"the mpi4py allgather path is unusable: {reason}. Launch with mpirun or "
                           "horovodrun --mpi, or use transport 'horovod'.")
    log.info("hvdcomp: sparse payloads use Horovod allgather: %s", reason)
    return HorovodAllgatherer()
