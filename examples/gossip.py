"""Decentralized training in a Horovod script: Choco-SGD (Koloskova, Stich and Jaggi, ICML 2019)
with top-k (10 %) messages to the neighbours on a ring, no global average of the gradients
(``hvdcomp.gossip.GossipOptimizer``; docs/gossip.md).

Launch (any of them; the neighbour exchange needs MPI: not ``horovodrun --gloo``):
    horovodrun -np 2 python examples/gossip.py --steps 50
    mpirun -np 2 python examples/gossip.py --steps 50
    srun --mpi=pmix -n 2 python examples/gossip.py --steps 50

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss of the ranks' average model on a
held-out batch before and after training, the number of neighbours, and the bytes this rank sent per
step (over the whole run; each step sends one message to each neighbour).
"""
from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE for the background exchange)
import argparse

import horovod.torch as hvd
import torch

import hvdcomp.gossip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compression", default="topk:density=0.1")
    parser.add_argument("--consensus-step", type=float, default=0.5, help="Choco-SGD's γ in (0, 1]")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)                                   # the same teacher and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    opt = hvdcomp.gossip.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), method="choco",
                                         topology="ring", compression=args.compression,
                                         consensus_step=args.consensus_step)
    gen = torch.Generator().manual_seed(1 + hvd.rank())    # each rank its own data
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        opt.timer.begin_step()
        opt.zero_grad()
        loss_fn(model(x), x @ teacher).backward()
        opt.step()                                         # local SGD step, then gossip with the neighbours
        opt.timer.end_step()
    opt.timer.begin_step()
    opt.flush()                                            # the last exchange (still in flight) applied
    opt.timer.end_step()                                   # (each exchange is counted when it arrives)
    with torch.no_grad(), opt.average_model():             # the network average (one allreduce)
        after = loss_fn(model(x_test), x_test @ teacher).item()
    sent = opt.timer.sums()["bytes_sent"] / args.steps
    neighbours = opt.topology.degree(hvd.rank())
    opt.close()
    if hvd.rank() == 0:
        print(f"RESULT example=gossip ranks={hvd.size()} steps={args.steps} neighbours={neighbours} "
              f"loss_before={before:.6f} loss_after={after:.6f} bytes_sent_per_step={sent:.1f} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
