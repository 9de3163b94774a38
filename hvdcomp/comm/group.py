"""The ranks a reduction runs among, and the collectives hvdcomp's core runs among them: one
interface (:class:`ProcessGroup`), two implementations, :class:`HorovodGroup` (a Horovod process
set; mpi4py for variable-size allgathers and messages where Horovod runs on MPI) and
:class:`hvdcomp.comm.torchdist.TorchDistGroup` (``torch.distributed``: gloo or NCCL; torchrun,
srun). Every collective of the core goes through it (docs/architecture.md, "The layers"); what
differs (how an average rounds, whether issue order must match) is said on each implementation.
"""
from __future__ import annotations

import abc
import os
import pickle
import time
from typing import Any, List, Sequence

import torch

__all__ = ["ProcessGroup", "HorovodGroup", "Group", "HOROVOD_ALLREDUCE_DTYPES", "horovod", "FollowsWorld", "elastic_world",
           "world_changed", "instance_prefix"]

# dtypes Horovod 0.28's PyTorch allreduce accepts on CPU/MPI (no bfloat16)
HOROVOD_ALLREDUCE_DTYPES = (torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                            torch.int32, torch.int64)


_created: dict = {}  # per front-end kind, how many this process built


def instance_prefix(kind: str = "") -> str:
    """The name prefix of a new front-end object's collectives, ``hvdcomp.<kind>.<n>`` (``n``: its
    creation index among this process's objects of ``kind``): unique per object, and the same on
    ranks that build the same objects in the same order (the set-up agreement compares them)."""
    base = f"hvdcomp.{kind}" if kind else "hvdcomp"
    n = _created[base] = _created.get(base, -1) + 1
    return f"{base}.{n}"


def pickled(obj: Any) -> torch.Tensor:
    """``obj``'s pickle as a 1-D uint8 tensor (the object gathers and broadcasts of both groups)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpickled(data: torch.Tensor) -> Any:
    """The object :func:`pickled` turned into ``data`` (a CPU tensor)."""
    return pickle.loads(data.numpy().tobytes())


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


class ProcessGroup(abc.ABC):
    """The ranks a reduction runs among, seen from one process, and the collectives the core needs.

    Attributes:
        size, rank: the group's size and this process's rank in it (1 and 0 for a process
            outside the group, which trains on its own).
        ranks: global ranks of the members, in group-rank order.
        included: whether this process belongs to the group.
        is_global: whether the group is every rank of the job.
        backend: ``"horovod"``, ``"gloo"``, ``"nccl"``, ...
        ordered: collectives must be issued in the same order on every rank (no negotiation):
            transports then launch in a fixed order.

    Collectives are called by every member, with the same ``name`` (Horovod matches by it;
    ``torch.distributed`` by issue order). Tensors are 1-D or any shape, contiguous.
    """

    size: int
    rank: int
    ranks: List[int]
    included: bool = True
    is_global: bool = True
    backend: str = ""
    ordered: bool = False

    def describe(self) -> dict:
        """JSON-able description: backend and global ranks of the members."""
        return {"backend": self.backend, "ranks": self.ranks}

    # ---- allreduce -----------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True, prescale: float = 1.0,
                        postscale: float = 1.0):
        """Start ``postscale · Σ_ranks (prescale · tensor)`` (``average``: divided by ``size``)
        into a new tensor; returns a handle for :meth:`synchronize`."""

    @abc.abstractmethod
    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True, prescale: float = 1.0,
                         postscale: float = 1.0):
        """:meth:`allreduce_async` in place: the result overwrites ``tensor``."""

    @abc.abstractmethod
    def synchronize(self, handle) -> torch.Tensor:
        """Wait for a handle of :meth:`allreduce_async` (or ``_``); returns the reduced tensor."""

    def allreduce(self, tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
        """Blocking :meth:`allreduce_async`: the mean (or sum) over the members, a new tensor."""
        return self.synchronize(self.allreduce_async(tensor, name, average))

    # ---- broadcast and small agreements ---------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """The ``tensor`` of the member whose group rank is ``root`` (same shape and dtype on
        every member), as a new tensor (blocking)."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every member's ``obj`` (picklable), in rank order (blocking)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """``obj`` of the member whose group rank is ``root``, on every member (blocking)."""

    def allgather_ints(self, values: Sequence[int], name: str = "hvdcomp.ints") -> List[List[int]]:
        """Every member's ``values`` (a few int64, the same count on every member), in rank order."""
        return [list(v) for v in self.allgather_object([int(x) for x in values], name)]

    # ---- what the transports build on -------------------------------------------------------------
    @abc.abstractmethod
    def allgatherer(self, prefer: str = "auto", prefix: str = "hvdcomp"):
        """The variable-size allgather of payloads among the members
        (:class:`hvdcomp.comm.allgatherv.Allgatherer`), made now (collectively), its named
        collectives ``prefix.*`` (:func:`instance_prefix`).

        Raises:
            RuntimeError: ``prefer`` names a path this group cannot take.
            ValueError: an unknown ``prefer``.
        """

    @abc.abstractmethod
    def point_to_point(self, gatherer=None):
        """Byte messages among the members (:class:`hvdcomp.comm.exchange.PointToPoint`),
        collectively made (once, without ``gatherer``; beside ``gatherer``'s own channel with
        one); None where the members cannot message each other (Horovod without MPI)."""

    def step_comm(self, timer, prefix: str, point_to_point=None):
        """The collectives of a step-wide method's step (:func:`hvdcomp.comm.stepcomm.timed_step_comm`:
        blocking mean allreduce and broadcast, named ``prefix.name``, timed as ``communicate`` and
        counted in ``timer``), with the given :meth:`point_to_point` messages (or None)."""
        from .stepcomm import timed_step_comm

        return timed_step_comm(lambda tensor, name: self.allreduce(tensor, f"{prefix}.{name}"),
                               lambda tensor, root, name: self.broadcast(tensor, root, f"{prefix}.{name}"),
                               self.rank, self.size, timer, point_to_point)

    def latency(self, prefix: str, calls: int = 5) -> float:
        """Seconds of one tiny allreduce in this group (its cycle and negotiation): the median of
        ``calls`` after one untimed, rank 0's value on every member."""
        probe = torch.zeros(1)
        times = []
        for k in range(calls + 1):
            t0 = time.perf_counter()
            self.allreduce(probe, f"{prefix}.latency.{k}", average=False)
            times.append(time.perf_counter() - t0)
        mine = sorted(times[1:])[calls // 2]
        return float(self.broadcast(torch.tensor([mine], dtype=torch.float64), 0, f"{prefix}.latency")[0])


class HorovodGroup(ProcessGroup):
    """A Horovod process set seen from one process (:class:`ProcessGroup`): Horovod's named
    collectives (negotiated, so issue order may differ between ranks); an average sums, then
    scales (``op=hvd.Average``).

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

    backend = "horovod"

    def describe(self) -> dict:
        """JSON-able description: global ranks of the members."""
        return {"ranks": self.ranks}

    # ---- collectives (members only) -----------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True, prescale: float = 1.0,
                        postscale: float = 1.0):
        """Horovod ``allreduce_async`` within the set (``op=Average`` or ``Sum``); returns a
        handle for :meth:`synchronize`."""
        return self.hvd.allreduce_async(tensor, name=name, op=self.hvd.Average if average else self.hvd.Sum,
                                        prescale_factor=prescale, postscale_factor=postscale,
                                        process_set=self.process_set)

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True, prescale: float = 1.0,
                         postscale: float = 1.0):
        """:meth:`allreduce_async` in place: the result overwrites ``tensor`` (as stock Horovod
        reduces gradients)."""
        return self.hvd.allreduce_async_(tensor, name=name, op=self.hvd.Average if average else self.hvd.Sum,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         process_set=self.process_set)

    def synchronize(self, handle) -> torch.Tensor:
        """Wait for a handle from :meth:`allreduce_async`; returns the reduced tensor."""
        return self.hvd.synchronize(handle)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Blocking Horovod broadcast of the tensor of the member whose rank in the set is
        ``root`` (same shape and dtype on every member)."""
        return self.hvd.broadcast(tensor, root_rank=self.ranks[root], name=name, process_set=self.process_set)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every member's ``obj`` (picklable), in rank order (two Horovod allgathers)."""
        if self.size == 1:
            return [obj]
        data = pickled(obj)
        sizes = self.hvd.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz",
                                   process_set=self.process_set).tolist()
        gathered = self.hvd.allgather(data, name=f"{name}.data", process_set=self.process_set)
        return [unpickled(t) for t in torch.split(gathered, sizes)]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        """``obj`` of the member whose rank in the set is ``root``, on every member."""
        if self.size == 1:
            return obj
        return self.hvd.broadcast_object(obj, root_rank=self.ranks[root], name=name,
                                         process_set=self.process_set)

    def allgather_ints(self, values: Sequence[int], name: str = "hvdcomp.ints") -> List[List[int]]:
        """Every member's ``values`` by one ``hvd.allgather`` of int64, in rank order."""
        mine = torch.tensor([[int(v) for v in values]], dtype=torch.int64)
        if self.size == 1:
            return mine.tolist()
        return self.hvd.allgather(mine, name=name, process_set=self.process_set).tolist()

    def allgatherer(self, prefer="auto", prefix: str = "hvdcomp"):
        """The allgather of payloads over the set (collective over its members).

        Args:
            prefer: an :class:`~hvdcomp.comm.allgatherv.Allgatherer` (used as it is), ``"auto"``
                (mpi4py when Horovod runs on MPI, else Horovod's allgather), ``"mpi4py"``,
                ``"hierarchical"`` (:class:`hvdcomp.comm.hierarchical.HierarchicalAllgatherer`) or
                ``"horovod"``; overridden by ``HVDCOMP_ALLGATHER``.
            prefix: names Horovod's collectives of the transport (:func:`instance_prefix`).

        Raises:
            RuntimeError: ``"mpi4py"`` or ``"hierarchical"`` without Horovod on MPI (e.g.
                ``horovodrun --gloo``) or with an mpi4py world other than Horovod's.
            ValueError: unknown ``prefer``.
        """
        from . import _warn_if_mpi4py_after_horovod, log
        from .allgatherv import Allgatherer, HorovodAllgatherer, MPIAllgatherer
        from .hierarchical import HierarchicalAllgatherer

        if isinstance(prefer, Allgatherer):  # injected (tests, custom transports)
            return prefer
        prefer = os.environ.get("HVDCOMP_ALLGATHER", prefer)
        if prefer not in ("auto", "mpi4py", "hierarchical", "horovod"):
            raise ValueError(f"allgather transport must be auto, mpi4py, hierarchical or horovod, got {prefer!r}")
        hvd = self.hvd
        if prefer == "horovod":
            return HorovodAllgatherer(self, prefix)
        if hvd.mpi_enabled():
            try:
                _warn_if_mpi4py_after_horovod(hvd)
                from mpi4py import MPI

                if MPI.COMM_WORLD.Get_size() != hvd.size():
                    reason = f"MPI world size {MPI.COMM_WORLD.Get_size()} != Horovod size {hvd.size()}"
                elif prefer == "hierarchical":
                    return HierarchicalAllgatherer(comm=self.mpi_comm())
                else:
                    return MPIAllgatherer(comm=self.mpi_comm())
            except ImportError as exc:
                reason = f"mpi4py is not importable ({exc})"
        else:
            reason = "Horovod is not running on MPI (e.g. horovodrun --gloo)"
        if prefer in ("mpi4py", "hierarchical"):
            raise RuntimeError(f"the {prefer} allgather path is unusable: {reason}. Launch with mpirun or "
                               "horovodrun --mpi, or use allgather='horovod'.")
        log.info("hvdcomp: sparse payloads use Horovod allgather: %s", reason)
        return HorovodAllgatherer(self, prefix)

    def point_to_point(self, gatherer=None):
        """:class:`hvdcomp.comm.exchange.MPIExchange` on a duplicate of an mpi4py communicator of
        the set: ``gatherer``'s (an :class:`~hvdcomp.comm.allgatherv.MPIAllgatherer`; a Horovod
        allgatherer has none, and then there is no point-to-point), or, without a gatherer, the
        set's own (made once). Under elastic Horovod (Gloo) the job's
        :class:`hvdcomp.comm.exchange.HorovodExchange`; otherwise None without MPI."""
        from ..launch import elastic_launch
        from .exchange import HorovodExchange, MPIExchange

        if self.is_global and not self.hvd.mpi_enabled() and elastic_launch():
            if getattr(self, "_p2p", None) is None:
                self._p2p = HorovodExchange(self.hvd, self.rank, self.size, "hvdcomp.exchange")
            return self._p2p
        if gatherer is not None:
            comm = getattr(gatherer, "comm", None)
            return None if comm is None else MPIExchange(comm.Dup())
        if getattr(self, "_p2p", None) is None:
            comm = self.mpi_comm() if self.hvd.mpi_enabled() else None
            if comm is None:
                return None
            self._p2p = MPIExchange(comm.Dup())
        return self._p2p

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

Group = HorovodGroup  # (the name the training modes used; one release)


def elastic_world(group: ProcessGroup, what: str) -> bool:
    """Whether ``group`` is elastic Horovod's world (a Horovod group under ``HOROVOD_ELASTIC=1``,
    set by ``horovodrun --min-np/--max-np``), whose size may change while the job runs.

    Raises:
        ValueError: a process set other than the whole job under elastic Horovod (``what`` names
            the front-end in the message).
    """
    from ..launch import elastic_launch

    elastic = getattr(group, "hvd", None) is not None and elastic_launch()
    if elastic and not group.is_global:
        raise ValueError(f"under elastic Horovod (HOROVOD_ELASTIC=1) {what} runs over the whole job, whose size "
                         "changes: leave process_set unset (a process set's ranks do not survive Horovod's reset)")
    return elastic


def world_changed(group: ProcessGroup) -> bool:
    """Whether elastic Horovod reset the world under ``group`` (the whole job's
    :class:`HorovodGroup`): its size or this process's rank is no longer Horovod's. A worker
    replaced at the same size and rank is not seen: register the reset callback."""
    hvd = getattr(group, "hvd", None)
    return hvd is not None and group.is_global and (hvd.size(), hvd.rank()) != (group.size, group.rank)


class FollowsWorld:
    """How every front-end of :data:`hvdcomp.launch.ELASTIC_FRONTENDS` follows elastic Horovod's
    world (``horovodrun --min-np/--max-np``) when workers are lost or added.

    A front-end calls ``_init_world()`` at construction (no collective: a new worker builds
    its optimizer while the others are in Horovod's reset) and ``_follow_world()`` at each step
    boundary; the user registers :meth:`reset` as a reset callback of ``hvd.elastic.TorchState``.
    The front-end gives ``_world_group()`` (its group now), ``_resize(group)`` (rebuild over a new
    group; no collective) and ``_join_world()`` (the first step of a world, collective).
    """

    _elastic = False
    _joining = False

    def _init_world(self, group: ProcessGroup, what: str) -> None:
        """:func:`elastic_world`; if so, the first step joins it (``_join_world()``)."""
        self._elastic = self._joining = elastic_world(group, what)

    def reset(self) -> None:
        """Follow elastic Horovod's reset: register it once,
        ``state.register_reset_callbacks([opt.reset])``. No collective: every rank joins the new
        world at its next step.

        Raises:
            ValueError: the front-end does not run on Horovod (elastic Horovod only).
        """
        group = self._world_group()
        if getattr(group, "hvd", None) is None:
            raise ValueError(f"{type(self).__name__}.reset() follows elastic Horovod's reset; this optimizer does "
                             "not run on Horovod")
        self._resize(HorovodGroup(group.process_set))
        self._joining = True

    def _follow_world(self) -> None:
        """At a step boundary, under elastic Horovod: :meth:`reset` if the world changed without it
        (:func:`world_changed`), then, at the first step of a world, ``_join_world()``."""
        if not self._elastic:
            return
        if not self._joining and world_changed(self._world_group()):
            self.reset()
        if self._joining:
            self._join_world()
