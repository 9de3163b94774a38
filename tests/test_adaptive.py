"""``adaptive`` (L-GreCo): the dynamic program against brute force, and the wrapper on simulated
ranks against plans and errors computed independently in the test."""
import itertools
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.compressors.adaptive import choose_settings
from hvdcomp.compressors.base import simulated_world
from hvdcomp.compressors.topk import num_kept
from tests.simworld import SimulatedRanks


# ---- the dynamic program -----------------------------------------------------------------------
def brute_force(errors, costs, budget):
    best, best_plan = math.inf, None
    for plan in itertools.product(range(errors.shape[1]), repeat=errors.shape[0]):
        rows = np.arange(errors.shape[0])
        if costs[rows, plan].sum() <= budget:
            e = errors[rows, plan].sum()
            if e < best:
                best, best_plan = e, plan
    return best, best_plan


def test_hand_worked_two_layers():
    # uniform (column 1): 10 + 10 = 20 bytes, error 5 + 5 = 10. Layer 0 cheap (4 bytes, error 6)
    # and layer 1 rich (16 bytes, error 1): 20 bytes, error 7, the best of the 9 plans within 20
    # bytes (layer 0 rich and layer 1 cheap: 2 + 8 = 10, not better).
    errors = np.array([[6.0, 5.0, 2.0], [8.0, 5.0, 1.0]])
    costs = np.array([[4, 10, 16], [4, 10, 16]])
    assert choose_settings(errors, costs, uniform=1).tolist() == [0, 2]
    # nothing beats uniform when every trade loses: the uniform plan comes back
    assert choose_settings(np.array([[9.0, 5.0, 4.5]] * 2), costs, uniform=1).tolist() == [1, 1]


@pytest.mark.parametrize("seed", range(25))
def test_dynamic_program_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    layers, cands = rng.integers(1, 6), rng.integers(2, 4)
    costs = np.sort(rng.integers(0, 60, size=(layers, cands)), axis=1)
    errors = np.sort(rng.random((layers, cands)) * 10, axis=1)[:, ::-1].copy()  # more bytes, less error
    uniform = int(rng.integers(0, cands))
    budget = int(costs[:, uniform].sum())
    plan = choose_settings(errors, costs, uniform, resolution=max(1, budget))  # 1 byte per unit: exact
    rows = np.arange(layers)
    assert costs[rows, plan].sum() <= budget
    best, _ = brute_force(errors, costs, budget)
    assert errors[rows, plan].sum() == pytest.approx(best, rel=1e-12, abs=1e-12)
    # at the default (coarser) resolution: still within budget and never worse than uniform
    coarse = choose_settings(errors, costs, uniform)
    assert costs[rows, coarse].sum() <= budget
    assert errors[rows, coarse].sum() <= errors[:, uniform].sum() + 1e-12


def test_dynamic_program_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one \\(L, C\\) shape"):
        choose_settings(np.zeros((2, 3)), np.zeros((2, 2)), 0)


# ---- the wrapper on simulated ranks ------------------------------------------------------------
NAMES = ["spiky", "dense", "small"]


def layer_grads(world, step):
    """Per rank: a layer whose mass is in a few entries, a dense Gaussian layer, a small one."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * step + r)
        spiky = torch.randn(400, generator=g) * 0.01
        spiky[:8] += 50.0 * (1 + r)
        out.append({"spiky": spiky, "dense": torch.randn(600, generator=g),
                    "small": torch.randn(30, generator=g)})
    return out


def topk_error(x, density):
    k = num_kept(x.numel(), density)
    kept = x.abs().double().topk(k).values
    return float(x.double().pow(2).sum() - kept.pow(2).sum())


def run_allgather_step(comps, grads):
    """Every rank encodes each layer, then every rank aggregates all ranks' payloads (as the
    optimizer's allgather path does). Returns (per-rank results per layer, per-rank payloads)."""
    world = len(comps)
    results = [{} for _ in range(world)]
    payloads = {}
    for name in NAMES:
        enc = []
        for r, c in enumerate(comps):
            with simulated_world(world, r):
                enc.append(c.encode(grads[r][name], name))
        payloads[name] = enc
        for r, c in enumerate(comps):
            with simulated_world(world, r):
                results[r][name] = c.aggregate([[t.clone() for t in e[0]] for e in enc], enc[r][1])
    return results, payloads


def test_plan_is_the_program_on_errors_averaged_over_ranks_and_every_rank_agrees():
    world, density = 4, 0.05
    spec = f"adaptive:base=topk,budget={density},every=2,ef=false"
    comps = [hvdcomp.get_compressor(spec) for _ in range(world)]
    settings = comps[0].settings
    grads0 = layer_grads(world, 0)
    out0, pay0 = run_allgather_step(comps, grads0)
    for name in NAMES:  # step 0: the uniform density, the mean of every rank's own top-k
        ref = sum(torch.zeros(grads0[r][name].numel()).index_put_(
            (grads0[r][name].abs().topk(num_kept(grads0[r][name].numel(), density)).indices,),
            grads0[r][name][grads0[r][name].abs().topk(num_kept(grads0[r][name].numel(), density)).indices])
            for r in range(world)) / world
        for r in range(world):
            assert torch.allclose(out0[r][name], ref, atol=1e-6), name
        assert pay0[name][0][0][-1].numel() == len(settings)   # the error table rides along
    # the errors each rank measured: top-k's squared error for every candidate, meaned over ranks
    errors = np.array([[np.mean([topk_error(grads0[r][n], s) for r in range(world)]) for s in settings]
                       for n in sorted(NAMES)])
    costs = np.array([[8 * num_kept(grads0[0][n].numel(), s) for s in settings] for n in sorted(NAMES)])
    expected = dict(zip(sorted(NAMES), choose_settings(errors, costs, settings.index(density)).tolist()))
    grads1 = layer_grads(world, 1)
    out1, pay1 = run_allgather_step(comps, grads1)
    for c in comps:
        assert c.plan == expected
    assert expected != {n: settings.index(density) for n in NAMES}      # the spiky layer gives up bytes
    assert settings[expected["spiky"]] < density
    for name in NAMES:  # step 1 is not measuring: plain top-k payloads at the planned density
        k = num_kept(grads1[0][name].numel(), settings[expected[name]])
        assert all(len(p) == 2 and p[0].numel() == k for p, _ in pay1[name])
    sent = sum(8 * num_kept(grads1[0][n].numel(), settings[expected[n]]) for n in NAMES)
    uniform = sum(8 * num_kept(grads1[0][n].numel(), density) for n in NAMES)
    assert sent <= uniform
    planned_error = sum(errors[i, expected[n]] for i, n in enumerate(sorted(NAMES)))
    assert planned_error < errors[:, settings.index(density)].sum()


def test_randomk_through_allreduce_every_rank_decodes_the_same_plan():
    world = 3
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor("adaptive:base=randomk,budget=0.1,every=1,ef=false"), world)
    for step in range(3):
        grads = layer_grads(world, step)
        for name in NAMES:
            enc = sim.encode([g[name] for g in grads], name)
            outs = sim.combine(enc)
            base = sim.comps[0].methods[sim.comps[0].plan.get(name, sim.comps[0].uniform)]
            idx = enc[0][1][1][2]                                   # random-k's shared indices
            ref = torch.zeros(grads[0][name].numel())
            ref[idx] = torch.stack([g[name][idx] for g in grads]).mean(0)
            for o in outs:
                assert torch.allclose(o, ref, atol=1e-6)
            assert idx.numel() == num_kept(ref.numel(), base.density)
        plans = [c.plan for c in sim.comps]
        assert all(p == plans[0] for p in plans)
    assert sim.comps[0].plan_round == 1 and sim.comps[0].plan


def test_error_feedback_by_default_and_nothing_lost():
    comp = hvdcomp.get_compressor("adaptive:base=topk,budget=0.1,every=1")
    assert isinstance(comp, hvdcomp.ErrorFeedback)
    assert not isinstance(hvdcomp.get_compressor("adaptive:base=qsgd,budget=8"), hvdcomp.ErrorFeedback)
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(500)
    for step in range(4):
        x = torch.randn(500, generator=g)
        payload, ctx = comp.encode(x, "w")
        sent = comp.decode(payload, ctx)
        new = comp.residuals["w"]
        assert torch.allclose(sent + new, x + residual, atol=1e-6)
        residual = new.clone()


def test_state_round_trip_and_rollback():
    comp = hvdcomp.get_compressor("adaptive:base=topk,budget=0.05,every=2,ef=false")
    world = 1
    for step in range(3):
        run_allgather_step([comp], layer_grads(world, step))
    clone = hvdcomp.get_compressor("adaptive:base=topk,budget=0.05,every=2,ef=false")
    clone.load_state_dict(comp.state_dict())
    assert clone.plan == comp.plan and clone.steps == comp.steps
    grads = layer_grads(world, 7)
    a, _ = run_allgather_step([comp], grads)
    b, _ = run_allgather_step([clone], grads)
    assert all(torch.equal(a[0][n], b[0][n]) for n in NAMES)
    steps = dict(comp.steps)
    comp.begin_step()
    run_allgather_step([comp], layer_grads(world, 8))
    comp.rollback()
    assert comp.steps == steps
    with pytest.raises(ValueError, match="unknown"):
        clone.load_state_dict({"bogus": 1})


@pytest.mark.parametrize("spec, match", [
    ("adaptive:base=dgc,budget=0.01", "must be one of"),
    ("adaptive:base=topk,budget=0.01,density=0.1", "give the uniform value as budget="),
    ("adaptive:base=topk,budget=0.01,every=0", "every must be"),
    ("adaptive:base=topk,budget=0.01,candidates=a/b", "candidates must be numbers"),
    ("adaptive:base=topk,budget=2", "budget must be in"),
])
def test_bad_arguments(spec, match):
    with pytest.raises(ValueError, match=match):
        hvdcomp.get_compressor(spec)


def test_budget_defaults_to_the_base_methods_default():
    assert hvdcomp.get_compressor("adaptive").inner.budget == 0.01               # top-k's density
    assert hvdcomp.get_compressor("adaptive:base=qsgd").budget == 16             # QSGD's levels


def test_needs_parameter_names():
    with pytest.raises(ValueError, match="named_parameters"):
        hvdcomp.get_compressor("adaptive:base=topk,budget=0.1,ef=false").encode(torch.ones(4))
