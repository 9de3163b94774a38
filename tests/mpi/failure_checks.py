"""A rank that raises mid-training must end the whole job (no hang).

Usage: mpirun -np N python tests/mpi/failure_checks.py  (rank 1 raises at step 2)
"""
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.launch import abort_on_uncaught_exception

hvd.init()
abort_on_uncaught_exception()
torch.manual_seed(0)
model = torch.nn.Linear(10, 10)
opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="topk:density=0.1")
for step in range(1000):
    if step == 2 and hvd.rank() == 1:
        raise RuntimeError("injected failure at step 2")
    opt.zero_grad()
    model(torch.randn(4, 10)).pow(2).sum().backward()
    opt.step()
print("UNREACHABLE: the job should have been aborted", flush=True)
