"""AB-training under mpirun (4 ranks: 2 groups of 2). Usage: mpirun -np 4 python tests/mpi/ab_checks.py"""
import copy

from mpi4py import MPI
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.lowrank import ABTraining

COMM = MPI.COMM_WORLD


def model_and_data(step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    g = torch.Generator().manual_seed(100 * hvd.rank() + step)
    return model, torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def loss_of(model, step):
    g = torch.Generator().manual_seed(100 * hvd.rank() + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def check_group_averaging():
    model, _, _ = model_and_data(0)
    ab = ABTraining(model, sgd, groups=2, warmup_steps=0, steps_between_syncs=5, full_rank_steps=1,
                    cutoff=0.0, full_rank=["2.weight"], base_lr=0.1)
    assert ab.phase == "grouped" and [f.name for f in ab.factorized] == ["0.weight"]
    f = ab.factorized[0]
    ab.zero_grad()
    loss_of(model, 0).backward()
    gw = f.param.grad.clone()
    local = gw @ f.b.detach().t() if ab.trains() == "A" else f.a.detach().t() @ gw
    full_local = {n: p.grad.clone() for n, p in ab.always_full}
    ab.synchronize()
    every = COMM.allgather(local)
    group = [r for r in range(COMM.size) if r * 2 // COMM.size == ab.group_index]
    ref = sum(every[r] for r in group) / len(group)
    got = f.a.grad if ab.trains() == "A" else f.b.grad
    assert torch.allclose(got, ref, atol=1e-6), (got, ref)
    other = [r for r in range(COMM.size) if r not in group]
    assert not torch.allclose(got.reshape(-1)[:3], (sum(every[r] for r in other) / len(other)).reshape(-1)[:3]) \
        or got.shape != every[other[0]].shape
    for n, p in ab.always_full:
        ref = sum(COMM.allgather(full_local[n])) / COMM.size
        assert torch.allclose(p.grad, ref, atol=1e-6), n
    assert ab.trains() == ("A" if ab.group_index == 0 else "B")


def check_full_rank_matches_data_parallel():
    model, _, _ = model_and_data(0)
    twin = copy.deepcopy(model)
    ab = ABTraining(model, sgd, groups=2, warmup_steps=3, steps_between_syncs=2, full_rank_steps=1,
                    cutoff=0.0, base_lr=0.1, ramp_steps=0)
    dp = hvdcomp.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                      named_parameters=twin.named_parameters(), compression="none")
    for step in range(3):
        assert ab.phase == "warmup"
        ab.zero_grad()
        loss_of(model, step).backward()
        ab.synchronize()
        ab.step()
        dp.zero_grad()
        loss_of(twin, step).backward()
        dp.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def check_schedule_and_sync():
    model, _, _ = model_and_data(0)
    ab = ABTraining(model, sgd, groups=2, warmup_steps=2, steps_between_syncs=3, full_rank_steps=1,
                    cutoff=0.2, base_lr=0.1, ramp_steps=2)
    phases, lrs = [], []
    for step in range(12):
        phases.append(ab.phase)
        ab.zero_grad()
        loss_of(model, step).backward()
        ab.synchronize()
        ab.step()
        lrs.append(ab.optimizer.param_groups[0]["lr"] if ab.phase == phases[-1] else None)
        if phases[-1] == "grouped" and ab.phase == "full-rank":
            w = model[0].weight.detach()
            assert all(torch.equal(w, o) for o in COMM.allgather(w))   # synced: the same W everywhere
    assert phases == ["warmup"] * 2 + ["grouped"] * 3 + ["full-rank"] + ["grouped"] * 3 + ["full-rank"] + ["grouped"] * 2
    rep = ab.communication_report()
    assert set(rep["bytes_by_phase"]) == {"warmup", "grouped", "sync", "full-rank"}
    assert rep["steps_by_phase"] == {"warmup": 2, "grouped": 8, "full-rank": 2}
    dense = 4 * sum(p.numel() for p in model.parameters())
    assert rep["bytes_by_phase"]["warmup"] == 2 * dense and rep["bytes_by_phase"]["full-rank"] == 2 * dense
    assert rep["bytes_by_phase"]["sync"] == 2 * 4 * (30 + 15)        # two syncs of both weights
    assert rep["compression_ratio"] == 12 * dense / sum(rep["bytes_by_phase"].values())


if __name__ == "__main__":
    hvd.init()
    for name in ("group_averaging", "full_rank_matches_data_parallel", "schedule_and_sync"):
        globals()[f"check_{name}"]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
