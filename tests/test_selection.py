"""Tests of the shared top-k selection (hvdcomp/compressors/selection.py) and of topk's
``select=sample`` option, against dense references (sorted magnitudes, ``torch.topk``,
``torch.nonzero``) computed independently of the code under test."""
import math

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import selection
from hvdcomp.compressors.rng import RankGenerators
from hvdcomp.compressors.topk import num_kept

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def assert_top_by_magnitude(mag, idx):
    """``idx`` holds distinct valid indices whose magnitudes are the largest ones of ``mag``:
    sorted descending they equal the first len(idx) sorted magnitudes, and none is below an
    unselected magnitude."""
    n, m = mag.numel(), idx.numel()
    assert idx.dtype == torch.int64 and idx.dim() == 1
    assert idx.unique().numel() == m, "indices repeat"
    if m:
        assert 0 <= idx.min() and idx.max() < n
    ref = torch.sort(mag, descending=True).values
    assert torch.equal(torch.sort(mag[idx], descending=True).values, ref[:m])
    chosen = torch.zeros(n, dtype=torch.bool, device=mag.device)
    chosen[idx] = True
    if 0 < m < n:
        assert mag[chosen].min() >= mag[~chosen].max()


# ---- exact top-k and the scan -------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (5000, 4999), (7, 7), (7, 20), (5, 0)])
def test_exact_topk_is_torch_topk_set(n, k):
    x = torch.randn(n, generator=gen(n + k))
    got = selection.exact_topk(x, k, magnitudes=False)
    if k >= n:
        assert got.tolist() == list(range(n))
    elif k == 0:
        assert got.numel() == 0 and got.dtype == torch.int64
    else:
        ref = torch.topk(x.abs(), k).indices
        assert set(got.tolist()) == set(ref.tolist())
        assert torch.equal(selection.exact_topk(x.abs(), k), got)


@pytest.mark.parametrize("n", [0, 1, 8, 13, 64, 1000, 4099])
@pytest.mark.parametrize("chunk", [8, 24, 1 << 20])
def test_indices_at_least_equals_nonzero(n, chunk):
    x = torch.randn(n, generator=gen(n))
    if n > 3:
        x[1] = float("nan")
        x[2] = -x[3]                                  # |x| ties across signs
    for thr in [0.0, 0.5, 1.7, 100.0, float(x[3].abs()) if n > 3 else 1.0]:
        t = torch.tensor(thr)
        ref = torch.nonzero(x.abs() >= t).view(-1)    # NaN never passes
        assert torch.equal(selection.indices_at_least(x, t, magnitudes=False, chunk=chunk), ref)
        assert torch.equal(selection.indices_at_least(x.abs(), t, chunk=chunk), ref)
        # the device (CUDA) path, run on the CPU
        assert torch.equal(selection.indices_at_least(x, t, magnitudes=False, chunked=False), ref)


# ---- sampled threshold --------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,density,seed", [(200_000, 0.01, 0), (200_000, 0.001, 1), (50_000, 0.05, 2),
                                            (1_300_017, 0.002, 3), (30_000, 0.3, 4)])
def test_sampled_selection_is_a_threshold_set_of_about_k(device, n, density, seed):
    x = torch.randn(n, generator=gen(seed)).to(device)
    k = num_kept(n, density)
    idx = selection.sampled_threshold_topk(x, k, 0.01, gen(seed, device), magnitudes=False)
    assert 0.8 * k <= idx.numel() <= 1.3 * k
    assert_top_by_magnitude(x.abs(), idx)


def test_sampled_selection_many_draws_cover_every_branch(monkeypatch):
    """Heavy-tailed data at a low density: the first threshold is often off by more than the
    window, so some draws lower it (several scans) and some cut the candidates to exactly k.
    Every result must still be a threshold set within [0.8k, 1.3k]."""
    scans = []
    real = selection.indices_at_least

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        scans[-1].append(out.numel())
        return out

    monkeypatch.setattr(selection, "indices_at_least", counting)
    n, k = 100_000, 50                                # sample of 1000: threshold from the top 1
    x = torch.randn(n, generator=gen(7)) ** 3
    mag = x.abs()
    exact_k = 0
    for seed in range(40):
        scans.append([])
        idx = selection.sampled_threshold_topk(x, k, 0.01, gen(seed), magnitudes=False)
        assert 0.8 * k <= idx.numel() <= 1.3 * k
        assert_top_by_magnitude(mag, idx)
        exact_k += scans[-1][-1] > 1.3 * k and idx.numel() == k
    assert any(len(s) > 1 for s in scans), "no draw lowered the threshold"
    assert exact_k > 0, "no draw cut the candidates to the exact top k"


def test_many_ties_give_exactly_k():
    x = torch.ones(10_000)
    x[:30] = 2.0
    idx = selection.sampled_threshold_topk(x, 100, 0.01, gen(0))
    assert idx.numel() == 100 and idx.unique().numel() == 100
    assert set(range(30)) <= set(idx.tolist())        # the 2.0 entries are never dropped


def test_small_tensors_fall_back_to_exact_topk_without_drawing():
    g = gen(3)
    before = g.get_state()
    x = torch.randn(6399, generator=gen(1))           # 1 % of 6399 -> 64 samples would be drawn...
    idx = selection.sampled_threshold_topk(x, 64, 0.01, g, magnitudes=False, min_sample=65)
    assert torch.equal(g.get_state(), before)         # ...but 64 < min_sample: exact, no draw
    assert set(idx.tolist()) == set(torch.topk(x.abs(), 64).indices.tolist())
    assert selection.sampled_threshold_topk(x, 6399, 0.01, g).tolist() == list(range(6399))


def test_sampling_is_reproducible_and_uses_rank_generators_lazily():
    x = torch.randn(100_000, generator=gen(5))
    a = selection.sampled_threshold_topk(x, 500, 0.01, gen(11), magnitudes=False)
    b = selection.sampled_threshold_topk(x, 500, 0.01, gen(11), magnitudes=False)
    assert torch.equal(a, b)
    rng = RankGenerators(0)
    selection.sampled_threshold_topk(x[:100], 5, 0.01, rng)   # exact fallback: no generator made
    assert rng.state_dict() == {}
    selection.sampled_threshold_topk(x, 500, 0.01, rng)
    assert list(rng.state_dict()) == ["cpu"]


# ---- topk select=sample ---------------------------------------------------------------------------
def test_topk_sample_spec_and_describe():
    comp = hvdcomp.get_compressor("topk:density=0.01,select=sample")
    assert comp.describe() == {"name": "topk", "density": 0.01, "select": "sample",
                               "sample_ratio": 0.01, "ef": True}
    inner = hvdcomp.get_compressor("topk:density=0.01,select=sample,sample_ratio=0.05,seed=3,ef=false")
    assert inner.describe() == {"name": "topk", "density": 0.01, "select": "sample",
                                "sample_ratio": 0.05, "seed": 3}
    assert hvdcomp.get_compressor("topk:density=0.01,select=exact").describe() == \
        {"name": "topk", "density": 0.01, "ef": True}


def test_topk_sample_under_error_feedback_keeps_the_unsent_part():
    comp = hvdcomp.get_compressor("topk:density=0.01,select=sample,sample_ratio=0.05")
    g = gen(21)
    n = 20_000
    k = num_kept(n, 0.01)
    residual = torch.zeros(n)
    total_sent = torch.zeros(n)
    grads = [torch.randn(n, generator=g) for _ in range(6)]
    for grad in grads:
        p = grad + residual                           # what error feedback compresses
        payload, ctx = comp.encode(grad, "w")
        sent = comp.decode(payload, ctx)
        idx = payload[1].long()
        assert 0.8 * k <= idx.numel() <= 1.3 * k
        assert_top_by_magnitude(p.abs(), idx)
        expected_sent = torch.zeros(n)
        expected_sent[idx] = p[idx]
        assert torch.equal(sent, expected_sent)
        residual = p.clone()
        residual[idx] = 0.0
        assert torch.equal(comp.residuals["w"], residual)
        total_sent += sent
    assert torch.allclose(total_sent + residual, torch.stack(grads).sum(0), atol=1e-5)


def test_topk_sample_state_dict_roundtrip_is_bit_identical():
    a = hvdcomp.get_compressor("topk:density=0.01,select=sample")
    g = gen(9)
    xs = [torch.randn(50_000, generator=g) for _ in range(4)]
    for x in xs[:2]:
        a.encode(x, "p")
    state = a.state_dict()
    assert set(state["inner"]) == {"rng"}
    b = hvdcomp.get_compressor("topk:density=0.01,select=sample")
    b.load_state_dict(state)
    for x in xs[2:]:
        pa, pb = a.encode(x, "p")[0], b.encode(x, "p")[0]
        assert all(torch.equal(u, v) for u, v in zip(pa, pb))
    # the exact path stays stateless (old checkpoints still load)
    assert hvdcomp.get_compressor("topk:density=0.01,ef=false").state_dict() == {}


def test_topk_exact_is_unchanged_reference():
    comp = hvdcomp.get_compressor("topk:density=0.01,ef=false")
    x = torch.randn(30_000, generator=gen(4))
    payload, _ = comp.encode(x, "w")
    assert set(payload[1].tolist()) == set(torch.topk(x.abs(), 300).indices.tolist())


@pytest.mark.parametrize("spec,match", [
    ("topk:select=fast", "select must be one of exact, sample"),
    ("topk:select=1", "select must be one of exact, sample"),
    ("topk:select=sample,sample_ratio=0", r"sample_ratio must be in \(0, 1\]"),
    ("topk:select=sample,sample_ratio=1.5", r"sample_ratio must be in \(0, 1\]"),
    ("topk:sample_ratio=0.05", "only applies to select=sample"),
    ("dgc:sample_ratio=2", r"sample_ratio must be in \(0, 1\]"),
])
def test_bad_selection_options_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        hvdcomp.get_compressor(spec)


def test_dgc_uses_the_shared_selection(monkeypatch):
    calls = []
    real = selection.sampled_threshold_topk

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    from hvdcomp.compressors import dgc as dgc_module
    monkeypatch.setattr(dgc_module, "sampled_threshold_topk", spy)
    comp = hvdcomp.get_compressor("dgc:density=0.01")
    comp.encode(torch.randn(10_000, generator=gen(0)), "p")
    assert calls == [math.ceil(0.01 * 10_000)]
