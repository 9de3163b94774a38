"""Top-k (1 %) gradient compression in a Horovod script: ``hvdcomp.DistributedOptimizer`` in place
of ``hvd.DistributedOptimizer``.

Launch (any of them):
    horovodrun -np 2 python examples/horovod_topk.py --steps 50
    mpirun -np 2 python examples/horovod_topk.py --steps 50
    srun --mpi=pmix -n 2 python examples/horovod_topk.py --steps 50

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss on a held-out batch before and after
training and the bytes this rank sent per step (mean over the steps).
"""
from mpi4py import MPI  # noqa: F401  (first: MPI starts with MPI_THREAD_MULTIPLE for the background allgather)
import argparse

import horovod.torch as hvd
import torch

import hvdcomp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compression", default="topk:density=0.01")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)                                   # the same teacher and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=args.compression,
                                       cost_model="off")   # every gradient by allgather (the default,
    # "measure", times a few collectives at start and may allreduce a small bucket densely instead)
    gen = torch.Generator().manual_seed(1 + hvd.rank())    # each rank its own data
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        opt.timer.begin_step()
        with opt.timer.phase("compute"):
            opt.zero_grad()
            loss_fn(model(x), x @ teacher).backward()
        opt.step()
        opt.timer.end_step()                               # seconds per phase, bytes sent / received
    with torch.no_grad():
        after = loss_fn(model(x_test), x_test @ teacher).item()
    sent = opt.timer.totals()["bytes_sent"]
    if hvd.rank() == 0:
        print(f"RESULT example=horovod_topk ranks={hvd.size()} steps={args.steps} loss_before={before:.6f} "
              f"loss_after={after:.6f} bytes_sent_per_step={sent:.1f} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())}", flush=True)
    opt.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
