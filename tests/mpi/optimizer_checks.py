"""Multi-rank checks of hvdcomp.DistributedOptimizer, run by tests/test_mpi_optimizer.py.

Usage: mpirun -np N python tests/mpi/optimizer_checks.py CHECK
Each check raises (non-zero exit) on failure and prints "OK <check>" on rank 0.
"""
import math
import sys

import pytest
import torch
import horovod.torch as hvd

import hvdcomp


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def train_side_by_side(models, opts, steps=3):
    """``steps`` SGD steps of each (model, optimizer) pair on the same per-rank batches."""
    for step in range(steps):
        x, y = batch(step)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def check_none_matches_horovod():
    """hvdcomp 'none' == stock hvd.DistributedOptimizer(Compression.none) after 3 SGD steps."""
    models = [small_model(), small_model()]
    stock = hvd.DistributedOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1),
                                     named_parameters=models[0].named_parameters(),
                                     compression=hvd.Compression.none)
    from hvdcomp.comm.allgatherv import MPIAllgatherer

    exchanges = []  # the per-step agreement travels with the gradients: no allgather of flags

    class Recording(MPIAllgatherer):
        def allgather_ints(self, values):
            exchanges.append(values)
            return super().allgather_ints(values)

    ours = hvdcomp.DistributedOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1),
                                        named_parameters=models[1].named_parameters(),
                                        compression="none", allgather=Recording())
    train_side_by_side(models, (stock, ours))
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), (n, (a - b).abs().max())
    assert exchanges == [], exchanges
    # and the parameters really moved and are identical across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in models[1].parameters()])
    assert torch.equal(hvd.broadcast(flat, 0, name="bcast.check"), flat)


def dense_reference(grads_of_rank, compressor_fn):
    """Mean over ranks of each rank's compressed-then-decompressed gradient (independent code)."""
    return sum(compressor_fn(g) for g in grads_of_rank) / len(grads_of_rank)


def ref_topk(g, density):
    flat = g.reshape(-1)
    k = min(flat.numel(), max(1, math.ceil(density * flat.numel())))
    order = sorted(range(flat.numel()), key=lambda i: -abs(float(flat[i])))[:k]
    out = torch.zeros_like(flat)
    out[order] = flat[order]
    return out.reshape(g.shape)


def all_grads(grad, name):
    """Every rank's copy of ``grad`` (list indexed by rank)."""
    gathered = hvd.allgather(grad.unsqueeze(0), name=name)
    return list(gathered)


def check_sparse(spec, ref_fn, zero_rank=None, **kwargs):
    """The aggregated gradient equals the dense reference of what each rank sent (one step)."""
    model = small_model()
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(),
                                       compression=spec, **kwargs)
    x, y = batch(0)
    if zero_rank is not None and hvd.rank() == zero_rank:
        x = x * 0  # the second layer's gradient still flows; first layer weight grad is 0
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    for n, p in model.named_parameters():
        ref = dense_reference(all_grads(local[n], f"ref.{n}"), ref_fn)
        assert torch.allclose(p.grad, ref, atol=1e-6, rtol=1e-5), (spec, n, p.grad, ref)
    rec = opt.timer.end_step()
    assert rec["bytes_sent"] > 0 and rec["dense_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    with opt.skip_synchronize():
        opt.step()
    return opt, rec


def check_topk():
    """One payload per gradient (fuse_tensors=False), then the gradients of the bucket compressed
    in one call (the default): the same per-tensor top-k, one payload for the bucket."""
    density = 0.2
    opt, rec = check_sparse(f"topk:density={density},ef=false", lambda g: ref_topk(g, density),
                            cost_model="off", fuse_tensors=False)
    # 8 bytes per kept element + one int64 count per payload tensor (2 per parameter)
    model_sizes = [30, 5, 15, 3]
    kept = sum(max(1, math.ceil(density * n)) for n in model_sizes)
    assert rec["bytes_sent"] == 8 * kept + 16 * len(model_sizes), rec
    assert rec["bytes_received"] == hvd.size() * (8 * kept + 16 * len(model_sizes)), rec
    assert len(opt.transport.buckets) == 1  # 212 dense bytes fit in one default (25 MiB) bucket
    opt, rec = check_sparse(f"topk:density={density},ef=false", lambda g: ref_topk(g, density),
                            cost_model="off")
    assert rec["bytes_sent"] == 8 * kept + 16, rec  # one [values, indices] pair (two counts) for the bucket
    assert opt.transport.units == {"fused0": ["2.bias", "2.weight", "0.bias", "0.weight"]}, opt.transport.units


def check_buckets_and_wire():
    """One bucket per parameter (bucket_bytes=1) and compact coding: same result as the dense
    reference of fp16-rounded values; bytes = 2 per value + 1 per index + 16 per parameter."""
    density = 0.2

    def ref(g):
        return ref_topk(g, density).to(torch.float16).to(torch.float32)

    opt, rec = check_sparse(f"topk:density={density},ef=false,values=fp16,index=compact", ref,
                            cost_model="off", bucket_bytes=1)
    model_sizes = [30, 5, 15, 3]  # every n <= 256: one byte per index
    kept = sum(max(1, math.ceil(density * n)) for n in model_sizes)
    assert len(opt.transport.buckets) == 4
    assert rec["bytes_sent"] == 3 * kept + 16 * len(model_sizes), rec


def check_threaded_and_inline_exchange_agree():
    """The background-thread exchange (default under MPI_THREAD_MULTIPLE) and the inline one
    give the same aggregated gradients over three steps with error feedback."""
    from hvdcomp.comm.allgatherv import MPIAllgatherer

    grads = []
    for threaded in (True, False):
        model = small_model()
        gatherer = MPIAllgatherer(threaded=threaded)
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:density=0.3", cost_model="off", bucket_bytes=64,
                                           allgather=gatherer)
        assert gatherer.threaded == threaded
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def check_cost_model_routes():
    """Given alpha = 0, beta = 1 ns/B: allgather (p-1)·8k·beta vs allreduce 2(p-1)/p·4n·beta,
    i.e. gather while k < n/p (hand-worked per tensor); the gradients match the reference."""
    density, p = 0.2, hvd.size()
    opt, _ = check_sparse(f"topk:density={density},ef=false", lambda g: ref_topk(g, density),
                          cost_model=(0.0, 1e-9))
    sizes = {"0.weight": 30, "0.bias": 5, "2.weight": 15, "2.bias": 3}
    expected = {n: "allgather" if max(1, math.ceil(density * k)) < k / p else "decoded-allreduce"
                for n, k in sizes.items()}
    assert opt.transport.routes == expected, (opt.transport.routes, expected)
    if p == 4:
        assert opt.transport.routes["2.bias"] == "decoded-allreduce"  # k = 1 is not < 3/4


def check_fused_equals_unfused():
    """fuse_tensors=True (one call per bucket) and False (one call per gradient) give bit-identical
    parameters and compressor state over 3 steps, allgathered (top-k, bf16, threshold, QSGD,
    TernGrad, EF-signSGD, DGC, sampled top-k) and allreduced (fp16, signSGD's votes, random-k),
    with error feedback, at bucket sizes that fuse all or some gradients."""
    for spec in ("topk:density=0.2", "fp16", "fp16:ef=true", "bf16", "threshold:threshold=0.05"):
        for bucket_bytes in (25 * 2**20, 100):  # one fused unit; three gradients fused + one alone
            runs = []
            for fuse in (False, True):
                model = small_model()
                opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   named_parameters=model.named_parameters(),
                                                   compression=spec, cost_model="off",
                                                   bucket_bytes=bucket_bytes, fuse_tensors=fuse)
                for step in range(3):
                    x, y = batch(step)
                    opt.zero_grad()
                    (torch.nn.functional.mse_loss(model(x), y) * 10.0 ** step).backward()
                    opt.step()
                runs.append((model, opt))
            (m0, o0), (m1, o1) = runs
            assert not o0.transport.units and o1.transport.units, (spec, o1.transport.units)
            for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
                assert torch.equal(a, b), (spec, bucket_bytes, n, (a - b).abs().max())
            s0, s1 = o0.state_dict()["hvdcomp"], o1.state_dict()["hvdcomp"]
            assert hvdcomp.agreement.digest(s0) == hvdcomp.agreement.digest(s1), (spec, s0, s1)
    # the methods made segmentable for issue 31, on a model whose largest weight (7000 entries)
    # takes a sampled threshold (select=sample, dgc: 70 samples at 1 %)
    for spec in ("qsgd:levels=16", "terngrad", "efsignsgd", "signsgd", "randomk:density=0.05",
                 "dgc:density=0.05", "topk:density=0.05,select=sample"):
        for bucket_bytes in (25 * 2**20, 1200):  # one fused unit; three gradients fused + one alone
            runs = []
            for fuse in (False, True):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
                opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   named_parameters=model.named_parameters(),
                                                   compression=spec, cost_model="off",
                                                   bucket_bytes=bucket_bytes, fuse_tensors=fuse)
                for step in range(3):
                    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
                    x, y = torch.randn(8, 100, generator=g), torch.randn(8, 3, generator=g)
                    opt.zero_grad()
                    (torch.nn.functional.mse_loss(model(x), y) * 10.0 ** step).backward()
                    opt.step()
                runs.append((model, opt))
            (m0, o0), (m1, o1) = runs
            assert not o0.transport.units and o1.transport.units, (spec, o1.transport.units)
            for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
                assert torch.equal(a, b), (spec, bucket_bytes, n, (a - b).abs().max())
            s0, s1 = o0.state_dict()["hvdcomp"], o1.state_dict()["hvdcomp"]
            assert hvdcomp.agreement.digest(s0) == hvdcomp.agreement.digest(s1), (spec, bucket_bytes)
    # rank 1 never uses the second head (its gradients are sent at synchronize()): the fused units
    # still take each gradient's random draw as one call per gradient does
    for spec, bucket_bytes in (("qsgd:levels=16", 25 * 2**20), ("topk:density=0.05,select=sample", 25 * 2**20),
                               ("qsgd:levels=16", 1200)):
        runs = []
        for fuse in (False, True):
            torch.manual_seed(0)
            model = torch.nn.ModuleDict({"body": torch.nn.Linear(100, 70), "a": torch.nn.Linear(70, 3),
                                         "b": torch.nn.Linear(70, 100)})
            opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters(), compression=spec,
                                               cost_model="off", bucket_bytes=bucket_bytes, fuse_tensors=fuse)
            for step in range(3):
                g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
                x, y = torch.randn(8, 100, generator=g), torch.randn(8, 3, generator=g)
                opt.zero_grad()
                h = torch.tanh(model["body"](x))
                out = model["a"](h) if hvd.rank() == 1 else model["a"](h) + model["b"](h).sum(1, keepdim=True)
                torch.nn.functional.mse_loss(out, y).backward()
                opt.step()
            runs.append((model, opt))
        (m0, o0), (m1, o1) = runs
        assert o1.transport.units, spec
        for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
            assert torch.equal(a, b), (spec, "unused head", n, (a - b).abs().max())
        s0, s1 = o0.state_dict()["hvdcomp"], o1.state_dict()["hvdcomp"]
        assert hvdcomp.agreement.digest(_sorted(s0)) == hvdcomp.agreement.digest(_sorted(s1)), spec


def _sorted(state):
    """A state dict with every dict's keys sorted (names enter it in the order they are encoded)."""
    return {k: _sorted(state[k]) for k in sorted(state)} if isinstance(state, dict) else state


def check_threshold_with_empty_rank():
    """Rank 1 sends nothing for the first layer's weight (its input is zero): zero-length gather."""
    lam = 0.05
    check_sparse(f"threshold:threshold={lam},ef=false",
                 lambda g: torch.where(g.abs() >= lam, g, torch.zeros_like(g)), zero_rank=1)


def check_horovod_allgather_fallback():
    """The same top-k result through Horovod's allgather instead of mpi4py."""
    density = 0.2
    model = small_model()
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(),
                                       compression=f"topk:density={density},ef=false",
                                       allgather="horovod")
    assert opt.transport.allgather == "horovod"
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    for n, p in model.named_parameters():
        ref = dense_reference(all_grads(local[n], f"ref2.{n}"), lambda g: ref_topk(g, density))
        assert torch.allclose(p.grad, ref, atol=1e-6), n


def check_fp16_predivide():
    """Two (or more) ranks of [40000.] average to exactly 40000 through fp16, under both optimizers."""
    for use_stock in (False, True):
        p = torch.nn.Parameter(torch.zeros(1))
        sgd = torch.optim.SGD([p], lr=1.0)
        if use_stock:
            opt = hvd.DistributedOptimizer(sgd, named_parameters=[("w", p)],
                                           compression=hvdcomp.get_compressor("fp16"))
        else:
            opt = hvdcomp.DistributedOptimizer(sgd, named_parameters=[("w", p)], compression="fp16")
        (p * 40000.0).sum().backward()
        opt.synchronize()
        assert p.grad.item() == 40000.0, (use_stock, p.grad)
        with opt.skip_synchronize():
            opt.step()


def check_sparse_refused_by_stock_horovod():
    p = torch.nn.Parameter(torch.ones(10))
    _opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)],
                                   compression=hvdcomp.get_compressor("topk:density=0.1,ef=false"))
    try:
        p.sum().backward()
    except TypeError as exc:
        assert "hvdcomp.DistributedOptimizer" in str(exc), exc
    else:
        raise AssertionError("stock Horovod accepted a sparse compressor")


def check_scaleout_methods():
    """gtopk, cltk and twophase over real ranks, 3 steps of a small model:

    * parameters identical on every rank;
    * error feedback loses nothing: size·mean + Σ new residuals = Σ (gradient + old residual)
      (twophase: + size·Σ of the change of the server residuals, each at its rank's chunk);
    * cltk: the result is the mean of every rank's compensated values at the leader's top-k
      positions (reference from the allgathered gradients); the leader is rank step mod p, or with
      leader=variance,window=1 (VAR-Topk) the first rank of the largest gradient norm;
    * gtopk: ≤ k non-zeros, at most (log2(p) + 1)·k entries sent per rank (+ the fold's positions);
      at density 1, the dense mean;
    * gtopk without an MPI communicator (allgather='horovod') is refused with the fix."""
    p = hvd.size()
    for spec in ("gtopk:density=0.1", "cltk:density=0.1", "cltk:density=0.1,leader=variance,window=1", "gtopk:density=1",
                 "twophase:base=qsgd,levels=4,block=8", "gtopk:density=0.1,hierarchical=true"):
        model = small_model()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression=spec)
        expected = {"gtopk": "sparse-allreduce", "cltk": "broadcast+allreduce", "twophase": "alltoall+allgather"}
        assert str(opt.transport) == expected[spec.split(":")[0]] + " (batched)", str(opt.transport)
        names = [n for n, _ in reversed(list(model.named_parameters()))]  # the optimizer's order
        params = dict(model.named_parameters())
        n = sum(q.numel() for q in model.parameters())
        k = max(1, math.ceil(float(spec.split("density=")[1].split(",")[0]) * n)) if "density" in spec else n
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            comp = opt.compression
            acc = torch.cat([(params[m].grad + comp.residual.get(m, torch.zeros_like(params[m]))).reshape(-1)
                             for m in names])
            everyone = all_grads(acc, f"acc.{spec}.{step}")
            raw = torch.cat([params[m].grad.reshape(-1) for m in names])
            raw_norms = [float(g.double().norm()) for g in all_grads(raw, f"raw.{spec}.{step}")]
            server_before = comp.server.get("cpu", 0.0) if spec.startswith("twophase") else 0.0
            opt.synchronize()
            mean = torch.cat([params[m].grad.reshape(-1) for m in names])
            with opt.skip_synchronize():
                opt.step()  # commits the step's residuals
            resid = torch.cat([comp.residual[m].reshape(-1) for m in names])
            if spec.startswith("twophase"):  # this rank's chunk of the server residual
                lo, hi = comp.chunk_bounds(n, p)[hvd.rank():hvd.rank() + 2]
                resid[lo:hi] += p * (comp.server.get("cpu", server_before) - server_before)
            total = hvd.allreduce(resid, op=hvd.Sum, name=f"res.{spec}.{step}")
            torch.testing.assert_close(p * mean + total, sum(everyone), rtol=1e-5, atol=1e-5)
            assert int((mean != 0).sum()) <= k, spec
            if spec.startswith("cltk"):
                lead = everyone[raw_norms.index(max(raw_norms)) if "variance" in spec else step % p]
                idx = torch.topk(lead.abs(), k).indices
                ref = torch.zeros(n)
                ref[idx] = sum(a[idx] for a in everyone) / p
                torch.testing.assert_close(mean, ref, rtol=1e-6, atol=1e-7)
            elif spec.startswith("gtopk") and k == n:
                torch.testing.assert_close(mean, sum(everyone) / p, rtol=1e-6, atol=1e-7)
            rec = opt.timer.end_step()
            if spec.startswith("gtopk") and p > 1:
                rounds = (p.bit_length() - 1) + 1
                local = (p - 1) * 12 * k if "hierarchical" in spec else 0  # one node here: the leader hands out
                assert 0 < rec["bytes_sent"] <= rounds * k * 8 + 4 * k + local, rec
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        assert torch.equal(hvd.broadcast(flat, 0, name=f"bcast.{spec}"), flat), spec
    if p > 1:
        model = small_model()
        try:
            hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression="gtopk", allgather="horovod")
        except RuntimeError as exc:
            assert "mpirun" in str(exc), exc
        else:
            raise AssertionError("gtopk accepted a job without MPI point-to-point messages")


def check_transport_auto():
    """transport='auto' picks by the cost model, hand-worked from the collectives' terms:
    latency-bound (alpha 1 ms, beta 1 ns/B), top-k takes gtopk (one message per step, against
    top-k's 2(p-1) and cltk's ceil(log2 p) + 2(p-1)); bandwidth-bound (alpha 0, beta 1 us/B),
    QSGD takes twophase iff 2(p-1)/p·B < (p-1)·Σb_i·0.99 (B: the whole model's quantized bytes,
    b_i: each gradient's). The chosen optimizer's parameters after 3 steps equal those of an
    optimizer built with that method directly."""
    p = hvd.size()
    for kwargs, words in (({"transport": "fastest"}, "one of planned, auto"),
                          ({"transport": "auto", "cost_model": "off"}, "cost_model='measure'")):
        model = small_model()
        try:
            hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), compression="topk", **kwargs)
        except ValueError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"{kwargs} accepted")
    # measured cost model and Horovod wait: every rank makes the same choice, priced for each candidate
    model = small_model()
    measured = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            compression="topk:density=0.2", transport="auto")
    every = hvd.allgather_object((measured.compression.name, sorted(measured.transport.choice)))
    assert all(e == every[0] for e in every) and len(every[0][1]) == 3, every
    assert all(v > 0 for v in measured.transport.choice.values()), measured.transport.choice
    sizes = [p_.numel() for p_ in small_model().parameters()]
    q = hvdcomp.get_compressor("qsgd:levels=4")
    whole, parts = q.expected_payload_bytes(sum(sizes)), sum(q.expected_payload_bytes(n) for n in sizes)
    qsgd_choice = "twophase" if 2 * (p - 1) / p * whole < (p - 1) * parts * 0.99 else "qsgd"
    cases = (("topk:density=0.2", (1e-3, 1e-9), "gtopk", "gtopk:density=0.2"),
             ("qsgd:levels=4", (0.0, 1e-6), qsgd_choice,
              "twophase:base=qsgd,levels=4" if qsgd_choice == "twophase" else "qsgd:levels=4"))
    for spec, cost, expect, direct_spec in cases:
        models = [small_model(), small_model()]
        auto = hvdcomp.DistributedOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1),
                                            named_parameters=models[0].named_parameters(),
                                            compression=spec, transport="auto", cost_model=cost)
        assert auto.compression.name == expect, (spec, auto.compression.describe(), auto.transport.choice)
        assert "chosen by the cost model" in str(auto.transport), str(auto.transport)
        assert len(auto.transport.choice) == (3 if spec.startswith("topk") else 2), auto.transport.choice
        direct = hvdcomp.DistributedOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1),
                                              named_parameters=models[1].named_parameters(),
                                              compression=direct_spec, cost_model="off")
        train_side_by_side(models, (auto, direct))
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), (spec, (a - b).abs().max())


def check_hierarchical_allgather():
    """The node-aware allgather returns exactly what the flat one does (payloads in rank order,
    several dtypes, empty contributions), for emulated node layouts: one node, contiguous nodes
    of 2, interleaved nodes, one rank per node; and an optimizer on it (top-k, 3 steps) ends
    with parameters bit-identical to one on the flat allgather."""
    from hvdcomp.comm.allgatherv import MPIAllgatherer
    from hvdcomp.comm.hierarchical import HierarchicalAllgatherer

    p, me = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(me)
    payload = [torch.randn(3 * me, generator=g), torch.arange(me + 1, dtype=torch.int32),
               torch.randn(0 if me % 2 else 5, generator=g).half()]
    flat = MPIAllgatherer()
    fh = flat.start(payload, "flat")
    expect = flat.finish(fh)
    for nodes in ([0] * p, [r // 2 for r in range(p)], [r % 2 for r in range(p)], list(range(p))):
        hier = HierarchicalAllgatherer(nodes=nodes)
        h = hier.start(payload, "hier")
        got = hier.finish(h)
        assert len(got) == p and h.bytes_received == fh.bytes_received
        # a node member sends its own payload (as flat); a leader instead its node's bundle and,
        # to a node of several ranks, the whole result
        node = hier.members[hier.my_node]
        bundle = sum(sum(t.numel() * t.element_size() for t in expect[r]) for r in node)
        whole = sum(t.numel() * t.element_size() for r in range(p) for t in expect[r])
        mine = bundle + (whole if len(node) > 1 else 0) if hier.is_leader else h.send.nbytes
        assert h.bytes_sent - fh.bytes_sent == mine - h.send.nbytes, (nodes, h.bytes_sent, fh.bytes_sent)
        for r in range(p):
            for a, b in zip(got[r], expect[r]):
                assert a.dtype == b.dtype and torch.equal(a, b), (nodes, r)
        hier.probe(64)
        hier.close()
    flat.close()
    models = [small_model(), small_model()]
    opts = [hvdcomp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                         compression="topk:density=0.2", allgather=kind, cost_model="off")
            for m, kind in zip(models, ("hierarchical", "mpi4py"))]
    assert str(opts[0].transport).startswith("mpi4py-hierarchical-allgather"), str(opts[0].transport)
    train_side_by_side(models, opts)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def check_close():
    """close() stops the allgather thread (threads back to the count before 20
    build-step-close rounds, flat and hierarchical); it refuses during a step; a closed
    optimizer refuses to synchronize or step (an allgather and a batched method), and its
    compressor may serve a new optimizer."""
    import threading

    from hvdcomp.comm import HierarchicalAllgatherer, MPIAllgatherer

    def build(spec, kind="mpi4py"):
        m = small_model()
        return m, hvdcomp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                               named_parameters=m.named_parameters(), compression=spec,
                                               allgather=kind, cost_model="off")

    baseline = threading.active_count()
    for i in range(20):
        gatherer = HierarchicalAllgatherer() if i % 2 else MPIAllgatherer()
        m, opt = build("topk:density=0.2", gatherer)
        train_side_by_side([m], [opt], steps=1)  # the first exchange starts the allgather thread
        assert gatherer.threaded and threading.active_count() == baseline + 1
        opt.close()
        assert threading.active_count() == baseline, (i, threading.active_count(), baseline)
    for spec in ("topk:density=0.2", "gtopk:density=0.2"):
        model, o = build(spec)
        x, y = batch(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"close\(\) during a step"):
            o.close()
        o.step()
        o.close()
        o.close()  # idempotent
        o.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="was closed"):
            o.step()
        with pytest.raises(RuntimeError, match="was closed"), o.skip_synchronize():
            o.step()  # (would apply the local, un-averaged gradient)
    # a closed optimizer's compressor (and its residuals) serves the next one; an open one's is refused
    m, o = build("topk:density=0.2")
    train_side_by_side([m], [o], steps=1)
    with pytest.raises(ValueError, match="already serves another"):
        hvdcomp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters(), compression=o.compression)
    o.close()
    o2 = hvdcomp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                      compression=o.compression, cost_model="off")
    assert o2.compression is o.compression
    o2.close()


#: what reads a tensor's value on the host (on CUDA: waits for the device), or has a data-dependent size
HOST_READS = [(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                                          "numpy", "nonzero", "masked_select", "unique", "bincount")] + \
             [(torch, n) for n in ("nonzero", "masked_select", "unique", "bincount")]


def host_reads(fn):
    """Calls of :data:`HOST_READS` made by hvdcomp's code while ``fn()`` runs, by call site."""
    import collections
    import os

    package = os.path.dirname(hvdcomp.__file__)
    sites = collections.Counter()
    saved = [(owner, name, getattr(owner, name)) for owner, name in HOST_READS]

    def counting(name, f):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                sites[f"{name} {os.path.relpath(caller, package)}:{sys._getframe(1).f_lineno}"] += 1
            return f(*args, **kwargs)
        return wrapper

    for owner, name, f in saved:
        setattr(owner, name, counting(name, f))
    try:
        fn()
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    return sites


def check_host_reads():
    """Host reads per step do not grow with the number of gradients (nor with their distinct
    shapes): on CUDA each is a synchronisation with the device, so a front-end may afford a few
    per step, never one per gradient. Counted for every default method on models of 3 and of 9
    layers of distinct shapes (2 gradients each)."""
    def reads(spec, layers):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8 + i, 9 + i) for i in range(layers)])
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(), compression=spec,
                                           cost_model="off")

        def step(s):
            g = torch.Generator().manual_seed(100 * hvd.rank() + s)
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()

        for s in range(2):  # (the first steps learn: fp16's exponents, PowerSGD's first Qs)
            step(s)
        sites = host_reads(lambda: [step(2 + s) for s in range(2)])
        opt.close()
        return sites

    for spec in ("none", "fp16", "topk:density=0.01", "qsgd:levels=16", "powersgd:matrix_rank=2",
                 "dgc:density=0.01"):
        few, many = reads(spec, 3), reads(spec, 9)
        if hvd.rank() == 0:
            print(f"host reads per step, {spec}: {sum(few.values()) / 2:g} (6 gradients), "
                  f"{sum(many.values()) / 2:g} (18 gradients): {dict(many)}", flush=True)
        assert sum(many.values()) == sum(few.values()), (spec, few, many)
        assert sum(many.values()) <= 4 * 2, (spec, many)  # (at most 4 a step: see docs/fused-compression.md)


CHECKS = {f.__name__[len("check_"):]: f for f in [
    check_none_matches_horovod, check_topk, check_threshold_with_empty_rank,
    check_horovod_allgather_fallback, check_fp16_predivide, check_sparse_refused_by_stock_horovod,
    check_buckets_and_wire, check_cost_model_routes, check_threaded_and_inline_exchange_agree,
    check_fused_equals_unfused, check_scaleout_methods, check_transport_auto, check_hierarchical_allgather, check_close, check_host_reads]}

if __name__ == "__main__":
    hvd.init()
    names = sys.argv[1:] or list(CHECKS)
    for name in names:
        CHECKS[name]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
