"""A compression method of your own, registered through the public API and then used by name, as
every built-in method is (docs/adding-a-method.md walks through it).

The method: 8-bit quantization with one scale per tensor. A rank sends s = max|g|/127 (float32)
and the codes round(g/s) (int8): n + 4 bytes for a tensor of n elements, 4x fewer than float32.
Ranks' scales differ, so the payloads are gathered (``PayloadKind.GATHERED``) and every rank
averages the decoded tensors; error feedback (on by default here) keeps the rounding error.

Launch (any of them):
    horovodrun -np 2 python examples/custom_method.py --steps 50
    mpirun -np 2 python examples/custom_method.py --steps 50
    torchrun --nproc_per_node 2 examples/custom_method.py --steps 50 --frontend ddp

The model learns a fixed random linear map from random inputs (each rank draws its own batches).
Rank 0 prints one line: ``RESULT key=value ...`` with the loss on a held-out batch before and after
training and the bytes this rank sent per step (mean over the steps).
"""
import argparse
import os
import sys

import torch

import hvdcomp
import hvdcomp.ddp
from hvdcomp.compressors import PayloadKind


@hvdcomp.register("int8")
class Int8Compressor(hvdcomp.Compressor):
    """8-bit round-to-nearest codes with one float32 scale per tensor.

    Payload: ``[scale (1,) float32, codes (n,) int8]``, s = max|g|/127 (1 for an all-zero tensor).
    """

    name = "int8"
    payload_kind = PayloadKind.GATHERED      # per-rank scales: gather the payloads, average the decodes
    default_error_feedback = True            # the spec "int8:ef=false" turns it off

    def _encode(self, tensor, name):
        flat = tensor.detach().reshape(-1).float()
        top = flat.abs().max() if flat.numel() else flat.new_zeros(())
        scale = torch.where(top > 0, top / 127, torch.ones_like(top)).reshape(1)
        codes = torch.round(flat / scale).clamp_(-127, 127).to(torch.int8)
        return [scale, codes], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        scale, codes = payload
        shape, dtype = ctx
        return (codes.float() * scale).reshape(shape).to(dtype)

    def nominal_ratio(self, numel):
        return 4 * numel / (numel + 4)       # float32 against codes + scale


def model_and_data(rank):
    torch.manual_seed(0)                     # the same teacher, model and held-out batch on every rank
    teacher = torch.randn(64, 10)
    x_test = torch.randn(256, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own data
    return teacher, x_test, model, gen


def train(model, opt, timer, teacher, x_test, gen, steps):
    """``steps`` steps; returns the held-out loss before and after, and the bytes sent per step."""
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(x_test), x_test @ teacher).item()
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        timer.begin_step()
        with timer.phase("compute"):
            opt.zero_grad()
            loss_fn(model(x), x @ teacher).backward()
        opt.step()
        timer.end_step()
    with torch.no_grad():
        after = loss_fn(model(x_test), x_test @ teacher).item()
    return before, after, timer.totals()["bytes_sent"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--frontend", choices=["horovod", "ddp"], default="horovod")
    args = parser.parse_args()
    assert "int8" in hvdcomp.available()

    if args.frontend == "horovod":
        from mpi4py import MPI  # noqa: F401  (before Horovod: MPI_THREAD_MULTIPLE)
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        teacher, x_test, model, gen = model_and_data(rank)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           named_parameters=model.named_parameters(),
                                           compression="int8", cost_model="off")
        before, after, sent = train(model, opt, opt.timer, teacher, x_test, gen, args.steps)
        opt.close()
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        hvdcomp.ddp.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        teacher, x_test, model, gen = model_and_data(rank)
        model = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        hook = hvdcomp.ddp.register(model, "int8", optimizer=opt)
        before, after, sent = train(model, opt, hook.timer, teacher, x_test, gen, args.steps)
    shapes = [tuple(p.shape) for p in model.parameters()]
    if rank == 0:
        print(f"RESULT example=custom_method frontend={args.frontend} ranks={size} steps={args.steps} "
              f"loss_before={before:.6f} loss_after={after:.6f} bytes_sent_per_step={sent:.1f} "
              f"dense_bytes_per_step={4 * sum(p.numel() for p in model.parameters())} "
              f"shapes={';'.join('x'.join(map(str, s)) for s in shapes)}", flush=True)
    if args.frontend == "horovod":
        hvd.shutdown()
    else:
        dist.barrier()                       # every rank past its last collective before teardown
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)                          # (gloo's exit race: docs/troubleshooting.md)


if __name__ == "__main__":
    main()
