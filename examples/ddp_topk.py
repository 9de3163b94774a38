"""Top-k (1 %) gradient compression in a PyTorch DDP script, without Horovod: a DDP communication
hook registered by ``hvdcomp.ddp.register``.

Launch (any of them):
    torchrun --nproc_per_node 2 examples/ddp_topk.py --steps 50
    srun -n 2 python examples/ddp_topk.py --steps 50        (hvdcomp.ddp.init_process_group reads SLURM's variables)

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss on a held-out batch before and after
training and the bytes this rank sent per step (mean over the steps).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcomp.ddp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compression", default="topk:density=0.01")
    args = parser.parse_args()

    hvdcomp.ddp.init_process_group("gloo")                 # torchrun's or srun's variables
    torch.manual_seed(0)                                   # the same teacher, model and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hook = hvdcomp.ddp.register(model, args.compression, optimizer=opt)   # the DDP comm hook

    gen = torch.Generator().manual_seed(1 + dist.get_rank())   # each rank its own data
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        hook.timer.begin_step()
        with hook.timer.phase("compute"):
            opt.zero_grad()
            loss_fn(model(x), x @ teacher).backward()
        opt.step()
        hook.timer.end_step()                              # seconds per phase, bytes sent / received
    with torch.no_grad():
        after = loss_fn(model(x_test), x_test @ teacher).item()
    sent = hook.timer.totals()["bytes_sent"]
    if dist.get_rank() == 0:
        print(f"RESULT example=ddp_topk ranks={dist.get_world_size()} steps={args.steps} loss_before={before:.6f} "
              f"loss_after={after:.6f} bytes_sent_per_step={sent:.1f} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())}", flush=True)
    # every rank past its last collective before any tears its gloo connections down (a rank that
    # exits first can abort a peer still sending: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads outlive destroy_process_group() and can, rarely, abort the interpreter's
    # teardown (docs/troubleshooting.md): everything is written, so leave without it
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
