"""Hand-worked recipe cases, restores, settings that must agree, low precision, failures.

Usage: mpirun -np N python tests/mpi/recipe_checks.py CHECK [CHECK ...]
Each check raises on failure and prints "OK <check>" on rank 0. Values in the docstrings are
worked out by hand (2 ranks unless stated).
"""
import io
import os
import sys
import time
import warnings

import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.transports import StepMethod  # noqa: E402
from hvdcomp.compressors import PayloadKind  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from recipes import SPECS, batch, mlp, mpi_exchange, params, reference_step_comm  # noqa: E402


def vector_opt(spec, w=None, lr=0.1, **kw):
    """A single parameter ``w`` (ones(4) by default) under hvdcomp; loss = (c · w).sum()."""
    w = torch.nn.Parameter(torch.ones(4) if w is None else w)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=lr), named_parameters=[("w", w)],
                                       compression=spec, cost_model="off", **kw)
    return w, opt


def close(a, b, atol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          rtol=0, atol=atol)


def check_amp_overflow_then_steps():
    """GradScaler("cpu", 2**16), lr 0.1, w = ones(4); iteration 1 has coefficients [1e35,1,1,1]
    (overflow: skipped), iterations 2 and 3 [1,2,3,4]. none: [1,1,1,1], [.9,.8,.7,.6],
    [.8,.6,.4,.2]. topk 0.5 with EF: step 2 sends [0,0,3,4] (residual [1,2,0,0]·S), step 3 sends
    the top 2 of [2,4,3,4] = [0,4,0,4]: [1,1,1,1], [1,1,.7,.6], [1,.6,.7,.2]."""
    expected = {"none": [[1, 1, 1, 1], [.9, .8, .7, .6], [.8, .6, .4, .2]],
                "topk:density=0.5": [[1, 1, 1, 1], [1, 1, .7, .6], [1, .6, .7, .2]]}
    for spec, want in expected.items():
        w, opt = vector_opt(spec)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for it, c in enumerate([[1e35, 1, 1, 1], [1, 2, 3, 4], [1, 2, 3, 4]]):
            opt.zero_grad()
            scaler.scale((torch.tensor(c) * w).sum()).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            assert close(w.detach(), want[it]), (spec, it, w)
        assert scaler.get_scale() == 2.0**15


def check_amp_scale_change_rescales_residual():
    """topk 0.5 (EF), GradScaler 2**16: step 1 [1,2,3,4] sends [0,0,3,4], residual S·[1,2,0,0];
    step 2 overflows (S halves); step 3 [1,2,3,4] must compress (S/2)·([1,2,3,4] + [1,2,0,0]):
    top 2 of [2,4,3,4] -> [0,4,0,4], w = [1,.6,.7,.2], residual (S/2)·[2,0,3,0]. Without the
    rescale it would compress (S/2)·[3,6,3,4] and give w = [1,.4,.7,.2]."""
    for explicit in (False, True):
        w = torch.nn.Parameter(torch.ones(4))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                           compression="topk:density=0.5", cost_model="off",
                                           grad_scaler=scaler if explicit else None)
        for c in ([1, 2, 3, 4], [1e35, 1, 1, 1], [1, 2, 3, 4]):
            opt.zero_grad()
            scaler.scale((torch.tensor(c) * w).sum()).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        assert close(w.detach(), [1, .6, .7, .2]), (explicit, w)
        assert torch.equal(opt.compression.residuals["w"], 2.0**15 * torch.tensor([2.0, 0, 3, 0])), explicit


def check_clip_without_skip_synchronize():
    """Every rank [1,2,3,4], topk 0.25: synchronize, clip to norm 1, step(): the update is the
    clipped average [0,0,0,1] (compressed once), the residual [1,2,3,0]."""
    w, opt = vector_opt("topk:density=0.25", lr=1.0)
    (torch.tensor([1.0, 2, 3, 4]) * w).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_([w], 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(c.message) for c in caught)
    assert close(w.detach(), [1, 1, 1, 0]), w
    assert torch.equal(opt.compression.residuals["w"], torch.tensor([1.0, 2, 3, 0]))


def check_discard_leaves_no_trace():
    """A synchronized gradient discarded with zero_grad() leaves parameters and every piece of
    compressor state (residuals, momenta, counters, generators) as if that step never ran."""
    for spec in SPECS:
        if spec.startswith("powersgd"):
            continue  # PowerSGD's state moves in synchronize(); checked below without discard
        runs = []
        for discard in (True, False):
            model = mlp()
            opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters(),
                                               compression=spec, cost_model="off")
            for step in range(4):
                if step == 2 and not discard:
                    continue
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(batch(step)[0]), batch(step)[1]).backward()
                opt.synchronize()
                if step != 2:
                    with opt.skip_synchronize():
                        opt.step()
            opt.zero_grad()
            buf = io.BytesIO()
            torch.save(opt.compression.state_dict(), buf)
            runs.append((params(model), buf.getvalue()))
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])), spec
        assert runs[0][1] == runs[1][1], f"{spec}: compressor state differs after a discarded step"


def check_zero_grad_between_accumulated_passes_refused():
    """backward_passes_per_step=2: zero_grad() after the first pass is refused, as Horovod does."""
    for make in ("stock", "ours"):
        model = mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if make == "stock":
            opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                           backward_passes_per_step=2)
        else:
            opt = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                               compression="topk:density=0.3", backward_passes_per_step=2)
        torch.nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
        try:
            opt.zero_grad()
        except AssertionError as exc:
            assert "zero_grad() was called after loss.backward()" in str(exc)
        else:
            raise AssertionError(f"{make}: zero_grad() between accumulated passes was accepted")
        torch.nn.functional.mse_loss(model(batch(1)[0]), batch(1)[1]).backward()
        opt.step()


def _train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(batch(step)[0]), batch(step)[1]).backward()
        opt.step()


def check_resume_rank0_only():
    """Linear(8,2), momentum SGD, topk 0.5 (and every stateful method): 3 steps, rank 0 saves;
    a new job where rank 0 alone loads, then hvd.broadcast_parameters + broadcast_optimizer_state
    (deadlocked before): no hang; momenta and parameters equal on every rank; the shared
    compressor state (counters, Q, epoch) is rank 0's everywhere after the first step."""
    for spec in ["topk:density=0.5", "randomk:density=0.5", "dgc:density=0.5", "powersgd:matrix_rank=1",
                 "qsgd:levels=4,block=8"]:
        momentum = 0.0 if spec.startswith("dgc") else 0.9

        def build():
            torch.manual_seed(7)
            model = torch.nn.Linear(8, 2)
            x = torch.nn.Sequential(model)
            opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(x.parameters(), lr=0.1, momentum=momentum),
                                               named_parameters=x.named_parameters(), compression=spec,
                                               cost_model="off")
            return x, opt

        def step_batch(step):
            g = torch.Generator().manual_seed(100 * hvd.rank() + step)
            return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

        def train(model, opt, steps):
            for step in steps:
                opt.zero_grad()
                x, y = step_batch(step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()

        model, opt = build()
        train(model, opt, range(3))
        shared_saved = opt.compression.shared_state()
        buf = io.BytesIO()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        model, opt = build()
        if hvd.rank() == 0:
            buf.seek(0)
            state = torch.load(buf, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mom = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
        if momentum:
            flat = torch.cat([m.reshape(-1) for m in mom])
            assert torch.equal(hvd.broadcast(flat, 0, name=f"mom.{spec}"), flat), spec
        train(model, opt, range(3, 4))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(hvd.broadcast(flat, 0, name=f"par.{spec}"), flat), spec
        every = hvd.allgather_object(opt.compression.shared_state(), name=f"shared.{spec}")
        buf0 = io.BytesIO()
        torch.save(every[0], buf0)
        for other in every[1:]:
            b = io.BytesIO()
            torch.save(other, b)
            assert b.getvalue() == buf0.getvalue(), f"{spec}: shared state differs across ranks"
        assert shared_saved.keys() == every[0].keys(), spec


def check_resume_every_rank_bit_identical():
    """Each rank saves its own state_dict and loads it into a new job: the next steps are
    bit-identical to an uninterrupted run, for every stateful method."""
    for spec in ["topk:density=0.3", "topk:density=0.3,select=sample,ef=false", "dgc:density=0.3",
                 "randomk:density=0.3", "powersgd:matrix_rank=1", "qsgd:levels=4,block=8", "efsignsgd"]:
        def build():
            model = mlp()
            return model, hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                       named_parameters=model.named_parameters(),
                                                       compression=spec, cost_model="off")
        model, opt = build()
        _train(model, opt, range(5))
        straight = params(model)
        model, opt = build()
        _train(model, opt, range(3))
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        model, opt = build()
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        _train(model, opt, range(3, 5))
        assert all(torch.equal(a, b) for a, b in zip(params(model), straight)), spec


def check_restore_mid_training_on_one_rank_fails_loudly():
    """load_state_dict() on rank 0 only after training started: RuntimeError on every rank at
    the next step, naming the rank (no silent divergence, no hang)."""
    for spec in ("randomk:density=0.3", "none"):  # none: found from the sums it sends with the gradients
        model = mlp()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=spec, cost_model="off")
        _train(model, opt, range(2))
        if hvd.rank() == 0:
            opt.load_state_dict(opt.state_dict())
        try:
            _train(model, opt, range(2, 3))
        except RuntimeError as exc:
            assert "rank(s) [0] only" in str(exc), exc
        else:
            raise AssertionError("a restore on one rank mid-training went unnoticed")


def check_backward_passes_mismatch_raises_everywhere():
    for spec in ("topk:density=0.3", "none"):
        model = mlp()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=spec, cost_model="off")
        if hvd.rank() == 1:
            opt.set_backward_passes_per_step(2)
        try:
            _train(model, opt, range(1))
        except RuntimeError as exc:
            assert "backward_passes_per_step" in str(exc), exc
        else:
            raise AssertionError("ranks with different backward_passes_per_step went unnoticed")


def check_disagreeing_settings():
    """Each setting that must agree, set differently on rank 1: ValueError on every rank naming it."""
    cases = [("bucket_bytes", {"bucket_bytes": 1 if hvd.rank() == 1 else 2**20}),
             ("nonfinite", {"nonfinite": "raise" if hvd.rank() == 1 else "skip"}),
             ("op", {"op": hvd.Sum if hvd.rank() == 1 else hvd.Average}),
             ("gradient_predivide_factor", {"gradient_predivide_factor": 2.0 if hvd.rank() == 1 else 1.0}),
             ("cost_model", {"cost_model": "off" if hvd.rank() == 1 else (0.0, 1e-9)}),
             ("allgather", {"allgather": "horovod" if hvd.rank() == 1 else "mpi4py"})]
    for key, kw in cases:
        model = mlp()
        try:
            hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression="topk:density=0.3", **kw)
        except ValueError as exc:
            assert key in str(exc), (key, exc)
        else:
            raise AssertionError(f"ranks with different {key} went unnoticed")


def check_compressor_shared_between_optimizers_refused():
    comp = hvdcomp.get_compressor("topk:density=0.3")
    a, b = mlp(), mlp()
    keep = hvdcomp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                        named_parameters=a.named_parameters(), compression=comp)
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1),
                                     named_parameters=b.named_parameters(), compression=comp)
    except ValueError as exc:
        assert "already serves another" in str(exc)
    else:
        raise AssertionError("one compressor accepted by two optimizers")
    del keep


def check_adasum_refused():
    """op=hvd.Adasum: methods other than none/fp16 are refused, naming those (none and fp16 run
    stock Horovod's Adasum optimizer: tests/mpi/parity_checks.py compares them with stock)."""
    model = mlp()
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=hvd.Adasum,
                                     compression="topk:density=0.3")
    except ValueError as exc:
        assert "Adasum" in str(exc) and "'none' or 'fp16'" in str(exc), exc
    else:
        raise AssertionError("Adasum accepted")


def check_low_precision_every_method():
    """Every method × {float32, float16, bfloat16} parameters: the averaged gradient equals a
    float64 reference (each rank's compressor applied to its own gradient, decodes averaged in
    float64) within 4 units in the last place of the parameter dtype at the tensor's largest
    magnitude; residuals and momenta are float32; nothing overflows."""
    eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
    for dtype, spec in [(d, s) for d in eps for s in ["none"] + SPECS]:
        g = torch.Generator().manual_seed(10 + hvd.rank())
        coeff = (torch.randn(6, 5, generator=g) * 3).to(dtype)
        w = torch.nn.Parameter(torch.zeros(6, 5, dtype=dtype))
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                           compression=spec, cost_model="off")
        ref_comp = hvdcomp.get_compressor(spec)  # same seed, same rank: the same random draws
        (coeff.float() * w.float()).sum().backward()
        assert w.grad.dtype == dtype
        local = w.grad.clone()
        opt.synchronize()
        got = w.grad.double()
        if isinstance(ref_comp, StepMethod):
            named = [("w", local)]
            ref = ref_comp.reduce_batch(named, reference_step_comm(f"lp.{spec}.{dtype}", hvd.global_process_set,
                                                                   mpi_exchange(hvd.global_process_set), float64=True),
                                        hvdcomp.PhaseTimer(cuda_sync=False))[0].double()
        else:
            payload, ctx = ref_comp.encode(local, "w")
            every = hvd.allgather_object(payload, name=f"lp.{spec}.{dtype}")
            if ref_comp.payload_kind is not PayloadKind.GATHERED:
                mean = [sum(p[i].double() for p in every) / len(every) for i in range(len(payload))]
                ref = ref_comp.decode([t.to(payload[i].dtype) if payload[i].dtype == torch.float16 else t.float()
                                       for i, t in enumerate(mean)], ctx).double()
                if spec.startswith("signsgd"):
                    ref = ref_comp.decode([sum(p[0] for p in every)], ctx).double()
            else:
                ref = ref_comp.aggregate(every, ctx).double()
        tol = 4 * eps[dtype] * max(1.0, ref.abs().max().item()) + 1e-30
        if spec.startswith("fp16") or (spec == "none" and dtype == torch.float16):
            tol = max(tol, 8 * 2.0**-10 * ref.abs().max().item())  # an fp16 wire rounds each addend
        assert torch.isfinite(got).all(), (spec, dtype)
        assert (got - ref).abs().max().item() <= tol, (spec, dtype, (got - ref).abs().max().item(), tol)
        for store in ("residuals", "u", "v", "error", "residual", "server"):
            for t in getattr(getattr(opt.compression, "inner", opt.compression), store, {}).values():
                assert t.dtype == torch.float32, (spec, dtype, store, t.dtype)
            for t in getattr(opt.compression, store, {}).values():
                assert t.dtype in (torch.float32, torch.float64), (spec, dtype, store, t.dtype)


def check_fp16_sums_never_overflow():
    """fp16 parameters with 'none': every rank sends [40000, 60000, -65504]; the sum of the ranks'
    values would overflow fp16, the pre-divided allreduce gives the mean exactly."""
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                       compression="none")
    (torch.tensor([40000.0, 60000.0, -65504.0]) * w.float()).sum().backward()
    opt.synchronize()
    assert w.grad.tolist() == [40000.0, 60000.0, -65504.0], w.grad


def check_bf16_dense_route():
    """bf16 parameters (1000,), topk 0.5, cost_model=(1, 1) (failed with "BFloat16 is not
    supported" when the model chose the decoded route), and the same with the decoded-allreduce
    route forced: both equal the mean of the ranks' top-k decodes (Horovod has no bf16
    allreduce: the decode travels in float32)."""
    from hvdcomp.comm.costmodel import CostModel

    class AlwaysDense(CostModel):
        def choose(self, sparse_bytes, dense_bytes, p):
            return "allreduce"

    for cost_model in [(1.0, 1.0), AlwaysDense(0.0, 0.0)]:
        g = torch.Generator().manual_seed(20 + hvd.rank())
        coeff = torch.randn(1000, generator=g).to(torch.bfloat16)
        w = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                           compression="topk:density=0.5", cost_model=cost_model)
        if isinstance(cost_model, AlwaysDense):
            assert opt.transport.routes["w"] == "decoded-allreduce", opt.transport.routes
        (coeff.float() * w.float()).sum().backward()
        local = w.grad.float()
        opt.synchronize()
        every = hvd.allgather(local.unsqueeze(0), name="bf16.ref").double()
        dense = torch.zeros_like(every)
        for r in range(every.shape[0]):
            idx = every[r].abs().topk(500).indices
            dense[r, idx] = every[r, idx]
        ref = dense.mean(0)
        assert (w.grad.double() - ref).abs().max().item() <= 4 * 2.0**-7 * ref.abs().max().item()


def check_allgather_thread_failure_aborts_the_job():
    """The background allgather thread fails on rank 1: the job ends on every rank (MPI_Abort)
    instead of leaving rank 0 waiting in the collective. Expected to exit non-zero."""
    from hvdcomp.comm.allgatherv import MPIAllgatherer

    class Broken(MPIAllgatherer):
        """Rank 1's exchange fails on the background thread."""

        def _exchange(self, h, counts):
            if hvd.rank() == 1:
                raise MemoryError("injected failure on the allgather thread")
            return super()._exchange(h, counts)

    model = mlp()
    gatherer = Broken()
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression="topk:density=0.3", cost_model="off", allgather=gatherer)
    assert gatherer.threaded
    _train(model, opt, range(1))
    time.sleep(30)  # rank 0 must not get here alive: the abort ends the job first
    raise AssertionError("the job survived a failed allgather thread")


CHECKS = {f.__name__[len("check_"):]: f for f in [
    check_amp_overflow_then_steps, check_amp_scale_change_rescales_residual,
    check_clip_without_skip_synchronize, check_discard_leaves_no_trace,
    check_zero_grad_between_accumulated_passes_refused, check_resume_rank0_only,
    check_resume_every_rank_bit_identical, check_restore_mid_training_on_one_rank_fails_loudly,
    check_backward_passes_mismatch_raises_everywhere, check_disagreeing_settings,
    check_compressor_shared_between_optimizers_refused, check_adasum_refused,
    check_low_precision_every_method, check_fp16_sums_never_overflow, check_bf16_dense_route,
    check_allgather_thread_failure_aborts_the_job]}

if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:]:
        CHECKS[name]()
        hvd.barrier()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
