"""A rank that raises mid-training must end the whole job within seconds, with no call in the
script: the front-end installs hvdcomp.launch.abort_on_uncaught_exception at construction.

Usage (rank 1 raises at step 2 of a loop of 1000 steps):
    mpirun -np N python tests/mpi/failure_checks.py horovod       (also under horovodrun)
    torchrun --nproc_per_node N tests/mpi/failure_checks.py ddp   (also under mpirun)
    ... failure_checks.py horovod-thread                          (the exception in a thread)
    ... failure_checks.py local                                   (hvdcomp.local.DiLoCo, H = 2)
    ... failure_checks.py gossip                                  (hvdcomp.gossip.GossipOptimizer)
    ... failure_checks.py FRONTEND kill                           (rank 1 SIGKILLs itself instead)
"""
import os
import signal
import sys
import threading
import time

import torch

FRONTEND = sys.argv[1] if len(sys.argv) > 1 else "horovod"
KILL = sys.argv[2:3] == ["kill"]
if FRONTEND != "ddp":
    from mpi4py import MPI  # noqa: F401 - first, as the README's template starts (MPI_THREAD_MULTIPLE)
torch.manual_seed(0)
model = torch.nn.Linear(10, 10)
if FRONTEND.startswith("horovod"):
    import horovod.torch as hvd

    import hvdcomp

    hvd.init()
    rank = hvd.rank()
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression="topk:density=0.1")
elif FRONTEND == "local":
    import horovod.torch as hvd

    from hvdcomp.local import DiLoCo

    hvd.init()
    rank = hvd.rank()
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), local_steps=2,
                 compression="topk:density=0.1")
elif FRONTEND == "gossip":
    import horovod.torch as hvd

    from hvdcomp.gossip import GossipOptimizer

    hvd.init()
    rank = hvd.rank()
    opt = GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), method="choco",
                          compression="sign", consensus_step=0.5)
elif FRONTEND == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp.ddp

    hvdcomp.ddp.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvdcomp.ddp.register(model, "topk:density=0.1", optimizer=opt)
else:
    raise SystemExit(f"unknown front-end {FRONTEND!r}")


def fail():
    print(f"FAILING AT {time.time():.3f}", flush=True)  # (the test measures the job's end from here)
    if KILL:  # (no exception, no hook: the process is gone, as when the OOM killer takes it)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected failure at step 2")


for step in range(1000):
    if step == 2 and rank == 1:
        if FRONTEND.endswith("-thread"):
            threading.Thread(target=fail, name="loader").start()
        else:
            fail()
    opt.zero_grad()
    model(torch.randn(4, 10)).pow(2).sum().backward()
    opt.step()
print("UNREACHABLE: the job should have been ended", flush=True)
