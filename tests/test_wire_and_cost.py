"""Sparse wire coding (fp16 values, compact indices, dense fallback), buckets and the α-β model."""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.comm.allgatherv import _split, _stage
from hvdcomp.comm.costmodel import CostModel, fit_alpha_beta, measure_cost_model
from hvdcomp.compressors.sparse import compact_index_bytes
from hvdcomp.plan import make_buckets, step_collectives
from hvdcomp import get_compressor


@pytest.mark.parametrize("n,b", [(1, 1), (256, 1), (257, 2), (65536, 2), (65537, 3), (2**24, 3),
                                 (2**24 + 1, 4)])
def test_compact_index_bytes(n, b):
    assert compact_index_bytes(n) == b  # n-1 must fit in b bytes: 255, 65535, 2^24-1


@pytest.mark.parametrize("n", [200, 70000, 17_000_000])
def test_compact_indices_roundtrip(n):
    comp = hvdcomp.get_compressor(f"topk:density={min(1.0, 50 / n)},ef=false,index=compact")
    x = torch.zeros(n)
    pos = torch.tensor([0, 7, n // 3, n - 2, n - 1])
    x[pos] = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0]) * 100
    payload, ctx = comp.encode(x, "w")
    assert payload[1].dtype == torch.uint8
    assert payload[1].numel() == payload[0].numel() * compact_index_bytes(n)
    out = comp.decode(payload, ctx)
    assert torch.equal(out[pos], x[pos])  # the five large entries are among the kept ones
    assert torch.equal(out, torch.where(out != 0, x, out))


def test_fp16_values_saturate_and_error_feedback_keeps_rounding():
    comp = hvdcomp.get_compressor("topk:density=0.5,values=fp16")  # with error feedback
    x = torch.tensor([1e6, 1.0 + 2**-12, 0.0, 0.0])  # k = 2: 1e6 saturates, 1+2^-12 rounds to 1
    payload, ctx = comp.encode(x, "w")
    assert payload[0].dtype == torch.float16
    sent = comp.decode(payload, ctx)
    assert sent.tolist() == [65504.0, 1.0, 0.0, 0.0]
    comp.commit()
    # residual = what was not sent: (1e6 - 65504, 2^-12, 0, 0), computed by hand
    assert torch.allclose(comp.residuals["w"], torch.tensor([1e6 - 65504.0, 2**-12, 0.0, 0.0]))


def test_dense_fallback_sends_same_vector():
    comp = hvdcomp.get_compressor("topk:density=0.75,ef=false")  # k = 3 of 4: 24 B > 16 B dense
    x = torch.tensor([4.0, -1.0, 0.5, -3.0])
    payload, ctx = comp.encode(x, "w")
    assert payload[0].tolist() == [4.0, -1.0, 0.0, -3.0] and payload[1].numel() == 0
    assert comp.decode(payload, ctx).tolist() == [4.0, -1.0, 0.0, -3.0]
    # aggregate of one dense and one sparse payload: mean of the two decodes
    sparse = hvdcomp.get_compressor("topk:density=0.25,ef=false")
    p2, _ = sparse.encode(torch.tensor([0.0, 0.0, 0.0, 8.0]), "w")
    assert comp.aggregate([payload, p2], ctx).tolist() == [2.0, -0.5, 0.0, 2.5]
    assert comp.payload_bytes(4, 3) == 16 and comp.payload_bytes(4, 1) == 8


def test_wire_options_validated():
    with pytest.raises(ValueError, match="values must be one of"):
        hvdcomp.get_compressor("topk:values=int8")
    with pytest.raises(ValueError, match="index must be one of"):
        hvdcomp.get_compressor("dgc:index=zip")
    with pytest.raises(ValueError, match="not a sparsifier"):
        hvdcomp.get_compressor("qsgd:values=fp16")


def test_expected_payload_bytes():
    n = 10_000
    assert hvdcomp.get_compressor("topk:density=0.01").expected_payload_bytes(n) == 100 * 8
    assert hvdcomp.get_compressor("topk:density=0.01,values=fp16,index=compact").expected_payload_bytes(n) == 100 * 4
    assert hvdcomp.get_compressor("dgc:density=0.001").expected_payload_bytes(n) == 10 * 8
    assert hvdcomp.get_compressor("threshold").expected_payload_bytes(n) is None
    assert hvdcomp.get_compressor("fp16").expected_payload_bytes(n) == 2 * n


def test_make_buckets():
    assert make_buckets([10, 10, 10, 30, 5], 25) == [[0, 1], [2], [3], [4]]
    assert make_buckets([10, 10], 100) == [[0, 1]]
    assert make_buckets([], 10) == []


def test_stage_and_split_roundtrip_mixed_dtypes():
    payload = [torch.tensor([1.5, -2.0], dtype=torch.float16), torch.tensor([3], dtype=torch.uint8),
               torch.tensor([7, 8], dtype=torch.int32), torch.tensor([0.25])]
    buf, ready = _stage(payload)
    assert ready is None and buf.nbytes == 4 + 1 + 8 + 4
    two = np.concatenate([buf, buf])  # two "ranks" with the same payload
    counts = np.array([[2, 1, 2, 1], [2, 1, 2, 1]])
    out = _split(torch.from_numpy(two), counts, [t.dtype for t in payload], torch.device("cpu"))
    for rank in out:
        for a, b in zip(rank, payload):
            assert a.dtype == b.dtype and torch.equal(a, b)  # misaligned int32 piece copied


def test_cost_model_closed_forms():
    m = CostModel(alpha=1e-5, beta=1e-8)
    assert m.allreduce(1000, 4) == pytest.approx(6e-5 + 1.5 * 1000 * 1e-8)
    assert m.allgather(100, 4) == pytest.approx(3 * (2e-5 + 100 * 1e-8))
    assert m.allreduce(10**9, 1) == 0.0
    # bandwidth-bound: sparse 8k bytes vs dense 4n: gather iff k < n/p
    bw = CostModel(0.0, 1e-9)
    assert bw.choose(8 * 9, 4 * 100, 10) == "allgather" and bw.choose(8 * 11, 4 * 100, 10) == "allreduce"
    with pytest.raises(ValueError, match="beta"):
        CostModel(0.0, -1.0)


def test_fit_alpha_beta_recovers_parameters():
    alpha, beta = 5e-5, 2e-9
    samples = [(p - 1, (p - 1) * m, (p - 1) * (alpha + m * beta)) for p in (2, 4) for m in (8, 1e4, 1e6)]
    fit = fit_alpha_beta(samples)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6) and fit.beta == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="two"):
        fit_alpha_beta(samples[:1])


def test_measure_cost_model_with_a_simulated_link():
    clock = {"t": 0.0}
    alpha, beta, p = 1e-4, 1e-8, 4

    def fake_gather(nbytes):  # a ring allgather on a perfect link, on a fake clock
        clock["t"] += (p - 1) * (alpha + nbytes * beta)

    import hvdcomp.comm.costmodel as cm
    real = cm.time.perf_counter
    cm.time.perf_counter = lambda: clock["t"]
    try:
        model = measure_cost_model(fake_gather, p, agree=lambda v: v)
    finally:
        cm.time.perf_counter = real
    assert model.alpha == pytest.approx(alpha, rel=1e-6) and model.beta == pytest.approx(beta, rel=1e-6)
    assert math.isfinite(model.allreduce(1e6, 1024))


def test_dgc_fp16_values_keep_rounding_error_in_accumulation():
    comp = hvdcomp.get_compressor("dgc:density=0.25,momentum=0,values=fp16,index=compact")
    x = torch.tensor([1.0 + 2**-12, 0.5, 0.0, 0.0])  # k = 1: the first entry, sent as fp16 1.0
    payload, ctx = comp.encode(x, "w")
    comp.commit()
    assert payload[0].dtype == torch.float16 and payload[1].dtype == torch.uint8
    assert comp.decode(payload, ctx).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert comp.v["w"].tolist() == [2**-12, 0.5, 0.0, 0.0]  # unsent and rounding error stay
    assert comp.describe()["values"] == "fp16" and comp.describe()["index"] == "compact"


def test_int2_values_by_hand():
    """values=int2 (SparseLoCo's 2-bit values): s = max |v| = 3, levels (−3, −1, 1, 3); 0.4 → 1,
    2.1 → 3, −0.1 → −1 (nearest). Bytes: 4 (scale) + ⌈7/4⌉ + 7 indices (4 bytes each, or 1
    compact); the error feedback keeps v − level exactly where float32 holds it."""
    x = torch.tensor([3.0, -3.0, 1.0, -1.0, 0.4, 2.1, -0.1])
    for index, nbytes in (("int", 4 + 2 + 28), ("compact", 4 + 2 + 7)):
        comp = hvdcomp.get_compressor(f"topk:density=1.0,ef=false,values=int2,index={index}")
        payload, ctx = comp.encode(x, "w")
        assert payload[0].dtype == torch.uint8 and sum(t.numel() * t.element_size() for t in payload) == nbytes
        assert comp.payload_bytes(7, 7) == nbytes
        assert comp.decode(payload, ctx).tolist() == [3.0, -3.0, 1.0, -1.0, 1.0, 3.0, -1.0]
    ef = hvdcomp.get_compressor("topk:density=1.0,values=int2")
    payload, ctx = ef.encode(x, "w")
    ef.commit()
    assert torch.equal(ef.residuals["w"], x - torch.tensor([3.0, -3.0, 1.0, -1.0, 1.0, 3.0, -1.0]))
    assert hvdcomp.get_compressor("topk:density=0.01,values=int2,index=compact").expected_payload_bytes(10_000) == \
        4 + 25 + 100 * 2


def test_int2_aggregate_is_the_mean_of_each_ranks_scale_and_loud_when_non_finite():
    comp = hvdcomp.get_compressor("topk:density=0.5,ef=false,values=int2")
    a, ctx = comp.encode(torch.tensor([3.0, 2.0, 0.0, 0.0]), "w")   # s = 3: (3, 1): 2 → 1 (2.5 ties to code 2)
    b, _ = comp.encode(torch.tensor([0.0, 0.0, -6.0, 1.0]), "w")    # s = 6: (−6, 2)
    assert comp.decode(a, ctx).tolist() == [3.0, 1.0, 0.0, 0.0]
    assert comp.aggregate([a, b], ctx).tolist() == [1.5, 0.5, -3.0, 1.0]
    bad, _ = comp.encode(torch.tensor([float("inf"), 1.0, 0.0, 0.0]), "w")
    assert not torch.isfinite(comp.decode(bad, ctx)[:2]).any()       # never a finite wrong value
    # top-2 of (−5, 0, 0, 0) keeps a zero; no level holds 0, so it is not sent and decodes as 0
    sparse, _ = comp.encode(torch.tensor([-5.0, 0.0, 0.0, 0.0]), "w")
    assert sparse[1].numel() == 1 and comp.decode(sparse, ctx).tolist() == [-5.0, 0.0, 0.0, 0.0]


def test_dgc_int2_values_keep_rounding_error_in_accumulation():
    comp = hvdcomp.get_compressor("dgc:density=0.5,momentum=0,values=int2")
    payload, ctx = comp.encode(torch.tensor([3.0, 2.0, 0.1, 0.0]), "w")  # k = 2: 3 → 3, 2 → 1
    comp.commit()
    assert comp.decode(payload, ctx).tolist() == [3.0, 1.0, 0.0, 0.0]
    assert torch.allclose(comp.v["w"], torch.tensor([0.0, 1.0, 0.1, 0.0]))  # unsent and rounding error stay


def test_error_feedback_reuses_two_buffers_and_survives_rollback():
    """Residual e_t = (g_t + e_{t-1}) - sent_t (dense reference, by hand with top-1 of 4), with the
    residual memory alternating between two CPU buffers and a rolled-back step leaving e intact."""
    comp = hvdcomp.get_compressor("topk:density=0.25")
    grads = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 0.5, 0.5, -9.0]),
             torch.tensor([1.0, 1.0, 1.0, 1.0])]
    ref = torch.zeros(4)
    ptrs = []
    for t, g in enumerate(grads):
        comp.begin_step()
        payload, ctx = comp.encode(g, "w")
        if t == 1:  # skipped step (e.g. NaN elsewhere): residual must stay as after step 0
            comp.rollback()
            assert torch.equal(comp.residuals["w"], ref)
            continue
        comp.commit()
        p = g + ref
        sent = torch.zeros(4)
        i = int(p.abs().argmax())
        sent[i] = p[i]
        ref = p - sent
        assert torch.equal(comp.decode(payload, ctx), sent) and torch.equal(comp.residuals["w"], ref)
        assert torch.equal(g, grads[t])  # the caller's gradient is never modified
        ptrs.append(comp.residuals["w"].data_ptr())
    # step 0 -> fresh buffer A; rolled-back step 1 wrote into the spare; step 2 reuses memory
    assert len(set(ptrs)) == 2 or ptrs[1] != ptrs[0]


def test_aggregate_into_writes_in_place():
    comp = hvdcomp.get_compressor("topk:density=0.5,ef=false")
    a, ctx = comp.encode(torch.tensor([[3.0, 0.0], [0.0, -1.0]]), "w")
    b, _ = comp.encode(torch.tensor([[0.0, 2.0], [0.0, 5.0]]), "w")
    out = torch.full((2, 2), 99.0)
    ptr = out.data_ptr()
    comp.aggregate_into(out, [a, b], ctx)
    assert out.data_ptr() == ptr and out.tolist() == [[1.5, 1.0], [0.0, 2.0]]
    assert comp.aggregate([a, b], ctx).tolist() == [[1.5, 1.0], [0.0, 2.0]]


# ---- transport="auto": the collectives of a step and the choice among transports ----------------
def test_step_collectives_in_closed_form():
    numels, p = [1000, 10], 64
    k = [10, 1]                                        # ceil(0.01 · n) per gradient; whole model: 11
    assert step_collectives(get_compressor("topk:density=0.01"), numels, p, 8000) == [("allgather", 8.0 * 11, 2)]
    assert step_collectives(get_compressor("topk:density=0.01"), numels, p, 4000) == [("allgather", 8.0 * sum(k), 4)]
    assert step_collectives(get_compressor("gtopk:density=0.01"), numels, p, 8000) == [("sparse-allreduce", 88.0, 1)]
    assert step_collectives(get_compressor("cltk:density=0.01"), numels, p, 8000) == [("broadcast", 44.0, 1),
                                                                                     ("allreduce", 44.0, 1)]
    # VAR-Topk: every rank's statistic first (p float32 by allreduce)
    assert step_collectives(get_compressor("cltk:density=0.01,leader=variance"), numels, p, 8000) == [
        ("allreduce", 4.0 * p, 1), ("broadcast", 44.0, 1), ("allreduce", 44.0, 1)]
    q = get_compressor("qsgd:levels=4")
    whole = q.expected_payload_bytes(1010)
    assert step_collectives(get_compressor("twophase:base=qsgd,levels=4"), numels, p, 8000) == [
        ("alltoall", float(whole), 2), ("allgather", whole / p, 2)]
    assert step_collectives(get_compressor("none"), numels, p, 8000) == [("allreduce", 4.0 * 1010, 1)]
    assert step_collectives(get_compressor("powersgd"), numels, p, 8000) is None   # data-dependent


def test_choose_transport_hand_worked():
    from hvdcomp.plan import choose_transport, transport_candidates

    numels = [1000, 10]
    # bandwidth only (beta 1 ns/B), 64 ranks: top-k as the optimizer routes it, the 1000-element
    # gradient allgathered (63·80 B) and the 10-element one decoded and allreduced (its 8 B payload
    # would cost 63·8 B, its 40 B dense tensor 2·63/64·40 B); gtopk 6 rounds · 88 B = 528 B;
    # cltk broadcast 6 · 44 B + allreduce 2·63/64 · 44 B = 350.6 B -> cltk
    chosen, predicted = choose_transport(get_compressor("topk:density=0.01"), CostModel(0.0, 1e-9), 64, numels, 8000)
    assert chosen.name == "cltk"
    assert predicted == pytest.approx({"topk (allgather)": (63 * 80 + 2 * 63 / 64 * 40) * 1e-9,
                                       "gtopk (sparse-allreduce)": 528e-9,
                                       "cltk (broadcast+allreduce)": (6 * 44 + 2 * 63 / 64 * 44) * 1e-9})
    # latency only (alpha 1 ms): top-k 2·63 messages, gtopk 6, cltk 6 + 126 -> gtopk
    assert choose_transport(get_compressor("topk:density=0.01"), CostModel(1e-3, 0.0), 64, numels, 8000)[0].name == "gtopk"
    # two ranks, bandwidth only: all three move 88 B -> the method asked for stays
    assert choose_transport(get_compressor("topk:density=0.01"), CostModel(0.0, 1e-9), 2, numels, 8000)[0].name == "topk"
    # no candidates for top-k without error feedback (gtopk and cltk keep residuals) or DGC
    assert [c.name for c in transport_candidates(get_compressor("topk:density=0.01,ef=false"))] == ["topk"]
    assert [c.name for c in transport_candidates(get_compressor("dgc:density=0.01"))] == ["dgc"]
    cands = transport_candidates(get_compressor("qsgd:levels=16,block=256"))
    assert [c.name for c in cands] == ["qsgd", "twophase"]
    assert cands[1].describe()["base"] == get_compressor("qsgd:levels=16,block=256,ef=false").describe()


def test_step_collectives_follow_the_optimizer_routing_and_skip_empty_gradients():
    # density 0.5: 500 entries of 8 B = 4000 B per rank against a 4000 B dense tensor; with beta
    # only, allgather (p-1)·4000 > allreduce 2(p-1)/p·4000: the optimizer would decode and allreduce
    top = get_compressor("topk:density=0.5")
    assert step_collectives(top, [1000], 8, 8000, CostModel(0.0, 1e-9)) == [("allreduce", 4000.0, 1)]
    assert step_collectives(top, [1000], 8, 8000) == [("allgather", 4000.0, 2)]   # no cost model: as sent
    q = get_compressor("qsgd:levels=4")
    assert step_collectives(q, [1000, 0, 1000], 2, 8000) == step_collectives(q, [1000, 1000], 2, 8000)


def test_choose_transport_prices_horovod_waits_and_needs_point_to_point():
    from hvdcomp.plan import choose_transport, predict_step_seconds

    numels, cm = [1000, 10], CostModel(0.0, 1e-9)
    cltk = get_compressor("cltk:density=0.01")
    base = predict_step_seconds(cltk, cm, 64, numels, 8000)
    # broadcast + allreduce through Horovod: two calls, each waiting 5 ms more
    assert predict_step_seconds(cltk, cm, 64, numels, 8000, horovod_latency=5e-3) == pytest.approx(base + 10e-3)
    # with that wait, gtopk (mpi4py) beats cltk at 64 ranks (528 B·beta vs 350.6 B·beta + 10 ms)
    assert choose_transport(get_compressor("topk:density=0.01"), cm, 64, numels, 8000,
                            horovod_latency=5e-3)[0].name == "gtopk"
    # without MPI point-to-point, gtopk and twophase are not candidates
    chosen, predicted = choose_transport(get_compressor("topk:density=0.01"), cm, 64, numels, 8000,
                                         point_to_point=False)
    assert chosen.name == "cltk" and "gtopk (sparse-allreduce)" not in predicted
    assert choose_transport(get_compressor("qsgd:levels=4"), cm, 64, numels, 8000,
                            point_to_point=False)[1] == {"qsgd (allgather)": pytest.approx(
                                predict_step_seconds(get_compressor("qsgd:levels=4"), cm, 64, numels, 8000))}
