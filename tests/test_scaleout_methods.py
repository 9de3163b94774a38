"""The scale-out methods — global top-k's sparse allreduce (gTop-k), cyclic-leader top-k (CLT-k) and
the two-phase compressed allreduce of quantizers — with simulated ranks in threads of one process
(tests/simworld.py), against hand-worked examples and dense references."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcomp import get_compressor
from hvdcomp.comm.sparse_allreduce import global_topk, hierarchical_topk, merge_entries, select_largest
from tests.simworld import SimulatedRanks, ThreadNetwork, horovod_allreduce, run_ranks


def run_global_topk(inputs, k):
    """global_topk on every simulated rank; (results, network)."""
    net = ThreadNetwork(len(inputs))
    out = run_ranks(len(inputs), lambda r: global_topk(inputs[r][0], inputs[r][1], k, net.endpoint(r)))
    return out, net


def test_hand_worked_two_ranks():
    # rank 0 keeps {0: 3, 2: 2} of its three entries, rank 1 {1: 5, 3: -4}; the merge keeps the
    # two largest of {0: 3, 1: 5, 2: 2, 3: -4}: {1: 5, 3: -4}, which are rank 1's alone
    inputs = [(torch.tensor([0, 1, 2]), torch.tensor([3.0, -1.0, 2.0])),
              (torch.tensor([1, 3]), torch.tensor([5.0, -4.0]))]
    (r0, r1), _ = run_global_topk(inputs, 2)
    for idx, val, _ in (r0, r1):
        assert idx.tolist() == [1, 3] and val.tolist() == [5.0, -4.0]
    assert r0[2].tolist() == [] and r1[2].tolist() == [1, 3]


def test_hand_worked_three_ranks_fold():
    # p = 3: rank 2 folds into rank 0 ({5: 1 + 1 = 2, 7: 6}, keep 2: {5: 2, 7: 6}), which then
    # merges with rank 1 ({5: 4}): {5: 6, 7: 6}; every rank's entry at 5 and rank 2's at 7 count
    inputs = [(torch.tensor([5]), torch.tensor([1.0])),
              (torch.tensor([5]), torch.tensor([4.0])),
              (torch.tensor([5, 7]), torch.tensor([1.0, 6.0]))]
    out, _ = run_global_topk(inputs, 2)
    for idx, val, _ in out:
        assert idx.tolist() == [5, 7] and val.tolist() == [6.0, 6.0]
    assert [o[2].tolist() for o in out] == [[5], [5], [5, 7]]


def test_merge_is_symmetric_and_select_breaks_ties_by_position():
    a = (torch.tensor([4, 1]), torch.tensor([1.0, 2.0]))
    b = (torch.tensor([1, 9]), torch.tensor([0.5, -3.0]))
    idx, val = merge_entries(a, b)
    assert idx.tolist() == [1, 4, 9] and val.tolist() == [2.5, 1.0, -3.0]
    idx2, val2 = merge_entries(b, a)
    assert torch.equal(idx, idx2) and torch.equal(val, val2)
    idx, val = select_largest(torch.tensor([0, 1, 2, 3]), torch.tensor([2.0, -2.0, 0.0, 2.0]), 2)
    assert idx.tolist() == [0, 1]  # equal magnitudes: lower positions first; zeros never kept


@settings(max_examples=25, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 12, 16]), k=st.integers(1, 12),
       n=st.integers(1, 40), seed=st.integers(0, 2**16), empty=st.booleans(), same=st.booleans())
def test_global_topk_properties(size, k, n, seed, empty, same):
    """Identical results on every rank; ≤ k entries; each result value is exactly the sum of the
    entries the ranks report as kept (integer-valued floats: exact sums); per-rank bytes within
    (log2(p) + 1)·k entries; with k ≥ every distinct position, the dense sum exactly."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for r in range(size):
        m = 0 if (empty and r % 2 == 1) else int(torch.randint(0, n + 1, (1,), generator=gen))
        idx = torch.randperm(n, generator=gen)[:m]
        val = torch.randint(-8, 9, (m,), generator=gen).float()
        inputs.append((idx, val))
    if same:
        inputs = [inputs[0]] * size
    out, net = run_global_topk(inputs, k)
    first = out[0]
    for idx, val, kept in out:
        assert torch.equal(idx, first[0]) and torch.equal(val, first[1])
    assert first[0].numel() <= k and bool((first[0][1:] > first[0][:-1]).all())
    expect = {}
    for r, (idx, val, kept) in enumerate(out):
        mine = dict(zip(inputs[r][0].tolist(), inputs[r][1].tolist()))
        assert set(kept.tolist()) <= set(mine) and set(kept.tolist()) <= set(idx.tolist())
        for i in kept.tolist():
            expect[i] = expect.get(i, 0.0) + mine[i]
    got = dict(zip(first[0].tolist(), first[1].tolist()))
    assert {i: v for i, v in expect.items()} == {i: v for i, v in got.items()}
    rounds = (size.bit_length() - 1) + 1
    assert max(net.sent) <= rounds * k * 12 + k * 8  # int64 index + float32 value; the fold's positions
    dense = torch.zeros(n)
    for idx, val in inputs:
        dense.index_add_(0, idx.long(), val)
    if k >= n:
        full = torch.zeros(n)
        full[first[0]] = first[1]
        assert torch.equal(full, dense)


@settings(max_examples=20, deadline=None)
@given(layout=st.sampled_from([(2, 4), (4, 2), (3, 3), (2, 3), (1, 5), (5, 1)]), k=st.integers(1, 10),
       seed=st.integers(0, 2**16), blocked=st.booleans())
def test_hierarchical_topk(layout, k, seed, blocked):
    """nodes × ranks per node, placed in blocks or round robin: identical results with ≤ k entries,
    each value exactly the sum of the entries the ranks report as kept, and between nodes only the
    leaders (each node's lowest rank) send."""
    nodes_n, per = layout
    size = nodes_n * per
    nodes = [r // per for r in range(size)] if blocked else [r % nodes_n for r in range(size)]
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for r in range(size):
        m = int(torch.randint(0, 20, (1,), generator=gen))
        inputs.append((torch.randperm(30, generator=gen)[:m], torch.randint(-8, 9, (m,), generator=gen).float()))
    net = ThreadNetwork(size, nodes)
    out = run_ranks(size, lambda r: hierarchical_topk(inputs[r][0], inputs[r][1], k, net.endpoint(r), nodes))
    first = out[0]
    assert all(torch.equal(o[0], first[0]) and torch.equal(o[1], first[1]) for o in out)
    assert first[0].numel() <= k
    expect = {}
    for r, (_, _, kept) in enumerate(out):
        mine = dict(zip(inputs[r][0].tolist(), inputs[r][1].tolist()))
        for i in kept.tolist():
            expect[i] = expect.get(i, 0.0) + mine[i]
    assert expect == dict(zip(first[0].tolist(), first[1].tolist()))
    leaders = {min(r for r in range(size) if nodes[r] == n) for n in set(nodes)}
    for (src, dst), nbytes in net.pair_bytes.items():
        if nodes[src] != nodes[dst]:
            assert src in leaders and dst in leaders, (src, dst, nbytes)


def grads_for(size, step, shapes, scale=1.0):
    g = torch.Generator().manual_seed(100 * step + 7)
    return [[(f"w{j}", scale * torch.randn(*s, generator=g)) for j, s in enumerate(shapes)] for _ in range(size)]


def compensated(sim, grads):
    """Every rank's flat gradient plus its committed residual (what the method compresses)."""
    return [torch.cat([(g + c.residual.get(name, torch.zeros_like(g))).reshape(-1) for name, g in named])
            for c, named in zip(sim.comps, grads)]


def committed_step(sim, grads, nodes=None):
    """One step on every simulated rank, committed (as the optimizer's step() does); returns the
    flat result of rank 0 after checking that every rank got the same bits."""
    for c in sim.comps:
        c.begin_step()
    outs = sim.reduce_batch(grads, nodes)
    for c in sim.comps:
        c.commit()
    flat = [torch.cat([t.reshape(-1) for t in o]) for o in outs]
    for f in flat[1:]:
        assert torch.equal(f, flat[0])
    return flat[0]


@pytest.mark.parametrize("spec", ["gtopk:density=0.05", "cltk:density=0.05", "gtopk:density=0.05,hierarchical=true"])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_sparse_error_feedback_conserves_mass(spec, size):
    """Over 4 steps: size·mean + Σ new residuals = Σ (gradient + old residual), every rank gets the
    same result with ≤ k non-zeros (hierarchical: two ranks per node, the last alone if odd)."""
    shapes = [(7, 9), (9,), (40,)]
    n = sum(math.prod(s) for s in shapes)
    k = math.ceil(0.05 * n)
    sim = SimulatedRanks(lambda: get_compressor(spec), size)
    for step in range(4):
        grads = grads_for(size, step, shapes)
        before = compensated(sim, grads)
        mean = committed_step(sim, grads, [r // 2 for r in range(size)] if "hierarchical" in spec else None)
        assert int((mean != 0).sum()) <= k
        after = sum(torch.cat([c.residual[name].reshape(-1) for name, _ in grads[0]]) for c in sim.comps)
        torch.testing.assert_close(size * mean + after, sum(before), rtol=1e-5, atol=1e-5)


def test_cltk_matches_dense_reference():
    """Step t: the leader (rank t mod p) picks its top-k positions; the result there is the mean
    of every rank's compensated values (Horovod's allreduce model), zero elsewhere."""
    size, shapes = 3, [(5, 6), (11,)]
    sim = SimulatedRanks(lambda: get_compressor("cltk:density=0.1"), size)
    n = 41
    k = math.ceil(0.1 * n)
    for step in range(4):
        grads = grads_for(size, step, shapes)
        acc = compensated(sim, grads)
        got = committed_step(sim, grads)
        leader = step % size
        idx = torch.topk(acc[leader].abs(), k).indices.sort().values
        ref = torch.zeros(n)
        ref[idx] = horovod_allreduce([a[idx] for a in acc])
        assert torch.equal(got, ref), step
        assert all(c.step == step + 1 for c in sim.comps)


def test_vartopk_leader_is_the_largest_smoothed_norm():
    """VAR-Topk (leader=variance), 3 ranks, window 2, α 0.5: the leader of a step is worked out
    by hand from each rank's gradient norms (weights 1/2 for this step's norm, 1/4 for the previous
    one's), the result is the dense mean of the compensated gradients at the leader's top-k
    positions, and sent + new residual = gradient + old residual on every rank."""
    size, shapes, n = 3, [(5, 6), (11,)], 41
    k = math.ceil(0.1 * n)
    sim = SimulatedRanks(lambda: get_compressor("cltk:density=0.1,leader=variance,window=2,smoothing=0.5"), size)
    # ‖g_r(t)‖ = norms[t][r] (unit random directions, scaled); smoothed s = (x_t/2 + x_{t-1}/4) / (3/4):
    # step 0 (one norm, s = x): 1, 3, 2 -> rank 1 (the cycle's leader would be rank 0)
    # step 1: (2.4/2 + 1/4)/.75 = 1.93, (1/2 + 3/4)/.75 = 1.67, (2/2 + 2/4)/.75 = 2 -> rank 2 (this step's norm
    #         alone would pick rank 0, the cycle rank 1)
    # step 2: (1/2 + 2.4/4)/.75 = 1.47, (2.5/2 + 1/4)/.75 = 2, (6/2 + 2/4)/.75 = 4.67 -> rank 2
    # step 3: (1/2 + 1/4)/.75 = 1, (4/2 + 2.5/4)/.75 = 3.5, (3/2 + 6/4)/.75 = 4 -> rank 2 (this step's norm: rank 1)
    norms = [(1.0, 3.0, 2.0), (2.4, 1.0, 2.0), (1.0, 2.5, 6.0), (1.0, 4.0, 3.0)]
    leaders = [1, 2, 2, 2]
    for step in range(4):
        g = torch.Generator().manual_seed(50 + step)
        grads = []
        for r in range(size):
            u = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
            length = math.sqrt(sum(float(t.square().sum()) for t in u))
            grads.append([(f"w{j}", (norms[step][r] / length * t).float()) for j, t in enumerate(u)])
        acc = compensated(sim, grads)
        got = committed_step(sim, grads)
        leader = leaders[step]
        idx = torch.topk(acc[leader].abs(), k).indices.sort().values
        ref = torch.zeros(n)
        ref[idx] = horovod_allreduce([a[idx] for a in acc])
        assert torch.equal(got, ref), step
        cyclic = torch.topk(acc[step % size].abs(), k).indices.sort().values
        assert step % size == leader or not torch.equal(cyclic, idx)  # (the leader is observable)
        for r, c in enumerate(sim.comps):
            sent = torch.zeros(n)
            sent[idx] = acc[r][idx]
            resid = torch.cat([c.residual[name].reshape(-1) for name, _ in grads[0]])
            assert torch.equal(sent + resid, acc[r]), (step, r)
    assert [len(c.norms["window"]) for c in sim.comps] == [2, 2, 2]
    state = sim.comps[2].state_dict()
    fresh = get_compressor("cltk:density=0.1,leader=variance,window=2,smoothing=0.5")
    fresh.load_state_dict(state)
    assert fresh.norms["window"] == pytest.approx((6.0, 3.0)) and fresh.step == 4
    fresh.rescale_state(0.5)  # an AMP loss scale halved: the norms are in gradient units too
    assert fresh.norms["window"] == pytest.approx((3.0, 1.5))


def test_gtopk_full_density_is_the_dense_mean():
    size, shapes = 4, [(6, 3), (5,)]
    sim = SimulatedRanks(lambda: get_compressor("gtopk:density=1"), size)
    grads = grads_for(size, 0, shapes)
    outs = sim.reduce_batch(grads)
    for j in range(len(shapes)):
        dense = sum(grads[r][j][1] for r in range(size)) / size
        torch.testing.assert_close(outs[0][j], dense, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(sim.comps[r].residual[f"w{j}"], torch.zeros(shapes[j])) for r in range(size))


@pytest.mark.parametrize("spec", ["gtopk", "cltk"])
def test_zero_and_extreme_gradients(spec):
    """All-zero gradients give zeros (and send nothing for gtopk); float16 gradients of 6e4 on
    every rank are not overflowed by the float32 accumulation (saturated to float16's range)."""
    size = 4
    sim = SimulatedRanks(lambda: get_compressor(f"{spec}:density=0.5"), size)
    zeros = [[("w", torch.zeros(6))] for _ in range(size)]
    outs = sim.reduce_batch(zeros)
    assert all(torch.equal(o[0], torch.zeros(6)) for o in outs)
    big = [[("w", torch.full((6,), 6e4, dtype=torch.float16))] for _ in range(size)]
    sim = SimulatedRanks(lambda: get_compressor(f"{spec}:density=1"), size)
    outs = sim.reduce_batch(big)
    assert outs[0][0].dtype == torch.float16 and torch.equal(outs[0][0], big[0][0][1])


def scaled_sign(x):
    """1-bit Adam's quantizer, written independently: mean |x| times sign(x), sign(0) = +1."""
    return x.abs().mean() * torch.where(x >= 0, 1.0, -1.0) if x.numel() else x


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_twophase_matches_a_dense_reference_and_conserves_mass(size):
    """Three steps of twophase:base=efsignsgd against the algorithm written out with dense tensors:
    per chunk j, m_j = mean_r Q(acc_r[j]); result[j] = Q(m_j + s_j); s_j = m_j + s_j − result[j];
    worker residual acc_r − Q(acc_r) per chunk. Every rank gets the same result."""
    shapes = [(5, 4), (9,)]
    n = 29
    sim = SimulatedRanks(lambda: get_compressor("twophase"), size)
    bounds = [j * n // size for j in range(size + 1)]
    worker = [torch.zeros(n) for _ in range(size)]
    server = [torch.zeros(bounds[j + 1] - bounds[j]) for j in range(size)]
    for step in range(3):
        grads = grads_for(size, step, shapes)
        acc = [torch.cat([g.reshape(-1) for _, g in grads[r]]) + worker[r] for r in range(size)]
        ref = torch.zeros(n)
        for j in range(size):
            lo, hi = bounds[j], bounds[j + 1]
            m = sum(scaled_sign(a[lo:hi]) for a in acc) / size
            ref[lo:hi] = scaled_sign(m + server[j])
            server[j] = m + server[j] - ref[lo:hi]
        for r in range(size):
            worker[r] = torch.cat([acc[r][bounds[j]:bounds[j + 1]] - scaled_sign(acc[r][bounds[j]:bounds[j + 1]])
                                   for j in range(size)])
        got = committed_step(sim, grads)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for r, c in enumerate(sim.comps):
            mine = torch.cat([c.residual[name].reshape(-1) for name, _ in grads[0]])
            torch.testing.assert_close(mine, worker[r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c.server["cpu"], server[r], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", ["qsgd:levels=4,block=8", "terngrad", "efsignsgd"])
def test_twophase_bytes_do_not_grow_with_ranks(base):
    """Per rank: 2·(p−1)/p of the whole model's payload B plus size headers, whatever p is (an
    allgather of the quantizer would move (p−1)·B)."""
    name, _, args = base.partition(":")
    spec = f"twophase:base={name}" + (f",{args}" if args else "")
    n = 4000
    for size in (2, 4, 8):
        sim = SimulatedRanks(lambda: get_compressor(spec), size)
        sim.reduce_batch([[("w", torch.randn(n))] for _ in range(size)])
        quant = get_compressor(name + (":" + args if args else ""), ef=False)
        whole = sum(t.numel() * t.element_size() for t in quant.encode(torch.randn(n), "w")[0])
        sent = sim.last_network.sent
        headers = 2 * (size - 1) * 64  # each packed message: an int64 header of 1 + 2·tensors words
        assert max(sent) <= 2 * (size - 1) / size * whole + headers + 64 * size, (size, sent, whole)
        assert min(sent) >= 2 * (size - 1) / size * whole * 0.9, (size, sent, whole)


@pytest.mark.parametrize("spec", ["gtopk:density=0.1", "cltk:density=0.1", "twophase:base=qsgd,levels=4"])
def test_state_round_trip_and_errors(spec):
    comp = get_compressor(spec)
    with pytest.raises(TypeError, match="reduce_batch"):
        comp.encode(torch.ones(3), "w")
    if "density" in spec:
        with pytest.raises(ValueError, match="density"):
            get_compressor(spec.replace("0.1", "0"))
    with pytest.raises(ValueError, match="built in"):
        get_compressor(spec + ",ef=true")
    sim = SimulatedRanks(lambda: get_compressor(spec), 2)
    sim.reduce_batch(grads_for(2, 0, [(4, 4)]))
    state = sim.comps[1].state_dict()
    fresh = get_compressor(spec)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.residual["w0"], sim.comps[1].residual["w0"])
    with pytest.raises(ValueError, match="residual"):
        fresh.load_state_dict({"bogus": 1})
