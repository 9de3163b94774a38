"""Which front-ends a launch accepts, started for real (tests/test_launchers.py runs it).

Usage:
    torchrun --standalone --nproc_per_node 2 tests/launch_checks.py torchrun
    mpirun -np 2 python tests/launch_checks.py mpirun

Each front-end is built on a one-layer model; a refusal raises before any collective, so every
rank prints, per front-end, ``ACCEPTED <name>`` or ``REFUSED <name>: <message>`` (one line).

- ``torchrun``: the Horovod and MPI front-ends (hvdcomp.DistributedOptimizer, hvdcomp.local.DiLoCo,
  hvdcomp.adaptive_opt.OneBitAdam, hvdcomp.gossip.GossipOptimizer, hvdcomp.lowrank.ABTraining)
  after ``hvd.init()``, which joins each process alone; then the DDP front-end on torchrun's
  process group (accepted).
- ``mpirun``: the DDP front-end on a process group each rank made alone (``world_size=1``), as
  a script written for one process does (refused); then the Horovod front-end (accepted).
"""
import sys

import torch


def report(name, build):
    try:
        build()
    except RuntimeError as exc:
        print(f"REFUSED {name}: {' '.join(str(exc).split())}", flush=True)
    else:
        print(f"ACCEPTED {name}", flush=True)


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def horovod_frontends():
    import hvdcomp
    from hvdcomp.adaptive_opt import OneBitAdam
    from hvdcomp.gossip import GossipOptimizer
    from hvdcomp.local import DiLoCo
    from hvdcomp.lowrank import ABTraining

    m = model()
    report("DistributedOptimizer", lambda: hvdcomp.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), compression="topk:density=0.5"))
    m = model()
    report("DiLoCo", lambda: DiLoCo(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), local_steps=2))
    m = model()
    report("OneBitAdam", lambda: OneBitAdam(m.named_parameters(), lr=1e-3, freeze_step=2))
    m = model()
    report("GossipOptimizer", lambda: GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                                      method="choco", compression="sign", consensus_step=0.5))
    m = model()
    report("ABTraining", lambda: ABTraining(m, lambda ps: torch.optim.SGD(ps, lr=0.1), rank_groups=1))


def main(mode):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp.ddp

    if mode == "torchrun":
        import horovod.torch as hvd

        hvd.init()
        horovod_frontends()
        dist.init_process_group("gloo")
        m = DDP(model())
        report("ddp.register", lambda: hvdcomp.ddp.register(m, "topk:density=0.5"))
        dist.destroy_process_group()
    elif mode == "mpirun":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        m = DDP(model())
        report("ddp.register", lambda: hvdcomp.ddp.register(m, "topk:density=0.5"))
        dist.destroy_process_group()
        from mpi4py import MPI  # noqa: F401 - before Horovod, as the README's template (docs/troubleshooting.md)
        import horovod.torch as hvd

        import hvdcomp

        hvd.init()
        m = model()
        report("DistributedOptimizer", lambda: hvdcomp.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            compression="topk:density=0.5"))
    else:
        raise SystemExit(f"unknown mode {mode!r}: torchrun or mpirun")


if __name__ == "__main__":
    main(sys.argv[1])
