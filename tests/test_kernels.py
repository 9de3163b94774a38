"""The compressors' kernels: native C (hvdcomp.native) against the vectorised torch kernels and
against independent references (closed forms, torch.topk, torch.nonzero, index_add_), on awkward
sizes; both kernel sets are run (the torch set is the CUDA path and the fallback without a C
compiler). No timing assertions: speed is measured by benchmarks/kernels.py."""
import math

import pytest
import torch

import hvdcomp
from hvdcomp import native
from hvdcomp.compressors import bitpack, selection

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.status()}")
KERNELS = ["native", "torch"]


@pytest.fixture(params=KERNELS)
def kernels(request):
    previous = native.set_enabled(request.param == "native")
    yield request.param
    native.set_enabled(previous)


@pytest.fixture
def torch_kernels():
    previous = native.set_enabled(False)
    yield
    native.set_enabled(previous)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def encode(spec, x, name="w"):
    comp = hvdcomp.get_compressor(spec)
    payload, ctx = comp.encode(x, name)
    return comp, payload, ctx


def both(fn):
    """fn() with the native kernels, then with the torch kernels."""
    previous = native.set_enabled(True)
    try:
        a = fn()
        native.set_enabled(False)
        b = fn()
    finally:
        native.set_enabled(previous)
    return a, b


# ---- build and loading ---------------------------------------------------------------------------
def test_status_and_build_into_a_new_directory(tmp_path):
    assert native.status()["native"] and native.enabled()
    path = native.build(str(tmp_path))
    assert path.startswith(str(tmp_path)) and path.endswith(".so")
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(str(tmp_path), compiler="no-such-compiler-hvdcomp")


def test_wrappers_refuse_wrong_dtypes():
    with pytest.raises(ValueError, match="contiguous CPU torch.float32"):
        native.moments(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous CPU torch.float32"):
        native.moments(torch.ones(4, 2).t())


# ---- QSGD ------------------------------------------------------------------------------------------
QSGD_CASES = [(1, 7, 1), (2, 13, 29), (3, 512, 1000), (4, 10, 8191), (8, 512, 70_001),
              (16, 512, 3 * 8192 + 5), (32, 100, 20_000), (64, 16, 4099), (127, 9000, 30_000),
              (16, 1, 1000)]


@pytest.mark.parametrize("levels,bucket,n", QSGD_CASES)
@pytest.mark.parametrize("scale", ["l2", "max"])
def test_qsgd_native_codes_round_to_a_neighbouring_level(levels, bucket, n, scale):
    """Native payload, read back with the torch unpacker: every code is floor(r) or floor(r)+1
    with r = s·|x|/scale and the sign of x; scales are the bucket norms (float64, as torch)."""
    x = torch.randn(n, generator=gen(n)) * torch.rand(n, generator=gen(n + 1)).mul(4).exp()
    comp, (scales, packed), _ = encode(f"qsgd:levels={levels},block={bucket},scale={scale}", x)
    assert packed.numel() == math.ceil(n * comp.bits / 8) and scales.numel() == math.ceil(n / bucket)
    padded = torch.nn.functional.pad(x, (0, (-n) % bucket)).view(-1, bucket)
    ref = padded.double().norm(dim=1).float() if scale == "l2" else padded.abs().amax(dim=1)
    assert torch.allclose(scales, ref, rtol=1e-6, atol=0)
    level = bitpack.unpack_bits(packed, comp.bits, n) - levels
    per = scales.repeat_interleave(bucket)[:n]
    r = (x.abs() / per * levels).clamp(max=levels)
    assert (level.abs() == r.floor()).logical_or(level.abs() == r.floor() + 1).all()
    assert ((level == 0) | (torch.sign(level) == torch.sign(x))).all()
    assert level.abs().max() <= levels


@pytest.mark.parametrize("levels,bucket,n", QSGD_CASES)
def test_qsgd_decode_and_aggregate_native_equal_torch(levels, bucket, n):
    x = torch.randn(n, generator=gen(2 * n))
    comp, p1, ctx = encode(f"qsgd:levels={levels},block={bucket}", x)
    p2, _ = comp.encode(x * 3, "w")
    p3, _ = comp.encode(-x, "w")
    for payloads in ([p1], [p1, p2, p3]):
        a, b = both(lambda: comp.aggregate_into(torch.empty(n), payloads, ctx))
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # against the definition: mean over payloads of scale·(code - s)/s
    ref = sum(sc.repeat_interleave(bucket)[:n] * (bitpack.unpack_bits(pk, comp.bits, n) - levels) / levels
              for sc, pk in (p1, p2, p3)) / 3
    assert torch.allclose(comp.aggregate([p1, p2, p3], ctx), ref, rtol=1e-5, atol=1e-6)


def test_qsgd_native_is_deterministic_and_independent_of_threads():
    x = torch.randn(100_000, generator=gen(3))
    threads = torch.get_num_threads()
    payloads = []
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        comp = hvdcomp.get_compressor("qsgd:levels=16,block=100")
        payloads.append(comp.encode(x, "w")[0])
    torch.set_num_threads(threads)
    for p in payloads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(payloads[0], p))
    comp = hvdcomp.get_compressor("qsgd:levels=16,block=100")
    first, second = comp.encode(x, "w")[0][1], comp.encode(x, "w")[0][1]
    assert not torch.equal(first, second)          # a new key per call: new draws


@pytest.mark.parametrize("levels", [1, 16, 127])
def test_qsgd_unbiased_both_kernels(kernels, levels):
    """E[Q(v)] = v per element (3.5 standard errors, 97 % of the elements), both kernel sets."""
    v = torch.randn(300, generator=gen(levels))
    comp = hvdcomp.get_compressor("qsgd", levels=levels, block=64)
    outs = torch.stack([comp.decode(*comp.encode(v, "w")) for _ in range(3000)]).double()
    se = outs.std(0) / math.sqrt(len(outs)) + 1e-12
    assert ((outs.mean(0) - v.double()).abs() <= 3.5 * se + 1e-9).float().mean() >= 0.97


def test_qsgd_rounding_variance_and_independence_both_kernels(kernels):
    """Stochastic rounding's second moments on a 1M-element tensor over 8 calls: the error
    variance equals the closed form Σ (scale/s)²·f(1-f) (f the fractional level) within 1 %, and
    errors of neighbouring elements (lags 1-8: the four generator lanes and their steps, and a
    work unit's boundary at 8192), of successive calls and of two ranks' generators are
    uncorrelated (|corr| < 0.01; the standard error is ~3e-4)."""
    from hvdcomp.compressors.base import simulated_world

    n, s, d, calls = 1 << 20, 16, 512, 8
    v = torch.randn(n, generator=gen(11))
    errors = {}
    for r in (0, 1):
        with simulated_world(2, r):
            comp = hvdcomp.get_compressor("qsgd", levels=s, block=d)
            errors[r] = torch.stack([comp.decode(*comp.encode(v, "w")) - v for _ in range(calls)]).double()
    vb = v.double().view(-1, d)
    r_ = vb.abs() / vb.norm(dim=1, keepdim=True) * s
    f = r_ - r_.floor()
    theory = ((vb.norm(dim=1, keepdim=True) / s) ** 2 * f * (1 - f)).sum().item()
    e = errors[0]
    assert e.pow(2).sum(1).mean().item() == pytest.approx(theory, rel=0.01)

    def corr(a, b):
        return ((a * b).sum() / (a.norm() * b.norm())).item()

    for lag in (1, 2, 3, 4, 5, 8, 8192):
        assert abs(corr(e[:, :-lag], e[:, lag:])) < 0.01, lag
    assert abs(corr(e[:-1], e[1:])) < 0.01                    # successive calls
    assert abs(corr(errors[0], errors[1])) < 0.01             # two ranks, same input


def test_qsgd_special_inputs_both_kernels(kernels):
    comp = hvdcomp.get_compressor("qsgd:levels=127,block=4")
    zeros = torch.zeros(10)
    assert torch.equal(comp.decode(*comp.encode(zeros, "w")), zeros)
    big = torch.tensor([3e38, -3e38, 3e38, -3e38, 1.0, -1.0, 0.0])
    payload, ctx = comp.encode(big, "w")
    assert torch.isfinite(payload[0]).all() and torch.isfinite(comp.decode(payload, ctx)).all()
    assert torch.isfinite(comp.aggregate([payload] * 4, ctx)).all()
    nan = torch.tensor([1.0, float("nan"), 2.0, 3.0, 4.0])
    out = comp.decode(*comp.encode(nan, "w"))
    assert out.shape == (5,) and torch.isnan(out[:4]).all() and torch.isfinite(out[4:]).all()
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(33, generator=gen(1)).to(dtype)
        out = comp.decode(*comp.encode(x, "w"))
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_decode_into_other_dtype_and_layout(kernels):
    comp, payload, ctx = encode("qsgd:levels=16,block=8", torch.randn(6, 4, generator=gen(4)))
    ref = comp.decode(payload, ctx)
    half = torch.empty(6, 4, dtype=torch.float16)
    comp.decode_into(half, payload, ctx)
    assert torch.allclose(half.float(), ref, rtol=1e-3, atol=1e-3)
    strided = torch.empty(4, 6).t()                  # non-contiguous (6, 4) view
    comp.decode_into(strided, payload, ctx)
    assert torch.equal(strided, ref)


# ---- TernGrad, signs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 8191, 8193, 100_003])
def test_terngrad_native_scale_and_codes(n):
    x = torch.randn(n, generator=gen(n))
    if n > 10:
        x[5] = 40.0                                   # clipped
    comp, (s, packed), ctx = encode("terngrad", x)
    if n > 1:
        c = 2.5 * x.std()
        assert s.item() == pytest.approx(min(x.abs().max().item(), c.item()), rel=1e-6)
    codes = bitpack.unpack_bits(packed, 2, n)
    assert codes.max() <= 2
    clipped = x.clamp(-s.item(), s.item())
    sign = codes - 1
    assert ((sign == 0) | (sign == torch.sign(clipped))).all()
    a, b = both(lambda: comp.aggregate([[s, packed], [s * 2, packed]], ctx))
    assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert torch.allclose(a, 1.5 * s * sign.float(), rtol=1e-6, atol=0)


def test_terngrad_unbiased_both_kernels(kernels):
    x = torch.randn(200, generator=gen(6))
    comp = hvdcomp.get_compressor("terngrad")
    c = 2.5 * x.std()
    outs = torch.stack([comp.decode(*comp.encode(x, "w")) for _ in range(3000)]).double()
    se = outs.std(0) / math.sqrt(len(outs)) + 1e-12
    assert ((outs.mean(0) - x.clamp(-c, c).double()).abs() <= 3.5 * se + 1e-9).float().mean() >= 0.97


def test_terngrad_equal_values_and_huge_values(kernels):
    comp = hvdcomp.get_compressor("terngrad")
    # std 0: the clip is 2.5·|mean| = 17.5, s = 7, every |g|/s = 1 is kept: exactly 7 everywhere
    out = comp.decode(*comp.encode(torch.full((9,), 7.0), "w"))
    assert torch.equal(out, torch.full((9,), 7.0))
    payload, ctx = comp.encode(torch.tensor([3e38, -3e38, 1.0]), "w")
    assert torch.isfinite(payload[0]).all() and torch.isfinite(comp.decode(payload, ctx)).all()


@pytest.mark.parametrize("n", [1, 9, 8192, 8199, 100_000])
def test_sign_kernels_equal_torch(n):
    x = torch.randn(n, generator=gen(n))
    x[0] = 0.0
    if n > 3:
        x[1], x[2] = -0.0, float("nan")
    for spec in ("signsgd", "signsgd:vote=allgather", "efsignsgd"):
        comp = hvdcomp.get_compressor(spec, ef=False) if spec == "efsignsgd" else hvdcomp.get_compressor(spec)
        pa, pb = both(lambda: comp.encode(x, "w")[0])
        ctx = comp.encode(x, "w")[1]
        assert torch.equal(pa[-1], pb[-1]), spec                      # signs / votes bit-identical
        if spec == "efsignsgd":
            assert pa[0].item() == pytest.approx(pb[0].item(), rel=1e-6, nan_ok=True)
        others = [comp.encode(x.flip(0) * (i + 1), "w")[0] for i in range(3)]
        a, b = both(lambda: comp.aggregate([pa] + others, ctx))
        assert torch.allclose(a, b, rtol=1e-6, atol=0, equal_nan=True), spec


def test_efsignsgd_native_residual_in_place():
    comp = hvdcomp.get_compressor("efsignsgd")
    x = torch.randn(1001, generator=gen(8))
    for _ in range(3):
        comp.encode(x, "p")
    e = comp.residuals["p"]
    ref = hvdcomp.get_compressor("efsignsgd")
    native.set_enabled(False)
    try:
        for _ in range(3):
            ref.encode(x, "p")
    finally:
        native.set_enabled(True)
    assert torch.allclose(e, ref.residuals["p"], rtol=1e-5, atol=1e-6)


# ---- selection and sparse aggregation ------------------------------------------------------------------
def _distributions(n):
    g = gen(n)
    yield "normal", torch.randn(n, generator=g)
    yield "heavy", torch.randn(n, generator=g) ** 5
    block = torch.randn(n, generator=g) * 0.01
    block[n // 3: n // 3 + n // 50] += 10.0                          # all the large ones together
    yield "block", block
    ties = torch.randint(0, 4, (n,), generator=g).float()
    yield "ties", ties
    yield "equal", torch.full((n,), -2.0)
    periodic = torch.randn(n, generator=g) * 0.01
    periodic[::100] = 5.0                                            # aligned with the sample stride
    yield "periodic", periodic


@pytest.mark.parametrize("n", [1 << 15, 100_003, 1 << 20])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3])
def test_exact_topk_threshold_path_is_the_topk_set(n, density):
    k = math.ceil(density * n)
    for name, x in _distributions(n):
        idx = selection.exact_topk(x, k, magnitudes=False)
        assert idx.numel() == k and idx.unique().numel() == k, name
        assert bool((idx[1:] > idx[:-1]).all()), name                  # ascending
        ref = torch.topk(x.abs(), k).values
        assert torch.equal(torch.sort(x[idx].abs(), descending=True).values, ref), name


def test_exact_topk_with_nan_falls_back_or_ignores_nan():
    x = torch.randn(1 << 16, generator=gen(2))
    x[::7] = float("nan")                                           # in the sample: torch.topk path
    idx = selection.exact_topk(x, 500, magnitudes=False)
    assert idx.numel() == 500 and idx.unique().numel() == 500


@pytest.mark.parametrize("n", [1, 1000, 65536, 65537, 300_001])
def test_fused_scan_equals_nonzero(n):
    x = torch.randn(n, generator=gen(n))
    if n > 3:
        x[0], x[2] = float("nan"), float("-inf")
    for thr in (0.0, 1.0, 2.5, float("inf")):
        for absval in (True, False):
            total, counts = native.count_at_least(x, thr, absval)
            ref = torch.nonzero((x.abs() if absval else x) >= thr).view(-1)
            assert total == ref.numel() == int(counts.sum())
            idx, vals = native.compact_at_least(x, thr, absval, counts, total, values=True)
            assert torch.equal(idx, ref) and torch.equal(vals, x[ref])


def _sparse_payloads(comp, n, count, seed):
    g = gen(seed)
    return [comp.encode(torch.randn(n, generator=g), "w")[0] for _ in range(count)]


@pytest.mark.parametrize("spec", ["topk:density=0.01,ef=false", "topk:density=0.01,ef=false,index=compact,values=fp16",
                                  "topk:density=0.01,select=sample,ef=false", "dgc:density=0.01",
                                  "threshold:threshold=2.0,ef=false"])
@pytest.mark.parametrize("n", [1000, 16384 * 3 + 7, 200_000])
def test_sparse_aggregate_native_equals_index_add(spec, n):
    comp = hvdcomp.get_compressor(spec)
    payloads = _sparse_payloads(comp, n, 4, n)
    ctx = (torch.Size([n]), torch.float32)
    ref = torch.zeros(n)
    for p in payloads:
        values, idx = comp.unpack(p, n)
        if idx is None:
            ref += values / 4
        else:
            ref.index_add_(0, idx, values, alpha=0.25)
    a, b = both(lambda: comp.aggregate_into(torch.full((n,), 9.0), payloads, ctx))
    assert torch.equal(a, b) and torch.allclose(a, ref, rtol=1e-6, atol=1e-7)


def test_sparse_aggregate_dense_and_unsorted_payloads():
    comp = hvdcomp.get_compressor("topk:density=0.5,ef=false")
    ctx = (torch.Size([6]), torch.float32)
    dense = [torch.tensor([1.0, 2, 3, 4, 5, 6]), torch.zeros(0, dtype=torch.int32)]
    unsorted = [torch.tensor([10.0, 20.0]), torch.tensor([5, 1], dtype=torch.int32)]
    out = comp.aggregate_into(torch.empty(6), [dense, unsorted], ctx)   # index_add_ fallback
    assert out.tolist() == [0.5, 11.0, 1.5, 2.0, 2.5, 8.0]
    bad = [torch.tensor([1.0]), torch.tensor([6], dtype=torch.int32)]   # out of range
    assert not native.sparse_aggregate(torch.empty(6), [torch.tensor([6])], [torch.tensor([1.0])], 1.0)
    with pytest.raises((IndexError, RuntimeError)):
        comp.aggregate_into(torch.empty(6), [bad], ctx)


# ---- random-k ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,density", [(1, 0.5), (100, 0.01), (1000, 0.1), (1000, 0.2), (123_457, 0.01)])
def test_randomk_indices_same_with_both_kernels(n, density):
    comp = hvdcomp.get_compressor(f"randomk:density={density},ef=false")
    for step in range(3):
        a, b = both(lambda: comp.indices(n, "layer.w", step))
        k = max(1, math.ceil(density * n))
        assert torch.equal(a, b) and a.numel() == k and a.unique().numel() == k
        assert bool((a[1:] > a[:-1]).all()) and 0 <= a.min() and a.max() < n


def test_randomk_indices_are_uniform():
    """Each index is kept with probability k/n: counts over 4000 steps within 5 binomial sigmas."""
    comp = hvdcomp.get_compressor("randomk:density=0.05,ef=false")
    n, steps = 200, 4000
    hits = torch.zeros(n)
    for step in range(steps):
        hits[comp.indices(n, "u", step)] += 1
    p = 10 / n
    sigma = math.sqrt(steps * p * (1 - p))
    assert (hits - steps * p).abs().max() <= 5 * sigma


def test_randomk_aggregate_is_mean_of_values(kernels):
    comp = hvdcomp.get_compressor("randomk:density=0.1,ef=false")
    x = torch.randn(100, generator=gen(5))
    payload, ctx = comp.encode(x, "w")
    other = [payload[0] * 3]
    out = comp.aggregate_into(torch.full((100,), 7.0), [payload, other], ctx)
    ref = torch.zeros(100)
    ref[ctx[2]] = 2 * payload[0]
    assert torch.allclose(out, ref)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_small_tensors_run_on_the_calling_thread():
    """A kernel over fewer than 8192 elements starts no OpenMP team (it has one work unit): a
    thread that never ran one gets no worker threads from it. Larger tensors get one thread per
    8192 elements, up to torch's thread count. (Each team costs a wake-up and a join per call:
    milliseconds on a busy machine; twophase at 64 ranks made 3·64 such calls per rank and step.)"""
    import os
    import threading

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert [native._threads(n) for n in (0, 3, 8192, 8193, 3 * 8192, 10**7)] == [1, 1, 1, 2, 3, 4]
        started = {}

        def run(n):
            x = torch.randn(n, generator=gen(5))
            before = len(os.listdir("/proc/self/task"))
            native.sign_bits(x, torch.empty((n + 7) // 8, dtype=torch.uint8))
            started[n] = len(os.listdir("/proc/self/task")) - before   # this thread's team stays

        for n in (3, 8192, 2 * 8192 + 1):
            worker = threading.Thread(target=run, args=(n,))
            worker.start()
            worker.join()
    finally:
        torch.set_num_threads(threads)
    assert started == {3: 0, 8192: 0, 2 * 8192 + 1: 2}
