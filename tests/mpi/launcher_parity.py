"""Each training mode run for a few steps at N ranks, the same under mpirun (Horovod) and under
torchrun (torch.distributed, gloo): rank 0 prints the final parameters' SHA-256 and their sum,
the test (tests/test_launcher_parity.py) compares the two launchers' lines.

Usage: mpirun -np 2 python tests/mpi/launcher_parity.py MODE [MODE ...]
       torchrun --nproc_per_node 2 tests/mpi/launcher_parity.py MODE [MODE ...]
prints "PARAMS <mode> <sha256> <sum> <bytes sent per step>" on rank 0 for each mode.
"""
import hashlib
import os
import sys

import torch
import torch.distributed as dist

UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
if UNDER_TORCHRUN:
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
else:
    import horovod.torch as hvd

    hvd.init()
    RANK = hvd.rank()

import hvdcomp.adaptive_opt  # noqa: E402
import hvdcomp.gossip  # noqa: E402
from hvdcomp.lowrank import ABTraining  # noqa: E402
import hvdcomp.local  # noqa: E402

STEPS = 8


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 * RANK + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train(m, opt, steps=STEPS):
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def local(spec, compression, inner=None):
    def run():
        m = model()
        make = inner or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        opt = hvdcomp.local.from_spec(spec, make(m.parameters()), m.named_parameters(), local_steps=3,
                                      compression=compression, cost_model="off")
        train(m, opt)
        opt.flush()
        with opt.global_parameters():
            params = [p.detach().clone() for p in m.parameters()]
        return params, opt.timer.bytes_sent / max(1, opt.steps)
    return run


def adaptive(make):
    def run():
        m = model()
        opt = make(m.named_parameters())
        train(m, opt)
        return [p.detach().clone() for p in m.parameters()], opt.timer.bytes_sent / STEPS
    return run


def gossip(method, **kwargs):
    def run():
        m = model()
        opt = hvdcomp.gossip.GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                             method=method, **kwargs)
        train(m, opt)
        opt.flush()
        return [p.detach().clone() for p in m.parameters()], opt.timer.bytes_sent / STEPS
    return run


def ab(**kwargs):
    def run():
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
        torch.manual_seed(0)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.3)
        opt = ABTraining(m, lambda ps: torch.optim.SGD(ps, lr=0.05), rank_groups=2, warmup_steps=2,
                         steps_between_syncs=2, full_rank_steps=1, full_rank=["4.weight"], ramp_steps=2,
                         base_lr=0.05, **kwargs)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.synchronize()
            opt.step()
        return [p.detach().clone() for p in m.parameters()], opt.timer.bytes_sent / STEPS
    return run


MODES = {
    "ab-only-b": ab(),
    "ab-ab": ab(mode="ab", sync="full", cutoff=0.2),
    "choco-topk": gossip("choco", compression="topk:density=0.5", consensus_step=0.5),
    "choco-sign": gossip("choco", compression="sign", consensus_step=0.3, overlap=False),
    "dcd": gossip("dcd", compression="qsgd:levels=16"),
    "ecd": gossip("ecd", compression="qsgd:levels=16"),
    "powergossip": gossip("powergossip", power_iterations=2),
    "onebit-adam": adaptive(lambda named: hvdcomp.adaptive_opt.OneBitAdam(named, lr=0.01, freeze_step=3)),
    "zeroone-adam": adaptive(lambda named: hvdcomp.adaptive_opt.ZeroOneAdam(named, lr=0.01, var_freeze_step=3,
                                                                            local_step_scaler=2)),
    "onebit-lamb": adaptive(lambda named: hvdcomp.adaptive_opt.OneBitLamb(named, lr=0.01, freeze_step=3)),
    "amsgrad": adaptive(lambda named: hvdcomp.adaptive_opt.CompressedAMSGrad(named, lr=0.01)),
    "diloco-topk": local("diloco", "topk:density=0.3"),
    "diloco-fp16": local("diloco", "fp16"),
    "co2-none": local("co2", "none"),
    "sparseloco": local("sparseloco", "topk:density=0.25,tile=4,values=stat2,index=compact,average=senders"),
    "adaalter": local("adaalter", "none", inner=lambda ps: hvdcomp.local.AdaAlter(ps, lr=0.01)),
}

for name in sys.argv[1:]:
    params, per_step = MODES[name]()
    flat = torch.cat([p.reshape(-1).double() for p in params])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    if RANK == 0:
        print(f"PARAMS {name} {digest} {flat.sum().item():.12g} {per_step:.6g}", flush=True)
sys.stdout.flush()
if UNDER_TORCHRUN:
    dist.barrier()
    os._exit(0)  # (gloo's exit race is issue 60's; these runs compare parameters)
