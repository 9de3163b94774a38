"""2 ranks: local-update training of a CUDA model keeps θ_start and Δ on the host (``host_copy``,
the default for CUDA parameters: the reduction runs on host tensors, so Horovod needs no GPU
operations) and ends where the same run on the CPU ends; DiLoCo and CO2 (whose reduction runs on
its own thread). Usage: mpirun -np 2 python tests/mpi/cuda_local_checks.py"""
from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE for CO2's reduction thread)

import torch
import horovod.torch as hvd

from hvdcomp.local import CO2, DiLoCo


def run(cls, device):
    """6 inner steps (3 rounds of H = 2) of a small MLP on ``device``: (parameters on the CPU, the
    devices of θ_start, the devices of Δ)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), local_steps=2,
              outer_lr=0.7, outer_momentum=0.5, cost_model="off")
    for step in range(6):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x, y = torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush()
    out = ([p.detach().cpu() for p in model.parameters()], {a.device.type for a in opt.anchors.values()},
           {d.device.type for d in opt.pseudo_gradients.values()})
    assert opt.rounds == 3
    opt.close()
    return out


if __name__ == "__main__":
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    for cls in (DiLoCo, CO2):
        gpu, anchors, deltas = run(cls, "cuda")
        assert anchors == deltas == {"cpu"}, (cls.__name__, anchors, deltas)
        cpu, _, _ = run(cls, "cpu")
        for a, b in zip(gpu, cpu):
            assert torch.allclose(a, b, atol=1e-5), (cls.__name__, (a - b).abs().max())
    if hvd.rank() == 0:
        print("OK cuda local", flush=True)
