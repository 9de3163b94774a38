"""1-bit Adam in a Horovod script (``hvdcomp.adaptive_opt.OneBitAdam``, Tang et al., ICML 2021;
docs/adaptive-optimizers.md): Adam with fp32 gradients averaged for ``freeze_step`` warm-up steps,
then the variance frozen and the momentum averaged at 1 bit per element by a two-phase compressed
allreduce with worker and server error feedback. It replaces both the optimizer and
``hvd.DistributedOptimizer``.

Launch (any of them; the compressed allreduce needs MPI: not ``horovodrun --gloo``):
    horovodrun -np 2 python examples/onebit_adam.py --steps 40
    mpirun -np 2 python examples/onebit_adam.py --steps 40
    srun --mpi=pmix -n 2 python examples/onebit_adam.py --steps 40

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss on a held-out batch before and after
training, and the bytes this rank sent in a warm-up step and in a 1-bit step (the median step of
each kind: the first step also agrees on the set-up).
"""
from mpi4py import MPI  # noqa: F401  (first: MPI starts with MPI_THREAD_MULTIPLE)
import argparse

import horovod.torch as hvd
import torch

import hvdcomp.adaptive_opt


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze-step", type=int, default=8, help="warm-up steps (authors: 15-25 %% of the run)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)                                   # the same teacher and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    opt = hvdcomp.adaptive_opt.OneBitAdam(model.named_parameters(), lr=3e-3, freeze_step=args.freeze_step)
    gen = torch.Generator().manual_seed(1 + hvd.rank())    # each rank its own data
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    sent = {}                                              # step kind -> bytes this rank sent per step
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        opt.timer.begin_step()
        opt.zero_grad()
        loss_fn(model(x), x @ teacher).backward()
        opt.step()
        sent.setdefault(opt.last_step_kind, []).append(opt.timer.end_step()["bytes_sent"])
    with torch.no_grad():
        after = loss_fn(model(x_test), x_test @ teacher).item()
    if hvd.rank() == 0:
        per_kind = " ".join(f"bytes_sent_per_{kind}_step={sorted(b)[len(b) // 2]} {kind}_steps={len(b)}"
                            for kind, b in sorted(sent.items()))
        print(f"RESULT example=onebit_adam ranks={hvd.size()} steps={args.steps} loss_before={before:.6f} "
              f"loss_after={after:.6f} {per_kind} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
