"""The ranks an optimizer averages over, and the Horovod collectives it runs among them.

:class:`Group` wraps a Horovod process set (the global one by default): its size and this
process's rank in it, and the few collectives the optimizer needs outside the payload transport
(allreduce of mean payloads, object allgather and broadcast for set-up agreements). Every
Horovod call of the optimizer goes through here, so a process set is honoured everywhere.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, List

import torch

__all__ = ["Group", "HOROVOD_ALLREDUCE_DTYPES", "horovod"]

# dtypes Horovod 0.28's PyTorch allreduce accepts on CPU/MPI (no bfloat16)
HOROVOD_ALLREDUCE_DTYPES = (torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                            torch.int32, torch.int64)


def horovod():
    """``horovod.torch``, imported now (Horovod is optional: the compressors and the DDP front-end
    run without it).

    Raises:
        ImportError: Horovod is not installed (the message names the fix).
    """
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(f"hvdcomp.DistributedOptimizer is the Horovod front-end and needs Horovod, which is "
                          f"not importable here ({exc}). Build it with `make install` (scripts/install.sh; "
                          "HVDCOMP_HOROVOD=0 skips it), or use the DDP front-end, which needs no Horovod: "
                          "hvdcomp.ddp.register(DistributedDataParallel(model), 'topk:density=0.01', "
                          "optimizer=opt) (docs/ddp.md)") from exc
    return hvd


class Group:
    """A Horovod process set seen from one process.

    Args:
        process_set: a ``horovod.torch.ProcessSet`` (``hvd.global_process_set`` when None).

    Attributes:
        process_set: the Horovod process set.
        included: whether this process belongs to it (excluded processes train locally, as in
            Horovod).
        size: number of ranks in the set (1 for an excluded process).
        rank: this process's rank in the set (0 for an excluded process).
        ranks: global ranks of the members, ascending.

    Raises:
        RuntimeError: Horovod is not initialised.
        ValueError: ``process_set`` is not a Horovod ``ProcessSet`` registered with Horovod.
    """

    def __init__(self, process_set=None):
        hvd = horovod()
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call hvd.init() first")
        self.hvd = hvd
        ps = hvd.global_process_set if process_set is None else process_set
        if not hasattr(ps, "included") or getattr(ps, "process_set_id", None) is None:
            raise ValueError(f"process_set must be a horovod.torch.ProcessSet registered with Horovod "
                             f"(hvd.init(process_sets=[...]) or hvd.add_process_set(...)); got {process_set!r}")
        self.process_set = ps
        self.is_global = ps.process_set_id == hvd.global_process_set.process_set_id
        self.included = bool(ps.included())
        self.ranks: List[int] = list(ps.ranks) if ps.ranks is not None else list(range(hvd.size()))
        self.size = int(ps.size()) if self.included else 1
        self.rank = int(ps.rank()) if self.included else 0

    def describe(self) -> dict:
        """JSON-able description: global ranks of the members."""
        return {"ranks": self.ranks}

    # ---- collectives (members only) -----------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor, name: str, op, prescale: float = 1.0,
                        postscale: float = 1.0):
        """Horovod ``allreduce_async`` within the set; returns a handle for :meth:`synchronize`."""
        return self.hvd.allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                        postscale_factor=postscale, process_set=self.process_set)

    def allreduce_async_(self, tensor: torch.Tensor, name: str, op, prescale: float = 1.0,
                         postscale: float = 1.0):
        """:meth:`allreduce_async` in place: the result overwrites ``tensor`` (as stock Horovod
        reduces gradients)."""
        return self.hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                         postscale_factor=postscale, process_set=self.process_set)

    def synchronize(self, handle) -> torch.Tensor:
        """Wait for a handle from :meth:`allreduce_async`; returns the reduced tensor."""
        return self.hvd.synchronize(handle)

    def allreduce(self, tensor: torch.Tensor, name: str, op) -> torch.Tensor:
        """Blocking Horovod allreduce within the set."""
        return self.synchronize(self.allreduce_async(tensor, name, op))

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Blocking Horovod broadcast of the tensor of the member whose rank in the set is
        ``root`` (same shape and dtype on every member)."""
        return self.hvd.broadcast(tensor, root_rank=self.ranks[root], name=name, process_set=self.process_set)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every member's ``obj`` (picklable), in rank order (two Horovod allgathers)."""
        if self.size == 1:
            return [obj]
        buf = io.BytesIO()
        pickle.dump(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sizes = self.hvd.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz",
                                   process_set=self.process_set).tolist()
        gathered = self.hvd.allgather(data, name=f"{name}.data", process_set=self.process_set).numpy()
        out, start = [], 0
        for n in sizes:
            out.append(pickle.loads(gathered[start:start + n].tobytes()))
            start += n
        return out

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """``obj`` of the member whose rank in the set is ``root``, on every member."""
        if self.size == 1:
            return obj
        return self.hvd.broadcast_object(obj, root_rank=self.ranks[root], name=name,
                                         process_set=self.process_set)

    def mpi_comm(self):
        """An mpi4py communicator over the members (``COMM_WORLD`` for the global set), or
        ``None`` where mpi4py is unusable. Collective over the members only."""
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        world = MPI.COMM_WORLD
        if self.is_global:
            return world
        return world.Create_group(world.Get_group().Incl(self.ranks))

