"""2 ranks: the same 3 training steps on CUDA and on the CPU give the same parameters; the CUDA
run's phase timer uses events. Usage: mpirun -np 2 python tests/mpi/cuda_checks.py SPEC"""
import sys

import torch
import horovod.torch as hvd

import hvdcomp


def run(spec, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=spec,
                                       cost_model="off")
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x, y = torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)
        opt.timer.begin_step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        rec = opt.timer.end_step()
        assert rec["compress"] >= 0 and rec["wall"] > 0
    return [p.detach().cpu() for p in model.parameters()], opt.timer


if __name__ == "__main__":
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    spec = sys.argv[1]
    gpu, timer = run(spec, "cuda")
    cpu, _ = run(spec, "cpu")
    assert timer.uses_events
    for a, b in zip(gpu, cpu):
        assert torch.allclose(a, b, atol=1e-5), (spec, (a - b).abs().max())
    if hvd.rank() == 0:
        print("OK cuda", flush=True)
