"""Both front-ends' compression phases appear as ``hvdcomp.<phase>`` ranges in a torch.profiler
trace (hvdcomp.metrics.PhaseTimer).

Usage: mpirun -np 2 python tests/mpi/profiler_checks.py   (prints "OK <front-end> <ranges>" on rank 0)
"""
import datetime
import os

import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcomp
import hvdcomp.ddp

WANT = {"hvdcomp.compress", "hvdcomp.communicate", "hvdcomp.decompress"}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def step(m, opt):
    opt.zero_grad()
    m(torch.randn(5, 8)).pow(2).sum().backward()
    opt.step()


def ranges(prof):
    return {e.key for e in prof.key_averages() if e.key.startswith("hvdcomp.")}


def check(front_end, m, opt):
    step(m, opt)                                           # (the DDP hook: buckets are rebuilt once)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(m, opt)
    got = ranges(prof)
    assert WANT <= got, (front_end, sorted(got))
    if hvd.rank() == 0:
        print(f"OK {front_end} {sorted(got)}", flush=True)


hvd.init()
m = model()
opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   compression="topk:density=0.25")
check("horovod", m, opt)
opt.close()

port = hvd.broadcast_object(int(os.environ.get("HVDCOMP_TEST_PORT", "29517")), root_rank=0, name="port")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size(),
                        timeout=datetime.timedelta(seconds=60))
m = DDP(model())
opt = torch.optim.SGD(m.parameters(), lr=0.1)
hvdcomp.ddp.register(m, "topk:density=0.25", optimizer=opt)
check("ddp", m, opt)
dist.barrier()
dist.destroy_process_group()
hvd.shutdown()
