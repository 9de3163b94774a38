#!/usr/bin/env python
"""Link-bound step of hvdcomp's PowerSGD through the DDP hook against PyTorch's ``powerSGD_hook``
(issue 59), the variants taking turns in one process so that they share a sitting.

The medium LSTM's gradients (embedding 10000×300, four LSTM matrices 1200×300, four biases of
1200; rank 2, 2 plain steps, ``min_compression_rate`` 2, as ``benchmarks/ddp_hooks.py``) with a
batch of 2×2 tokens, so that compute (about 40 ms) leaves the step to the link and the hooks.
Per step, in turn, each after a barrier: ``powerSGD_hook`` (one DDP bucket, as the benchmarks give
it), hvdcomp with the step's verdict as a gather of its own (``verdict_rides`` off: the path before
issue 59), hvdcomp with the verdict riding on the first allreduce (DDP's default buckets), and the
same with one bucket. Prints per variant the median over the timed steps of the slowest rank's step.

Run on emulated hosts (root; ``../shared/tools/netem_mpi.sh``), e.g. 4 hosts at 10 Mbit/s::

    export NETEM_PYTHON=$PWD/.venv/bin/python
    bash ../shared/tools/netem_mpi.sh up 4 && bash ../shared/tools/netem_mpi.sh shape 10mbit
    bash ../shared/tools/netem_mpi.sh mpirun -n 4 -x MASTER=10.77.0.1 -x OMP_NUM_THREADS=1 -- \\
        $NETEM_PYTHON benchmarks/powersgd_link_ab.py 30
    bash ../shared/tools/netem_mpi.sh down
"""
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hvdcomp.ddp  # noqa: E402
from hvdcomp.lm.model import LSTMLM  # noqa: E402
from hvdcomp.transports.powersgd import PowerSGDCompressor  # noqa: E402

SPEC = "powersgd:matrix_rank=2,start_step=2,min_compression_rate=2"


def main(steps: int) -> None:
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ.get('MASTER', '127.0.0.1')}:29571",
                            rank=rank, world_size=size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    raw = LSTMLM(10000, 300, dropout=0.0)
    one_bucket = {"bucket_cap_mb": 4 * sum(p.numel() for p in raw.parameters()) / 2 ** 20 + 1}
    variants = {}  # label: (model, optimizer, verdict_rides or None)
    m = DDP(copy.deepcopy(raw), **one_bucket)
    m.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True, random_seed=0),
                         psgd.powerSGD_hook)
    variants["powerSGD_hook"] = (m, torch.optim.SGD(m.parameters(), lr=0.01), None)
    for label, rides, buckets in (("hvdcomp, verdict gathered", False, {}), ("hvdcomp, verdict riding", True, {}),
                                  ("hvdcomp, riding, 1 bucket", True, one_bucket)):
        m = DDP(copy.deepcopy(raw), **buckets)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        hvdcomp.ddp.register(m, SPEC, optimizer=opt)
        variants[label] = (m, opt, rides)
    g = torch.Generator().manual_seed(rank)
    times = {k: [] for k in variants}
    for step in range(3 + steps):
        x, y = torch.randint(0, 10000, (2, 2), generator=g), torch.randint(0, 10000, (2, 2), generator=g)
        for label, (m, opt, rides) in variants.items():
            if rides is not None:
                PowerSGDCompressor.verdict_rides = rides
            opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            logits, _ = m(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, 10000), y.reshape(-1)).backward()
            opt.step()
            if step >= 3:
                times[label].append(time.perf_counter() - t0)
    PowerSGDCompressor.verdict_rides = True
    t = torch.tensor([times[k] for k in variants], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        base = statistics.median(t[0].tolist())
        for label, row in zip(variants, t.tolist()):
            print(f"{label:28s} median {1e3 * statistics.median(row):7.1f} ms ({statistics.median(row) / base:.3f}x "
                  f"the hook's), min {1e3 * min(row):7.1f}, max {1e3 * max(row):7.1f}; {len(row)} steps, slowest rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
