"""Multi-rank checks of every method through hvdcomp.DistributedOptimizer.

Usage: mpirun -np N python tests/mpi/method_checks.py CHECK [SPEC ...]
"""
import math
import sys

import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.compressors.base import Compressor

SPECS = ["none", "fp16", "bf16", "topk:density=0.2", "randomk:density=0.2",
         "randomk:density=0.2,ef=false", "threshold:threshold=0.05", "dgc:density=0.2",
         "qsgd:levels=4,block=8", "qsgd:levels=64,block=16,scale=max", "terngrad", "signsgd",
         "signsgd:vote=allgather", "efsignsgd", "sidco:density=0.2", "sbc:density=0.2",
         "lowbit:bits=4,block=8", "lowbit:bits=8,beta=0.5", "adaptive:base=topk,budget=0.2,every=1",
         "adaptive:base=randomk,budget=0.2,every=1", "adaptive:base=qsgd,budget=8,block=8,every=1"]


class Recording(Compressor):
    """Test wrapper: remembers what each parameter's payload decodes to locally (what was sent)."""

    def __init__(self, inner):
        self.inner, self.sent = inner, {}
        self.payload_kind = inner.payload_kind
        self.owns_momentum, self.name = inner.owns_momentum, inner.name
        self.aggregate_is_mean = inner.aggregate_is_mean
        self.expected_payload_bytes = inner.expected_payload_bytes

    def _encode(self, tensor, name=None):
        payload, ctx = self.inner.encode(tensor, name)
        self.sent[name] = self.inner.decode([t.clone() for t in payload], ctx)
        return payload, ctx

    def decode(self, payload, ctx):
        return self.inner.decode(payload, ctx)

    def aggregate(self, payloads, ctx):
        return self.inner.aggregate(payloads, ctx)


def model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    g = torch.Generator().manual_seed(100 + hvd.rank())
    return model, torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def check_matches_dense_reference(spec):
    """Two steps; each time p.grad == the mean (or sign vote) of what every rank sent."""
    model, x, y = model_and_batch()
    comp = Recording(hvdcomp.get_compressor(spec))
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=comp)
    tol = 2e-3 if spec == "fp16" else 1e-5
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            every = hvd.allgather(comp.sent[n].unsqueeze(0), name=f"ref.{spec}.{step}.{n}")
            if spec.startswith("signsgd"):
                ref = torch.where(every.sum(0) >= 0, 1.0, -1.0)
            else:
                ref = every.mean(0)
            assert torch.allclose(p.grad, ref, atol=tol, rtol=tol), (spec, step, n, p.grad, ref)
        with opt.skip_synchronize():
            opt.step()
    # parameters stay identical across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0, name=f"same.{spec}"), flat), spec


def check_randomk_indices_shared():
    """Indices equal on all ranks; the global RNG state is untouched."""
    comp = hvdcomp.get_compressor("randomk:density=0.01,ef=false")
    before = torch.get_rng_state()
    idx = comp.indices(100_000, "encoder.weight", 7)
    assert torch.equal(torch.get_rng_state(), before)
    every = hvd.allgather(idx.unsqueeze(0), name="randomk.idx")
    assert all(torch.equal(every[r], idx) for r in range(hvd.size()))


def check_dgc_momentum_applied_once():
    """1 element, g = 1 for 3 steps, m = 0.9, lr = 1: parameter deltas 1.0, 1.9, 2.71."""
    p = torch.nn.Parameter(torch.zeros(1))
    comp = hvdcomp.get_compressor("dgc", density=1.0, momentum=0.9, momentum_masking=False)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)],
                                       compression=comp)
    deltas, last = [], 0.0
    for _ in range(3):
        opt.zero_grad()
        (-p).sum().backward()                 # gradient -1, so the step adds +1 * velocity
        opt.step()
        deltas.append(round(p.item() - last, 6))
        last = p.item()
    assert deltas == [1.0, 1.9, 2.71], deltas
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD([p], lr=1.0, momentum=0.9),
                                     named_parameters=[("w", p)], compression="dgc")
    except ValueError as exc:
        assert "momentum would be applied twice" in str(exc), exc
    else:
        raise AssertionError("DGC with a momentum optimizer was accepted")


def check_fp16_agreed_scale():
    """The issue's input through Horovod: every rank sends [1e-6, 3e-6, 1e-4]·(1 + rank/8). The
    first step travels in float32 (exact), later ones in float16 with the agreed scale (within
    (N+2)·2^-11 of the mean); every rank records the same exponent."""
    p = torch.nn.Parameter(torch.zeros(3))
    comp = hvdcomp.get_compressor("fp16")
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                       compression=comp)
    base = torch.tensor([1e-6, 3e-6, 1e-4])
    x = base * (1 + hvd.rank() / 8)
    mean = base.double() * (1 + (hvd.size() - 1) / 16)
    sent = []
    for step in range(3):
        opt.timer.begin_step()
        opt.zero_grad()
        (p * x).sum().backward()
        opt.synchronize()
        rel = ((p.grad.double() - mean) / mean).abs().max().item()
        assert rel < (1e-6 if step == 0 else (hvd.size() + 2) * 2.0**-11), (step, p.grad, rel)
        with opt.skip_synchronize():
            opt.step()
        sent.append(opt.timer.end_step()["bytes_sent"])
    assert sent == [4 * (3 + 277), 2 * (3 + 25), 2 * (3 + 25)], sent
    every = hvd.allgather(torch.tensor([comp.exponents["w"]]), name="fp16.exponent")
    expected = math.floor(math.log2(1e-4 * (1 + (hvd.size() - 1) / 8)))
    assert (every == expected).all(), (every, expected)


def check_adaptive_plans_agree():
    """adaptive (L-GreCo) through the optimizer, allgather (top-k) and allreduce (random-k): after
    each re-plan every rank holds the same plan, the spiky layer gives bytes to the dense one, and
    the measured bytes of a planned step stay within the uniform setting's."""
    from hvdcomp.compressors.adaptive import AdaptiveCompressor
    from hvdcomp.compressors.topk import num_kept

    for base in ("topk", "randomk"):
        torch.manual_seed(0)
        spiky = torch.nn.Linear(40, 60)
        dense = torch.nn.Linear(40, 30)
        comp = hvdcomp.get_compressor(f"adaptive:base={base},budget=0.05,every=2")
        inner = comp.inner
        assert isinstance(inner, AdaptiveCompressor)
        params = [("spiky.weight", spiky.weight), ("dense.weight", dense.weight)]
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.0),
                                           named_parameters=params, compression=comp)
        g = torch.Generator().manual_seed(7 + hvd.rank())
        mask = torch.zeros(60, 40)
        mask[:2, :3] = 1.0
        sent = []
        for step in range(5):
            opt.timer.begin_step()
            opt.zero_grad()
            x = torch.randn(16, 40, generator=g)
            # the spiky layer's gradient lives in 6 entries; the dense layer's everywhere
            loss = (spiky.weight * mask * 100).sum() * (1 + hvd.rank()) + dense(x).pow(2).sum()
            loss.backward()
            opt.step()
            sent.append(opt.timer.end_step()["bytes_sent"])
            plan = torch.tensor([inner.plan.get(n, -1) for n, _ in params])
            every = hvd.allgather(plan.unsqueeze(0), name=f"adaptive.plan.{base}.{step}")
            assert all(torch.equal(every[r], plan) for r in range(hvd.size())), (base, step, every)
        uniform = inner.settings.index(0.05)
        assert inner.plan["spiky.weight"] < uniform < inner.plan["dense.weight"], (base, inner.plan)
        per_value = 8 if base == "topk" else 4
        budget = sum(per_value * num_kept(p.numel(), 0.05) for _, p in params)
        planned = sum(per_value * num_kept(p.numel(), inner.setting_of(n)) for n, p in params)
        assert planned <= budget, (planned, budget)
        if base == "topk":  # step 3 is planned and not measuring: exactly the planned payload,
            # plus the allgather's per-tensor size header
            assert sent[3] - planned in range(0, 64), (sent, planned)


if __name__ == "__main__":
    hvd.init()
    check = sys.argv[1]
    if check == "dense_reference":
        for spec in sys.argv[2:] or SPECS:
            check_matches_dense_reference(spec)
            if hvd.rank() == 0:
                print(f"OK dense_reference {spec}", flush=True)
    else:
        globals()[f"check_{check}"]()
        if hvd.rank() == 0:
            print(f"OK {check}", flush=True)
