"""Collectives: the process-group interface and its Horovod implementation (:mod:`.group`),
its ``torch.distributed`` implementation (:mod:`.torchdist`), mpi4py's byte layer
(:mod:`.allgatherv`, :mod:`.hierarchical`, :mod:`.exchange`, :mod:`.sparse_allreduce`), the world
(:mod:`.world`) and the α-β cost model (:mod:`.costmodel`); :func:`resolve_group` picks the group a
front-end runs on."""
from __future__ import annotations

import logging

from .allgatherv import Allgatherer, HorovodAllgatherer, MPIAllgatherer
from .group import HorovodGroup, ProcessGroup
from .hierarchical import HierarchicalAllgatherer

__all__ = ["Allgatherer", "HorovodAllgatherer", "MPIAllgatherer", "HierarchicalAllgatherer", "ProcessGroup",
           "HorovodGroup", "resolve_group"]


def resolve_group(where=None, frontend: str = "") -> ProcessGroup:
    """The :class:`~hvdcomp.comm.group.ProcessGroup` a training mode runs on.

    Args:
        where: a :class:`ProcessGroup` (used as it is), a Horovod process set, a
            ``torch.distributed`` process group, or None: the whole job, through Horovod where it
            is initialised (``mpirun``/``horovodrun``: ``hvd.init()``), else through
            ``torch.distributed`` where it is (``torchrun``/``srun``: ``init_process_group``).
        frontend: the front-end's name (e.g. ``"hvdcomp.local.DiLoCo"``): then the launch is
            checked against the group's runtime and an uncaught exception is made to end the
            job (:func:`hvdcomp.launch.start_frontend`), before any collective.

    Raises:
        RuntimeError: neither is initialised (the message names both fixes), or (with
            ``frontend``) the group sees one rank where the launcher started several
            (:func:`hvdcomp.launch.check_frontend_launch`).
        TypeError: ``where`` is none of the above.
    """
    import torch.distributed as dist

    group = _pick_group(where, dist)
    if frontend:
        from ..launch import start_frontend

        hvd = getattr(group, "hvd", None)
        start_frontend(frontend, "horovod" if hvd is not None else "torch.distributed",
                       hvd.size() if hvd is not None else dist.get_world_size())
    return group


def _pick_group(where, dist) -> ProcessGroup:
    """:func:`resolve_group`'s choice (see there)."""
    if isinstance(where, ProcessGroup):
        return where
    if where is not None:
        if hasattr(where, "process_set_id"):
            return HorovodGroup(where)
        if dist.is_available() and isinstance(where, dist.ProcessGroup):
            from .torchdist import TorchDistGroup

            return TorchDistGroup(where)
        raise TypeError(f"expected a Horovod process set or a torch.distributed process group, got {where!r}")
    try:
        import horovod.torch as hvd

        horovod_up = hvd.is_initialized()
    except ImportError:
        horovod_up = False
    torch_up = dist.is_available() and dist.is_initialized()
    if horovod_up and torch_up and hvd.size() == 1 and dist.get_world_size() > 1:
        horovod_up = False  # (torchrun with a stray hvd.init(): the torch.distributed job is the job)
    if horovod_up:
        return HorovodGroup()
    if torch_up:
        from .torchdist import TorchDistGroup

        return TorchDistGroup()
    raise RuntimeError("no process group: under mpirun or horovodrun call hvd.init() first (horovod.torch); under "
                       "torchrun or srun call torch.distributed.init_process_group('gloo') (or 'nccl') first")


log = logging.getLogger(__name__)


_warned_import_order = False


def _warn_if_mpi4py_after_horovod(hvd) -> None:
    """Log once when mpi4py is first imported after ``hvd.init()`` started MPI, an order that has
    crashed Open MPI (docs/troubleshooting.md: import mpi4py before ``horovod.torch``)."""
    global _warned_import_order
    import sys

    if _warned_import_order or "mpi4py.MPI" in sys.modules or not hvd.is_initialized():
        return
    _warned_import_order = True
    log.warning("hvdcomp: mpi4py is imported after hvd.init() started MPI on Horovod's background thread; "
                "with Open MPI this has crashed (SIGSEGV in MPI_Bcast): import it first, `from mpi4py import MPI` "
                "before `import horovod.torch as hvd` (docs/troubleshooting.md)")
