"""Single-process tests of the study's methods and the classic quantizers, against values
computed independently (closed forms, Monte Carlo with standard errors, hand-worked examples)."""
import math

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import PayloadKind
from hvdcomp.compressors import bitpack
from hvdcomp.compressors.randomk import shared_seed
from hvdcomp.compressors.selection import sampled_threshold_topk
from hvdcomp.compressors.topk import num_kept

ALL_SPECS = ["none", "fp16", "bf16", "topk:density=0.1", "randomk:density=0.1",
             "randomk:density=0.1,ef=false", "threshold:threshold=0.5", "dgc:density=0.1",
             "qsgd:levels=4,block=8", "qsgd:levels=64,scale=max", "terngrad", "signsgd",
             "signsgd:vote=allgather", "efsignsgd", "sidco:density=0.1", "sbc:density=0.1",
             "lowbit:bits=4,block=8", "adaptive:base=topk,budget=0.1,every=1"]


def roundtrip(comp, x, name="w"):
    payload, ctx = comp.encode(x, name)
    return payload, comp.decode(payload, ctx)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_zeros_give_exact_zeros_and_one_element_works(spec):
    comp = hvdcomp.get_compressor(spec)
    _, out = roundtrip(comp, torch.zeros(37, 3))
    if spec.startswith("signsgd"):                    # sign(0) = +1 by definition
        assert torch.equal(out, torch.ones(37, 3))
    else:
        assert torch.equal(out, torch.zeros(37, 3)), spec
    _, out = roundtrip(comp, torch.tensor([0.75]), name="one")
    assert out.shape == (1,) and torch.isfinite(out).all()


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("m", [0, 1, 7, 8, 9, 63, 1000])
def test_bitpack_roundtrip_any_length(bits, m):
    g = torch.Generator().manual_seed(bits * 1000 + m)
    codes = torch.randint(0, 2**bits, (m,), generator=g)
    packed = bitpack.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(m * bits / 8)
    assert torch.equal(bitpack.unpack_bits(packed, bits, m), codes)


def test_bitpack_hand_example():
    # codes 1, 2, 3 at 2 bits: bit stream 10 01 11 (LSB first) -> byte 0b00111001
    assert bitpack.pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b00111001]
    assert bitpack.bits_for_levels(2 * 64 + 1) == 8 and bitpack.bits_for_levels(33) == 6
    assert bitpack.bits_for_levels(9) == 4 and bitpack.bits_for_levels(3) == 2


# ---- random-k ---------------------------------------------------------------------------------
def test_randomk_leaves_global_rng_alone_and_is_deterministic():
    comp = hvdcomp.get_compressor("randomk:density=0.1,ef=false")
    before = torch.get_rng_state()
    a = comp.indices(1000, "layer.weight", 3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, comp.indices(1000, "layer.weight", 3))
    assert not torch.equal(a, comp.indices(1000, "layer.weight", 4))
    assert a.numel() == 100 and a.unique().numel() == 100
    assert shared_seed(0, "x", 1) == shared_seed(0, "x", 1) != shared_seed(0, "y", 1)


def test_randomk_is_k_contraction_in_expectation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, generator=g, dtype=torch.float64)
    comp = hvdcomp.get_compressor("randomk:density=0.1,ef=false")
    errs = torch.stack([(x - roundtrip(comp, x, "p")[1]).pow(2).sum() for _ in range(400)])
    k = num_kept(200, 0.1)
    expected = (1 - k / 200) * x.pow(2).sum()          # E||x - C(x)||^2 exactly
    assert abs(errs.mean() - expected) < 3 * errs.std() / math.sqrt(len(errs))
    assert errs.mean() <= expected * 1.05


def test_randomk_payload_is_values_only():
    comp = hvdcomp.get_compressor("randomk:density=0.05")
    payload, _ = comp.encode(torch.randn(1000), "w")
    assert len(payload) == 1 and payload[0].numel() == 50 and comp.payload_kind is PayloadKind.MEAN


# ---- QSGD -------------------------------------------------------------------------------------
@pytest.mark.parametrize("levels,bucket,scale", [(4, 16, "l2"), (1, 8, "l2"), (16, 32, "max")])
def test_qsgd_unbiased_and_variance_bound(levels, bucket, scale):
    g = torch.Generator().manual_seed(levels)
    v = torch.randn(bucket, generator=g)
    comp = hvdcomp.get_compressor("qsgd", levels=levels, block=bucket, scale=scale)
    outs = torch.stack([roundtrip(comp, v)[1] for _ in range(4000)]).double()
    mean, se = outs.mean(0), outs.std(0) / math.sqrt(len(outs)) + 1e-12
    assert ((mean - v.double()).abs() <= 3.5 * se + 1e-9).float().mean() >= 0.97
    var = (outs - v.double()).pow(2).sum(1).mean()
    if scale == "l2":
        bound = min(bucket / levels**2, math.sqrt(bucket) / levels) * v.double().pow(2).sum()
        assert var <= bound * 1.05


def test_qsgd_wire_format_and_levels():
    comp = hvdcomp.get_compressor("qsgd:levels=16,block=10")
    x = torch.randn(25)
    (scales, packed), out = roundtrip(comp, x)
    assert comp.bits == 6 and scales.numel() == 3 and packed.numel() == math.ceil(25 * 6 / 8)
    assert comp.wire_bytes(25) == 3 * 4 + packed.numel()
    # every output is scale * j / s for an integer |j| <= s
    per = scales.repeat_interleave(10)[:25]
    j = out / per * 16
    assert torch.allclose(j, j.round(), atol=1e-4) and j.abs().max() <= 16
    # an all-zero bucket in the middle decodes to exact zeros
    y = torch.randn(30)
    y[10:20] = 0
    assert torch.equal(roundtrip(comp, y)[1][10:20], torch.zeros(10))


def test_qsgd_all_negative_bucket_uses_magnitude():
    comp = hvdcomp.get_compressor("qsgd:levels=2,block=4,scale=max")
    x = torch.tensor([-1.0, -2.0, -4.0, -0.5])
    outs = torch.stack([roundtrip(comp, x)[1] for _ in range(200)])
    assert (outs <= 0).all() and outs.min() == -4.0


# ---- TernGrad ---------------------------------------------------------------------------------
def test_terngrad_ternary_and_unbiased_for_clipped():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g)
    comp = hvdcomp.get_compressor("terngrad")
    c = 2.5 * x.std()
    clipped = x.clamp(-c, c)
    outs = torch.stack([roundtrip(comp, x)[1] for _ in range(3000)]).double()
    s = clipped.abs().max()
    assert set((outs / s).round().unique().tolist()) <= {-1.0, 0.0, 1.0}
    se = outs.std(0) / math.sqrt(len(outs)) + 1e-12
    assert ((outs.mean(0) - clipped.double()).abs() <= 3.5 * se + 1e-9).float().mean() >= 0.97
    payload, _ = comp.encode(x)
    assert payload[1].numel() == 16                   # 64 elements at 2 bits


def test_terngrad_clips_outlier():
    x = torch.zeros(100)
    x[0] = 100.0
    x[1:] = torch.linspace(-1, 1, 99)
    (s, _), _ = hvdcomp.get_compressor("terngrad").encode(x)
    assert s.item() == pytest.approx(2.5 * x.std().item(), rel=1e-6)


# ---- signSGD ----------------------------------------------------------------------------------
@pytest.mark.parametrize("vote", ["allreduce", "allgather"])
def test_sign_majority_vote_equals_elementwise_majority(vote):
    comp = hvdcomp.get_compressor("signsgd", vote=vote)
    g = torch.Generator().manual_seed(2)
    ranks = [torch.randn(41, generator=g) for _ in range(4)]
    ranks[0][:5] = 0.0                                       # sign(0) = +1
    payloads, ctx = zip(*[comp.encode(r) for r in ranks])
    if comp.payload_kind is PayloadKind.SUM:   # what Horovod's int32 allreduce-sum produces
        agg = comp.decode([sum(p[0] for p in payloads)], ctx[0])
    else:
        agg = comp.aggregate(list(payloads), ctx[0])
    for i in range(41):
        positive = sum(1 for r in ranks if r[i] >= 0)
        assert agg[i].item() == (1.0 if positive >= 2 else -1.0), i


def test_efsignsgd_scale_and_error_feedback():
    comp = hvdcomp.get_compressor("efsignsgd")
    x = torch.tensor([1.0, -3.0, 0.0, 2.0])
    _, out = roundtrip(comp, x, "p")
    assert out.tolist() == [1.5, -1.5, 1.5, 1.5]           # ||x||_1 / n = 6 / 4
    assert comp.residuals["p"].tolist() == [-0.5, -1.5, -1.5, 0.5]


# ---- DGC ---------------------------------------------------------------------------------------
def test_dgc_warmup_schedule():
    comp = hvdcomp.get_compressor("dgc", density=0.001, warmup_epochs=4)
    got = [comp.density_at(e) for e in range(6)]
    assert [round(d, 4) for d in got[:4]] == [0.2512, 0.0631, 0.0158, 0.0040]
    assert got[4] == got[5] == 0.001


def test_dgc_momentum_factor_masking():
    comp = hvdcomp.get_compressor("dgc", density=0.25, momentum=0.5)
    g1 = torch.tensor([1.0, -4.0, 0.5, 2.0, 0.1, -0.2, 3.0, 0.0])
    payload, _ = comp.encode(g1, "p")
    sent = set(payload[1].tolist())
    assert sent == {1, 6}                                   # k = 2 largest |v|
    u, v = comp.u["p"], comp.v["p"]
    for i in range(8):
        if i in sent:
            assert u[i] == 0 and v[i] == 0
        else:
            assert u[i] == g1[i] and v[i] == g1[i]
    g2 = torch.ones(8)
    payload, _ = comp.encode(g2, "p")
    expected_u = [0.5 * float(g1[i]) * (i not in sent) + 1 for i in range(8)]
    expected_v = [float(g1[i]) * (i not in sent) + expected_u[i] for i in range(8)]
    for i in range(8):
        if i in payload[1].tolist():
            assert comp.u["p"][i] == 0 and comp.v["p"][i] == 0
        else:
            assert comp.u["p"][i].item() == pytest.approx(expected_u[i])
            assert comp.v["p"][i].item() == pytest.approx(expected_v[i])


def test_dgc_sampled_threshold_close_to_k():
    comp = hvdcomp.get_compressor("dgc", density=0.01, sample_ratio=0.01)
    g = torch.Generator().manual_seed(0)
    mag = torch.randn(200_000, generator=g).abs()
    # (DGC's selection function with the method's own generator and sample ratio)
    idx = sampled_threshold_topk(mag, 2000, comp.sample_ratio, comp.rng, min_sample=comp.min_sample)
    assert 0.8 * 2000 <= idx.numel() <= 1.3 * 2000
    assert idx.min() >= 0 and idx.max() < 200_000
    # every selected magnitude is at least every unselected one's (a threshold, not a sample)
    mask = torch.zeros(200_000, dtype=torch.bool)
    mask[idx] = True
    assert mag[mask].min() >= mag[~mask].max()


def test_dgc_local_clipping_scales_by_world_size():
    comp = hvdcomp.get_compressor("dgc", density=1.0, momentum=0.0, clip_norm=1.0)
    with hvdcomp.compressors.simulated_world(4, 0):
        _, out = roundtrip(comp, torch.tensor([3.0, 4.0]), "p")  # norm 5 -> clipped to 1/sqrt(4)
    assert torch.allclose(out, torch.tensor([0.3, 0.4]))


def test_dgc_refuses_extra_error_feedback():
    with pytest.raises(ValueError, match="built in"):
        hvdcomp.get_compressor("dgc:ef=true")


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s not in ("none", "fp16")])
def test_state_dict_roundtrip_is_bit_identical(spec):
    a = hvdcomp.get_compressor(spec)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(50, generator=g) for _ in range(4)]
    for x in xs[:2]:
        roundtrip(a, x, "p")
    b = hvdcomp.get_compressor(spec)
    b.load_state_dict(a.state_dict())
    for x in xs[2:]:
        assert torch.equal(roundtrip(a, x, "p")[1], roundtrip(b, x, "p")[1]), spec


@pytest.mark.parametrize("spec,match", [
    ("qsgd:levels=0", "levels"), ("qsgd:block=0", "bucket"), ("qsgd:scale=signed", "scale"),
    ("dgc:momentum=-0.1", "momentum"), ("dgc:warmup_epochs=-1", "warmup_epochs"),
    ("dgc:sample_ratio=0", "sample_ratio"), ("randomk:density=2", "density"),
    ("signsgd:vote=maybe", "vote"), ("terngrad:clip_sigmas=-1", "clip_sigmas"),
])
def test_out_of_range_parameters(spec, match):
    with pytest.raises(ValueError, match=match):
        hvdcomp.get_compressor(spec)
