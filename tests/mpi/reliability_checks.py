"""Faults under mpirun: non-finite gradients, disagreeing ranks, checkpoints, accumulation, huge
messages. Usage: mpirun -np N python tests/mpi/reliability_checks.py CHECK"""
import io
import sys

from mpi4py import MPI
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.comm.allgatherv import MPIAllgatherer

SPECS = ["topk:density=0.3", "dgc:density=0.3", "randomk:density=0.3", "qsgd:levels=4,block=8",
         "efsignsgd", "powersgd:matrix_rank=1"]


def make(spec, nonfinite="skip", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hvdcomp.get_compressor(spec), nonfinite=nonfinite)
    return model, opt


def train_step(model, opt, step, poison=False):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    if poison:  # NaN in the data: this rank's gradients become NaN during backward
        x[0, 0] = float("nan")
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def same_state(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def check_nonfinite_skip():
    # none: its agreement travels with the gradients, decided from their (non-finite) results
    for spec in SPECS + ["none", "fp16"]:
        model, opt = make(spec)
        train_step(model, opt, 0)
        before, state = flat(model), opt.compression.state_dict()
        state = {k: v for k, v in state.items() if k != "rng"}
        train_step(model, opt, 1, poison=hvd.rank() == 1)       # one rank's NaN: every rank skips
        after = {k: v for k, v in opt.compression.state_dict().items() if k != "rng"}
        assert torch.equal(flat(model), before), spec
        assert same_state(after, state), spec                       # memory/momentum not poisoned
        assert opt.skipped_steps == 1
        train_step(model, opt, 2)
        assert not torch.equal(flat(model), before) and torch.isfinite(flat(model)).all(), spec


def check_nonfinite_raise():
    # none reduces in place: the averaged gradient is non-finite on every rank and the rank it came
    # from is not known, so no rank is named (issue 57: every rank was named, [0, 1, ...])
    # PowerSGD: its verdict rides on its first allreduce; a non-finite gradient falls back to the
    # allgather that names the rank
    for spec, named in (("topk:density=0.3", [hvd.size() - 1]), ("none", None),
                        ("powersgd:matrix_rank=1", [hvd.size() - 1])):
        model, opt = make(spec, nonfinite="raise")
        try:
            train_step(model, opt, 0, poison=hvd.rank() == hvd.size() - 1)
        except FloatingPointError as exc:
            if named is None:
                assert "not known" in str(exc) and "rank(s) [" not in str(exc), exc
            else:
                assert f"rank(s) {named}" in str(exc), exc
        else:
            raise AssertionError("no FloatingPointError")


def check_powersgd_verdict_rides():
    """PowerSGD's per-step verdict rides on its first allreduce (5 summed floats): a clean step
    runs no allgather of its own (before: one per step), and its results are those of a twin
    with nonfinite="ignore", which agrees on nothing (bit for bit at 2 ranks, where a sum of two
    is exact whatever the buffer; to float32 rounding at more)."""
    (model, opt), (twin, twin_opt) = make("powersgd:matrix_rank=1"), make("powersgd:matrix_rank=1",
                                                                          nonfinite="ignore")
    gatherer, gathers = opt.reducer.pipe.gatherer, []
    allgather_ints = gatherer.allgather_ints
    gatherer.allgather_ints = lambda values: gathers.append(list(values)) or allgather_ints(values)
    for step in range(4):
        train_step(model, opt, step)
        train_step(twin, twin_opt, step)
    assert gathers == [], gathers
    if hvd.size() == 2:
        assert torch.equal(flat(model), flat(twin))
    else:
        assert torch.allclose(flat(model), flat(twin), rtol=1e-5, atol=1e-7), (flat(model) - flat(twin)).abs().max()
    assert opt.skipped_steps == 0


def check_disagreeing_ranks():
    torch.manual_seed(0)
    width = 5 if hvd.rank() == 0 else 4
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="topk:density=0.1")
    except ValueError as exc:
        assert "parameter #" in str(exc) and "(3, 5)" in str(exc) and "(3, 4)" in str(exc), exc
    else:
        raise AssertionError("mismatched parameters accepted")
    model = torch.nn.Linear(3, 3)
    spec = "topk:density=0.1" if hvd.rank() == 0 else "topk:density=0.2"
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression=spec)
    except ValueError as exc:
        assert "compression" in str(exc) and "0.2" in str(exc), exc
    else:
        raise AssertionError("mismatched compressors accepted")


def check_checkpoint_bit_identical():
    for spec in SPECS:
        model, opt = make(spec)
        for step in range(4):
            train_step(model, opt, step)
        reference = flat(model)
        model, opt = make(spec)
        for step in range(2):
            train_step(model, opt, step)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)                 # safe loading: no pickled objects
        model, opt = make(spec, seed=123)                         # a fresh process would start here
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        for step in range(2, 4):
            train_step(model, opt, step)
        assert torch.equal(flat(model), reference), spec


def check_accumulation_frozen_unused_unnamed():
    """backward_passes_per_step=2 with a final partial group (3 passes), a frozen parameter, a
    parameter used on rank 0 only, and no names."""
    torch.manual_seed(0)
    used, unused_elsewhere, frozen = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    frozen.requires_grad_(False)
    params = list(used.parameters()) + list(unused_elsewhere.parameters()) + list(frozen.parameters())
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), compression="topk:density=0.5,ef=false",
                                       backward_passes_per_step=2)
    local = {id(p): torch.zeros_like(p) for p in params}
    for k in range(3):                                          # 2 + a partial group of 1
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * hvd.rank() + k))
        out = used(x) + frozen(x)
        if hvd.rank() == 0:
            out = out + unused_elsewhere(x)
        out.pow(2).sum().backward()
        if k == 1:
            opt.synchronize()
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
            continue
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.requires_grad:
            local[id(p)] = p.grad.clone()
    opt.synchronize()
    for i, p in enumerate(params):
        if not p.requires_grad:
            assert p.grad is None
            continue
        every = hvd.allgather(local[id(p)].unsqueeze(0), name=f"acc.{i}")
        comp = hvdcomp.get_compressor("topk:density=0.5,ef=false")
        ref = sum(comp.decode(*comp.encode(e)) for e in every) / hvd.size()
        assert torch.allclose(p.grad, ref, atol=1e-6)


def check_allgather_in_rounds():
    """The >2^31 path, run for real with a tiny limit: byte counts 0..N on ranks, 7 bytes per round."""
    ag = MPIAllgatherer(max_count=7)
    n = 3 * hvd.rank() + (1 if hvd.rank() % 2 else 0)            # rank 0 sends nothing
    payload = [torch.arange(n, dtype=torch.float32) + 100 * hvd.rank(), torch.arange(n, dtype=torch.int32)]
    got = ag.finish(ag.start(payload, "rounds"))
    for r, (vals, idx) in enumerate(got):
        m = 3 * r + (1 if r % 2 else 0)
        assert torch.equal(vals, torch.arange(m, dtype=torch.float32) + 100 * r)
        assert torch.equal(idx, torch.arange(m, dtype=torch.int32))


def check_disagreeing_transport():
    """One rank sparse, the others dense: refused on every rank before any transport is set up."""
    model = torch.nn.Linear(3, 3)
    spec = "topk:density=0.5" if hvd.rank() == 0 else "none"
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression=spec)
    except ValueError as exc:
        assert "compression" in str(exc), exc
    else:
        raise AssertionError("mismatched transports accepted")


if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:]:
        globals()[f"check_{name}"]()
        MPI.COMM_WORLD.Barrier()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
