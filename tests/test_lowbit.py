"""Tests of ``lowbit`` (4/8-bit block quantization with moving-average error compensation,
after LoCo). Every expected value is computed independently: by hand (literals), by a NumPy
reference quantizer and bit unpacker written here, or in float64."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hvdcomp
from hvdcomp.compressors import PayloadKind
import hvdcomp.compressors.lowbit  # noqa: F401  (registers "lowbit")
from hvdcomp.compressors import simulated_world
from hvdcomp.compressors.lowbit import LowBitCompressor, LowBitQuantizer
from tests.simworld import SimulatedRanks

HALF = (torch.float16, torch.bfloat16)
U = 2.0 ** -24  # float32 unit roundoff


# ---- independent references ----------------------------------------------------------------------
def levels(bits):
    return 2 ** (bits - 1) - 1


def ref_unpack(codes: torch.Tensor, bits: int, n: int) -> np.ndarray:
    """The n unsigned codes of a little-endian bit stream (code i at bits [i·b, (i+1)·b))."""
    stream = np.unpackbits(codes.numpy(), bitorder="little")
    assert not stream[n * bits:].any(), "padding bits must be zero"
    return stream[: n * bits].reshape(n, bits).astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))


def ref_quantize(v, bits, block):
    """NumPy float32 Q: (scales float32 (nb,), signed codes int64 (n,), Q(v) float32 (n,))."""
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    L, n = levels(bits), v.size
    nb = -(-n // block)
    scales = np.zeros(nb, np.float32)
    codes = np.zeros(n, np.int64)
    q = np.zeros(n, np.float32)
    for j in range(nb):
        vb = v[j * block:(j + 1) * block]
        s = np.float32(np.abs(vb).max()) / np.float32(L)
        scales[j] = s
        c = np.clip(np.rint(vb / s), -L, L) if s > 0 else np.zeros(vb.size, np.float32)
        codes[j * block:j * block + vb.size] = c.astype(np.int64)
        q[j * block:j * block + vb.size] = c.astype(np.float32) * s
    return scales, codes, q


def ref_decode(payload, bits, block, n) -> np.ndarray:
    """One payload decoded in float64: s_j·(code − L)."""
    scales, codes = payload
    assert scales.dtype == torch.float32 and codes.dtype == torch.uint8
    c = ref_unpack(codes, bits, n) - levels(bits)
    return c.astype(np.float64) * np.repeat(scales.numpy().astype(np.float64), block)[:n]


def payload_equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


# ---- worked by hand --------------------------------------------------------------------------------
G_HAND = [7.0, -3.5, 0.5, 2.4, -14.0, 3.0, 0.0, 1.0, 0.0, 0.0]


def test_hand_example_4_bits():
    """bits=4 (L=7), block=4: blocks [7, -3.5, 0.5, 2.4] (s=7/7=1), [-14, 3, 0, 1] (s=14/7=2),
    [0, 0] (s=0). v/s = [7, -3.5, 0.5, 2.4 | -7, 1.5, 0, 0.5 | 0, 0]; round half to even:
    c = [7, -4, 0, 2 | -7, 2, 0, 0 | 0, 0]; unsigned c+7 = [14, 3, 7, 9, 0, 9, 7, 7, 7, 7]; packed
    low nibble first: 14+16·3=62, 7+16·9=151, 0+16·9=144, 7+16·7=119, 119."""
    comp = hvdcomp.get_compressor("lowbit:bits=4,block=4")
    payload, ctx = comp.encode(torch.tensor(G_HAND), "w")
    scales, codes = payload
    assert scales.dtype == torch.float32 and scales.tolist() == [1.0, 2.0, 0.0]
    assert codes.dtype == torch.uint8 and codes.tolist() == [62, 151, 144, 119, 119]
    assert comp.decode(payload, ctx).tolist() == [7.0, -4.0, 0.0, 2.0, -14.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    assert nbytes(payload) == comp.expected_payload_bytes(10) == 4 * 3 + 5
    # beta=0: h = p - q = g - q
    e24 = float(torch.tensor(2.4) - 2.0)   # float32(2.4) - 2, exact in float32
    assert comp.residuals["w"].tolist() == [0.0, 0.5, 0.5, e24, 0.0, -1.0, 0.0, 1.0, 0.0, 0.0]


def test_hand_example_8_bits():
    """bits=8 (L=127), one block, s = 127/127 = 1: c = [127, -64 (tie), 0, 2 (tie), -1]; c+127."""
    comp = hvdcomp.get_compressor("lowbit:bits=8,block=8")
    payload, ctx = comp.encode(torch.tensor([127.0, -63.5, 0.25, 1.5, -0.75]), "w")
    assert payload[0].tolist() == [1.0]
    assert payload[1].tolist() == [254, 63, 127, 129, 126]
    assert comp.decode(payload, ctx).tolist() == [127.0, -64.0, 0.0, 2.0, -1.0]


def test_hand_example_two_steps_beta_half():
    """beta=0.5, the same g twice (block=4, bits=4).
    Step 1: q1 = [7,-4,0,2 | -14,4,0,0 | 0,0]; h1 = 0.5·(g - q1) = [0,.25,.25,.2 | 0,-.5,0,.5 | 0,0].
    Step 2: p2 = g + h1 = [7,-3.25,.75,2.6 | -14,2.5,0,1.5 | 0,0]; s = 1, 2, 0;
    p2/s = [7,-3.25,.75,2.6 | -7,1.25,0,.75]: c = [7,-3,1,3 | -7,1,0,1]; q2 = [7,-3,1,3 | -14,2,0,2 | 0,0];
    h2 = 0.5·h1 + 0.5·(p2 - q2) = [0, 0, 0, -0.1 | 0, 0, 0, 0 | 0, 0]."""
    comp = hvdcomp.get_compressor("lowbit:bits=4,block=4,beta=0.5")
    g = torch.tensor(G_HAND)
    comp.encode(g, "w")
    e24 = float(torch.tensor(2.4) - 2.0)
    assert comp.residuals["w"].tolist() == [0.0, 0.25, 0.25, e24 / 2, 0.0, -0.5, 0.0, 0.5, 0.0, 0.0]
    payload, ctx = comp.encode(g, "w")
    assert payload[0].tolist() == [1.0, 2.0, 0.0]
    assert comp.decode(payload, ctx).tolist() == [7.0, -3.0, 1.0, 3.0, -14.0, 2.0, 0.0, 2.0, 0.0, 0.0]
    h2 = comp.residuals["w"]
    assert torch.allclose(h2, torch.tensor([0.0, 0, 0, -0.1, 0, 0, 0, 0, 0, 0]), rtol=0, atol=1e-6)


# ---- the quantizer -----------------------------------------------------------------------------------
def draw_gradient(n, dtype, seed):
    """Normal values scaled per stretch by 10^U(-3, 3), with an all-zero stretch and a zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** torch.empty(n, dtype=torch.float64).uniform_(-3, 3, generator=g).cummax(0).values.floor()
    if n > 20:
        x[5:15] = 0.0
    if n:
        x[n // 2] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("n,block", [(0, 4), (1, 4), (1, 1), (2, 1), (1000, 7), (1000, 64), (4099, 512),
                                     (517, 1000)])
def test_quantization_error_bound_and_reference(dtype, bits, n, block):
    """|v - Q(v)| <= s_j/2 per element (plus float32 rounding: 2L·2^-24·s_j), scales max|v|/L,
    codes and bytes exactly as the NumPy reference; decode returns the gradient's dtype."""
    x = draw_gradient(n, dtype, seed=n + bits)
    comp = hvdcomp.get_compressor(f"lowbit:bits={bits},block={block}")
    payload, ctx = comp.encode(x.reshape(-1, 1) if n else x.reshape(0, 3), "w")
    v = x.to(torch.float32).numpy()                                # what Q sees (float32 exact for halves)
    scales, codes = payload
    nb = math.ceil(n / block)
    assert scales.shape == (nb,) and codes.shape == (math.ceil(n * bits / 8),)
    assert nbytes(payload) == comp.expected_payload_bytes(n) == 4 * nb + math.ceil(n * bits / 8)
    r_scales, r_codes, r_q = ref_quantize(v, bits, block)
    assert np.array_equal(scales.numpy(), r_scales)
    unsigned = ref_unpack(codes, bits, n)
    assert ((unsigned >= 0) & (unsigned <= 2 * levels(bits))).all()
    assert np.array_equal(unsigned - levels(bits), r_codes)
    q = ref_decode(payload, bits, block, n)
    s = np.repeat(r_scales.astype(np.float64), block)[:n]
    assert (np.abs(v.astype(np.float64) - q) <= s * (0.5 + 2 * levels(bits) * U)).all()
    assert (q[s == 0] == 0).all()                                   # all-zero blocks: exact zeros
    out = comp.decode(payload, ctx)
    assert out.dtype == dtype and out.shape == ((n, 1) if n else (0, 3))
    # the float32 product s·c (the float32 rounding of the exact q), then the gradient's dtype
    assert torch.equal(out.reshape(-1), torch.from_numpy(q).to(torch.float32).to(dtype))
    assert comp.residuals["w"].dtype == (torch.float32 if dtype in HALF else dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vals=st.lists(st.floats(-2.0 ** 126, 2.0 ** 126, width=32).map(lambda f: 0.0 if abs(f) < 2.0 ** -100 else f),
                     max_size=40),
       bits=st.sampled_from([2, 4, 5, 8]), block=st.integers(1, 9))
def test_error_bound_property(vals, bits, block):
    """Any float32 data with normal-range scales (|v| in [2^-100, 2^126] or 0): the bound holds
    and decode is the reference's Q."""
    comp = LowBitQuantizer(bits=bits, block=block)
    x = torch.tensor(vals, dtype=torch.float32)
    payload, ctx = comp.encode(x)
    r_scales, _, r_q = ref_quantize(x.numpy(), bits, block)
    out = comp.decode(payload, ctx)
    assert np.array_equal(out.numpy(), r_q)
    s = np.repeat(r_scales.astype(np.float64), block)[: len(vals)]
    err = np.abs(np.asarray(vals, np.float64) - out.numpy().astype(np.float64))
    assert (err <= s * (0.5 + 2 * levels(bits) * U)).all()


def test_largest_float32_values_decode_finite():
    big = torch.finfo(torch.float32).max
    for bits in range(2, 9):
        comp = LowBitQuantizer(bits=bits, block=4)
        x = torch.tensor([big, -big, 1.0, 3e38])
        payload, ctx = comp.encode(x)
        for agg in (comp.decode(payload, ctx), comp.aggregate([payload] * 3, ctx)):
            assert torch.isfinite(agg).all(), (bits, agg)
            assert torch.allclose(agg[:2], x[:2], rtol=1e-6)


# ---- beta = 0 is error feedback ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_beta_zero_is_error_feedback_around_the_quantizer(dtype):
    ours = hvdcomp.get_compressor("lowbit:bits=4,block=16,beta=0")
    classic = hvdcomp.ErrorFeedback(LowBitQuantizer(bits=4, block=16))
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        g = (torch.randn(5, 13, generator=gen) * 3).to(dtype)
        a, ctx_a = ours.encode(g, "layer.w")
        b, ctx_b = classic.encode(g, "layer.w")
        assert payload_equal(a, b)
        assert torch.equal(ours.decode(a, ctx_a), classic.decode(b, ctx_b))
        assert ours.decode(a, ctx_a).dtype == dtype
        assert torch.equal(ours.residuals["layer.w"], classic.residuals["layer.w"])
        assert ours.residuals["layer.w"].dtype == classic.residuals["layer.w"].dtype


# ---- the moving average --------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9])
def test_moving_average_against_float64_formula_and_telescoping(beta):
    """float64 gradients (h float64): p = g + h, q = Q(float32(p)) by the reference,
    h = β·h + (1-β)·(p - q), all in float64 here; and Σq = Σg - (h_T - h_0)/(1-β)."""
    bits, block, n, steps = 4, 32, 300, 6
    gen = torch.Generator().manual_seed(11)
    h0 = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    comp = hvdcomp.get_compressor(f"lowbit:bits={bits},block={block},beta={beta}")
    comp.load_state_dict({"residuals": {"w": h0.clone()}})
    h = h0.numpy().copy()
    sum_q, sum_g = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        g = torch.randn(n, generator=gen, dtype=torch.float64)
        payload, ctx = comp.encode(g, "w")
        p = g.numpy() + h
        r_scales, r_codes, r_q = ref_quantize(p.astype(np.float32), bits, block)
        assert np.array_equal(payload[0].numpy(), r_scales)
        assert np.array_equal(ref_unpack(payload[1], bits, n) - levels(bits), r_codes)
        q = r_q.astype(np.float64)
        h = beta * h + (1 - beta) * (p - q)
        assert np.allclose(comp.residuals["w"].numpy(), h, rtol=1e-12, atol=1e-14)
        out = comp.decode(payload, ctx)
        assert out.dtype == torch.float64 and np.array_equal(out.numpy(), q)
        sum_q += q
        sum_g += g.numpy()
    h_T = comp.residuals["w"].numpy()
    assert np.allclose(sum_q, sum_g - (h_T - h0.numpy()) / (1 - beta), rtol=0, atol=1e-12)
    # the identity per step: h_t - h_{t-1} = (1-β)(g_t - q_t) (checked through the sums above)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_moving_average_per_step_in_float32_state(dtype):
    """Each step, from the compressor's own h_{t-1} and q_t, in float64: h_t = β·h_{t-1} +
    (1-β)(g_t + h_{t-1} - q_t) to float32 rounding; and the telescoped sum to accumulated rounding."""
    beta, n, steps = 0.7, 200, 8
    comp = hvdcomp.get_compressor(f"lowbit:bits=8,block=50,beta={beta}")
    gen = torch.Generator().manual_seed(5)
    h_prev = np.zeros(n)
    sum_q, sum_g = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        g = torch.randn(n, generator=gen).to(dtype)
        payload, ctx = comp.encode(g, "w")
        q = ref_decode(payload, 8, 50, n)
        gg = g.to(torch.float64).numpy()
        h_new = comp.residuals["w"]
        assert h_new.dtype == torch.float32
        expected = beta * h_prev + (1 - beta) * (gg + h_prev - q)
        scale = np.abs(gg).max() + np.abs(h_prev).max()
        assert np.allclose(h_new.numpy(), expected, rtol=0, atol=4 * U * scale)
        h_prev = h_new.numpy().astype(np.float64)
        sum_q += q
        sum_g += gg
    assert np.allclose(sum_q, sum_g - h_prev / (1 - beta), rtol=0, atol=steps * 1e-5)


# ---- state -----------------------------------------------------------------------------------------
def run(comp, grads, name="w"):
    return [comp.encode(g, name)[0] for g in grads]


def grads_for(seed, count=3, shape=(7, 11), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(count)]


@pytest.mark.parametrize("beta", [0.0, 0.6])
def test_rescale_state(beta):
    spec = f"lowbit:bits=4,block=8,beta={beta}"
    comp = hvdcomp.get_compressor(spec)
    g1, g2, g3 = grads_for(1)
    run(comp, [g1, g2])
    before = comp.residuals["w"].clone()
    comp.rescale_state(0.25)
    assert torch.equal(comp.residuals["w"], before * 0.25)     # power of two: exact
    other = hvdcomp.get_compressor(spec)
    other.load_state_dict({"residuals": {"w": before * 0.25}})
    assert payload_equal(comp.encode(g3, "w")[0], other.encode(g3, "w")[0])


def test_state_round_trip_and_copies():
    comp = hvdcomp.get_compressor("lowbit:bits=4,block=8,beta=0.3")
    g1, g2, g3 = grads_for(2)
    run(comp, [g1, g2], "a")
    run(comp, [g1], "b")
    state = comp.state_dict()
    assert set(state) == {"residuals"} and set(state["residuals"]) == {"a", "b"}
    fresh = hvdcomp.get_compressor("lowbit:bits=4,block=8,beta=0.3")
    fresh.load_state_dict(state)
    state["residuals"]["a"].fill_(123.0)                        # copies both ways
    assert not torch.equal(comp.residuals["a"], state["residuals"]["a"])
    assert not torch.equal(fresh.residuals["a"], state["residuals"]["a"])
    for name in ("a", "b"):
        pa, ca = comp.encode(g3, name)
        pb, cb = fresh.encode(g3, name)
        assert payload_equal(pa, pb)
        assert torch.equal(comp.decode(pa, ca), fresh.decode(pb, cb))
        assert torch.equal(comp.residuals[name], fresh.residuals[name])


def test_load_state_dict_validates():
    comp = hvdcomp.get_compressor("lowbit")
    with pytest.raises(ValueError, match="'residuals'.*unknown key.*'rng'"):
        comp.load_state_dict({"residuals": {}, "rng": {}})
    with pytest.raises(ValueError, match="floating-point tensor"):
        comp.load_state_dict({"residuals": {"w": [1.0, 2.0]}})
    with pytest.raises(ValueError, match="dict"):
        comp.load_state_dict({"residuals": [torch.zeros(2)]})
    comp.load_state_dict({})                                    # nothing: no residuals
    assert comp.state_dict() == {"residuals": {}}
    assert LowBitQuantizer().state_dict() == {}
    with pytest.raises(ValueError, match="stateless"):
        LowBitQuantizer().load_state_dict({"residuals": {}})


def test_rollback_leaves_no_trace_and_nan_does_not_poison():
    comp = hvdcomp.get_compressor("lowbit:bits=4,block=8,beta=0.5")
    g1, g2, g3 = grads_for(3, shape=(40,))
    comp.begin_step()
    comp.encode(g1, "w")
    assert "w" not in comp.residuals                            # staged, not committed
    comp.commit()
    committed = comp.residuals["w"]
    snapshot = committed.clone()
    reference = hvdcomp.get_compressor("lowbit:bits=4,block=8,beta=0.5")
    reference.load_state_dict(comp.state_dict())

    bad = g2.clone()
    bad[3] = float("nan")
    bad[20] = float("inf")
    comp.begin_step()
    payload, ctx = comp.encode(bad, "w")                        # does not raise
    scales, codes = payload
    assert torch.isnan(scales[0]) and torch.isinf(scales[2]) and torch.isfinite(scales[[1, 3, 4]]).all()
    assert ((torch.from_numpy(ref_unpack(codes, 4, 40)) <= 14)).all()
    out = comp.decode(payload, ctx)
    assert torch.isnan(out[:8]).all() and torch.isnan(out[16:24]).all()
    assert torch.isfinite(out[8:16]).all() and torch.isfinite(out[24:]).all()
    assert torch.isnan(comp._get("residuals", "w")).any()     # the staged h is poisoned ...
    comp.rollback()
    assert comp.residuals["w"] is committed and torch.equal(committed, snapshot)   # ... not the committed one
    assert torch.isfinite(comp.residuals["w"]).all()

    comp.begin_step()
    p_next, _ = comp.encode(g3, "w")
    comp.commit()
    assert payload_equal(p_next, reference.encode(g3, "w")[0])
    assert torch.equal(comp.residuals["w"], reference.residuals["w"])
    assert comp.residuals["w"] is not committed and torch.equal(committed, snapshot)  # never in place


# ---- registry, flags, arguments ------------------------------------------------------------------------
def test_registry_flags_and_describe():
    assert "lowbit" in hvdcomp.available()
    comp = hvdcomp.get_compressor("lowbit")
    assert type(comp) is LowBitCompressor
    assert comp.describe() == {"name": "lowbit", "bits": 4, "block": 512, "beta": 0.0}
    assert hvdcomp.get_compressor("lowbit:bits=8,block=64,beta=0.25").describe() == \
        {"name": "lowbit", "bits": 8, "block": 64, "beta": 0.25}
    assert (comp.payload_kind is not PayloadKind.GATHERED, comp.aggregate_is_mean, comp.builtin_error_feedback, comp.has_scaled_state,
            comp.elementwise, comp.segmentable, comp.shared_state_keys) == (False, True, True, True, False,
                                                                            False, ())
    assert type(hvdcomp.get_compressor("lowbit:ef=false")) is LowBitCompressor
    with pytest.raises(ValueError, match="built in"):
        hvdcomp.get_compressor("lowbit:ef=true")
    with pytest.raises(ValueError, match="already applies error feedback"):
        hvdcomp.ErrorFeedback(comp)
    with pytest.raises(TypeError, match="hvdcomp.DistributedOptimizer"):
        comp.compress(torch.ones(3))                            # stock Horovod cannot carry it


@pytest.mark.parametrize("bits,block", [(4, 512), (8, 512), (4, 64), (3, 10)])
def test_sizes_and_nominal_ratio(bits, block):
    comp = hvdcomp.get_compressor(f"lowbit:bits={bits},block={block}")
    assert comp.nominal_ratio(10 ** 6) == pytest.approx(32 / (bits + 32 / block))
    for n in (0, 1, 2, 3, block - 1, block, block + 1, 10007):
        expected = 4 * math.ceil(n / block) + math.ceil(n * bits / 8)
        assert comp.expected_payload_bytes(n) == expected
        payload, _ = comp.encode(torch.randn(n), f"p{n}")
        assert nbytes(payload) == expected
    assert LowBitCompressor(bits=4, block=512).nominal_ratio(1) == pytest.approx(32 / 4.0625)


@pytest.mark.parametrize("spec,match", [
    ("lowbit:bits=1", "bits must be an integer in \\[2, 8\\]"),
    ("lowbit:bits=9", "bits must be"),
    ("lowbit:bits=0", "bits must be"),
    ("lowbit:bits=4.5", "bits must be"),
    ("lowbit:bits=four", "bits must be"),
    ("lowbit:block=0", "block must be an integer >= 1"),
    ("lowbit:block=-3", "block must be"),
    ("lowbit:block=2.5", "block must be"),
    ("lowbit:beta=1", "beta must be in \\[0, 1\\)"),
    ("lowbit:beta=1.5", "beta must be"),
    ("lowbit:beta=-0.1", "beta must be"),
    ("lowbit:beta=nan", "beta must be"),
    ("lowbit:beta=x", "beta must be"),
    ("lowbit:levels=7", "unknown argument"),
])
def test_bad_arguments(spec, match):
    with pytest.raises(ValueError, match=match):
        hvdcomp.get_compressor(spec)


def test_bad_arguments_by_keyword_and_bad_input():
    for kwargs in ({"bits": True}, {"block": True}, {"beta": True}, {"beta": None}):
        with pytest.raises(ValueError):
            LowBitCompressor(**kwargs)
    comp = hvdcomp.get_compressor("lowbit")
    with pytest.raises(ValueError, match="named_parameters"):
        comp.encode(torch.ones(3), None)
    with pytest.raises(TypeError, match="floating-point gradients"):
        comp.encode(torch.ones(3, dtype=torch.int64), "w")
    with pytest.raises(TypeError, match="real gradients"):
        comp.encode(torch.ones(3, dtype=torch.complex64), "w")
    comp.encode(torch.ones(3), "w")
    with pytest.raises(ValueError, match="shape"):
        comp.encode(torch.ones(4), "w")
    payload, ctx = comp.encode(torch.ones(3), "w")
    with pytest.raises(ValueError, match="does not hold"):
        comp.aggregate([[payload[0], payload[1][:1]]], (torch.Size([1000]), torch.float32, 1000))


# ---- aggregation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8, 5])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_aggregate_into_chunks_and_layouts(bits, out_dtype):
    """Many small chunks (odd 4-bit tails, partial last block), non-contiguous and float16 outputs:
    the mean over W=3 payloads of the reference decodes."""
    n, block, world = 1001, 7, 3
    comp = LowBitQuantizer(bits=bits, block=block)
    comp._chunk = 56 * 3                                        # lcm(7, 8)·3: 6 chunks, last one short
    gen = torch.Generator().manual_seed(bits)
    payloads = [comp.encode(torch.randn(n, generator=gen) * (r + 1))[0] for r in range(world)]
    ctx = (torch.Size([n]), out_dtype, n)
    ref = np.mean([ref_decode(p, bits, block, n) for p in payloads], axis=0)
    tol = 4 * U * np.abs(ref).max() + 1e-7
    flat = comp.aggregate_into(torch.empty(n, dtype=out_dtype), payloads, ctx)
    big = torch.empty(2 * n, dtype=out_dtype)
    strided = comp.aggregate_into(big[::2], payloads, ctx)
    assert not big[::2].is_contiguous() and strided.data_ptr() == big.data_ptr()
    for out in (flat, strided, comp.aggregate(payloads, ctx)):
        assert out.dtype == out_dtype
        if out_dtype == torch.float32:
            assert np.allclose(out.numpy(), ref, rtol=0, atol=tol)
        else:
            assert np.allclose(out.to(torch.float64).numpy(), ref, rtol=2 ** -10, atol=1e-7)
    assert comp.aggregate([], ctx).tolist() == [0.0] * n


@pytest.mark.parametrize("spec", ["lowbit:bits=4", "lowbit:bits=8,beta=0.5"])
def test_simulated_ranks_mean_of_own_decodes(spec):
    """4 simulated ranks over 3 steps: the aggregate equals the mean over ranks of each rank's own
    decoded payload (independent float64 decode), and each payload has expected_payload_bytes."""
    world, shape = 4, (30, 50)                                  # n = 1500: 3 blocks of 512, last partial
    n = 1500
    bits = 4 if "bits=4" in spec else 8
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor(spec), world)
    mirror = []
    for r in range(world):
        with simulated_world(world, r):
            mirror.append(hvdcomp.get_compressor(spec))
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        grads = [torch.randn(shape, generator=gen) * (r + 1) for r in range(world)]
        out = sim.step(grads)
        own = []
        for r in range(world):
            with simulated_world(world, r):
                payload, _ = mirror[r].encode(grads[r], "w")
            assert nbytes(payload) == mirror[r].expected_payload_bytes(n) == 4 * 3 + n * bits // 8
            own.append(ref_decode(payload, bits, 512, n))
        mean = np.mean(own, axis=0).reshape(shape)
        assert out.shape == shape and out.dtype == torch.float32
        assert np.allclose(out.numpy(), mean, rtol=0, atol=4 * U * np.abs(mean).max() * world)
        for r in range(world):                                  # the simulated ranks kept the same state
            assert torch.equal(sim.comps[r].residuals["w"], mirror[r].residuals["w"])


# ---- internals that must not change results ---------------------------------------------------------
def test_pack4_is_bitpack_layout():
    from hvdcomp.compressors.bitpack import pack_bits
    from hvdcomp.compressors.lowbit import _pack4
    gen = torch.Generator().manual_seed(4)
    for m in (0, 1, 2, 3, 8, 1001):
        c = torch.randint(0, 16, (m + 1,), generator=gen, dtype=torch.uint8)
        assert torch.equal(_pack4(c[:m]), pack_bits(c[:m], 4))
        assert torch.equal(_pack4(c[1:]), pack_bits(c[1:], 4))      # odd storage offset


def test_work_buffer_reuse_does_not_leak_between_calls():
    """One instance encoding tensors of different sizes in turn (its CPU work buffer reused and
    grown) gives what fresh instances give."""
    shared = hvdcomp.get_compressor("lowbit:bits=4,block=6,beta=0.5")
    gen = torch.Generator().manual_seed(8)
    sizes = {"big": 500, "small": 13, "mid": 97}
    fresh = {k: hvdcomp.get_compressor("lowbit:bits=4,block=6,beta=0.5") for k in sizes}
    for _ in range(2):
        for name, n in sizes.items():
            g = torch.randn(n, generator=gen)
            a, ca = shared.encode(g, name)
            b, cb = fresh[name].encode(g, name)
            assert payload_equal(a, b)
            assert torch.equal(shared.residuals[name], fresh[name].residuals[name])
