"""Tests of ``sbc`` (Sparse Binary Compression): values worked by hand, and properties checked
against independent references written here (numpy for the rule, pure Python for the bit
streams)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hvdcomp
from hvdcomp.compressors import sbc  # registers "sbc"
from tests.simworld import SimulatedRanks

PHI = (1 + 5 ** 0.5) / 2


# ---- independent references -----------------------------------------------------------------
def ref_kept(n, density):
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


def ref_rice_b(n, m):
    """Smallest b >= 0 with 2^b > ln(φ−1)/ln(1−p): the same as 1 + floor(log2(.)) clipped at 0."""
    if m == 0 or m >= n:
        return 0
    ratio = math.log(PHI - 1) / math.log1p(-m / n)
    b = 0
    while 2 ** b <= ratio:
        b += 1
    return b


def bits_to_bytes(bits, pad):
    bits = list(bits) + [pad] * (-len(bits) % 8)
    return bytes(sum(bit << j for j, bit in enumerate(bits[i:i + 8])) for i in range(0, len(bits), 8))


def ref_streams(idx, b):
    """The unary and remainder streams of the module docstring, bit by bit in Python."""
    unary, rem, prev = [], [], -1
    for i in idx:
        g = i - prev - 1
        prev = i
        unary += [1] * (g >> b) + [0]
        rem += [(g >> j) & 1 for j in range(b)]
    return bits_to_bytes(unary, 1), bits_to_bytes(rem, 0)


def ref_rice_bits(idx, b):
    gaps = np.diff(np.asarray(idx, dtype=np.int64), prepend=-1) - 1
    return int(((gaps >> b) + 1 + b).sum())


def ref_choice(x, density):
    """(positions, signed float32 mu) SBC sends for float32 numpy ``x``."""
    k = ref_kept(x.size, density)

    def side(mag):
        cand = np.flatnonzero(mag > 0)
        order = np.argsort(-mag[cand], kind="stable")      # ties: lower index first
        sel = np.sort(cand[order[:k]])
        mu = np.float32(mag[sel].astype(np.float64).mean()) if sel.size else np.float32(0)
        return sel, mu

    pos, mu_pos = side(np.where(x > 0, x, 0).astype(np.float32))
    neg, mu_neg = side(np.where(x < 0, -x, 0).astype(np.float32))
    return (pos, mu_pos) if mu_pos >= mu_neg else (neg, -mu_neg)


def ref_decode(x, density):
    sel, mu = ref_choice(x, density)
    out = np.zeros(x.size, dtype=np.float32)
    out[sel] = mu
    return out


def payload_nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


# ---- hand-worked examples -----------------------------------------------------------------------
def test_hand_example_negative_side_wins():
    comp = hvdcomp.get_compressor("sbc:density=0.3,ef=false")
    x = torch.tensor([0.5, -2.0, 1.0, 0.0, -0.25, 3.0, -1.0, 2.0, -3.5, 0.25])
    # k = ceil(0.3·10) = 3. Positives 3, 2, 1 → μ+ = 2; negatives 3.5, 2, 1 → μ− = 6.5/3 = 2.1667
    # μ− > μ+: send −2.1667 at positions 8, 1, 6 → sorted 1, 6, 8
    payload, ctx = comp.encode(x, "w")
    mu = torch.tensor(-6.5 / 3, dtype=torch.float32).item()
    assert payload[0].dtype == torch.float32 and payload[0].tolist() == [mu]
    # n = 10, m = 3: p = 0.3, ln(0.618)/ln(0.7) = 1.349, b = 1 + floor(0.43) = 1
    # gaps 1, 4, 1 → q = 0, 2, 0 and r = 1, 0, 1
    # unary "0" "110" "0" + padding "111" = bits 0,1,1,0,0,1,1,1 → 2+4+32+64+128 = 230
    # remainders 1, 0, 1 at one bit → 1 + 4 = 5
    assert payload[1].dtype == torch.uint8 and payload[1].tolist() == [230]
    assert payload[2].dtype == torch.uint8 and payload[2].tolist() == [5]
    out = comp.decode(payload, ctx)
    assert out.tolist() == [0.0, mu, 0.0, 0.0, 0.0, 0.0, mu, 0.0, mu, 0.0]
    values, idx = comp.unpack(payload, 10)
    assert values.tolist() == [mu] * 3 and idx.dtype == torch.int64 and idx.tolist() == [1, 6, 8]
    assert payload_nbytes(payload) == 4 + 1 + 1


def test_hand_example_positive_side_and_ties():
    comp = hvdcomp.get_compressor("sbc:density=0.25,ef=false")
    # k = ceil(0.25·8) = 2. Positives 4, 1, 1, 0.5: the tie at 1 goes to the lower index (1, not 3)
    x = torch.tensor([4.0, 1.0, -2.0, 1.0, -2.0, -0.5, 0.0, 0.5])
    # μ+ = (4 + 1)/2 = 2.5, μ− = (2 + 2)/2 = 2 → positive side, positions 0 and 1
    payload, ctx = comp.encode(x, "w")
    assert comp.decode(payload, ctx).tolist() == [2.5, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # k = ceil(0.5·6) = 3 of the first six: 4, 1, 1 → μ+ = 2; 2, 2, 0.5 → μ− = 1.5; positive
    half = hvdcomp.get_compressor("sbc:density=0.5,ef=false")
    payload, ctx = half.encode(x[:6], "w")
    assert half.decode(payload, ctx).tolist() == [2.0, 2.0, 0.0, 2.0, 0.0, 0.0]
    # equal means: the positive side wins
    tie = hvdcomp.get_compressor("sbc:density=0.5,ef=false")
    payload, ctx = tie.encode(torch.tensor([1.0, -1.0]), "w")
    assert tie.decode(payload, ctx).tolist() == [1.0, 0.0]


def test_nan_goes_to_neither_side():
    comp = hvdcomp.get_compressor("sbc:density=0.5,ef=false")
    nan = float("nan")
    # k = 3. Positives 2, 1 → μ+ = 1.5; negatives 3, 0.5 → μ− = 1.75: −1.75 at positions 2 and 5
    payload, ctx = comp.encode(torch.tensor([nan, 1.0, -3.0, 2.0, nan, -0.5]), "w")
    assert comp.decode(payload, ctx).tolist() == [0.0, 0.0, -1.75, 0.0, 0.0, -1.75]


def test_all_zero_sends_no_position():
    comp = hvdcomp.get_compressor("sbc:density=0.1,ef=false")
    payload, ctx = comp.encode(torch.zeros(3, 4), "w")
    assert payload[0].tolist() == [0.0] and payload[1].numel() == 0 and payload[2].numel() == 0
    out = comp.decode(payload, ctx)
    assert out.shape == (3, 4) and not out.any()
    payload, ctx = comp.encode(torch.empty(0, 5), "w")
    assert comp.decode(payload, ctx).shape == (0, 5)


def test_hand_worked_rice_streams():
    # positions 3, 4, 12, 13 with b = 2: gaps 3, 0, 7, 0 → q = 0, 0, 1, 0 and r = 3, 0, 3, 0
    # unary "0" "0" "10" "0" + "111" = bits 0,0,1,0,0,1,1,1 → 4+32+64+128 = 0xE4
    # remainders 3, 0, 3, 0 at two bits: 3 + 3·16 = 0x33
    unary, rem = sbc.rice_encode(torch.tensor([3, 4, 12, 13]), 2)
    assert bytes(unary.tolist()) == b"\xe4" and bytes(rem.tolist()) == b"\x33"
    assert sbc.rice_decode(unary, rem, 2).tolist() == [3, 4, 12, 13]
    # n = 20, m = 4: p = 0.2, ln(0.618)/ln(0.8) = 2.157 → b = 1 + 1 = 2: the same streams
    assert sbc.rice_parameter(20, 4) == 2
    assert [t.tolist() for t in sbc.encode_positions(torch.tensor([3, 4, 12, 13]), 20)] == [[0xE4], [0x33]]
    # b = 0: every gap in unary; 0, 2 → gaps 0, 1 → "0" "10" + "11111" = 0b11111010 = 0xFA
    unary, rem = sbc.rice_encode(torch.tensor([0, 2]), 0)
    assert bytes(unary.tolist()) == b"\xfa" and rem.numel() == 0
    # b = 19 (wider than bitpack's 16): one position 999999 of 10^6
    # q = 999999 >> 19 = 1 → "10" + six ones = 0xFD; r = 999999 − 2^19 = 475711 = 0x07423F
    assert sbc.rice_parameter(10**6, 1) == 19
    unary, rem = sbc.encode_positions(torch.tensor([999_999]), 10**6)
    assert bytes(unary.tolist()) == b"\xfd" and bytes(rem.tolist()) == b"\x3f\x42\x07"
    assert sbc.decode_positions(unary, rem, 10**6).tolist() == [999_999]


@pytest.mark.parametrize("n,m,b", [(100, 1, 6), (10**4, 100, 6), (20, 4, 2), (10, 3, 1), (100, 38, 1),
                                   (1000, 382, 0), (5, 5, 0), (2, 1, 0), (10**6, 1, 19), (7, 0, 0)])
def test_rice_parameter(n, m, b):
    # p = 0.01: ln(0.618)/ln(0.99) = 47.88, log2 = 5.58 → b = 6
    assert sbc.rice_parameter(n, m) == b == ref_rice_b(n, m)


# ---- properties of the position coding ----------------------------------------------------------
@st.composite
def index_sets(draw):
    n = draw(st.integers(1, 5000))
    density = draw(st.floats(1e-4, 1.0))
    m = min(n, max(0, round(density * n)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["uniform", "run", "ends", "clustered"]))
    if layout == "uniform":
        idx = rng.choice(n, m, replace=False)
    elif layout == "run":
        start = int(rng.integers(0, n - m + 1))
        idx = np.arange(start, start + m)
    elif layout == "ends":
        idx = np.unique(np.concatenate([[0, n - 1], rng.choice(n, m, replace=False)]))
    else:
        centre = rng.choice(n, max(1, m // 8 + 1))
        idx = np.unique(np.clip(centre[:, None] + np.arange(8), 0, n - 1))[:m]
    return n, np.sort(np.asarray(idx, dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(index_sets())
def test_position_coding_round_trip_and_layout(case):
    n, idx = case
    m = idx.size
    b = ref_rice_b(n, m)
    assert sbc.rice_parameter(n, m) == b
    unary, rem = sbc.encode_positions(torch.from_numpy(idx), n)
    assert unary.dtype == rem.dtype == torch.uint8
    want_unary, want_rem = ref_streams(idx.tolist(), b)
    assert bytes(unary.tolist()) == want_unary and bytes(rem.tolist()) == want_rem
    assert sbc.decode_positions(unary, rem, n).tolist() == idx.tolist()
    # two streams = the interleaved Rice code, within the one byte of separate rounding
    rice = ref_rice_bits(idx, b)
    assert math.ceil(rice / 8) <= unary.numel() + rem.numel() <= math.ceil(rice / 8) + 1
    # the largest payload whatever the positions: Σq_i ≤ (n − m)/2^b
    assert 4 + unary.numel() + rem.numel() <= 4 + math.ceil((m + (n - m) // 2**b) / 8) + math.ceil(m * b / 8)


def test_code_size_for_uniform_positions_matches_geometric_expectation():
    n, p = 10**6, 0.01
    k = ref_kept(n, p)
    idx = np.sort(np.random.default_rng(0).choice(n, k, replace=False))
    unary, rem = sbc.encode_positions(torch.from_numpy(idx), n)
    b = ref_rice_b(n, k)
    assert b == 6
    # gaps ~ Geometric(p) on {0, 1, ...}: P(q >= j) = (1 − p)^(j·2^b), so E[q] = θ/(1 − θ)
    theta = (1 - p) ** (2 ** b)
    expected = b + 1 + theta / (1 - theta)                 # 8.108 bits per position
    got = 8 * (unary.numel() + rem.numel()) / k
    assert got == pytest.approx(expected, rel=0.02)
    rice_bytes = math.ceil(ref_rice_bits(idx, b) / 8)
    assert rice_bytes <= unary.numel() + rem.numel() <= rice_bytes + 1
    assert expected == pytest.approx(sbc.expected_bits_per_position(n, k), rel=1e-12)
    comp = sbc.SBCCompressor(density=p)
    assert comp.expected_payload_bytes(n) == pytest.approx(4 + unary.numel() + rem.numel(), rel=0.02)
    assert 64 / expected > 7.8                             # vs topk's 8 bytes per kept entry


# ---- properties of the rule ---------------------------------------------------------------------
@st.composite
def gradients(draw):
    n = draw(st.integers(1, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "zeros", "positive", "negative", "ties", "sparse", "scaled",
                                 "nan"]))
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "zeros":
        x = np.zeros(n)
    elif kind == "positive":
        x = rng.random(n) + 1e-3
    elif kind == "negative":
        x = -(rng.random(n) + 1e-3)
    elif kind == "ties":
        x = rng.integers(-3, 4, n).astype(np.float64)
    elif kind == "sparse":
        x = rng.standard_normal(n) * (rng.random(n) < 0.05)
    elif kind == "scaled":
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
    else:
        x = np.where(rng.random(n) < 0.1, np.nan, rng.standard_normal(n))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return torch.from_numpy(x.astype(np.float32)).to(dtype), draw(st.floats(1e-3, 1.0))


@settings(max_examples=200, deadline=None)
@given(gradients())
def test_decode_matches_numpy_reference(case):
    x, density = case
    comp = sbc.SBCCompressor(density=density)
    payload, ctx = comp.encode(x, "w")
    out = comp.decode(payload, ctx)
    x32 = x.to(torch.float32).numpy()
    want = torch.from_numpy(ref_decode(x32, density)).to(x.dtype)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out, want)
    sel, mu = ref_choice(x32, density)
    n, m = x.numel(), sel.size
    assert payload[0].tolist() == [float(mu)]
    b = ref_rice_b(n, m)
    quotients = (np.diff(sel, prepend=-1) - 1) >> b
    assert payload[1].numel() == math.ceil((quotients.sum() + m) / 8)
    assert payload[2].numel() == math.ceil(m * b / 8)


def test_large_tensor_with_ties_matches_reference():
    # n >= 2^15: the selection's threshold path (native on CPU); many ties on a coarse grid
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal(100_000), 2).astype(np.float32)
    for density in (0.001, 0.01, 0.3):
        comp = sbc.SBCCompressor(density=density)
        payload, ctx = comp.encode(torch.from_numpy(x), "w")
        assert np.array_equal(comp.decode(payload, ctx).numpy(), ref_decode(x, density))


# ---- error feedback, ranks, options --------------------------------------------------------------
def test_error_feedback_through_registry_is_exact():
    comp = hvdcomp.get_compressor("sbc:density=0.05")           # EF on by default
    assert isinstance(comp, hvdcomp.ErrorFeedback)
    assert comp.describe() == {"name": "sbc", "density": 0.05, "ef": True}
    g = torch.Generator().manual_seed(3)
    # multiples of 1/16 in [-8, 8], n = 160 (k = 8 per side): every sum, mean (÷8) and difference
    # below is exact in float32, so the identity holds bit for bit
    grads = [torch.randint(-128, 129, (160,), generator=g).float() / 16 for _ in range(2)]
    old = torch.zeros(160)
    for grad in grads:
        payload, ctx = comp.encode(grad, "w")
        sent = comp.decode(payload, ctx)
        residual = comp.residuals["w"]
        assert (sent != 0).sum() == 8                             # m = k: the mean is a /8
        assert torch.equal(sent + residual, grad + old)
        old = residual.clone()


def test_simulated_ranks_average_own_decodes():
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(3, 50, generator=g) * (r + 1) for r in range(4)]
    got = SimulatedRanks(lambda: hvdcomp.get_compressor("sbc:density=0.05,ef=false"), 4).step(grads)
    decodes = [ref_decode(x.reshape(-1).numpy(), 0.05) for x in grads]
    total = decodes[0].copy()
    for d in decodes[1:]:
        total = total + d                                         # float32, in rank order
    want = torch.from_numpy(total * np.float32(0.25)).reshape(3, 50)
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec", ["sbc:density=0.01,values=fp16", "sbc:density=0.01,index=compact",
                                  "sbc:values=fp16,index=compact"])
def test_wire_options_refused(spec):
    with pytest.raises(ValueError, match="SBC codes its own positions"):
        hvdcomp.get_compressor(spec)


def test_defaults_and_describe():
    comp = hvdcomp.get_compressor("sbc:density=0.01,ef=false")
    assert isinstance(comp, sbc.SBCCompressor) and comp.default_error_feedback
    assert comp.describe() == {"name": "sbc", "density": 0.01}
    assert comp.wire_options() == {} and comp.set_wire(values="fp32", index="int") is comp
    assert "sbc" in hvdcomp.available()
    # seed convention: k 32-bit indices + one 32-bit value against n values
    assert comp.nominal_ratio(10_000) == 10_000 / 101
    assert comp.expected_payload_bytes(0) is None


@pytest.mark.parametrize("density", [0, -0.1, 1.5, "abc", None, float("nan")])
def test_bad_density_raises(density):
    with pytest.raises(ValueError, match="density"):
        sbc.SBCCompressor(density=density)
    if isinstance(density, (int, float)) and not math.isnan(density):
        with pytest.raises(ValueError, match="density"):
            hvdcomp.get_compressor(f"sbc:density={density}")


def test_corrupt_payload_raises():
    comp = sbc.SBCCompressor(density=0.5)
    payload, _ = comp.encode(torch.tensor([1.0, 2.0, 3.0, 4.0]), "w")
    with pytest.raises(ValueError, match="position"):
        comp.unpack(payload, 2)                                    # decoded for a smaller tensor
    with pytest.raises(ValueError, match="mu, unary, remainders"):
        comp.unpack(payload[:2], 4)


def test_pack_binarizes_values_to_their_mean():
    """pack(values, idx) sends one value, the mean (1 + 2 + 6)/3 = 3, at every position."""
    comp = hvdcomp.get_compressor("sbc:density=0.3,ef=false")
    payload = comp.pack(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 4, 9]), 10)
    values, idx = comp.unpack(payload, 10)
    assert idx.tolist() == [0, 4, 9] and values.tolist() == [3.0, 3.0, 3.0]
    assert comp.decode(payload, ((10,), torch.float32)).tolist() == [3, 0, 0, 0, 3, 0, 0, 0, 0, 3]
