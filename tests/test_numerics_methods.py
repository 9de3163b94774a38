"""Numerical fixes in the per-tensor methods, each with the input that failed (issue 13), and the
statistical checks of the stochastic methods at extreme inputs and several simulated ranks
(means within 4 standard errors of the float64 expectation)."""
import math

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import simulated_world
from tests.simworld import SimulatedRanks


def roundtrip(comp, x, name="w"):
    payload, ctx = comp.encode(x, name)
    return comp.decode(payload, ctx)


# ---- fixes -------------------------------------------------------------------------------------
def test_qsgd_output_of_a_float16_gradient_stays_finite():
    """512 values of 6e4 (float16): the 2-norm is 1.36e6, a level rounded up decodes to
    1.36e6/16 = 8.5e4 > 65504, which was cast to inf."""
    x = torch.full((512,), 6e4, dtype=torch.float16)
    comp = hvdcomp.get_compressor("qsgd", levels=16)
    payload, ctx = comp.encode(x, "w")
    level_up = (torch.linalg.vector_norm(x.double()) / 16).item()
    assert level_up > 65504
    out = comp.decode(payload, ctx)
    assert torch.isfinite(out).all() and out.max() == 65504.0
    into = torch.empty(512, dtype=torch.float16)
    assert torch.isfinite(comp.aggregate_into(into, [payload, payload], ctx)).all()


def test_terngrad_constant_tensor_is_not_clipped_to_rounding_noise():
    """[0.7] * 8: std is 6e-8 (float rounding), so 2.5·std clipped every value to 1.6e-7."""
    x = torch.full((8,), 0.7)
    assert x.std().item() < 1e-6
    out = roundtrip(hvdcomp.get_compressor("terngrad"), x)
    assert torch.equal(out, x)                     # s = 0.7, Bernoulli(|g|/s = 1) keeps every value


def test_terngrad_clips_around_the_mean_magnitude_only_when_std_is_smaller():
    x = torch.tensor([10.0, 10.0, 10.0, 11.0])     # std 0.5 < |mean| 10.25: clip at 25.6, no effect
    (scale, _), _ = hvdcomp.get_compressor("terngrad").encode(x)
    assert scale.item() == 11.0


@pytest.mark.parametrize("magnitude", [1e20, 1e30])
def test_dgc_local_clipping_of_a_huge_gradient(magnitude):
    """The float32 norm of 1e30·(3, 4) overflowed to inf and the gradient was zeroed, not clipped."""
    with simulated_world(4, 0):
        comp = hvdcomp.get_compressor("dgc", density=1.0, momentum=0.0, clip_norm=1.0)
        out = roundtrip(comp, torch.tensor([3.0, 4.0]) * magnitude, "p")
    assert torch.allclose(out, torch.tensor([0.3, 0.4]))   # norm C / sqrt(N) = 0.5


# ---- statistical checks at extreme inputs -----------------------------------------------------
def aggregates(spec, grads, steps, name="w"):
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor(spec), len(grads))
    return torch.stack([sim.step(grads, name).double() for _ in range(steps)])


def within_standard_errors(samples, expected, z=4.0):
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    return ((mean - expected).abs() <= z * se + 1e-12 * expected.abs().max()).float().mean().item()


EXTREMES = [(torch.float32, 1e-30), (torch.float32, 1e30), (torch.float16, 1.0), (torch.bfloat16, 1e-20)]


@pytest.mark.parametrize("dtype,magnitude", EXTREMES)
def test_qsgd_aggregate_is_unbiased_at_extremes(dtype, magnitude):
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(24, generator=gen) * magnitude).to(dtype) for _ in range(4)]
    samples = aggregates("qsgd:levels=2,block=8", grads, 250)
    expected = torch.stack(grads).double().mean(0)
    assert within_standard_errors(samples, expected) >= 0.95
    # QSGD's variance bound per rank, min(d/s^2, sqrt(d)/s)·||v||^2 with d = 8, s = 2, averaged
    # over 4 independent ranks: E||agg - mean||^2 <= sum_r bound_r / 16
    bound = sum(min(8 / 4, math.sqrt(8) / 2) * g.double().pow(2).sum() for g in grads) / 16
    assert (samples - expected).pow(2).sum(1).mean() <= 1.1 * bound


@pytest.mark.parametrize("dtype,magnitude", EXTREMES)
def test_terngrad_aggregate_is_unbiased_at_extremes(dtype, magnitude):
    gen = torch.Generator().manual_seed(1)
    base = torch.linspace(-1, 1, 24)                         # no value beyond 2.5 sigma: no clipping
    grads = [((base + 0.1 * torch.randn(24, generator=gen)) * magnitude).to(dtype) for _ in range(4)]
    for g in grads:
        assert g.double().abs().max() <= 2.5 * g.double().std()
    samples = aggregates("terngrad", grads, 250)
    assert within_standard_errors(samples, torch.stack(grads).double().mean(0)) >= 0.95


@pytest.mark.parametrize("dtype,magnitude", EXTREMES)
def test_randomk_aggregate_is_k_over_n_times_the_mean(dtype, magnitude):
    """random-k (unscaled, the error-feedback variant): E[C(x)] = (k/n)·x, so (n/k)·C(x) is unbiased."""
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(40, generator=gen) * magnitude).to(dtype) for _ in range(4)]
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor("randomk", density=0.1, ef=False), 4)
    samples = torch.stack([sim.step(grads, "w").double() for _ in range(400)])   # a new step: new indices
    expected = torch.stack(grads).double().mean(0) * (4 / 40)                     # k = 4 of n = 40
    assert within_standard_errors(samples, expected) >= 0.95


def test_default_aggregate_accumulates_float16_decodes_in_float32():
    """Compressor.aggregate summed float16 decodes in float16: two ranks of 4e4 overflowed to inf
    (TernGrad, EF-signSGD use it)."""
    x = torch.full((6,), 4e4, dtype=torch.float16)
    for spec in ("terngrad", "efsignsgd:ef=false"):
        sim = SimulatedRanks(lambda: hvdcomp.get_compressor(spec), 2)
        out = sim.step([x, x])
        assert out.dtype == torch.float16 and out.tolist() == [4e4] * 6, spec


def test_powersgd_output_saturates_for_float16_gradients():
    """With the error added, P·Qᵀ can exceed a float16 gradient's range: it was cast to inf."""
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor("powersgd", matrix_rank=1), 2)
    g = torch.full((16, 12), 6e4, dtype=torch.float16)
    g[0, 0] = -6e4                                  # not rank 1: the error term is not zero
    for _ in range(3):
        outs = sim.reduce_batch([[("w", g)]] * 2)
        assert outs[0][0].dtype == torch.float16 and torch.isfinite(outs[0][0]).all()
