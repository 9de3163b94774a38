"""fp16 never delivers a saturated value as if it were right (issue 29), through
hvdcomp.DistributedOptimizer and stock hvd.DistributedOptimizer, at 2 ranks.

The issue's case: one parameter of 8 elements, every rank's gradient 1, 1, then 100, 100. The
scale agreed after the first steps (E = 0, headroom 3) puts 100 beyond the float16 window, and
the old code delivered 31.98 at the third step. Expected values are worked out by hand:

* bytes per step: a probe payload is float32 (n + 277), a scaled one float16 (n + 25), and a
  resend float32 (n + 277) per saturated tensor;
* a resend is the float32 probe: 100 from every rank averages to exactly 100 (sums to 200).

Usage: mpirun -np 2 python tests/mpi/saturation_checks.py CHECK [CHECK ...]   ("OK <check>" each)
"""
import sys

import torch
import horovod.torch as hvd

import hvdcomp

STEPS = [1.0, 1.0, 100.0, 100.0]
PROBE, SCALED = 4 * (8 + 277), 2 * (8 + 25)          # bytes of one 8-element payload
U16 = 2.0**-11


def run_steps(opt, params, values, coeffs=None):
    """One backward per value (each parameter's gradient = value·coeff); returns per step the
    synchronized gradients (clones) and the bytes this rank sent."""
    grads, sent = [], []
    for step, value in enumerate(values):
        opt.timer.begin_step()
        opt.zero_grad()
        loss = sum((p * (value * (1.0 if coeffs is None else coeffs[i][step]))).sum() for i, p in enumerate(params))
        loss.backward()
        opt.synchronize()
        grads.append([p.grad.clone() for p in params])
        with opt.skip_synchronize():
            opt.step()
        sent.append(opt.timer.end_step()["bytes_sent"])
    return grads, sent


def vector(spec, n=8, lr=0.0, **kw):
    w = torch.nn.Parameter(torch.zeros(n))
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([w], lr=lr), named_parameters=[("w", w)],
                                       compression=spec, **kw)
    return w, opt


def check_issue_case_is_resent():
    """compression="fp16" and hvd.Compression.fp16: gradients 1, 1, 100, 100 exactly (the resend
    is float32; 1 is exact in float16); step 3 costs one more probe-sized allreduce."""
    for spec in ("fp16", hvd.Compression.fp16):
        w, opt = vector(spec)
        grads, sent = run_steps(opt, [w], STEPS)
        got = [g[0].tolist() for g in grads]
        assert got == [[v] * 8 for v in STEPS], (spec, got)
        assert sent == [PROBE, SCALED, SCALED + PROBE, SCALED], (spec, sent)
        # the resend re-learned the exponent: step 4 is a scaled step at E = 6 (100 = 1.5625·2^6)
        assert opt.compression.exponents == {"w": 6}, opt.compression.exponents


def check_just_under_the_headroom_is_not_resent():
    """From max 1.0 (E = 0) a growth of 8·(1 − 2^-11) stays inside the window at N = 2 (C_2 =
    32752 = 0.9995·2^15, s = 2^(14 − 1 − 3) = 2^10): no resend, float16 accuracy."""
    w, opt = vector("fp16")
    grow = 8.0 * (1 - 2.0**-11)
    grads, sent = run_steps(opt, [w], [1.0, 1.0, grow])
    assert sent == [PROBE, SCALED, SCALED], sent
    assert (grads[2][0] - grow).abs().max().item() <= (hvd.size() + 2) * U16 * grow


def check_skip_policy_reports_an_overflow():
    """on_saturation="skip": step 3 is skipped on every rank (every .grad NaN, the parameter
    unchanged, skipped_steps 1); the exponent moved up anyway, so step 4 fits: 100 within
    float16 error, and the parameter moved by lr·(1 + 1 + 100)."""
    w, opt = vector("fp16:on_saturation=skip", lr=0.5)
    grads, sent = run_steps(opt, [w], STEPS)
    assert torch.isnan(grads[2][0]).all(), grads[2]
    assert opt.skipped_steps == 1
    assert sent == [PROBE, SCALED, SCALED, SCALED], sent
    assert (grads[3][0] - 100.0).abs().max().item() <= (hvd.size() + 2) * U16 * 100.0
    expected = -0.5 * (1.0 + 1.0 + grads[3][0])
    assert torch.equal(w.detach(), expected), (w, expected)


def check_error_feedback_residual_follows_the_resend():
    """fp16:ef=true, gradient g = v + 2^-13 (float16 drops 2^-13 at v = 1 on a scaled step: the
    residual keeps it). At the saturated step this rank's payload is resent as its float32
    p = g + e_old: the delivered gradient is p (both ranks equal), the new residual 0, so
    delivered + new residual == g + old residual exactly."""
    w, opt = vector("fp16:ef=true")
    tail = 2.0**-13
    residual = None
    for step, value in enumerate(STEPS):
        old = opt.compression.residuals.get("w", torch.zeros(8))
        opt.zero_grad()
        (w * (value + tail)).sum().backward()
        opt.synchronize()
        g = torch.full((8,), value + tail)
        residual = opt.compression._get("residuals", "w")
        if step == 2:
            p = g + old
            assert torch.equal(w.grad, p), (w.grad, p)
            assert torch.equal(residual, torch.zeros(8)), residual
        assert torch.equal(w.grad + residual, g + old), (step, w.grad, residual, g, old)
        with opt.skip_synchronize():
            opt.step()
    assert torch.equal(opt.compression.residuals["w"], residual)  # committed with the step


def check_op_sum_and_predivide():
    """op=hvd.Sum: the resend sums in float32 (2·100 = 200 exactly); gradient_predivide_factor=2:
    100·(1/2) summed and times 2/N is 100 exactly."""
    w, opt = vector("fp16", op=hvd.Sum)
    grads, sent = run_steps(opt, [w], STEPS)
    assert [g[0].tolist() for g in grads] == [[v * hvd.size()] * 8 for v in STEPS], grads
    assert sent[2] == SCALED + PROBE, sent
    w, opt = vector("fp16", gradient_predivide_factor=2.0)
    grads, sent = run_steps(opt, [w], STEPS)
    assert [g[0].tolist() for g in grads] == [[v] * 8 for v in STEPS], grads
    assert sent[2] == SCALED + PROBE, sent


def check_fused_unit_resends_only_the_saturated_gradient():
    """Two gradients fused in one unit (fuse_tensors, default): a grows 1 -> 100, b stays 3.
    Only a is resent (float32, 8 + 277 values), b keeps its scaled value; same with error
    feedback (a's residual 0 after the resend, b's unchanged by it)."""
    for spec in ("fp16", "fp16:ef=true"):
        a, b = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.0), named_parameters=[("a", a), ("b", b)],
                                           compression=spec)
        assert list(opt.transport.units.values()) == [["b", "a"]], opt.transport.units
        grads, sent = run_steps(opt, [a, b], STEPS, coeffs=[[1.0] * 4, [3.0 / v for v in STEPS]])
        assert [g[0].tolist() for g in grads] == [[v] * 8 for v in STEPS], grads
        assert all(g[1].tolist() == [3.0] * 8 for g in grads), grads   # 3 is exact in float16
        assert sent == [2 * PROBE, 2 * SCALED, 2 * SCALED + PROBE, 2 * SCALED], (spec, sent)
        if spec.endswith("ef=true"):
            res = opt.compression.residuals
            assert torch.equal(res["a"], torch.zeros(8)) and torch.equal(res["b"], torch.zeros(8)), res


def check_static_mode_is_loud_like_stock():
    """Stock hvd.DistributedOptimizer with hvdcomp's fp16 (no names: the static 1/N scale, no
    resend): a gradient of 1e5 (beyond float16) averages to inf, as stock's Compression.fp16
    makes it; 65504 on every rank averages to 65504 (stock: the float16 sum overflows to inf)."""
    for value, want_ours, want_stock in ((1e5, float("inf"), float("inf")), (65504.0, 65504.0, float("inf"))):
        for compression, want in ((hvdcomp.get_compressor("fp16"), want_ours), (hvd.Compression.fp16, want_stock)):
            w = torch.nn.Parameter(torch.zeros(4))
            opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                           compression=compression)
            opt.zero_grad()
            (w * value).sum().backward()
            opt.synchronize()
            assert w.grad.tolist() == [want] * 4, (value, compression, w.grad)
            with opt.skip_synchronize():
                opt.step()


CHECKS = {f.__name__[len("check_"):]: f for f in [
    check_issue_case_is_resent, check_just_under_the_headroom_is_not_resent,
    check_skip_policy_reports_an_overflow, check_error_feedback_residual_follows_the_resend,
    check_op_sum_and_predivide, check_fused_unit_resends_only_the_saturated_gradient,
    check_static_mode_is_loud_like_stock]}

if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        hvd.barrier()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
