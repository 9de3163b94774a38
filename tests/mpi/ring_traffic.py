"""Stock Horovod allreduces under mpirun, for Open MPI's pml monitoring to count the bytes each
rank sends to each peer: one Horovod allreduce of 2^20 float32 (4 MiB) and one of 2^20 float16
(2 MiB, Horovod's own MPI float16 type and sum op, as ``hvd.Compression.fp16`` sends), both through
Horovod's MPI controller. Usage: mpirun -np 4 python tests/mpi/ring_traffic.py"""
from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE before Horovod attaches)
import torch
import horovod.torch as hvd

hvd.init()
assert hvd.mpi_enabled(), "needs Horovod's MPI controller"
for dtype in (torch.float32, torch.float16):
    out = hvd.allreduce(torch.ones(1 << 20, dtype=dtype), name=f"ring-{dtype}", op=hvd.Sum)
    assert float(out[0]) == hvd.size() and float(out[-1]) == hvd.size()
print(f"OK rank {hvd.rank()}", flush=True)
