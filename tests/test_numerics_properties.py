"""Property tests (Hypothesis) of the invariants every method promises (issue 13, part 4):

* the aggregate equals the mean of the decodes (every rank's payload decoded alone);
* error feedback: ``sent + new residual == input + old residual`` exactly in float32 for every
  sparsifier and for the float16 / bfloat16 / none casts; for the stochastic quantizers (QSGD,
  TernGrad, EF-signSGD, signSGD) exact float32 equality is impossible in general (see
  ``test_exact_float32_identity_is_impossible_for_quantizers``), and the identity holds up to the
  single rounding of the residual, |sent + e − p| ≤ 2^-24·|p − sent|;
* the sparse wire codings (float16 values, compact indices, dense fallback) and the bit packing
  round-trip.
"""
import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import hvdcomp
from hvdcomp.compressors import PayloadKind
from hvdcomp.transports import StepMethod
from hvdcomp.compressors import bitpack, simulated_world
from hvdcomp.compressors.dgc import DGCCompressor
from hvdcomp.compressors.sparse import FP16_MAX
from tests.simworld import SimulatedRanks, horovod_allreduce

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def draw_tensor(draw, dtype, shape):
    """One gradient: zeros, values from a pool (ties, ±0, the dtype's extremes), or a scaled
    uniform draw; magnitudes within the dtype's normal range (1e-30 / 1e30 where it has them)."""
    n = math.prod(shape)
    info = torch.finfo(dtype)
    tiny, huge = max(1e-30, info.tiny), min(1e30, info.max / 8)
    kind = draw(st.sampled_from(["pool", "normal", "zeros"]))
    if kind == "zeros":
        vals = [0.0] * n
    elif kind == "pool":
        vals = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 0.5, tiny, -tiny, huge, -huge, 3.25]),
                             min_size=n, max_size=n))
    else:
        scale = draw(st.sampled_from([tiny * 16, 1e-3, 1.0, huge / 16]))
        vals = [scale * v for v in draw(st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n))]
    return torch.tensor(vals, dtype=torch.float64).reshape(shape).to(dtype)


@st.composite
def per_rank_gradients(draw, max_world=5, count=None):
    """(N, [g_r]) with g_r of one shape and dtype (``count`` tensors instead of N if given)."""
    world = draw(st.integers(1, max_world))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(0,), (1,), (7,), (3, 5), (16, 12)]))
    return world, [draw_tensor(draw, dtype, shape) for _ in range(count or world)]


MEAN_OF_DECODES = ["none", "fp16", "bf16", "topk:density=0.2,ef=false", "topk:density=0.2,select=sample,ef=false",
                   "topk:density=0.3,values=fp16,index=compact,ef=false",
                   "topk:density=0.3,values=int2,index=compact,ef=false", "randomk:density=0.3,ef=false",
                   "threshold:threshold=0.1,ef=false", "dgc:density=0.2", "qsgd:levels=4,block=8",
                   "qsgd:levels=64,scale=max", "terngrad", "efsignsgd:ef=false",
                   "sidco:density=0.2,ef=false", "sbc:density=0.2,ef=false", "lowbit:bits=4,block=8",
                   "adaptive:base=topk,budget=0.2,every=1,ef=false"]


@pytest.mark.parametrize("spec", MEAN_OF_DECODES)
@SETTINGS
@given(case=per_rank_gradients())
def test_aggregate_equals_the_mean_of_decodes(spec, case):
    """Every rank ends the step with the mean over ranks of decode(payload_r), to the transport's
    rounding: float32 sums for most ((N+2)·2^-24 of the mean magnitude), float16 sums for fp16
    ((N+2)·2^-11), and the casts to the gradient's dtype."""
    world, grads = case
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor(spec), world)
    encoded = sim.encode(grads, "w")
    decodes = []
    for r, (payload, ctx) in enumerate(encoded):
        with simulated_world(world, r):
            # a copy decodes: fp16 records the agreed exponent when decoding, not wanted here
            decodes.append(copy.deepcopy(sim.comps[r]).decode(payload, ctx).double())
    out = sim.combine(encoded)[0].double()
    mean = torch.stack(decodes).mean(0)
    mean_abs = torch.stack(decodes).abs().mean(0)
    dtype = grads[0].dtype
    unit = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    wire = (world + 2) * (2.0**-11 if spec == "fp16" and world > 1 else 2.0**-24)
    floor = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}[dtype]
    if spec == "fp16":   # float16 steps also flush below the window: (N+2)·2^-25 / s absolute
        floor = max(floor, (world + 2) * 2.0**-25 * 2.0**-encoded[0][1].k)
    assert out.shape == grads[0].shape
    # finite everywhere, except float16 sparse values without a residual: a value float16 cannot
    # hold travels as ±inf (loud, issue 29), and then exactly where the mean of the decodes is too
    loud = "values=fp16" in spec and "ef=false" in spec
    assert torch.equal(torch.isfinite(out), torch.isfinite(mean)) if loud else torch.isfinite(out).all()
    if loud:
        beyond = torch.stack([g.double().abs() >= 65520 for g in grads]).any(0)
        assert not (~torch.isfinite(out) & ~beyond).any(), (spec, grads, out)   # only out-of-range values
        out, mean, mean_abs = (t[torch.isfinite(mean)] for t in (out, mean, mean_abs))
    # each decode is rounded to the dtype, and so is the aggregate: two roundings apart at most
    assert ((out - mean).abs() <= (wire + 2 * unit) * mean_abs + floor).all(), (spec, grads, out, mean)


def test_aggregate_mean_property_covers_every_mean_method():
    names = {s.split(":")[0] for s in MEAN_OF_DECODES}
    per_tensor = [n for n in hvdcomp.available() if not isinstance(hvdcomp.get_compressor(n), StepMethod)]
    means = {n for n in per_tensor
             if hvdcomp.get_compressor(n).aggregate_is_mean or hvdcomp.get_compressor(n).payload_kind is not PayloadKind.SUM}
    assert means == names


# ---- error feedback ------------------------------------------------------------------------
EXACT = ["none:ef=true", "fp16:ef=true", "bf16:ef=true", "topk:density=0.2", "topk:density=0.2,select=sample",
         "topk:density=0.3,values=fp16,index=compact", "randomk:density=0.3", "threshold:threshold=0.1",
         "threshold:threshold=0.1,values=fp16"]
ONE_ROUNDING = ["qsgd:levels=4,block=8,ef=true", "terngrad:ef=true", "efsignsgd", "signsgd:ef=true",
                "topk:density=0.3,values=int2,index=compact"]


def local_sent(comp, payload, ctx):
    """What this rank's payload decodes to by itself, in the residual's dtype (float32 here)."""
    inner = comp.inner
    return copy.deepcopy(inner).decode(payload, ctx.inner)


def two_steps():
    """Two successive gradients of one parameter (same shape and dtype)."""
    return per_rank_gradients(max_world=1, count=2).map(lambda case: case[1])


@pytest.mark.parametrize("spec", EXACT + ONE_ROUNDING)
@SETTINGS
@given(steps=two_steps())
@example(steps=[torch.full((7,), 1e-3, dtype=torch.float16), torch.full((7,), 8000.0, dtype=torch.float16)])
@example(steps=[torch.tensor([1e-30, 0.0, 3.0]), torch.tensor([1e30, -1e-3, 7.0])])
@example(steps=[torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, 662510000.0])])
def test_error_feedback_identity(spec, steps):
    """p = g + e_old (float32 for half-precision g); after encode: float32(sent + e_new) == p.
    (The first example makes fp16 saturate: 8e3 after 1e-3 is far beyond its headroom.)"""
    comp = hvdcomp.get_compressor(spec)
    for g in steps:
        old = comp.residuals.get("w")
        p = g.to(torch.float32) if g.dtype in (torch.float16, torch.bfloat16) else g.clone()
        if old is not None:
            p = p + old
        payload, ctx = comp.encode(g, "w")
        sent = local_sent(comp, payload, ctx).reshape(p.shape)
        new = comp.residuals["w"]
        assert new.dtype == torch.float32 and sent.dtype == torch.float32
        # float16 values saturate at ±65504 and the residual keeps p ∓ 65504: exact while that is a
        # float32 (|p| − 65504 < 2^29), else rounded once (found by Hypothesis: p = 6.6251e8)
        rounded_once = "values=fp16" in spec and bool((p.abs() - 65504.0 >= 2.0**29).any())
        if spec in EXACT and not rounded_once:
            assert torch.equal(sent + new, p), (spec, g, p, sent, new)
        else:
            gap = (sent.double() + new.double() - p.double()).abs()
            assert (gap <= 2.0**-24 * (p.double() - sent.double()).abs()).all(), (spec, p, sent, new)


@SETTINGS
@given(steps=two_steps())
def test_dgc_velocity_identity(steps):
    """DGC's built-in feedback: sent + new velocity == velocity before masking, exactly."""
    comp = hvdcomp.get_compressor("dgc", density=0.2)
    assert isinstance(comp, DGCCompressor)
    for g in steps:
        flat = g.reshape(-1).to(torch.float32)
        u = comp.u.get("w", torch.zeros_like(flat))
        v = comp.v.get("w", torch.zeros_like(flat))
        before = v + (u * comp.momentum + flat)
        payload, ctx = comp.encode(g, "w")
        sent = comp.decode(payload, (flat.shape, torch.float32))
        assert torch.equal(sent + comp.v["w"], before)


def test_exact_float32_identity_is_impossible_for_quantizers():
    """p = float32(1e-3) quantised to q = 1 (a QSGD level or TernGrad's scale): no float32 residual
    r has float32(q + r) == p, because q + r near 1e-3 is a multiple of 2^-24 and p is not."""
    p = torch.tensor(1e-3, dtype=torch.float32)
    assert (p.double() / 2.0**-24).item() % 1 != 0
    r0 = (p - 1.0).item()
    candidates = torch.tensor(r0, dtype=torch.float32) + torch.arange(-64, 65) * 2.0**-24
    assert not bool(((1.0 + candidates) == p).any())
    # EF-signSGD (deterministic) on [1e-3, 1]: sent = 0.5005 each, the float32 residual of the
    # first element loses 1e-3's low bits, and sent + e misses p
    comp = hvdcomp.get_compressor("efsignsgd")
    x = torch.tensor([1e-3, 1.0])
    payload, ctx = comp.encode(x, "w")
    sent = local_sent(comp, payload, ctx)
    assert sent.tolist() == [torch.tensor(0.5005).item()] * 2
    total = sent + comp.residuals["w"]
    assert total[0] != x[0] and abs(total[0] - x[0]) <= 2.0**-24 * abs(x[0] - sent[0])


# ---- wire codings ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 70000), data=st.data(),
       values=st.sampled_from(["fp32", "fp16", "int2"]), index=st.sampled_from(["int", "compact"]))
def test_sparse_pack_unpack_round_trip(n, data, values, index):
    comp = hvdcomp.get_compressor("topk", density=0.5, ef=False).set_wire(values=values, index=index)
    m = data.draw(st.integers(0, min(n, 64)))
    idx = torch.tensor(sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), min_size=m, max_size=m))) if n else [],
                       dtype=torch.int64)
    vals = torch.tensor(data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=idx.numel(), max_size=idx.numel())),
                        dtype=torch.float32)
    if values == "int2" and data.draw(st.booleans()):   # some exact zeros among the kept values
        vals = torch.where(torch.rand(vals.shape, generator=torch.Generator().manual_seed(n)) < 0.3, 0.0, vals)
    payload = comp.pack(vals, idx, n)
    if values == "int2":  # exact zeros are not sent (no level holds 0): they decode as zeros
        idx, vals = idx[vals != 0], vals[vals != 0]
    assert sum(t.numel() * t.element_size() for t in payload) == comp.payload_bytes(n, idx.numel())
    got_vals, got_idx = comp.unpack(payload, n)
    if values == "int2":
        expected = int2_reference(vals, got_vals)
    else:
        expected = vals.clamp(-FP16_MAX, FP16_MAX).half().float() if values == "fp16" else vals
    if got_idx is None:                                          # written densely
        dense = torch.zeros(n)
        dense[idx] = expected
        assert torch.equal(got_vals, dense)
    else:
        assert torch.equal(got_idx, idx) and torch.equal(got_vals, expected)
    dense = torch.zeros(n)
    dense[idx] = expected
    assert torch.equal(comp.decode(payload, (torch.Size([n]), torch.float32)), dense)


def int2_reference(vals, got):
    """values=int2 by its definition, element by element in float64: s = max |v| (float32), each
    value a nearest of the levels (−1, −1/3, 1/3, 1)·s; returns ``got`` where it is one (at a tie,
    either level), else the nearest level (so a wrong code fails the comparison)."""
    s = max((abs(float(v)) for v in vals.tolist()), default=0.0)
    levels = [float(torch.tensor(lv, dtype=torch.float32)) * s for lv in (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0)]
    out = []
    for v, g in zip(vals.tolist(), got.tolist()):
        dist = sorted((abs(v - lv), float(torch.tensor(lv, dtype=torch.float32))) for lv in levels)
        near = [lv for d, lv in dist if d <= dist[0][0] + 1e-6 * s]  # a tie up to float32 rounding of v/s
        out.append(g if g in near else near[0])
    return torch.tensor(out, dtype=torch.float32)


@settings(max_examples=50, deadline=None)
@given(bits=st.integers(1, 16), data=st.data())
def test_bit_packing_round_trip(bits, data):
    m = data.draw(st.integers(0, 300))
    codes = torch.tensor(data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=m, max_size=m)), dtype=torch.int64)
    packed = bitpack.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_nbytes(m, bits)
    assert torch.equal(bitpack.unpack_bits(packed, bits, m), codes)


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 6), data=st.data())
def test_signsgd_vote_equals_majority_either_transport(world, data):
    """Both vote transports give sign(sum of signs), sign(0) = +1, for any world size."""
    n = data.draw(st.integers(0, 20))
    grads = [torch.tensor(data.draw(st.lists(st.sampled_from([-2.0, -0.0, 0.0, 1e-30, 3.0]), min_size=n, max_size=n)))
             for _ in range(world)]
    votes = sum(torch.where(g >= 0, 1.0, -1.0) for g in grads) if n else torch.zeros(0)
    majority = torch.where(votes >= 0, 1.0, -1.0)
    for vote in ("allreduce", "allgather"):
        sim = SimulatedRanks(lambda: hvdcomp.get_compressor("signsgd", vote=vote), world)
        assert torch.equal(sim.step(grads), majority)


def test_int32_vote_sum_is_the_allreduce_model():
    a, b = torch.tensor([1, -1], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    assert horovod_allreduce([a, b], "sum").tolist() == [2, 0]
