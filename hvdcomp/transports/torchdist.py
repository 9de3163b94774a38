"""The torch.distributed transport: compressed payloads over a ``torch.distributed`` process group
(gloo on CPU, NCCL on CUDA), for the DDP front-end (:mod:`hvdcomp.ddp`). No Horovod, no MPI.

How a payload travels depends on its kind, read from the compressor in one place
(:func:`payload_kind`):

==============  ==========================================================================  =============
kind            collectives on the group                                                    methods
==============  ==========================================================================  =============
``gradient``    the bucket itself, as DDP's own path: ``× 1/N``, then a summed ``all_reduce``  ``none``
                in place (bit-identical to DDP without a hook)
``average``     summed ``all_reduce`` of the payload (one per dtype), then ``× 1/N`` (Horovod's  fp16, bf16,
                ``op=Average``: sum, then post-scale); ``decode`` of the mean                  (ef) ...
``sum``         summed ``all_reduce``; ``decode`` receives the sum (sign votes)              signsgd
``gather``      counts exchange (``all_gather_into_tensor`` of int64 element counts), then    top-k, DGC,
                every rank's payload bytes padded to the largest rank's and gathered with     QSGD, ...
                one ``all_gather_into_tensor``; aggregated on every rank
``batched``     the method's own step-wide collectives through a                              PowerSGD,
                :class:`~hvdcomp.comm.step.StepComm` built here (``all_reduce``,              gtopk, cltk,
                ``broadcast``, point-to-point messages)                                       twophase
==============  ==========================================================================  =============

The gather's data phase uses ``all_gather_into_tensor`` with padding rather than ``all_gather``
into a list of tensors (:data:`GATHER_INTO_TENSOR`): a quick ratio on gloo, 2 and 4 ranks on a
loaded 2-core machine (not evidence of speed), put the two within noise of each other (list /
into-tensor 0.6–1.4 from 4 KiB to 4 MiB); one contiguous output is also NCCL's native form. Top-k
payloads have the same size on every rank, so they carry no padding.

Byte counters (:class:`Exchange` results) count what each collective moves for this rank, as
the Horovod front-end counts: an ``all_reduce`` of B bytes sends and receives B; a gather sends
its counts (8 bytes per payload tensor) and its padded data, and receives those of the other
N − 1 ranks. Point-to-point messages count their size headers (8 bytes each).

All collectives of a step are issued from the thread that runs DDP's communication hooks, in
bucket order, so every rank issues them in the same order (issuing them from future callbacks,
which run on gloo's worker threads in completion order, is what makes collectives mismatch).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..comm.exchange import node_ids
from ..comm.step import StepComm
from ..compressors.base import Compressor, PayloadKind

__all__ = ["payload_kind", "KINDS", "TorchDistGroup", "Exchange", "TorchDistExchange", "GATHER_INTO_TENSOR"]

KINDS = ("gradient", "average", "sum", "gather", "batched")

#: data phase of a gather: True: padded ``all_gather_into_tensor`` (one output buffer); False:
#: ``all_gather`` into a list of per-rank tensors (same padding; gloo needs equal sizes either way)
GATHER_INTO_TENSOR = True

_ALIGN = 8  # bytes: each payload tensor starts at a multiple of 8, so a uint8 slice views any dtype


def payload_kind(compression) -> str:
    """How ``compression``'s payloads travel (one of :data:`KINDS`, see the module docstring).

    The one place that reads what the method's payloads are (a step-wide method, or its
    :class:`~hvdcomp.compressors.base.PayloadKind`)."""
    if not isinstance(compression, Compressor):
        return "batched"
    if compression.payload_is_gradient:
        return "gradient"
    return {PayloadKind.SUM: "sum", PayloadKind.MEAN: "average"}.get(compression.payload_kind, "gather")


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class Exchange:
    """One bucket's collectives in flight.

    Attributes:
        works: the ``torch.distributed`` work handles to wait for.
        outputs: what the collectives write (reduced payload tensors, or a gather's buffers).
        sent, received: bytes this rank puts on / takes off the wire (see the module docstring).
        payload: the payload tensors (a gather: this rank's, to pack once the counts are known).
        counts: a gather's gathered element counts, ``(size, tensors)`` int64, once exchanged.
        data_started: a gather's data phase has started (:meth:`TorchDistGroup.start_gather_data`).
    """

    works: List[Any] = field(default_factory=list)
    outputs: List[torch.Tensor] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    payload: Sequence[torch.Tensor] = ()
    counts: Optional[torch.Tensor] = None
    data_started: bool = False

    def wait(self) -> None:
        """Wait for every collective of the exchange (blocking; CUDA: stream-ordered)."""
        for w in self.works:
            w.wait()
        self.works = []


class TorchDistGroup:
    """The ranks a DDP model averages over, and the collectives hvdcomp runs among them.

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
        import torch.distributed as dist

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
        # one output buffer for all ranks (torch 2.13 renames all_gather_into_tensor to this)
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._p2p = None

    def describe(self) -> dict:
        """JSON-able: backend and global ranks of the members."""
        return {"backend": self.backend, "ranks": self.ranks}

    # ---- summable payloads ----------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor]) -> Exchange:
        """Start a summed ``all_reduce`` of each tensor, in place (asynchronous)."""
        ex = Exchange(outputs=list(tensors))
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            ex.sent += nbytes
            ex.received += nbytes
            if self.size > 1:
                ex.works.append(self.dist.all_reduce(t, group=self.process_group, async_op=True))
        return ex

    # ---- variable-size payloads -------------------------------------------------------------------
    def start_gather(self, payload: Sequence[torch.Tensor]) -> Exchange:
        """Start the counts exchange of a gather (asynchronous); :meth:`start_gather_data` sends
        the data once the counts are in, :meth:`gathered` cuts the result per rank.

        ``payload``: 1-D tensors, the same number and dtypes on every rank (sizes may differ)."""
        ex = Exchange(payload=list(payload))
        mine = torch.tensor([t.numel() for t in payload], dtype=torch.int64, device=self.device)
        if self.size == 1:
            ex.counts = mine.view(1, -1)
            return ex
        every = torch.empty(self.size * len(payload), dtype=torch.int64, device=self.device)
        ex.works.append(self._gather_into(every, mine, group=self.process_group, async_op=True))
        ex.counts = every.view(self.size, len(payload))
        ex.sent += mine.numel() * 8
        ex.received += (self.size - 1) * mine.numel() * 8
        return ex

    def start_gather_data(self, ex: Exchange) -> None:
        """Wait for ``ex``'s counts, then start the padded data gather (asynchronous). Idempotent."""
        if ex.data_started:
            return
        ex.wait()
        ex.data_started = True
        if self.size == 1:
            return
        sizes = [t.element_size() for t in ex.payload]
        per_rank = [sum(_padded(c * s) for c, s in zip(row, sizes)) for row in ex.counts.tolist()]
        width = max(per_rank)
        device = ex.payload[0].device if ex.payload else self.device
        parts = []
        for t in ex.payload:
            raw = t.detach().contiguous().view(-1).view(torch.uint8)
            parts.append(raw)
            pad = _padded(raw.numel()) - raw.numel()
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        filled = sum(p.numel() for p in parts)
        if width > filled:
            parts.append(torch.zeros(width - filled, dtype=torch.uint8, device=device))
        mine = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
        if width:
            if GATHER_INTO_TENSOR:
                out = torch.empty(self.size * width, dtype=torch.uint8, device=device)
                ex.works.append(self._gather_into(out, mine, group=self.process_group,
                                                                 async_op=True))
            else:
                pieces = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(self.size)]
                ex.works.append(self.dist.all_gather(pieces, mine, group=self.process_group, async_op=True))
                out = pieces
            ex.outputs = [out]
        ex.sent += width
        ex.received += (self.size - 1) * width

    def gathered(self, ex: Exchange) -> List[List[torch.Tensor]]:
        """Every rank's payload (rank order) of a finished gather: views of the received buffer
        (this rank's own payload as given)."""
        ex.wait()
        if self.size == 1:
            return [list(ex.payload)]
        counts = ex.counts.tolist()
        dtypes = [t.dtype for t in ex.payload]
        sizes = [t.element_size() for t in ex.payload]
        width = max(sum(_padded(c * s) for c, s in zip(row, sizes)) for row in counts)
        out = []
        for r, row in enumerate(counts):
            if r == self.rank:
                out.append(list(ex.payload))
                continue
            if not width:
                out.append([torch.zeros(0, dtype=d, device=t.device) for d, t in zip(dtypes, ex.payload)])
                continue
            buf = ex.outputs[0][r] if isinstance(ex.outputs[0], list) else ex.outputs[0][r * width:(r + 1) * width]
            pos, tensors = 0, []
            for c, s, d in zip(row, sizes, dtypes):
                tensors.append(buf[pos:pos + c * s].view(d))
                pos += _padded(c * s)
            out.append(tensors)
        return out

    # ---- small blocking collectives -----------------------------------------------------------------
    def all_gather_ints(self, values: Sequence[int]) -> List[List[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order (one blocking gather)."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if self.size == 1:
            return [mine.tolist()]
        every = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        self._gather_into(every, mine, group=self.process_group)
        return every.view(self.size, -1).tolist()

    def allgather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        out: List[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``obj`` of the member whose group rank is ``root``, on every member."""
        if self.size == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[root], group=self.process_group)
        return box[0]

    # ---- a batched method's collectives -------------------------------------------------------------
    def step_comm(self, timer, point_to_point: bool = False) -> StepComm:
        """The collectives of a batched compressor's step: mean by summed ``all_reduce`` then
        ``× 1/N``, broadcast, and (``point_to_point``) messages over a gloo group
        (:class:`TorchDistExchange`; made once, collectively, on first use). Timed as
        ``communicate``; bytes go to ``timer``."""
        p2p = None
        if point_to_point and self.size > 1:
            if self._p2p is None:
                self._p2p = TorchDistExchange(self)
            p2p = self._p2p
        return StepComm(lambda t, name: self._mean(t, timer), self.rank, self.size,
                        lambda t, root, name: self._broadcast(t, root, timer), p2p)

    def _mean(self, tensor: torch.Tensor, timer) -> torch.Tensor:
        out = tensor.detach().clone()
        nbytes = out.numel() * out.element_size()
        if self.size > 1:
            with timer.phase("communicate"):
                self.dist.all_reduce(out, group=self.process_group)
                out.mul_(1.0 / self.size)
        timer.add_bytes(sent=nbytes, received=nbytes)
        return out

    def _broadcast(self, tensor: torch.Tensor, root: int, timer) -> torch.Tensor:
        out = tensor.detach().clone()
        nbytes = out.numel() * out.element_size()
        if self.size > 1:
            with timer.phase("communicate"):
                self.dist.broadcast(out, src=self.ranks[root], group=self.process_group)
        timer.add_bytes(sent=nbytes if self.rank == root else 0, received=nbytes)
        return out


class TorchDistExchange:
    """:class:`hvdcomp.comm.exchange.PointToPoint` over ``torch.distributed``: byte messages
    among the ranks of a :class:`TorchDistGroup`, on a gloo process group over the same ranks (host
    memory whatever the devices; callers move tensors with ``.cpu()`` / ``.to(device)``, as for
    MPI). Each message is an int64 size header, then the bytes.

    Made collectively by every member (it creates the gloo group, unless the group is gloo
    already, and gathers the host names once).

    Attributes:
        rank, size: as the group's.
        bytes_sent, bytes_received: message bytes this rank moved, headers included.
        nodes: node id of every rank (ranks of one host share one: :func:`hvdcomp.comm.exchange.node_ids`).
    """

    def __init__(self, group: TorchDistGroup):
        dist = group.dist
        self.dist, self.ranks = dist, group.ranks
        self.rank, self.size = group.rank, group.size
        if group.backend == "gloo":
            self.group = group.process_group
        else:
            self.group = dist.new_group(group.ranks, backend="gloo", use_local_synchronization=True)
        self.bytes_sent = 0
        self.bytes_received = 0
        hosts: List[Any] = [None] * self.size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        self.nodes = node_ids(hosts)

    def _header(self, n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int64)

    def send(self, data, dest):
        data = data.detach().cpu().contiguous().view(torch.uint8)
        self.dist.send(self._header(data.numel()), self.ranks[dest], group=self.group)
        if data.numel():
            self.dist.send(data, self.ranks[dest], group=self.group)
        self.bytes_sent += 8 + data.numel()

    def recv(self, source, max_bytes):
        head = torch.empty(1, dtype=torch.int64)
        self.dist.recv(head, self.ranks[source], group=self.group)
        n = int(head[0])
        if n > max_bytes:
            raise RuntimeError(f"a message of {n} bytes from rank {source} exceeds the {max_bytes} expected")
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            self.dist.recv(buf, self.ranks[source], group=self.group)
        self.bytes_received += 8 + n
        return buf

    def _exchange(self, outgoing: dict, sources: Sequence[int]) -> dict:
        """Send ``outgoing[dest]`` to each dest and receive one message from each source,
        without deadlock (non-blocking sends and receives: headers first, then the bytes)."""
        d = self.dist
        out = {k: v.detach().cpu().contiguous().view(torch.uint8) for k, v in outgoing.items()}
        heads = {s: torch.empty(1, dtype=torch.int64) for s in sources}
        works = [d.isend(self._header(v.numel()), self.ranks[k], group=self.group) for k, v in out.items()]
        works += [d.irecv(h, self.ranks[s], group=self.group) for s, h in heads.items()]
        for w in works:
            w.wait()
        bufs = {s: torch.empty(int(h[0]), dtype=torch.uint8) for s, h in heads.items()}
        works = [d.isend(v, self.ranks[k], group=self.group) for k, v in out.items() if v.numel()]
        works += [d.irecv(b, self.ranks[s], group=self.group) for s, b in bufs.items() if b.numel()]
        for w in works:
            w.wait()
        self.bytes_sent += sum(8 + v.numel() for v in out.values())
        self.bytes_received += sum(8 + b.numel() for b in bufs.values())
        return bufs

    def sendrecv(self, data, partner, max_bytes):
        got = self._exchange({partner: data}, [partner])[partner]
        if got.numel() > max_bytes:
            raise RuntimeError(f"a message of {got.numel()} bytes from rank {partner} exceeds the {max_bytes} expected")
        return got

    def alltoall(self, parts):
        if len(parts) != self.size:
            raise ValueError(f"alltoall needs one part per rank ({self.size}), got {len(parts)}")
        others = [j for j in range(self.size) if j != self.rank]
        got = self._exchange({j: parts[j] for j in others}, others)
        own = parts[self.rank].detach().cpu().contiguous().view(torch.uint8).clone()
        return [own if j == self.rank else got[j] for j in range(self.size)]

    def allgather(self, data):
        return self.alltoall([data] * self.size)
