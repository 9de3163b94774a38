"""Byte messages among ranks (:class:`PointToPoint`: point to point, all-to-all, allgather) over
mpi4py (:class:`MPIExchange`, also the in-place reductions and broadcasts of AB-training's packed
buffers) or Horovod's collectives (:class:`HorovodExchange`), with their byte counters
(:class:`Messages`); and the package's one payload codec, :func:`pack_payload` /
:func:`unpack_payload` (several tensors as one message).
"""
from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

__all__ = ["moved_bytes", "PointToPoint", "Messages", "MPIExchange", "HorovodExchange", "SubGroup", "node_ids",
           "pack_payload", "unpack_payload", "message_bytes"]

# dtypes a payload tensor may have, by their code in a packed header
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool)


class PointToPoint(Protocol):
    """Blocking byte messages among ``size`` ranks (this is ``rank``). Messages are 1-D uint8
    tensors."""

    rank: int
    size: int

    def send(self, data: torch.Tensor, dest: int) -> None:
        """Send ``data`` to ``dest``."""

    def recv(self, source: int, max_bytes: int) -> torch.Tensor:
        """Receive one message (≤ ``max_bytes`` bytes) from ``source``."""

    def sendrecv(self, data: torch.Tensor, partner: int, max_bytes: int) -> torch.Tensor:
        """Exchange messages with ``partner`` (both call it); returns the partner's."""

    def alltoall(self, parts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Send ``parts[j]`` to rank j (every rank calls it); returns what each rank sent here."""

    def allgather(self, data: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's ``data`` (sizes may differ), in rank order."""


class Messages:
    """What every byte layer shares (:class:`MPIExchange`, :class:`HorovodExchange`,
    :class:`hvdcomp.comm.torchdist.TorchDistExchange`): ``bytes_sent`` / ``bytes_received`` (the
    bytes this rank moved, headers included, docs/architecture.md "One definition of bytes") and
    the ``nodes`` layout (node id of every rank)."""

    rank = bytes_sent = bytes_received = 0
    nodes: List[int] = []

    @property
    def spans_nodes(self) -> bool:
        """Whether the group holds ranks of more than one node."""
        return len(set(self.nodes)) > 1

    def _count(self, data: torch.Tensor, root: Optional[int] = None) -> torch.Tensor:
        """Count a reduction of ``data`` (or its broadcast from ``root``): :func:`moved_bytes`."""
        sent, received = moved_bytes(data, self.rank, root)
        self.bytes_sent += sent
        self.bytes_received += received
        return data


def moved_bytes(data: torch.Tensor, rank: int = 0, root: Optional[int] = None) -> Tuple[int, int]:
    """``(sent, received)`` bytes of a collective over ``data`` on ``rank`` (docs/architecture.md,
    "One definition of bytes"): a reduction sends and receives its bytes on every rank; a
    broadcast from ``root`` is sent by the root and received by every rank, the root too."""
    nbytes = data.numel() * data.element_size()
    return (nbytes if root is None or rank == root else 0), nbytes


def _cut(out: torch.Tensor, counts: Sequence[int]) -> List[torch.Tensor]:
    """``out`` cut into consecutive pieces of ``counts`` elements (views)."""
    return list(torch.split(out, [int(c) for c in counts]))


class MPIExchange(Messages):
    """:class:`PointToPoint` over an mpi4py communicator (host memory: tensors on a GPU are
    copied to the host and back by the callers' ``.cpu()`` / ``.to(device)``).

    Args:
        comm: an mpi4py communicator (the optimizer passes its own duplicate of the process
            set's).
        nodes: node id of every rank of ``comm``, when the caller knows the layout (e.g. an
            emulated one); None: :func:`node_ids` of the processor names, gathered at
            construction (collective).

    Raises:
        ValueError: ``nodes`` does not give one id per rank of ``comm``.
    """

    def __init__(self, comm, nodes: Optional[Sequence[int]] = None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if nodes is not None and len(nodes) != self.size:
            raise ValueError(f"nodes gives {len(nodes)} node ids for a communicator of {self.size} ranks")
        self.nodes = list(nodes) if nodes is not None else node_ids(comm.allgather(MPI.Get_processor_name()))

    def allreduce_(self, data: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``data`` in place over every rank with one MPI Allreduce; returns it.

        ``data``: a contiguous CPU tensor of a dtype NumPy holds, the same shape on every rank;
        ``op``: ``"sum"``, ``"max"`` or ``"min"``. Bytes: :func:`moved_bytes`.

        Raises:
            ValueError: an unknown ``op``, or ``data`` not a contiguous CPU tensor.
        """
        ops = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}
        if op not in ops:
            raise ValueError(f"allreduce_ op must be one of {sorted(ops)}, got {op!r}")
        self.comm.Allreduce(self.MPI.IN_PLACE, _host_buffer(data), op=ops[op])
        return self._count(data)

    def broadcast_(self, data: torch.Tensor, root: int) -> torch.Tensor:
        """Rank ``root``'s ``data`` written into ``data`` on every rank (one MPI Bcast); returns it.

        ``data``: a contiguous CPU tensor, the same shape and dtype on every rank. Bytes:
        :func:`moved_bytes`.

        Raises:
            ValueError: ``data`` not a contiguous CPU tensor.
        """
        self.comm.Bcast(_host_buffer(data), root=root)
        return self._count(data, root)

    def send(self, data, dest):
        buf = data.cpu().numpy()
        self.comm.Send([buf, self.MPI.BYTE], dest=dest, tag=71)
        self.bytes_sent += buf.nbytes

    def recv(self, source, max_bytes):
        buf = torch.empty(int(max_bytes), dtype=torch.uint8)
        status = self.MPI.Status()
        self.comm.Recv([buf.numpy(), self.MPI.BYTE], source=source, tag=71, status=status)
        n = status.Get_count(self.MPI.BYTE)
        self.bytes_received += n
        return buf[:n]

    def sendrecv(self, data, partner, max_bytes):
        send = data.cpu().numpy()
        buf = torch.empty(int(max_bytes), dtype=torch.uint8)
        status = self.MPI.Status()
        self.comm.Sendrecv([send, self.MPI.BYTE], dest=partner, sendtag=72,
                           recvbuf=[buf.numpy(), self.MPI.BYTE], source=partner, recvtag=72, status=status)
        n = status.Get_count(self.MPI.BYTE)
        self.bytes_sent += send.nbytes
        self.bytes_received += n
        return buf[:n]

    def alltoall(self, parts):
        send = [p.cpu().numpy() for p in parts]
        counts = np.array([a.nbytes for a in send], dtype=np.int64)
        recv_counts = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(counts, recv_counts)
        sbuf = np.concatenate(send) if send else np.zeros(0, np.uint8)
        rbuf = np.empty(int(recv_counts.sum()), dtype=np.uint8)
        sdis = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rdis = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
        self.comm.Alltoallv([sbuf, counts, sdis, self.MPI.BYTE], [rbuf, recv_counts, rdis, self.MPI.BYTE])
        me = self.rank
        self.bytes_sent += int(counts.sum() - counts[me]) + 8 * (self.size - 1)
        self.bytes_received += int(recv_counts.sum() - recv_counts[me]) + 8 * (self.size - 1)
        return _cut(torch.from_numpy(rbuf), recv_counts)

    def allgather(self, data):
        mine = data.cpu().numpy()
        counts = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(np.array([mine.nbytes], dtype=np.int64), counts)
        rbuf = np.empty(int(counts.sum()), dtype=np.uint8)
        dis = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.comm.Allgatherv(mine, [rbuf, counts, dis, self.MPI.BYTE])
        self.bytes_sent += mine.nbytes + 8
        self.bytes_received += int(counts.sum() - counts[self.rank]) + 8 * (self.size - 1)
        return _cut(torch.from_numpy(rbuf), counts)


class HorovodExchange(Messages):
    """The all-to-all and allgather of :class:`PointToPoint` through Horovod's collectives
    (``hvd.alltoall`` with splits, ``hvd.allgather``), for elastic Horovod (its Gloo controller; MPI
    communicators would not survive its reset). ``send``, ``recv`` and ``sendrecv`` raise. Making
    one runs no collective.

    Args:
        hvd: the Horovod module (``horovod.torch``).
        rank, size: this rank and the size of the global process set (the whole job).
        prefix: names the collectives (``prefix.alltoall``, ``prefix.allgather``: blocking, so
            one name serves every call).

    Attributes:
        messages: False: no ``send``/``recv`` (a method whose route ``needs_messages`` is
            refused at assembly).
    """

    messages = False

    def __init__(self, hvd, rank: int, size: int, prefix: str):
        self.hvd, self.rank, self.size, self.prefix = hvd, int(rank), int(size), prefix

    def _name(self, what: str) -> str:
        return f"{self.prefix}.{what}"

    def _refuse(self, *_args):
        raise RuntimeError("HorovodExchange has no point-to-point messages (Horovod's collectives only): "
                           "launch with mpirun or horovodrun --mpi for this method")

    send = recv = sendrecv = _refuse

    def alltoall(self, parts):
        if len(parts) != self.size:
            raise ValueError(f"alltoall needs one part per rank ({self.size}), got {len(parts)}")
        data = [p.detach().cpu().contiguous().view(torch.uint8).reshape(-1) for p in parts]
        splits = torch.tensor([d.numel() for d in data], dtype=torch.int32)
        out, received = self.hvd.alltoall(torch.cat(data), splits=splits, name=self._name("alltoall"))
        counts = [int(c) for c in received]
        me = self.rank
        self.bytes_sent += sum(4 + d.numel() for j, d in enumerate(data) if j != me)
        self.bytes_received += sum(4 + c for j, c in enumerate(counts) if j != me)
        return _cut(out, counts)

    def allgather(self, data):
        mine = data.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
        counts = self.hvd.allgather(torch.tensor([mine.numel()], dtype=torch.int64),
                                    name=self._name("allgather.sizes")).tolist()
        out = self.hvd.allgather(mine, name=self._name("allgather"))
        self.bytes_sent += 8 + mine.numel()
        self.bytes_received += sum(8 + c for j, c in enumerate(counts) if j != self.rank)
        return _cut(out, counts)


def _host_buffer(data: torch.Tensor) -> np.ndarray:
    """The NumPy view MPI writes into (no copy)."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("the mpi4py collectives take a contiguous CPU tensor: pass t.contiguous().cpu() "
                         "and copy the result back")
    return data.numpy()


def node_ids(hosts: Sequence[str]) -> List[int]:
    """Node id per rank from each rank's host name: 0, 1, … in order of first appearance."""
    seen: dict = {}
    return [seen.setdefault(h, len(seen)) for h in hosts]


class SubGroup:
    """Point-to-point messages (``send``, ``recv``, ``sendrecv``) among a subset of the ranks of
    another :class:`PointToPoint`, renumbered 0 … len(members) − 1 in the order given (for the
    node-local and cross-node stages of a hierarchical exchange). Byte counters are the parent's.

    Args:
        parent: the full group's messages.
        members: ranks of ``parent`` in this subset; must include ``parent.rank``.

    Raises:
        ValueError: this rank is not among ``members``.
    """

    def __init__(self, parent, members: Sequence[int]):
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not among the members {list(members)}")
        self.parent, self.members = parent, list(members)
        self.rank, self.size = self.members.index(parent.rank), len(self.members)

    def send(self, data, dest):
        self.parent.send(data, self.members[dest])

    def recv(self, source, max_bytes):
        return self.parent.recv(self.members[source], max_bytes)

    def sendrecv(self, data, partner, max_bytes):
        return self.parent.sendrecv(data, self.members[partner], max_bytes)


def pack_payload(payload: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 message holding a payload's tensors: an int64 header (count, then dtype code and
    element count per tensor) and their bytes back to back.

    Raises:
        TypeError: a tensor dtype outside the supported set (floats, ints, bool, uint8).
    """
    header = [len(payload)]
    for t in payload:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot pack a {t.dtype} payload tensor")
        header += [_DTYPES.index(t.dtype), t.numel()]
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head] + [t.detach().reshape(-1).contiguous().cpu().view(torch.uint8) for t in payload])


def message_bytes(numels: Sequence[int], itemsizes: Sequence[int]) -> int:
    """Exact bytes of one message (:func:`pack_payload`): the int64 header
    ``8·(1 + 2·tensors)`` (count; dtype and element count per tensor) plus the tensors' bytes."""
    return 8 * (1 + 2 * len(numels)) + sum(int(n) * int(s) for n, s in zip(numels, itemsizes))


def unpack_payload(data: torch.Tensor, device=None) -> List[torch.Tensor]:
    """The tensors :func:`pack_payload` packed (1-D each), on ``device`` (default: the data's)."""
    data = data.cpu()  # (a slice of a receive buffer: views of other dtypes need aligned copies)
    count = int(data[:8].clone().view(torch.int64)[0])
    header = data[8:8 + 16 * count].clone().view(torch.int64).tolist()
    pos, out = 8 + 16 * count, []
    for j in range(count):
        dtype, numel = _DTYPES[header[2 * j]], header[2 * j + 1]
        nbytes = numel * dtype.itemsize
        out.append(data[pos:pos + nbytes].clone().view(dtype).to(device or data.device))
        pos += nbytes
    return out
