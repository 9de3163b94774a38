"""The ranks of a ``torch.distributed`` process group and the collectives hvdcomp runs among them
(gloo on CPU, NCCL on CUDA; no Horovod, no MPI), for the DDP front-end (:mod:`hvdcomp.ddp`).

:class:`TorchDistGroup` is to ``torch.distributed`` what :class:`hvdcomp.comm.group.Group` is to a
Horovod process set: size, rank, the asynchronous collectives the payload transport
(:mod:`hvdcomp.transports.torchdist`) issues, the small blocking ones the agreements need
(:mod:`hvdcomp.agreement` calls ``allgather_object`` / ``broadcast_object`` / ``allgather_ints`` on
any group), and the :class:`~hvdcomp.comm.step.StepComm` of the step-wide methods.
:class:`TorchDistExchange` is a :class:`~hvdcomp.comm.exchange.PointToPoint` over it.
"""
from __future__ import annotations

import socket
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .exchange import node_ids
from .retain import retain
from .step import StepComm, timed_step_comm

__all__ = ["TorchDistGroup", "TorchDistExchange"]


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
        self._p2p: Optional[TorchDistExchange] = None

    def describe(self) -> dict:
        """JSON-able: backend and global ranks of the members."""
        return {"backend": self.backend, "ranks": self.ranks}

    # ---- asynchronous collectives (work handles: ``.wait()``) ---------------------------------------
    def all_reduce_async(self, tensor: torch.Tensor):
        """Start a summed ``all_reduce`` of ``tensor`` in place."""
        retain(tensor)  # (every tensor handed to a collective: held until the backend lets go, retain.py)
        return self.dist.all_reduce(tensor, group=self.process_group, async_op=True)

    def all_gather_into_async(self, out: torch.Tensor, tensor: torch.Tensor):
        """Start gathering every rank's ``tensor`` (same size everywhere) into the 1-D ``out`` of
        ``size`` times its size, in rank order."""
        retain(out, tensor)
        return self._gather_into(out, tensor, group=self.process_group, async_op=True)

    def all_gather_async(self, pieces: List[torch.Tensor], tensor: torch.Tensor):
        """Start gathering every rank's ``tensor`` (same size everywhere) into ``pieces`` (one per
        rank)."""
        retain(*pieces, tensor)
        return self.dist.all_gather(pieces, tensor, group=self.process_group, async_op=True)

    # ---- small blocking collectives -----------------------------------------------------------------
    def allgather_ints(self, values: Sequence[int]) -> List[List[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order (one blocking gather)."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if self.size == 1:
            return [mine.tolist()]
        every = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        retain(mine, every)
        self._gather_into(every, mine, group=self.process_group)
        return every.view(self.size, -1).tolist()

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order (``name``: unused, collectives of one
        group run in issue order)."""
        if self.size == 1:
            return [obj]
        out: List[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def broadcast_object(self, obj: Any, root: int, name: Optional[str] = None) -> Any:
        """``obj`` of the member whose group rank is ``root``, on every member."""
        if self.size == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[root], group=self.process_group)
        return box[0]

    def allreduce_mean(self, tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
        """The mean of ``tensor`` over the members, as a new tensor: summed ``all_reduce``, then
        ``× 1/N`` (Horovod's ``op=Average``)."""
        out = tensor.detach().clone()
        if self.size > 1:
            retain(out)
            self.dist.all_reduce(out, group=self.process_group)
            out.mul_(1.0 / self.size)
        return out

    def broadcast(self, tensor: torch.Tensor, root: int, name: Optional[str] = None) -> torch.Tensor:
        """The ``tensor`` of the member whose group rank is ``root`` (same shape and dtype on
        every member), as a new tensor."""
        out = tensor.detach().clone()
        if self.size > 1:
            retain(out)
            self.dist.broadcast(out, src=self.ranks[root], group=self.process_group)
        return out

    # ---- a step-wide method's collectives -------------------------------------------------------------
    def step_comm(self, timer, point_to_point: bool = False) -> StepComm:
        """The collectives of a step-wide method's step (:func:`hvdcomp.comm.step.timed_step_comm`:
        timed as ``communicate``, bytes to ``timer``): :meth:`allreduce_mean`, :meth:`broadcast`
        and, with ``point_to_point``, messages over a gloo group (:class:`TorchDistExchange`;
        made once, collectively, on first use)."""
        p2p = None
        if point_to_point and self.size > 1:
            if self._p2p is None:
                self._p2p = TorchDistExchange(self)
            p2p = self._p2p
        return timed_step_comm(self.allreduce_mean, self.broadcast, self.rank, self.size, timer, p2p)


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
        sizes = {k: self._header(v.numel()) for k, v in out.items()}
        retain(*out.values(), *heads.values(), *sizes.values())
        works = [d.isend(sizes[k], self.ranks[k], group=self.group) for k in out]
        works += [d.irecv(h, self.ranks[s], group=self.group) for s, h in heads.items()]
        for w in works:
            w.wait()
        bufs = {s: torch.empty(int(h[0]), dtype=torch.uint8) for s, h in heads.items()}
        retain(*bufs.values())
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
