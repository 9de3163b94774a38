"""The :class:`~hvdcomp.comm.group.ProcessGroup` of a ``torch.distributed`` process group (gloo on
CPU, NCCL on CUDA; torchrun or srun; no Horovod, no MPI): :class:`TorchDistGroup`, its
variable-size allgather of payloads (:class:`TorchDistAllgatherer`) and its byte messages
(:class:`TorchDistExchange`). Collectives match by issue order (``ordered``).
"""
from __future__ import annotations

import datetime
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .allgatherv import COUNT_BYTES, Allgatherer
from .exchange import Messages, node_ids
from .group import ProcessGroup, pickled, unpickled
from .retain import retain

__all__ = ["TorchDistGroup", "TorchDistAllgatherer", "TorchDistExchange", "exchange_messages"]


class _Reduction:
    """A started allreduce: its result tensor, the work handle (None alone) and the scale to
    apply once it is in."""

    __slots__ = ("tensor", "work", "scale")

    def __init__(self, tensor, work, scale):
        self.tensor, self.work, self.scale = tensor, work, scale


class TorchDistGroup(ProcessGroup):
    """The ranks a DDP model averages over, and the collectives hvdcomp runs among them. An
    in-place average divides by the size first, then sums (as DDP reduces a bucket); an average
    into a new tensor sums, then scales (as Horovod's ``op=Average``).

    Args:
        process_group: a ``torch.distributed`` process group (the default group when None),
            usually the DDP model's own (``ddp_model.process_group``).

    Attributes:
        size, rank: the group's size and this process's rank in it.
        ranks: global ranks of the members (group rank order).
        backend: ``"gloo"``, ``"nccl"``, ...
        device: where the group's collectives want tensors (``cuda:<current>`` for NCCL, else CPU).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, process_group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group"
                               "(backend) first (torchrun and srun set the rank variables it reads; see "
                               "hvdcomp.ddp.init_process_group)")
        self.dist = dist
        self.process_group = process_group
        self.size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.ranks: List[int] = list(dist.get_process_group_ranks(process_group or dist.group.WORLD))
        self.backend = str(dist.get_backend(process_group))
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self._p2p: Optional[TorchDistExchange] = None

    ordered = True  # (collectives match by issue order)

    @staticmethod
    def _gather_into(out: torch.Tensor, tensor: torch.Tensor, **kwargs):
        # one output buffer for all ranks (torch 2.13 renames all_gather_into_tensor to this)
        return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, **kwargs)

    # ---- allreduce (ProcessGroup) ---------------------------------------------------------------------
    def allreduce_async_(self, tensor: torch.Tensor, name: str = "", average: bool = True, prescale: float = 1.0,
                         postscale: float = 1.0) -> _Reduction:
        """Start ``postscale · Σ (prescale · tensor / size)`` in place (``/ size`` with
        ``average``; divided first, as DDP reduces a gradient bucket)."""
        return self._start(tensor, prescale / self.size if average else prescale, postscale)

    def allreduce_async(self, tensor: torch.Tensor, name: str = "", average: bool = True, prescale: float = 1.0,
                        postscale: float = 1.0) -> _Reduction:
        """Start ``postscale · Σ (prescale · tensor) / size`` into a new tensor (``/ size`` with
        ``average``; summed first, then scaled, as Horovod's ``op=Average``)."""
        return self._start(tensor.detach().clone(), prescale, postscale / self.size if average else postscale)

    def _start(self, tensor: torch.Tensor, prescale: float, postscale: float) -> _Reduction:
        """Scale ``tensor`` by ``prescale`` and start its in-place sum, ``postscale`` to apply."""
        if prescale != 1.0:
            tensor.mul_(prescale)
        work = None
        if self.size > 1:
            retain(tensor)  # (every tensor handed to a collective: held until the backend lets go, retain.py)
            work = self.dist.all_reduce(tensor, group=self.process_group, async_op=True)
        return _Reduction(tensor, work, postscale)

    def synchronize(self, handle: _Reduction) -> torch.Tensor:
        """Wait for a started allreduce; returns its result."""
        if handle.work is not None:
            handle.work.wait()
            handle.work = None
        if handle.scale != 1.0:
            handle.tensor.mul_(handle.scale)
            handle.scale = 1.0
        return handle.tensor

    def allgatherer(self, prefer: str = "auto", prefix: str = "hvdcomp") -> "TorchDistAllgatherer":
        """The variable-size allgather over this group (:class:`TorchDistAllgatherer`).

        Raises:
            RuntimeError: ``prefer`` names an MPI path (``"mpi4py"``, ``"hierarchical"``) or Horovod's.
            ValueError: an unknown ``prefer``.
        """
        if prefer not in ("auto", "mpi4py", "hierarchical", "horovod", "torch"):
            raise ValueError(f"allgather transport must be auto, mpi4py, hierarchical or horovod, got {prefer!r}")
        if prefer not in ("auto", "torch"):
            raise RuntimeError(f"allgather={prefer!r} needs Horovod/MPI; under torch.distributed the payloads are "
                               "gathered by torch.distributed itself: use allgather='auto'")
        return TorchDistAllgatherer(self)

    def point_to_point(self, gatherer=None) -> "TorchDistExchange":
        """:class:`TorchDistExchange` among the members (made once, collectively, on first use)."""
        if self._p2p is None:
            self._p2p = TorchDistExchange(self)
        return self._p2p

    # ---- asynchronous collectives (work handles: ``.wait()``) ---------------------------------------
    def all_gather_into_async(self, out: torch.Tensor, tensor: torch.Tensor):
        """Start gathering every rank's ``tensor`` (same size everywhere) into the 1-D ``out`` of
        ``size`` times its size, in rank order."""
        retain(out, tensor)  # (every tensor handed to a collective: held until the backend lets go, retain.py)
        return self._gather_into(out, tensor, group=self.process_group, async_op=True)

    # ---- small blocking collectives -----------------------------------------------------------------
    def allgather_ints(self, values: Sequence[int], name: Optional[str] = None) -> List[List[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order (one blocking gather)."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if self.size == 1:
            return [mine.tolist()]
        every = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        retain(mine, every)
        self._gather_into(every, mine, group=self.process_group)
        return every.view(self.size, -1).tolist()

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order (``name`` unused): the pickles' sizes,
        then the pickles padded to the longest, over this group's retained gathers
        (:mod:`hvdcomp.comm.retain` says why not ``torch.distributed.all_gather_object``)."""
        if self.size == 1:
            return [obj]
        mine = pickled(obj)
        sizes = [n for n, in self.allgather_ints([mine.numel()])]
        row = torch.zeros(max(sizes), dtype=torch.uint8)
        row[:mine.numel()] = mine
        every = torch.empty(self.size * row.numel(), dtype=torch.uint8, device=self.device)
        self.all_gather_into_async(every, row.to(self.device)).wait()
        rows = every.cpu().view(self.size, -1)
        return [unpickled(rows[r, :n]) for r, n in enumerate(sizes)]

    def broadcast_object(self, obj: Any, root: int, name: Optional[str] = None) -> Any:
        """``obj`` of the member whose group rank is ``root``, on every member (its pickle's
        size, then the pickle, over :meth:`broadcast`)."""
        if self.size == 1:
            return obj
        mine = pickled(obj) if self.rank == root else torch.zeros(0, dtype=torch.uint8)
        n = int(self.broadcast(torch.tensor([mine.numel()], device=self.device), root)[0])
        data = torch.zeros(n, dtype=torch.uint8) if self.rank != root else mine
        return unpickled(self.broadcast(data.to(self.device), root).cpu())

    def broadcast(self, tensor: torch.Tensor, root: int, name: Optional[str] = None) -> torch.Tensor:
        """The ``tensor`` of the member whose group rank is ``root`` (same shape and dtype on
        every member), as a new tensor."""
        out = tensor.detach().clone()
        if self.size > 1:
            retain(out)
            self.dist.broadcast(out, src=self.ranks[root], group=self.process_group)
        return out


_ALIGN = 8  # bytes: each payload tensor starts at a multiple of 8 in a gathered row (views any dtype)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Gather:
    """A gather in flight: counts first, then the padded data (see :class:`TorchDistAllgatherer`)."""

    __slots__ = ("payload", "device", "counts", "works", "out", "width", "bytes_sent", "bytes_received")


class TorchDistAllgatherer(Allgatherer):
    """The variable-size allgather of payloads over a :class:`TorchDistGroup`
    (:class:`~hvdcomp.comm.allgatherv.Allgatherer`), on the group itself (no staging copy),
    issued from the caller's thread in call order: the int64 counts (one
    ``all_gather_into_tensor``, started by :meth:`start`), then each rank's tensors end to end as
    bytes (each from a multiple of 8), padded to the largest rank's row (gloo and NCCL gather equal
    sizes), started at the next :meth:`start` or at :meth:`finish`. Bytes: the counts and rows,
    padding included (docs/architecture.md, "One definition of bytes").

    Args:
        group: the :class:`TorchDistGroup`.
    """

    kind = "torch.distributed"

    def __init__(self, group: TorchDistGroup):
        self.group, self.size, self.rank = group, group.size, group.rank
        self._unsent: List[_Gather] = []  # counts started, data not yet

    def start(self, payload: Sequence[torch.Tensor], name: str = "") -> _Gather:
        """Start the counts exchange of ``payload`` (1-D tensors, the same number and dtypes on
        every rank); starts the data of earlier gathers first (their counts are in by now)."""
        for h in self._unsent:
            self._start_data(h)
        self._unsent = []
        h = _Gather()
        h.payload = list(payload)
        h.works, h.out, h.width = [], None, 0
        h.device = payload[0].device if payload else self.group.device
        mine = torch.tensor([t.numel() for t in payload], dtype=torch.int64, device=self.group.device)
        h.bytes_sent, h.bytes_received = COUNT_BYTES * mine.numel(), COUNT_BYTES * mine.numel() * self.size
        if self.size == 1:
            h.counts = mine.view(1, -1)
        else:
            every = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.group.device)
            h.works.append(self.group.all_gather_into_async(every, mine))
            h.counts = every.view(self.size, mine.numel())
        self._unsent.append(h)
        return h

    def _start_data(self, h: _Gather) -> None:
        for w in h.works:
            w.wait()
        h.works = []
        device = h.device
        sizes = [t.element_size() for t in h.payload]
        counts = h.counts.tolist()
        h.width = max((sum(_aligned(c * z) for c, z in zip(row, sizes)) for row in counts), default=0)
        parts = []
        for t in h.payload:
            raw = t.detach().contiguous().view(-1).view(torch.uint8)
            parts.append(raw)
            if _aligned(raw.numel()) > raw.numel():
                parts.append(torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8, device=device))
        filled = sum(p.numel() for p in parts)
        if h.width > filled:
            parts.append(torch.zeros(h.width - filled, dtype=torch.uint8, device=device))
        row = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
        h.bytes_sent += h.width
        h.bytes_received += h.width * self.size
        if self.size == 1 or not h.width:
            h.out = row
            return
        h.out = torch.empty(self.size * h.width, dtype=torch.uint8, device=device)
        h.works.append(self.group.all_gather_into_async(h.out, row))

    def finish(self, h: _Gather) -> List[List[torch.Tensor]]:
        """Every rank's payload (rank order): views of the gathered buffer."""
        if h in self._unsent:
            self._unsent.remove(h)
            self._start_data(h)
        for w in h.works:
            w.wait()
        h.works = []
        sizes = [t.element_size() for t in h.payload]
        dtypes = [t.dtype for t in h.payload]
        out = []
        for r, row in enumerate(h.counts.tolist()):
            buf = h.out[r * h.width:(r + 1) * h.width]
            pos, tensors = 0, []
            for c, z, d in zip(row, sizes, dtypes):
                tensors.append(buf[pos:pos + c * z].view(d) if c else torch.zeros(0, dtype=d, device=h.out.device))
                pos += _aligned(c * z)
            out.append(tensors)
        return out

    def probe(self, nbytes: int) -> None:
        """Blocking ``all_gather_into_tensor`` of ``nbytes`` zero bytes per rank (cost model)."""
        mine = torch.zeros(int(nbytes), dtype=torch.uint8, device=self.group.device)
        out = torch.empty(int(nbytes) * self.size, dtype=torch.uint8, device=self.group.device)
        self.group.all_gather_into_async(out, mine).wait()

    def agree(self, values) -> np.ndarray:
        """Rank 0's ``values`` (float64) on every rank (one broadcast)."""
        t = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(self.group.device)
        return self.group.broadcast(t, 0).cpu().numpy()

    def allgather_ints(self, values, name: Optional[str] = None):
        """Every rank's ``values`` in rank order (:meth:`TorchDistGroup.allgather_ints`)."""
        return self.group.allgather_ints(values)


class TorchDistExchange(Messages):
    """:class:`hvdcomp.comm.exchange.PointToPoint` among the ranks of a :class:`TorchDistGroup`
    (:func:`exchange_messages` on a gloo group over the same ranks: host memory), and AB-training's
    :meth:`allreduce_` / :meth:`broadcast_` as :class:`hvdcomp.comm.exchange.MPIExchange`'s. Made
    collectively (the gloo group unless the group is gloo; the host names unless ``nodes`` is given).
    ``rank``, ``size``: as the group's; byte counters and ``nodes``: :class:`~hvdcomp.comm.exchange.Messages`.
    """

    def __init__(self, group: TorchDistGroup, nodes: Optional[Sequence[int]] = None):
        dist = group.dist
        self.dist, self.ranks = dist, group.ranks
        self.rank, self.size = group.rank, group.size
        if group.backend == "gloo":
            self.group = group.process_group
        else:
            self.group = dist.new_group(group.ranks, backend="gloo", use_local_synchronization=True)
        if nodes is None:
            nodes = node_ids(TorchDistGroup(self.group).allgather_object(socket.gethostname()))
        self.nodes = list(nodes)

    def allreduce_(self, data: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce the host tensor ``data`` in place over every rank (one ``all_reduce``); bytes
        counted as :meth:`hvdcomp.comm.exchange.MPIExchange.allreduce_` counts them.

        Raises:
            ValueError: an unknown ``op``.
        """
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"allreduce_ op must be one of {sorted(ops)}, got {op!r}")
        if self.size > 1:
            retain(data)
            self.dist.all_reduce(data, op=ops[op], group=self.group)
        return self._count(data)

    def broadcast_(self, data: torch.Tensor, root: int) -> torch.Tensor:
        """Rank ``root``'s ``data`` written into ``data`` on every rank (one ``broadcast``); bytes
        counted as :meth:`hvdcomp.comm.exchange.MPIExchange.broadcast_` counts them."""
        if self.size > 1:
            retain(data)
            self.dist.broadcast(data, src=self.ranks[root], group=self.group)
        return self._count(data, root)

    def _exchange(self, outgoing: dict, sources: Sequence[int], max_bytes: Optional[int] = None) -> dict:
        """:func:`exchange_messages` of host copies of ``outgoing``, counted; a received message
        over ``max_bytes`` raises ``RuntimeError``."""
        out = {k: v.detach().cpu().contiguous().view(torch.uint8) for k, v in outgoing.items()}
        bufs = exchange_messages(self.dist, self.group, self.ranks, out, sources)
        self.bytes_sent += sum(8 + v.numel() for v in out.values())
        self.bytes_received += sum(8 + b.numel() for b in bufs.values())
        for j, b in bufs.items():
            if max_bytes is not None and b.numel() > max_bytes:
                raise RuntimeError(f"a message of {b.numel()} bytes from rank {j} exceeds the {max_bytes} expected")
        return bufs

    def send(self, data, dest):
        self._exchange({dest: data}, [])

    def recv(self, source, max_bytes):
        return self._exchange({}, [source], max_bytes)[source]

    def sendrecv(self, data, partner, max_bytes):
        return self._exchange({partner: data}, [partner], max_bytes)[partner]

    def alltoall(self, parts):
        if len(parts) != self.size:
            raise ValueError(f"alltoall needs one part per rank ({self.size}), got {len(parts)}")
        others = [j for j in range(self.size) if j != self.rank]
        got = self._exchange({j: parts[j] for j in others}, others)
        own = parts[self.rank].detach().cpu().contiguous().view(torch.uint8).clone()
        return [own if j == self.rank else got[j] for j in range(self.size)]

    def allgather(self, data):
        return self.alltoall([data] * self.size)


def exchange_messages(dist, group, ranks: Sequence[int], send: Dict[int, torch.Tensor], sources: Sequence[int],
                      tag: int = 0, deadline: Optional[float] = None, late=None) -> Dict[int, torch.Tensor]:
    """Send ``send[j]`` (a 1-D uint8 host tensor) to each j and receive one message from each of
    ``sources`` (ranks of ``group``; global rank ``ranks[j]``), over ``torch.distributed`` point to
    point: per message an int64 size header, then the bytes, all posted non-blocking (no pair
    waits on the other). Returns the received bytes by source.

    With a ``deadline`` (``time.monotonic()`` seconds), a wait that passes it calls
    ``late(missing, unsent)`` (the peers not heard from, the peers that did not take this rank's
    message), which raises.
    """
    def wait(work) -> bool:
        if deadline is None:
            work.wait()
            return True
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(1e-3, deadline - time.monotonic())))
            return True
        except RuntimeError:
            return False

    sources = list(sources)
    heads = {j: torch.empty(1, dtype=torch.int64) for j in sources}
    sizes = {j: torch.tensor([data.numel()], dtype=torch.int64) for j, data in send.items()}
    retain(*heads.values(), *sizes.values(), *send.values())
    head_works = {j: dist.irecv(heads[j], ranks[j], group=group, tag=tag) for j in sources}
    sends = {j: [dist.isend(sizes[j], ranks[j], group=group, tag=tag)] for j in send}
    for j, data in send.items():
        if data.numel():
            sends[j].append(dist.isend(data, ranks[j], group=group, tag=tag))
    buffers, data_works = {}, {}
    for n, j in enumerate(sources):
        if not wait(head_works[j]):
            late(sources[n:], [])
        buffers[j] = torch.empty(int(heads[j][0]), dtype=torch.uint8)
        retain(buffers[j])
        if buffers[j].numel():
            data_works[j] = dist.irecv(buffers[j], ranks[j], group=group, tag=tag)
    for j, work in data_works.items():
        if not wait(work):
            late([j], [])
    for j, works in sends.items():
        if not all(wait(w) for w in works):
            late([], [j])
    return buffers
