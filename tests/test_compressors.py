"""Single-process tests of the compressors, error feedback and registry (values worked by hand
or computed by independent reference code)."""

import pytest
import torch

import hvdcomp
from hvdcomp.compressors.topk import num_kept


def roundtrip(comp, x, name="w"):
    payload, ctx = comp.encode(x, name)
    return payload, comp.decode(payload, ctx)


# ---- top-k -------------------------------------------------------------------------------------
def test_topk_hand_example():
    comp = hvdcomp.get_compressor("topk:density=0.4,ef=false")
    x = torch.tensor([[0.5, -3.0, 1.0], [2.0, -0.1, 0.0]])
    (values, idx), out = roundtrip(comp, x)     # k = max(1, ceil(0.4 * 6)) = 3
    assert idx.dtype == torch.int32 and values.dtype == torch.float32
    assert sorted(zip(idx.tolist(), values.tolist())) == [(1, -3.0), (2, 1.0), (3, 2.0)]
    assert out.tolist() == [[0.0, -3.0, 1.0], [2.0, 0.0, 0.0]]


@pytest.mark.parametrize("n,density,k", [(6, 0.4, 3), (100, 0.01, 1), (1000, 0.001, 1),
                                         (1, 0.01, 1), (0, 0.5, 0), (7, 1.0, 7), (3, 0.5, 2)])
def test_num_kept(n, density, k):
    assert num_kept(n, density) == k


def test_topk_one_and_zero_elements():
    comp = hvdcomp.get_compressor("topk", density=0.01, ef=False)
    (values, idx), out = roundtrip(comp, torch.tensor([-2.5]))
    # k = 1 of n = 1: 8 sparse bytes > 4 dense bytes, so the element travels densely (no index)
    assert values.tolist() == [-2.5] and idx.tolist() == [] and out.tolist() == [-2.5]
    (values, idx), out = roundtrip(comp, torch.empty(0, 3))
    assert values.numel() == 0 and idx.numel() == 0 and out.shape == (0, 3)


def test_topk_is_k_contraction():
    g = torch.Generator().manual_seed(0)
    comp = hvdcomp.get_compressor("topk", density=0.05, ef=False)
    for _ in range(20):
        x = torch.randn(1000, generator=g, dtype=torch.float64)
        _, out = roundtrip(comp, x)
        k = num_kept(1000, 0.05)
        assert (x - out).pow(2).sum() <= (1 - k / 1000) * x.pow(2).sum() + 1e-12


def test_topk_aggregate_adds_duplicates_and_divides():
    comp = hvdcomp.get_compressor("topk", density=0.5, ef=False)
    ctx = (torch.Size([4]), torch.float32)
    a = [torch.tensor([1.0, 2.0]), torch.tensor([0, 3], dtype=torch.int32)]
    b = [torch.tensor([5.0, -1.0]), torch.tensor([3, 1], dtype=torch.int32)]
    assert comp.aggregate([a, b], ctx).tolist() == [0.5, -0.5, 0.0, 3.5]


# ---- fp16 --------------------------------------------------------------------------------------
def test_fp16_divides_by_world_size_before_cast():
    comp = hvdcomp.get_compressor("fp16")
    x = torch.tensor([40000.0])
    with hvdcomp.compressors.simulated_world(2, 0):
        (wire,), ctx = comp.encode(x)
    assert wire.dtype == torch.float16 and wire.item() == 20000.0
    summed = wire + wire                      # what an fp16 allreduce-sum of two ranks holds
    assert torch.isfinite(summed).all()
    # stock Horovod (op=Average) divides the sum by 2; decode undoes the pre-division
    assert comp.decode([summed / 2], ctx).item() == 40000.0
    # without pre-division the fp16 sum overflows
    assert torch.isinf(x.half() + x.half()).all()


def test_fp16_keeps_dtype_and_shape():
    comp = hvdcomp.get_compressor("fp16")
    x = torch.randn(3, 4, dtype=torch.float64)
    _, out = roundtrip(comp, x)
    assert out.dtype == torch.float64 and out.shape == (3, 4)
    assert torch.allclose(out, x, rtol=1e-3, atol=1e-4)


# ---- error feedback ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:density=0.1", "threshold:threshold=0.8", "fp16:ef=true"])
def test_error_feedback_telescopes(spec):
    comp = hvdcomp.get_compressor(spec)
    assert isinstance(comp, hvdcomp.ErrorFeedback)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(12)]
    sent = torch.zeros(50, dtype=torch.float64)
    for grad in grads:
        _, out = roundtrip(comp, grad, name="layer.weight")
        sent += out
    total = torch.stack(grads).sum(0)
    assert torch.allclose(sent + comp.residuals["layer.weight"], total, rtol=0, atol=1e-12)


def test_error_feedback_state_roundtrip_and_reset():
    comp = hvdcomp.get_compressor("topk:density=0.2")
    roundtrip(comp, torch.arange(10.0), name="a")
    state = comp.state_dict()
    fresh = hvdcomp.get_compressor("topk:density=0.2")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.residuals["a"], comp.residuals["a"])
    x = torch.linspace(-1, 1, 10)
    assert torch.equal(roundtrip(fresh, x, "a")[1], roundtrip(comp, x, "a")[1])
    comp.reset()
    assert torch.count_nonzero(comp.residuals["a"]) == 0


def test_error_feedback_needs_a_name():
    comp = hvdcomp.get_compressor("topk:density=0.2")
    with pytest.raises(ValueError, match="named_parameters"):
        comp.encode(torch.ones(3), None)


# ---- registry and bad input ----------------------------------------------------------------------
def test_spec_string_equals_keywords():
    a = hvdcomp.get_compressor("topk:density=0.01")
    b = hvdcomp.get_compressor("topk", density=0.01)
    assert a.describe() == b.describe() == {"name": "topk", "density": 0.01, "ef": True}
    assert hvdcomp.parse_spec("topk:density=0.01,ef=false") == ("topk", {"density": 0.01, "ef": False})


def test_compressor_class_is_the_registered_class():
    from hvdcomp.compressors import compressor_class
    from hvdcomp.compressors.topk import TopKCompressor
    assert compressor_class("topk") is TopKCompressor
    assert type(hvdcomp.get_compressor("topk:density=0.01,ef=false")) is TopKCompressor
    with pytest.raises(ValueError, match="unknown compressor 'nosuch'; available: .*topk"):
        compressor_class("nosuch")


@pytest.mark.parametrize("spec,match", [
    ("nosuch", "unknown compressor 'nosuch'"),
    ("topk:density=0", r"density must be in \(0, 1\]"),
    ("topk:density=1.5", r"density must be in \(0, 1\]"),
    ("topk:density", "malformed argument"),
    ("topk:levels=3", r"unknown argument\(s\) \['levels'\]"),
    ("topk:ef=maybe", "ef must be True or False"),
    ("threshold:threshold=-1", "threshold must be > 0 and finite"),
    ("", "non-empty"),
    ("topk:density=0.1,density=0.2", "'density' is given twice"),   # (took 0.2 before)
    ("topk:density=0.1, density =0.1", "'density' is given twice"),
])
def test_bad_specs_raise_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        hvdcomp.get_compressor(spec)


def test_sparse_compressor_refused_by_horovod_api():
    with pytest.raises(TypeError, match="hvdcomp.DistributedOptimizer"):
        hvdcomp.get_compressor("topk:density=0.1,ef=false").compress(torch.ones(4))


def test_dense_compressor_horovod_api_roundtrip():
    comp = hvdcomp.get_compressor("none")
    t, ctx = comp.compress(torch.ones(2, 2))
    assert torch.equal(comp.decompress(t, ctx), torch.ones(2, 2))


def test_nominal_ratio_study_convention():
    comp = hvdcomp.get_compressor("topk:density=0.01")
    assert comp.nominal_ratio(4_444_800) == pytest.approx(50.0, rel=1e-4)
    assert hvdcomp.get_compressor("topk:density=0.001").nominal_ratio(10**6) == pytest.approx(500.0)


def test_duplicate_spec_keys_raise_in_every_front_end():
    """One parser for every spec: a key given twice is refused by get_compressor, the DDP hook's
    and the local-update modes' spec strings alike (each took the last value before)."""
    import hvdcomp.local
    with pytest.raises(ValueError, match="'density' is given twice"):
        hvdcomp.spec.resolve_compression("topk:density=0.1,density=0.2")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="'outer_lr' is given twice"):
        hvdcomp.local.from_spec("diloco:outer_lr=0.7,outer_lr=0.5", opt, local_steps=2)


def test_staging_opens_commits_and_rolls_back_once():
    """hvdcomp.step.Lifecycle, every front-end's lifecycle: a committed step's residual stays, a
    rolled-back one's goes, and a second commit or rollback does nothing."""
    from hvdcomp.step import Lifecycle
    comp = hvdcomp.get_compressor("topk:density=0.5")
    staging = Lifecycle(comp, "skip")
    g = torch.tensor([1.0, -3.0, 0.5, 2.0])
    staging.stage()
    comp.encode(g, "w")
    staging.commit()
    assert not staging.staged and torch.equal(comp.memory.committed["w"], torch.tensor([1.0, 0.0, 0.5, 0.0]))
    staging.commit()
    staging.stage()
    comp.encode(torch.zeros(4), "w")
    staging.rollback()
    staging.rollback()
    assert not staging.staged and torch.equal(comp.memory.committed["w"], torch.tensor([1.0, 0.0, 0.5, 0.0]))
