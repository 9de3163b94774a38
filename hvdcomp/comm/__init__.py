"""Transport: Horovod allreduce for summable payloads, Allgatherv for variable-size ones."""
from .allgather import Allgatherer, HorovodAllgatherer, MPIAllgatherer, make_allgatherer

__all__ = ["Allgatherer", "HorovodAllgatherer", "MPIAllgatherer", "make_allgatherer"]
