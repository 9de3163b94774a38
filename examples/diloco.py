"""DiLoCo in a Horovod script: H local steps of the inner optimizer without communication, then the
pseudo-gradient θ_start − θ averaged through top-k (10 %) and an outer Nesterov step
(``hvdcomp.local.DiLoCo``, Douillard et al., 2023; docs/local-update.md).

Launch (any of them):
    horovodrun -np 2 python examples/diloco.py --steps 48
    mpirun -np 2 python examples/diloco.py --steps 48
    srun --mpi=pmix -n 2 python examples/diloco.py --steps 48

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss of the global (averaged) model on a
held-out batch before and after training, the rounds, and the bytes this rank sent per round and
per step.
"""
from mpi4py import MPI  # noqa: F401  (first: MPI starts with MPI_THREAD_MULTIPLE)
import argparse

import horovod.torch as hvd
import torch

import hvdcomp.local


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--local-steps", type=int, default=4, help="H: inner steps per round")
    parser.add_argument("--compression", default="topk:density=0.1")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)                                   # the same teacher and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = hvdcomp.local.DiLoCo(inner, model.named_parameters(), local_steps=args.local_steps,
                               compression=args.compression,        # any hvdcomp method carries Δ
                               cost_model="off")                    # (every unit by allgather)
    gen = torch.Generator().manual_seed(1 + hvd.rank())    # each rank its own data
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        opt.zero_grad()
        loss_fn(model(x), x @ teacher).backward()
        opt.step()                                         # every H-th step: the round
    opt.flush()                                            # a round cut short by the end goes in too
    with torch.no_grad(), opt.global_parameters():         # θ_start: the same on every rank
        after = loss_fn(model(x_test), x_test @ teacher).item()
    report = opt.report()
    if hvd.rank() == 0:
        print(f"RESULT example=diloco ranks={hvd.size()} steps={args.steps} local_steps={args.local_steps} "
              f"rounds={opt.rounds} loss_before={before:.6f} loss_after={after:.6f} "
              f"bytes_sent_per_round={report['bytes_sent_per_round']:.1f} "
              f"bytes_sent_per_step={report['bytes_sent_per_step']:.1f} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())}", flush=True)
    opt.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
