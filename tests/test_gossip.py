"""Decentralized gossip in one process: topologies, mean preservation, consensus rates against the
spectral gap, PowerGossip's shared vectors and exact rank-1 removal, bad input.

Ranks are simulated: one method object per rank (its compressor built under ``simulated_world``),
payloads handed from rank to rank in a loop, as the neighbour transport would deliver them.
"""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.compressors import simulated_world
from hvdcomp.gossip import (ChocoGossip, PowerGossip, Topology, complete, exponential, from_adjacency,
                            from_weights, make_method, make_topology, ring, torus)
from hvdcomp.gossip.base import compressor_kind, gossip_compressor


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors here are tiny: a thread pool per kernel call only costs (10 ms a call on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- a simulated network -------------------------------------------------------------------------
class Network:
    """``n`` ranks of one method on ``topology``; ``params[r]`` is rank r's list of tensors."""

    def __init__(self, method, topology, params, names=None, **kwargs):
        self.n = topology.size
        self.params = params
        names = names or [f"p{k}" for k in range(len(params[0]))]
        self.methods = []
        for r in range(self.n):
            with simulated_world(self.n, r):
                self.methods.append(make_method(method, params[r], names, topology, r, **kwargs))
        if self.methods[0].needs_setup:
            for r, m in enumerate(self.methods):
                m.setup(params[r], {j: [p.reshape(-1).clone() for p in params[j]]
                                    for j in topology.all_neighbors(r)})

    def step(self, previous=None):
        """One gossip step (no gradient: ``previous`` is the current model where a method needs it)."""
        if previous is None and self.methods[0].needs_previous:
            previous = [[p.clone() for p in ps] for ps in self.params]
        for rnd in range(self.methods[0].rounds):
            outs = []
            for r, m in enumerate(self.methods):
                with simulated_world(self.n, r):
                    outs.append(m.outgoing(self.params[r], None if previous is None else previous[r], rnd))
            for r, m in enumerate(self.methods):
                got = {j: outs[j][r] if isinstance(outs[j], dict) else outs[j] for j in m.peers()}
                with simulated_world(self.n, r):
                    m.incoming(self.params[r], got, rnd)

    def stacked(self):
        """(n, total elements) float64."""
        return torch.stack([torch.cat([p.reshape(-1).double() for p in ps]) for ps in self.params])

    def distance(self):
        """Consensus distance Σ_i ‖x_i − x̄‖²."""
        x = self.stacked()
        return float(((x - x.mean(0)) ** 2).sum())


def random_models(n, shapes, seed=0, dtype=torch.float32, zero_mean=False):
    g = torch.Generator().manual_seed(seed)
    models = [[torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(n)]
    if zero_mean:
        for k in range(len(shapes)):
            mean = sum(m[k] for m in models) / n
            for m in models:
                m[k] -= mean
    return [[t.to(dtype) for t in m] for m in models]


# ---- topologies ---------------------------------------------------------------------------------
def test_ring_of_8_weights_and_spectral_gap_closed_form():
    topo = ring(8)
    w = topo.matrix()
    for i in range(8):
        assert topo.neighbors(i) == tuple(sorted({(i - 1) % 8, (i + 1) % 8}))
        assert w[i, i] == pytest.approx(1 / 3, abs=1e-15)
        assert w[i, (i + 1) % 8] == w[i, (i - 1) % 8] == 1 / 3
    # eigenvalues 1/3 + 2/3 cos(2πk/8): λ2 = 1/3 + 2/3 cos(π/4), λ_min = −1/3
    assert topo.spectral_gap == pytest.approx(1 - (1 / 3 + 2 / 3 * math.cos(math.pi / 4)), abs=1e-12)
    assert ring(2).neighbors(0) == (1,) and ring(2).matrix().tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert ring(1).neighbors(0) == () and ring(1).spectral_gap == 1.0
    assert complete(5).spectral_gap == pytest.approx(1.0)


def test_metropolis_weights_on_a_path_hand_worked():
    topo = from_adjacency([[1], [0, 2], [1, 3], [2]])  # degrees 1, 2, 2, 1
    third = 1 / 3
    expected = [[1 - third, third, 0, 0], [third, 1 - 2 * third, third, 0],
                [0, third, 1 - 2 * third, third], [0, 0, third, 1 - third]]
    assert np.allclose(topo.matrix(), expected, atol=1e-15, rtol=0)
    assert [topo.degree(i) for i in range(4)] == [1, 2, 2, 1]


def test_torus_shapes_and_degrees():
    assert torus(9).name == "torus 3x3" and {torus(9).degree(i) for i in range(9)} == {4}
    assert np.allclose(torus(9).matrix()[0][[0, 1, 2, 3, 6]], 0.2)
    t8 = torus(8)  # 2 x 4: the two vertical neighbours are one rank
    assert t8.name == "torus 2x4" and {t8.degree(i) for i in range(8)} == {3}
    assert t8.neighbors(0) == (1, 3, 4)
    assert torus(7).neighbors(0) == ring(7).neighbors(0)  # prime: 1 x 7, a ring
    assert make_topology("torus:4x2", 8).name == "torus 4x2"


def test_exponential_graph_pairs_and_exact_average_per_period():
    topo = exponential(8)
    assert topo.period == 3 and topo.time_varying
    for t in range(6):
        for i in range(8):
            assert topo.neighbors(i, t) == (i ^ (1 << (t % 3)),)
    prod = topo.matrix(2) @ topo.matrix(1) @ topo.matrix(0)
    assert np.allclose(prod, np.full((8, 8), 1 / 8), atol=1e-15, rtol=0)
    assert topo.spectral_gap == pytest.approx(1.0)
    assert topo.all_neighbors(0) == (1, 2, 4)


TOPOLOGIES = [ring(1), ring(2), ring(3), ring(8), torus(8), torus(9), torus(12), complete(4), complete(7),
              exponential(2), exponential(8), exponential(16),
              from_adjacency([[1, 2, 3], [0], [0], [0]]),                   # a star
              from_adjacency([[1], [0, 2], [1, 3], [2]], weights="metropolis")]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"{t.name}-{t.size}")
def test_uncompressed_gossip_keeps_the_mean_float64(topo):
    g = torch.Generator().manual_seed(topo.size)
    x = torch.randn(topo.size, 50, generator=g, dtype=torch.float64).numpy() * 10
    for t in range(topo.period):
        w = topo.matrix(t)
        assert np.allclose(w, w.T, atol=0) and np.allclose(w.sum(0), 1, atol=1e-13)
        mixed = w @ x
        assert np.abs(mixed.mean(0) - x.mean(0)).max() <= 1e-12 * np.abs(x).max()
        x = mixed


@pytest.mark.parametrize("method,kwargs,topo", [
    ("choco", dict(compression="none", consensus_step=0.7), ring(5)),
    ("choco", dict(compression="none"), from_adjacency([[1, 2, 3], [0], [0], [0]])),
    ("dcd", dict(compression="none"), torus(9)),
    ("ecd", dict(compression="none"), complete(4)),
    ("powergossip", {}, ring(6)),
    ("powergossip", dict(power_iterations=2), exponential(8)),
], ids=["choco-ring5", "choco-star", "dcd-torus9", "ecd-complete4", "powergossip-ring6", "powergossip-exp8"])
def test_methods_without_compression_keep_the_mean_float64(method, kwargs, topo):
    models = random_models(topo.size, [(4, 6), (6,)], seed=3, dtype=torch.float64)
    net = Network(method, topo, models, **kwargs)
    before = net.stacked().mean(0)
    d0 = net.distance()
    for _ in range(4):
        net.step()
    assert (net.stacked().mean(0) - before).abs().max() <= 1e-12 * before.abs().max()
    assert net.distance() < 0.5 * d0  # and it mixed


def test_choco_with_none_and_gamma_1_is_plain_gossip():
    topo = torus(9)
    models = random_models(9, [(3, 3)], seed=4, dtype=torch.float64)
    x = torch.stack([m[0].reshape(-1) for m in models]).numpy()
    net = Network("choco", topo, models, compression="none", consensus_step=1.0)
    net.step()
    assert np.allclose(net.stacked().numpy(), topo.matrix() @ x, atol=1e-14, rtol=0)


# ---- consensus rates -----------------------------------------------------------------------------
# (method, compression, γ, shape, steps of the window, zero-mean start, allowed factor on the rate,
#  window for the "each window decays" check). The prediction is the spectral gap's: uncompressed
#  gossip with the same γ shrinks Σ‖x_i − x̄‖² by (1 − γρ)² per step (ρ = 0.195 on the ring of 8).
CONSENSUS = [
    # scaled sign: fast at first; as the copies converge, x − x̂ gets a few large entries and the
    # sign's contraction δ = ‖v‖₁²/(n‖v‖²) drops to ~0.01-0.05, so the tail is up to 10x slower.
    ("choco", "sign", 0.45, (10, 10), (0, 300), False, (0.1, 1.25), 100),
    ("choco", "topk:density=0.01", 0.04, (40, 25), (0, 300), False, (0.8, 1.25), 25),
    ("choco", "qsgd", 0.2, (40, 25), (25, 150), False, (0.8, 1.25), 25),
    ("dcd", "qsgd", None, (40, 25), (0, 40), False, (0.8, 1.25), 10),
    # ECD compresses the model itself: the noise of its estimates scales with ‖x‖, so the decay is
    # the spectral gap's only while the disagreement dominates (zero-mean start, first 20 steps).
    ("ecd", "qsgd:levels=64,block=128", None, (40, 25), (0, 20), True, (0.67, 1.5), 10),
]


@pytest.mark.parametrize("method,spec,gamma,shape,window,zero_mean,factor,every", CONSENSUS,
                         ids=[f"{c[0]}-{c[1].split(':')[0]}" for c in CONSENSUS])
def test_consensus_decays_at_the_spectral_gap_rate(method, spec, gamma, shape, window, zero_mean, factor, every):
    topo = ring(8)
    net = Network(method, topo, random_models(8, [shape], seed=0, zero_mean=zero_mean), compression=spec,
                  **({} if gamma is None else {"consensus_step": gamma}))
    first, last = window
    dist = [net.distance()]
    for _ in range(last):
        net.step()
        dist.append(net.distance())
    predicted = -2 * math.log(1 - (gamma or 1.0) * topo.spectral_gap)  # per-step exponent
    measured = -math.log(dist[last] / dist[first]) / (last - first)
    ratio = measured / predicted
    assert factor[0] <= ratio <= factor[1], (method, spec, ratio, dist[::every])
    marks = dist[first:last + 1:every]
    assert all(b < a for a, b in zip(marks, marks[1:])), (method, spec, marks)  # geometric: every window decays


def test_ecd_estimates_carry_noise_proportional_to_the_model():
    """ECD's floor: with a common nonzero mean the disagreement stops at the compression noise of
    the mean model, orders of magnitude above DCD's (which compresses differences)."""
    floors = {}
    for method in ("dcd", "ecd"):
        models = random_models(8, [(40, 25)], seed=0)
        for m in models:
            m[0] += 5.0
        net = Network(method, ring(8), models, compression="qsgd:levels=64,block=128")
        for _ in range(60):
            net.step()
        floors[method] = net.distance()
    assert floors["ecd"] > 1e6 * floors["dcd"], floors


def test_dcd_diverges_with_a_coarse_compressor():
    """DCD-PSGD's replicas add up the compression noise: s = 2 levels is too coarse (the paper's
    bound on the compressor's variance), while s = 16 contracts (test above)."""
    net = Network("dcd", ring(8), random_models(8, [(40, 25)], seed=0), compression="qsgd:levels=2")
    d0 = net.distance()
    for _ in range(10):
        net.step()
    assert net.distance() > 1e3 * d0


# ---- PowerGossip ----------------------------------------------------------------------------------
def test_powergossip_both_ends_of_every_edge_hold_the_same_vectors():
    topo = ring(6)
    net = Network("powergossip", topo, random_models(6, [(5, 4), (3, 7), (4,)], seed=1))
    for step in range(4):
        net.step()
        for i in range(6):
            for j in topo.neighbors(i):
                vi, vj = net.methods[i].edge_vectors(j), net.methods[j].edge_vectors(i)
                assert len(vi) == 2 and all(torch.equal(a, b) for a, b in zip(vi, vj)), (step, i, j)
                # the sides alternate: n-dim (right) vectors are replaced by m-dim results and back
                assert vi[0].numel() == (5 if step % 2 == 0 else 4)
    # different edges draw different vectors
    fresh = [PowerGossip([torch.zeros(5, 4)], ["w"], topo, i) for i in (0, 1)]
    for f in fresh:
        f.outgoing([torch.zeros(5, 4)])
    assert torch.equal(fresh[0].edge_vectors(1)[0], fresh[1].edge_vectors(0)[0])
    assert not torch.equal(fresh[0].edge_vectors(1)[0], fresh[0].edge_vectors(5)[0])


def rank1_pair(seed=2):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64)
    u, v = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    return [[base.clone()], [base + torch.outer(u, v)]], base + 0.5 * torch.outer(u, v)


def test_powergossip_full_power_iteration_removes_a_rank1_difference_in_one_step():
    models, mean = rank1_pair()
    net = Network("powergossip", ring(2), models, power_iterations=2)
    net.step()
    scale = float(mean.abs().max())
    for r in (0, 1):
        assert (models[r][0] - mean).abs().max() <= 1e-13 * scale


def test_powergossip_warm_vector_removes_a_rank1_difference_in_one_step():
    models, mean = rank1_pair()
    net = Network("powergossip", ring(2), models)  # one half iteration per step (the paper's)
    d0 = float((models[1][0] - models[0][0]).norm())
    net.step()  # from the random vector: only its projection is removed; the vector aligns with u
    d1 = float((models[1][0] - models[0][0]).norm())
    assert 1e-3 * d0 < d1 < d0
    net.step()  # warm: the remaining rank-1 difference u·(v − (v·v̂)v̂)ᵀ goes exactly
    assert float((models[1][0] - models[0][0]).norm()) <= 1e-13 * d0
    assert (models[0][0] - mean).abs().max() <= 1e-13 * float(mean.abs().max())


def test_powergossip_sends_vectors_not_matrices():
    topo = ring(4)
    pg = PowerGossip([torch.zeros(100, 30), torch.zeros(30)], ["w", "b"], topo, 0)
    out = pg.outgoing([torch.zeros(100, 30), torch.zeros(30)])
    assert sorted(out) == [1, 3]
    assert [t.numel() for t in out[1]] == [100, 30]  # X v̂ (m = 100) and the bias uncompressed


# ---- compressors --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,kind", [("none", "exact"), ("qsgd", "unbiased"), ("terngrad:clip_sigmas=0", "unbiased"),
                                       ("topk:density=0.01", "contraction"), ("sign", "contraction"),
                                       ("randomk:density=0.1", "contraction"), ("bf16", "contraction")])
def test_compressor_kinds(spec, kind):
    assert compressor_kind(gossip_compressor(spec)).kind == kind


def test_qsgd_variance_bound_and_choco_rescaling():
    comp = gossip_compressor("qsgd:levels=4,block=8")
    omega = compressor_kind(comp).omega
    assert omega(100) == pytest.approx(min(8 / 16, math.sqrt(8) / 4))
    assert omega(5) == pytest.approx(min(5 / 16, math.sqrt(5) / 4))
    m = ChocoGossip([torch.zeros(100), torch.zeros(5)], ["a", "b"], ring(3), 0, compression=comp, consensus_step=0.5)
    assert m.scales == pytest.approx([1 / 1.5, 1 / (1 + 5 / 16)])
    # the bound holds on a sample (variance of the decoded value, measured)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(64, generator=g)
    errs = []
    for _ in range(200):
        q, ctx = comp.encode(v, "v")
        errs.append(float((comp.decode(q, ctx) - v).pow(2).sum()))
    assert np.mean(errs) <= omega(64) * float(v.pow(2).sum())


@pytest.mark.parametrize("spec,words", [
    ("signsgd", ["efsignsgd"]), ("threshold", ["δ = 0"]), ("fp16", ["bf16", "agreed"]), ("powersgd", ["powergossip"]),
    ("dgc", ["momentum"]),
    ("topk:ef=true", ["ef=true"]), ("terngrad", ["clip_sigmas=0"]), ("lowbit", ["error compensation"])])
def test_refused_compressors_say_why(spec, words):
    with pytest.raises(ValueError) as err:
        gossip_compressor(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_dcd_and_ecd_refuse_biased_compressors():
    for method in ("dcd", "ecd"):
        with pytest.raises(ValueError, match="unbiased.*choco"):
            make_method(method, [torch.zeros(4)], ["w"], ring(4), 0, compression="topk:density=0.5")
        with pytest.raises(ValueError, match="no consensus step"):
            make_method(method, [torch.zeros(4)], ["w"], ring(4), 0, compression="qsgd", consensus_step=0.5)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("adjacency,words", [
    ([[1], []], ["not symmetric", "rank 0 lists rank 1", "add 0 to rank 1"]),
    ([[1], [0], [3], [2]], ["disconnected", "[0, 1]", "[2, 3]"]),
    ([[1, 1], [0]], ["rank 0 lists rank 1 twice"]),
    ([[5], [0]], ["outside 0..1"]),
    ([[1.5], [0]], ["not an integer rank"]),
    (np.array([[0, 2], [2, 0]]), ["0/1"]),
])
def test_bad_adjacency_is_refused_with_the_rank(adjacency, words):
    with pytest.raises(ValueError) as err:
        from_adjacency(adjacency)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_self_loops_are_ignored():
    assert np.array_equal(from_adjacency([[0, 1], [0, 1]]).matrix(), ring(2).matrix())


def test_bad_topologies_and_weights():
    with pytest.raises(ValueError, match="regular graph.*metropolis"):
        from_adjacency([[1, 2, 3], [0], [0], [0]], weights="uniform")
    with pytest.raises(ValueError, match="power-of-two"):
        exponential(6)
    with pytest.raises(ValueError, match="not doubly stochastic"):
        from_weights([[0.5, 0.4], [0.4, 0.5]])
    with pytest.raises(ValueError, match="not symmetric"):
        from_weights([[0.5, 0.5], [0.25, 0.75]])
    with pytest.raises(ValueError, match="has 4 ranks but the job"):
        make_topology(ring(4), 8)
    with pytest.raises(ValueError, match="unknown topology"):
        make_topology("hypercube", 8)
    assert ring(8).fingerprint() != torus(8).fingerprint() and ring(8).fingerprint() == ring(8).fingerprint()


@pytest.mark.parametrize("gamma", [0, 1.5, -0.1, float("nan"), float("inf"), True, "0.5"])
def test_consensus_step_outside_0_1_is_refused(gamma):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="sign", consensus_step=gamma)


def test_choco_needs_a_gamma_with_compression_and_a_static_graph():
    with pytest.raises(ValueError, match="needs consensus_step"):
        ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="sign")
    with pytest.raises(ValueError, match="static topology"):
        ChocoGossip([torch.zeros(4)], ["w"], exponential(4), 0, compression="sign", consensus_step=0.5)
    with pytest.raises(ValueError, match="leave the compressor"):
        PowerGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="topk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method,kwargs", [("choco", dict(compression="topk:density=0.1", consensus_step=0.3)),
                                           ("choco", dict(compression="sign", consensus_step=0.45)),
                                           ("dcd", dict(compression="none")), ("powergossip", {})])
def test_cuda_parameters_match_cpu(method, kwargs):
    """The methods on CUDA parameters (the transport stages payloads through host memory) agree
    with the CPU run to float32 rounding; state stays on the parameters' device."""
    topo = ring(4)
    runs = []
    for device in ("cpu", "cuda"):
        models = [[t.to(device) for t in m] for m in random_models(4, [(8, 6), (6,)], seed=5)]
        net = Network(method, topo, models, **kwargs)
        for _ in range(5):
            net.step()
        runs.append(net.stacked())
        if method == "choco":
            assert net.methods[0].x_hat[0].device.type == device
    assert torch.allclose(runs[0], runs[1].cpu(), atol=1e-5, rtol=1e-5)


# ---- issue 57: periodic mixing matrices (item 12) -------------------------------------------------
def lazy_ring(n, a):
    """W = a·I + (1 − a)/2·(S + Sᵀ) on a ring of n (S: the cyclic shift); eigenvalues
    λ_k = a + (1 − a)·cos(2πk/n), k = 0..n−1 (a circulant matrix)."""
    w = np.zeros((n, n))
    for i in range(n):
        w[i, i] += a
        w[i, (i + 1) % n] += (1 - a) / 2
        w[i, (i - 1) % n] += (1 - a) / 2
    return w


def test_periodic_mixing_matrix_is_refused_with_its_spectral_gap():
    """A ring of 4 with zero self-weights has eigenvalue −1 (λ_k = cos(πk/2): 1, 0, −1, 0):
    x ← W x swaps the two halves for ever and never reaches consensus (spectral gap 0)."""
    w = lazy_ring(4, 0.0)
    x = np.array([1.0, 0.0, 1.0, 0.0])
    assert np.array_equal(w @ (w @ x), x) and not np.array_equal(w @ x, x)  # period 2: no consensus
    for matrix in (w, [[0.0, 1.0], [1.0, 0.0]]):
        with pytest.raises(ValueError) as err:
            from_weights(matrix)
        msg = str(err.value)
        assert "spectral gap 0" in msg and "|λ₂| = 1" in msg and "self-weight" in msg, msg
    # time-varying: the same periodic matrix every round (its product over the period: gap 0)
    with pytest.raises(ValueError, match="spectral gap 0"):
        Topology("two-rounds", [w, w])
    # through the optimizer's path (a Topology passed as topology=)
    with pytest.raises(ValueError, match="spectral gap 0"):
        make_topology(Topology("swap", [lazy_ring(4, 0.0)]), 4)


@pytest.mark.parametrize("n,a", [(4, 0.5), (5, 0.1), (6, 0.25), (4, 0.01), (8, 1 / 3)])
def test_valid_mixing_matrix_spectral_gap_closed_form(n, a):
    """1 − |λ₂| with λ_k = a + (1 − a)·cos(2πk/n): e.g. n = 6, a = 1/4: λ = 1, 5/8, −1/8, −1/2,
    −1/8, 5/8, so ρ = 3/8; n = 4, a = 0.01 (nearly periodic): λ_min = −0.98, ρ = 0.02, accepted."""
    lam = sorted((abs(a + (1 - a) * math.cos(2 * math.pi * k / n)) for k in range(n)), reverse=True)
    topo = from_weights(lazy_ring(n, a))
    assert topo.spectral_gap == pytest.approx(1 - lam[1], abs=1e-12)
    if (n, a) == (6, 0.25):
        assert topo.spectral_gap == pytest.approx(3 / 8, abs=1e-12)


# ---- issue 57: PowerGossip on non-contiguous parameters (item 11) ---------------------------------
@pytest.mark.parametrize("method,kwargs", [("powergossip", {}), ("powergossip", dict(power_iterations=2)),
                                           ("choco", dict(compression="topk:density=0.3", consensus_step=0.4)),
                                           ("dcd", dict(compression="qsgd:levels=16,block=8")),
                                           ("ecd", dict(compression="qsgd:levels=16,block=8"))],
                         ids=["powergossip", "powergossip-2it", "choco-topk", "dcd-qsgd", "ecd-qsgd"])
def test_channels_last_conv_weight_equals_the_contiguous_run(method, kwargs):
    """A ``channels_last`` conv weight (4-D, non-contiguous in the logical order) gossips to the
    same values, bit for bit, as the same weight stored contiguously, and stays channels_last."""
    shapes = [(4, 3, 2, 2), (5, 6), (4,)]
    runs = []
    for channels_last in (False, True):
        models = random_models(3, shapes, seed=7)
        if channels_last:
            for m in models:
                m[0] = m[0].contiguous(memory_format=torch.channels_last)
                assert not m[0].is_contiguous()
        net = Network(method, ring(3), models, **kwargs)
        for _ in range(3):
            net.step()
        if channels_last:
            assert all(m[0].is_contiguous(memory_format=torch.channels_last) for m in models)
        runs.append(net.stacked())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], Network(method, ring(3), random_models(3, shapes, seed=7), **kwargs).stacked())


# ---- issue 57: what a compressor guarantees (item 13) ---------------------------------------------
def test_topk_with_2bit_values_is_not_a_contraction_and_is_refused():
    """int2 values round every kept entry to ±s/3 or ±s (s: the largest kept magnitude). On
    v = (1, ε, ..., ε) the k − 1 small kept entries decode to s/3 = 1/3 each:
    ‖C(v) − v‖² = (k − 1)(1/3 − ε)² + (n − k)ε², ‖v‖² = 1 + (n − 1)ε², far above ‖v‖² for k ≥ 10."""
    n, density, eps = 1000, 0.1, 1e-4
    k = 100
    v = torch.full((n,), eps)
    v[0] = 1.0
    comp = hvdcomp.get_compressor("topk", ef=False, density=density, values="int2")
    q, ctx = comp.encode(v, "v")
    ratio = float((comp.decode(q, ctx) - v).double().pow(2).sum() / v.double().pow(2).sum())
    closed = ((k - 1) * (1 / 3 - eps) ** 2 + (n - k) * eps**2) / (1 + (n - 1) * eps**2)
    assert ratio == pytest.approx(closed, rel=1e-4) and ratio > 10
    assert comp.error_bound.kind == "none"
    for spec in ("topk:density=0.1,values=int2", "sidco:density=0.1,values=int2"):
        with pytest.raises(ValueError) as err:
            gossip_compressor(spec)
        assert "int2" in str(err.value) and "values=fp32" in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="int2"):
        ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="topk:density=0.5,values=int2",
                    consensus_step=0.5)
    assert compressor_kind(gossip_compressor("topk:density=0.1,values=fp16")).kind == "contraction"


def sample_vectors(n, seed=0):
    """Gaussian, one large entry, constant, heavy-tailed (Cauchy), a few non-zeros."""
    g = torch.Generator().manual_seed(seed)
    spike = torch.full((n,), 1e-4)
    spike[n // 3] = 1.0
    few = torch.zeros(n)
    few[:3] = torch.tensor([3.0, -2.0, 0.5])
    cauchy = torch.tan(math.pi * (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)).float()
    return [torch.randn(n, generator=g), spike, torch.full((n,), -0.7), cauchy, few]


def test_every_registered_method_states_its_error_bound():
    """Each per-tensor method says what it guarantees (:attr:`hvdcomp.Compressor.error_bound`);
    gossip asks it instead of knowing methods by name. Step-wide methods are refused (they run
    their own collectives)."""
    from hvdcomp.compressors import Method
    from hvdcomp.compressors.base import Compressor

    for name in hvdcomp.available():
        comp = hvdcomp.get_compressor(name, ef=False)
        if not isinstance(comp, Compressor):
            with pytest.raises(ValueError, match="whole step"):
                gossip_compressor(name)
            continue
        assert type(comp).error_bound is not Method.error_bound, name
        bound = comp.error_bound
        assert bound.kind in ("exact", "unbiased", "contraction", "none") and bound.statement, name
        if bound.kind == "none":
            with pytest.raises(ValueError, match="cannot be used for gossip"):
                gossip_compressor(name)


@pytest.mark.parametrize("spec", ["topk:density=0.05", "topk:density=0.05,values=fp16", "sidco:density=0.05",
                                  "sbc:density=0.05", "efsignsgd", "bf16", "randomk:density=0.05",
                                  "none", "qsgd:levels=4,block=64", "terngrad:clip_sigmas=0"])
def test_stated_error_bounds_hold_on_sample_vectors(spec):
    """‖C(v) − v‖² ≤ (1 − δ(n))‖v‖² for a contraction (in expectation for random-k: mean of 400
    draws), E‖C(v) − v‖² ≤ ω(n)‖v‖² for an unbiased method (mean of 400 draws, 10 % slack for the
    sampling), C(v) = v for ``none``; float64 sums."""
    name, kw = hvdcomp.parse_spec(spec)
    comp = hvdcomp.get_compressor(name, ef=False, **kw)
    bound = comp.error_bound
    n = 600
    draws = 400 if (bound.kind == "unbiased" or name == "randomk") else 1
    for v in sample_vectors(n):
        norm2 = float(v.double().pow(2).sum())
        errs = []
        for _ in range(draws):
            q, ctx = comp.encode(v, "v")
            errs.append(float((comp.decode(q, ctx).double() - v.double()).pow(2).sum()))
        err = float(np.mean(errs))
        if bound.kind == "exact":
            assert err == 0.0
        elif bound.kind == "unbiased":
            assert err <= 1.1 * bound.omega(n) * norm2, (spec, err / norm2, bound.omega(n))
        else:
            assert bound.kind == "contraction" and 0 < bound.delta(n) <= 1, spec
            slack = 1.1 if draws > 1 else 1.0 + 1e-6
            assert err <= slack * (1 - bound.delta(n)) * norm2, (spec, err / norm2, 1 - bound.delta(n))


# ---- issue 57: numpy and 0-d tensor numbers (item 13) ----------------------------------------------
@pytest.mark.parametrize("gamma", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64),
                                   0.5])
def test_consensus_step_accepts_numpy_and_0d_tensor_numbers(gamma):
    m = ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="sign", consensus_step=gamma)
    assert m.gamma == 0.5 and type(m.gamma) is float
    pg = PowerGossip([torch.zeros(4)], ["w"], ring(4), 0, consensus_step=gamma, power_iterations=np.int64(2),
                     seed=torch.tensor(3))
    assert pg.gamma == 0.5 and pg.rounds == 2 and type(pg.rounds) is int and pg.seed == 3
    assert PowerGossip([torch.zeros(4)], ["w"], ring(4), 0, power_iterations=torch.tensor(2)).rounds == 2
    assert ring(np.int64(4)).size == 4 and ring(torch.tensor(4)).size == 4
    assert torus(np.int32(8), shape=(np.int64(2), torch.tensor(4))).name == "torus 2x4"


@pytest.mark.parametrize("bad", [torch.tensor([0.5]), np.array([0.5]), np.bool_(True), "0.5", torch.tensor(True)])
def test_non_scalar_or_non_numeric_gamma_is_refused(bad):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="sign", consensus_step=bad)


def test_power_iterations_must_be_an_integer():
    for bad in (1.5, np.float32(2.0), torch.tensor(2.0), 0, True):
        with pytest.raises(ValueError, match="power_iterations"):
            PowerGossip([torch.zeros(4)], ["w"], ring(4), 0, power_iterations=bad)


def test_fp16_is_refused_for_gossip_where_bf16_converges():
    """hvdcomp's fp16 agrees a power-of-two scale between ranks through the averaged payload (an
    allreduce's protocol): decoded one neighbour's payload at a time, Choco-SGD with it diverged
    (ring of 8, γ = 0.5: NaN within 30 steps, before the issue-57 fix accepted it as a
    contraction). bf16, a plain rounding, follows uncompressed gossip."""
    assert hvdcomp.get_compressor("fp16", ef=False).error_bound.kind == "none"
    with pytest.raises(ValueError, match="bf16"):
        ChocoGossip([torch.zeros(4)], ["w"], ring(4), 0, compression="fp16", consensus_step=0.5)
    dists = {}
    for spec in ("bf16", "none"):
        net = Network("choco", ring(8), random_models(8, [(20, 10)], seed=0), compression=spec, consensus_step=0.5)
        for _ in range(30):
            net.step()
        dists[spec] = net.distance()
    assert dists["bf16"] == pytest.approx(dists["none"], rel=0.05), dists
