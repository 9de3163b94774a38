"""Collectives: Horovod's (:mod:`.group`), ``torch.distributed``'s (:mod:`.torchdist`, the DDP
front-end's), mpi4py's byte layer (:mod:`.allgather`,
:mod:`.hierarchical`, :mod:`.exchange`, :mod:`.sparse_allreduce`), the world (:mod:`.world`) and the
α-β cost model (:mod:`.costmodel`)."""
from __future__ import annotations

import logging
import os

from .allgather import Allgatherer, HorovodAllgatherer, MPIAllgatherer
from .group import Group
from .hierarchical import HierarchicalAllgatherer

__all__ = ["Allgatherer", "HorovodAllgatherer", "MPIAllgatherer", "HierarchicalAllgatherer", "make_allgatherer"]

log = logging.getLogger(__name__)


def make_allgatherer(prefer: str = "auto", group=None) -> Allgatherer:
    """Pick the allgather transport.

    Args:
        prefer: an :class:`Allgatherer` (used as it is), ``"auto"`` (mpi4py when Horovod runs on MPI, else Horovod allgather),
            ``"mpi4py"``, ``"hierarchical"`` (mpi4py, node-aware:
            :class:`hvdcomp.comm.hierarchical.HierarchicalAllgatherer`) or ``"horovod"``.
            Overridable with ``HVDCOMP_ALLGATHER``.
        group: a :class:`hvdcomp.comm.group.Group` (the global process set when None); the
            transport's collectives stay inside it. Collective over the group's members.

    Raises:
        RuntimeError: ``"mpi4py"`` or ``"hierarchical"`` was asked for but Horovod is not running on MPI (e.g. started
            with ``horovodrun --gloo``) or mpi4py's world differs from Horovod's.
        ValueError: unknown ``prefer``.
    """
    import horovod.torch as hvd  # (Horovod is optional for the compressors and the DDP front-end)

    if isinstance(prefer, Allgatherer):  # injected (tests, custom transports)
        return prefer
    group = Group() if group is None else group
    prefer = os.environ.get("HVDCOMP_ALLGATHER", prefer)
    if prefer not in ("auto", "mpi4py", "hierarchical", "horovod"):
        raise ValueError(f"allgather transport must be auto, mpi4py, hierarchical or horovod, got {prefer!r}")
    if prefer == "horovod":
        return HorovodAllgatherer(group.process_set)
    if hvd.mpi_enabled():
        try:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() != hvd.size():
                reason = f"MPI world size {MPI.COMM_WORLD.Get_size()} != Horovod size {hvd.size()}"
            elif prefer == "hierarchical":
                return HierarchicalAllgatherer(comm=group.mpi_comm())
            else:
                return MPIAllgatherer(comm=group.mpi_comm())
        except ImportError as exc:
            reason = f"mpi4py is not importable ({exc})"
    else:
        reason = "Horovod is not running on MPI (e.g. horovodrun --gloo)"
    if prefer in ("mpi4py", "hierarchical"):
        raise RuntimeError(f"the {prefer} allgather path is unusable: {reason}. Launch with mpirun or "
                           "horovodrun --mpi, or use allgather='horovod'.")
    log.info("hvdcomp: sparse payloads use Horovod allgather: %s", reason)
    return HorovodAllgatherer(group.process_set)
