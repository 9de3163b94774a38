"""No method delivers a saturated value as if it were right (issue 29).

fp16's scaled steps: the scale exponent k against its closed form, the exact growth a step
tolerates before clamping (at world sizes whose float16 limit has little slack), detection on
every rank alike, the resend (exact float32 mean; error-feedback residual consistent) and the
"skip" policy (a NaN gradient). Then the static mode, the sparsifiers' float16 values and
``cast_saturating``. Ranks are simulated in one process (tests/simworld.py, with the allreduce
transport's saturation check modelled); tests/mpi/saturation_checks.py runs the issue's case
through the optimizer at 2 ranks.
"""
import math
import os

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import simulated_world
from hvdcomp.compressors.base import cast_saturating
from hvdcomp.compressors.segments import Segments
from mpirun import check
from tests.simworld import SimulatedRanks, horovod_allreduce

U16, U32 = 2.0**-11, 2.0**-24


def closed_form_k(exponent, world, headroom):
    """k = ⌊log2(65504/N)⌋ − (E + 1) − h, with ⌊log2(65504/N)⌋ from integers (N ≤ 65504)."""
    return ((65504 // world).bit_length() - 1) - (exponent + 1) - headroom


def closed_form_limit(world):
    """C_N: the largest float16 ≤ 65504/N (float16 spacing 2^(L − 10) in binade L)."""
    top = (65504 // world).bit_length() - 1
    return math.floor(65504 / world / 2.0 ** (top - 10)) * 2.0 ** (top - 10)


def fp16_sim(world, spec="fp16", saturation=True):
    return SimulatedRanks(lambda: hvdcomp.get_compressor(spec), world, saturation=saturation)


def flagged(sim):
    """Whether the last step was found saturated (on every rank alike, or on none)."""
    found = [a is not None for a in sim.actions]
    assert all(found) or not any(found)
    return found[0]


# ---- the scale exponent ------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 63, 1024])
@pytest.mark.parametrize("headroom", [0, 3, 10])
@pytest.mark.parametrize("exponent", [-20, 0, 7])
def test_scale_exponent_matches_the_closed_form_and_is_the_one_encode_uses(world, headroom, exponent):
    """k from ``scale_exponent`` and from the payload itself: after a probe whose largest value
    is 1.5·2^E, encoding 2^E sends exactly 2^(E + k) (a power of two: no rounding)."""
    k = closed_form_k(exponent, world, headroom)
    sim = fp16_sim(world, f"fp16:headroom={headroom}", saturation=False)
    comp = sim.comps[0]
    assert comp.scale_exponent(exponent, world) == k
    sim.step([torch.tensor([1.5, 0.25]) * 2.0**exponent] * world)       # probe: E agreed
    assert comp.exponents["w"] == exponent
    with simulated_world(world, 0):
        payload, ctx = comp.encode(torch.tensor([2.0**exponent, 0.0]), "w")
    assert payload[0].dtype == torch.float16 and ctx.k == k
    assert payload[0][0].item() == 2.0 ** (exponent + k)


@pytest.mark.parametrize("world", [3, 7, 63])
@pytest.mark.parametrize("headroom", [0, 3])
def test_the_growth_a_step_tolerates_is_exactly_the_closed_form(world, headroom):
    """Previous largest value M just below 2^(E+1) (E = 2). Closed form: a value x is clamped iff
    x·2^k > C_N, i.e. x > x* = C_N·2^-k. Then: growth 2^h (x = 2^h·M) is inside; x* itself is
    inside (delivered within float16 error); the next float32 above x* is detected on every
    rank and resent (the exact mean). C_N/2^L is 1.33, 1.14 and 1.015 at N = 3, 7, 63: one
    binade more in k would clamp 2^h·M, one less would let x*'s neighbour through undetected."""
    exponent = 2
    top = torch.nextafter(torch.tensor(2.0 ** (exponent + 1)), torch.tensor(0.0)).item()
    k = closed_form_k(exponent, world, headroom)
    threshold = closed_form_limit(world) * 2.0**-k
    above = torch.nextafter(torch.tensor(threshold), torch.tensor(math.inf)).item()
    assert 2.0**headroom * top < threshold
    for x, saturates in ((2.0**headroom * top, False), (threshold, False), (above, True)):
        sim = fp16_sim(world, f"fp16:headroom={headroom}")
        sim.step([torch.tensor([top, 1.0])] * world)                 # probe: E = 2
        sim.step([torch.tensor([top, 1.0])] * world)                 # scaled, E stays 2
        assert sim.comps[0].exponents["w"] == exponent
        out = sim.step([torch.tensor([x, 1.0])] * world)
        assert flagged(sim) == saturates, (x, threshold)
        if saturates:                                                # float32 probe
            assert abs(out[0].item() - x) <= (world + 2) * U32 * x and out[1].item() == 1.0, (x, out)
        else:
            assert abs(out[0].item() - x) <= (world + 2) * U16 * x, (x, out)


def test_the_issue_case_without_the_check_and_with_it():
    """2 ranks, gradients 1, 1, 100, 100: the codec alone (no check) delivers the clamped
    C_2·2^-k = 32752·2^-10 = 31.984 at step 3; the transport's check resends: 100."""
    raw = fp16_sim(2, saturation=False)
    assert [raw.step([torch.full((8,), v)] * 2)[0].item() for v in (1.0, 1.0, 100.0)] == [1.0, 1.0, 32752 / 1024]
    sim = fp16_sim(2)
    assert [sim.step([torch.full((8,), v)] * 2)[0].item() for v in (1.0, 1.0, 100.0, 100.0)] == [1.0, 1.0, 100.0, 100.0]


def test_one_rank_that_grows_is_seen_by_every_rank_and_the_resend_is_the_float32_mean():
    world = 4
    sim = fp16_sim(world)
    small = [torch.tensor([0.5, -0.25, 0.125]) * (r + 1) for r in range(world)]
    sim.step(small)
    sim.step(small)
    grads = small[:3] + [torch.tensor([-3e3, 7.0, 0.0])]                # rank 3 alone grows
    out = sim.step(grads)
    assert flagged(sim)
    mean = torch.stack(grads).double().mean(0)
    assert ((out.double() - mean).abs() <= (world + 2) * U32 * torch.stack(grads).double().abs().mean(0)).all()
    assert all(c.exponents["w"] == math.floor(math.log2(3e3)) for c in sim.comps)   # re-learned by the probe


def test_skip_policy_gives_nan_and_moves_the_exponent_even_when_the_step_is_rolled_back():
    world = 2
    sim = fp16_sim(world, "fp16:on_saturation=skip")
    for v in (1.0, 1.0):
        sim.step([torch.full((4,), v)] * world)
    for r, comp in enumerate(sim.comps):
        comp.begin_step()
    out = sim.step([torch.full((4,), 100.0)] * world)
    assert flagged(sim) and sim.actions[0].payload is None and torch.isnan(out).all()
    for comp in sim.comps:
        comp.rollback()                       # the optimizer skips the step
        assert comp.exponents["w"] == 6       # 100 = 1.56·2^6: kept, so the next step fits
    out = sim.step([torch.full((4,), 100.0)] * world)
    assert not flagged(sim) and (out - 100.0).abs().max() <= (world + 2) * U16 * 100.0


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_after_a_resend_sent_plus_residual_is_input_plus_old_residual(world):
    """Per rank, exactly in float32: what this rank sent (its float32 p after the resend) plus
    its new residual (0) equals g + e_old, for different per-rank gradients."""
    sim = fp16_sim(world, "fp16:ef=true")
    gen = torch.Generator().manual_seed(world)
    for scale in (1.0, 1.0, 500.0):
        grads = [torch.randn(6, generator=gen) * scale for _ in range(world)]
        old = [c.residuals.get("w", torch.zeros(6)) for c in sim.comps]
        encoded = sim.encode(grads)
        outs = sim.combine(encoded)
        for r, comp in enumerate(sim.comps):
            p = grads[r] + old[r]
            if scale == 500.0:
                sent = sim.actions[r].payload[0][:6]           # this rank's replacement: float32 p
                assert torch.equal(sent, p) and torch.equal(comp.residuals["w"], torch.zeros(6))
            else:
                sent = comp.inner._values(encoded[r][0], encoded[r][1].inner)
            assert torch.equal(sent + comp.residuals["w"], p), (scale, r)
    assert flagged(sim)
    mean = torch.stack([g.double() for g in grads]).mean(0)
    assert (outs[0].double() - mean).abs().max() <= (world + 2) * U32 * 500.0 * 4


def test_segments_resend_only_the_saturated_segment_and_equal_per_tensor_calls():
    """A flat buffer of three gradients, one of which grows: the segmented encode, check, resend
    and decode give bit for bit what one call per gradient gives, and the replacement carries
    only the saturated segment (float32, 5 + 277 values)."""
    world = 2
    shapes = [(3,), (5,), (2, 2)]
    seg = Segments(["a", "b", "c"], shapes)
    steps = [[torch.tensor([1.0, -2.0, 0.5]), torch.full((5,), 0.75), torch.ones(2, 2)],
             [torch.tensor([1.0, -2.0, 0.5]), torch.full((5,), 0.75), torch.ones(2, 2)],
             [torch.tensor([1.0, -2.0, 0.5]), torch.full((5,), 3e3), torch.ones(2, 2) * 3]]

    def transport(comps, encoded):
        reduced = [horovod_allreduce([e[0][i] for e in encoded]) for i in range(len(encoded[0][0]))]
        actions = [c.saturation(reduced, e[1]) for c, e in zip(comps, encoded)]
        if actions[0] is not None:
            reduced = [horovod_allreduce([a.payload[i] for a in actions]) for i in range(len(actions[0].payload))]
            encoded = [(a.payload, a.ctx) for a in actions]
        return [c.decode(reduced, e[1]) for c, e in zip(comps, encoded)], actions

    fused = [hvdcomp.get_compressor("fp16") for _ in range(world)]
    single = [hvdcomp.get_compressor("fp16") for _ in range(world)]
    for step, grads in enumerate(steps):
        with simulated_world(world, 0):
            flat = torch.cat([g.reshape(-1) for g in grads])
            out, actions = transport(fused, [c.encode(flat.clone(), None, seg) for c in fused])
            per_tensor = []
            for name, g in zip(seg.names, grads):
                res, _ = transport(single, [c.encode(g.clone(), name) for c in single])
                per_tensor.append(res[0].reshape(-1))
        assert torch.equal(out[0], torch.cat(per_tensor)), step
        if step == 2:
            assert actions[0].names == ("b",) and actions[0].payload[0].numel() == 5 + 277
            assert out[0][3:8].tolist() == [3e3] * 5
        else:
            assert actions[0] is None
        assert fused[0].exponents == single[0].exponents


def test_headroom_and_policy_are_validated_and_described():
    assert hvdcomp.get_compressor("fp16:on_saturation=skip").describe() == {"name": "fp16", "on_saturation": "skip"}
    assert hvdcomp.get_compressor("fp16").describe() == {"name": "fp16"}
    with pytest.raises(ValueError, match="headroom"):
        hvdcomp.get_compressor("fp16:headroom=11")        # the flag bin E + h + 2 must exist
    with pytest.raises(ValueError, match="on_saturation"):
        hvdcomp.get_compressor("fp16:on_saturation=clamp")


# ---- the static mode (stock hvd.DistributedOptimizer) ---------------------------------------
def test_static_mode_sends_what_float16_cannot_hold_as_inf():
    """N = 2: |x| ≥ 65520 (where float16's own cast overflows) averages to ±inf; 65519 is a
    float16 value (rounds to 65504) and is clamped at C_2 = 32752 per rank: 65504."""
    world = 2
    x = torch.tensor([1e5, -7e4, 65520.0, 65519.0, 1.0])
    comps = [hvdcomp.get_compressor("fp16") for _ in range(world)]
    pairs = []
    for r, comp in enumerate(comps):
        with simulated_world(world, r):
            pairs.append(comp.compress(x))
    out = comps[0].decompress(horovod_allreduce([p[0] for p in pairs]), pairs[0][1])
    assert out.tolist() == [math.inf, -math.inf, math.inf, 65504.0, 1.0]


# ---- the sparsifiers' float16 values -----------------------------------------------------------
def test_sparse_float16_values_without_a_residual_overflow_to_inf():
    comp = hvdcomp.get_compressor("topk:density=0.5,values=fp16,ef=false")
    payload, ctx = comp.encode(torch.tensor([1e6, -2.0, 0.0, 0.5]), "w")
    assert comp.decode(payload, ctx).tolist() == [math.inf, -2.0, 0.0, 0.0]


def test_dgc_float16_values_saturate_and_the_velocity_keeps_the_excess():
    comp = hvdcomp.get_compressor("dgc:density=0.5,momentum=0.0,values=fp16")
    payload, ctx = comp.encode(torch.tensor([1e6, -2.0, 0.0, 0.5]), "w")
    assert comp.decode(payload, ctx).tolist() == [65504.0, -2.0, 0.0, 0.0]
    assert comp.v["w"].tolist() == [1e6 - 65504.0, 0.0, 0.0, 0.5]


def test_cast_saturating_keeps_inf_loud():
    out = cast_saturating(torch.tensor([math.inf, -math.inf, 1e5, -1e5, math.nan]), torch.float16)
    assert out[:4].tolist() == [math.inf, -math.inf, 65504.0, -65504.0] and math.isnan(out[4].item())


# ---- through the optimizer -----------------------------------------------------------------
def test_through_the_optimizer_at_two_ranks():
    worker = os.path.join(os.path.dirname(__file__), "mpi", "saturation_checks.py")
    out = check(2, [worker], timeout=300)
    for name in ("issue_case_is_resent", "just_under_the_headroom_is_not_resent", "skip_policy_reports_an_overflow",
                 "error_feedback_residual_follows_the_resend", "op_sum_and_predivide",
                 "fused_unit_resends_only_the_saturated_gradient", "static_mode_is_loud_like_stock"):
        assert f"OK {name}" in out, out[-3000:]


# ---- error feedback on half-precision gradients --------------------------------------------
def test_error_feedback_keeps_what_a_float16_gradient_cannot_hold():
    """top-k (k = 1 of 2) with error feedback, float16 gradients, 2 ranks, by hand: step 1 sends
    60000 of [60000, 60000] (residual [0, 60000]); step 2, g = [0, 60000]: p = [0, 120000], the
    mean 120000 does not fit float16: 65504 is delivered and the excess 54496 joins the residual
    (on both ranks), so delivered + residual is still 120000; step 3 (g = 0) delivers 54496."""
    world = 2
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor("topk:density=0.5"), world)
    h = torch.float16
    outs = [sim.step([torch.tensor(g, dtype=h)] * world) for g in ([60000.0, 60000.0], [0.0, 60000.0], [0.0, 0.0])]
    assert outs[1].tolist() == [0.0, 65504.0] and outs[1].dtype == h
    assert outs[2].tolist() == [0.0, 54496.0]
    for comp in sim.comps:
        assert comp.residuals["w"].tolist() == [0.0, 0.0]


def test_regenerating_the_numerics_tables_keeps_the_saturation_section(tmp_path):
    """docs/numerics.md's tables are generated; `make numerics` must not drop the hand-written
    section on saturation (scripts/numerics_table.py keeps everything from its marker on)."""
    import json

    from scripts.numerics_table import KEEP_MARKER, main

    doc = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "numerics.md")).read()
    assert KEEP_MARKER in doc and "## Saturation and clipping: what each method does" in doc.split(KEEP_MARKER)[1]
    cell = {"spec": "none", "input": "zeros", "dtype": "float32", "world": 1, "step": 0, "measured": 0.0, "bound": 1.0}
    data = {"inputs": ["zeros"], "dtypes": ["float32"], "worlds": [1], "cells": [cell],
            "rows": [{"method": "none", "ef": "off", "spec": "none", "bound": "b", "zeros": "elementwise", "steps": 1}]}
    (tmp_path / "m.json").write_text(json.dumps(data))
    out = tmp_path / "numerics.md"
    out.write_text("old tables\n" + KEEP_MARKER + "\nkept section\n")
    main([str(tmp_path / "m.json"), str(out)])
    text = out.read_text()
    assert "old tables" not in text and text.endswith(KEEP_MARKER + "\nkept section\n") and "`none`" in text
