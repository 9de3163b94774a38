"""AB-training under mpirun. Usage: mpirun -np 4 python tests/mpi/ab_checks.py [check ...]

At 4 ranks every check runs (process sets {0, 1} and {2, 3} are registered for
``process_set``); at 8 ranks give ``closed_form_bytes_2x4`` (the 2 x 4 node layout). Each check
prints ``OK <name>`` on rank 0."""
import copy
import sys
import warnings

from mpi4py import MPI
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.lowrank import ABTraining, kept_rank, matrix_view, traffic_summary
from mpi_scripts.train_cnn import DigitsMLP, DigitsVGG

COMM = MPI.COMM_WORLD
SETS = {}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def loss_of(model, step, rank=None):
    g = torch.Generator().manual_seed(100 * (hvd.rank() if rank is None else rank) + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def tiny():
    """Linear(6, 5) - Tanh - Linear(5, 3), identical on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def three_layer():
    """Linear(6, 8) - Tanh - Linear(8, 4) - Tanh - Linear(4, 3): 107 parameters; with
    ``4.weight`` at full rank, 0.weight (tall view 8 x 6) and 2.weight (8 x 4) are factorised and
    27 parameters (the biases, 4.weight) never are."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3))


def run(ab, model, steps, start=0, hook=None):
    for step in range(start, start + steps):
        ab.zero_grad()
        loss_of(model, step).backward()
        ab.synchronize()
        if hook:
            hook(step)
        ab.step()


def mean_over(t, ranks):
    every = COMM.allgather(t)
    return sum(every[r] for r in ranks) / len(ranks)


# ---- today's behaviour, reachable by arguments -------------------------------------------------
def check_group_averaging():
    """mode ab, rows orientation, unfactorised parameters over the world (hvdcomp's earlier layout)."""
    model = tiny()
    ab = ABTraining(model, sgd, rank_groups=2, warmup_steps=0, steps_between_syncs=5, full_rank_steps=1,
                    cutoff=0.0, full_rank=["2.weight"], base_lr=0.1, mode="ab", orientation="rows",
                    unfactorized_scope="world")
    assert ab.stage == "grouped" and [f.name for f in ab.factorized] == ["0.weight"]
    f = ab.factorized[0]
    ab.zero_grad()
    loss_of(model, 0).backward()
    gw = f.param.grad.clone()
    local = gw @ f.b.detach().t() if ab.trains() == "A" else f.a.detach().t() @ gw
    full_local = {n: p.grad.clone() for n, p in ab.always_full}
    ab.synchronize()
    group = [r for r in range(COMM.size) if r * 2 // COMM.size == ab.rank_group_index]
    got = f.a.grad if ab.trains() == "A" else f.b.grad
    assert torch.allclose(got, mean_over(local, group), atol=1e-6)
    for n, p in ab.always_full:
        assert torch.allclose(p.grad, mean_over(full_local[n], range(COMM.size)), atol=1e-6), n
    assert ab.trains() == ("A" if ab.rank_group_index == 0 else "B")


def check_full_rank_matches_data_parallel():
    model = tiny()
    twin = copy.deepcopy(model)
    ab = ABTraining(model, sgd, rank_groups=2, warmup_steps=3, steps_between_syncs=2, full_rank_steps=1,
                    cutoff=0.0, base_lr=0.1, ramp_steps=0)
    dp = hvdcomp.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                      named_parameters=twin.named_parameters(), compression="none")
    for step in range(3):
        assert ab.stage == "warmup"
        run(ab, model, 1, step)
        dp.zero_grad()
        loss_of(twin, step).backward()
        dp.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def check_schedule_and_sync():
    """hvdcomp's earlier variant: W averaged at the sync, rows orientation, a cut every time."""
    model = tiny()
    ab = ABTraining(model, sgd, rank_groups=2, warmup_steps=2, steps_between_syncs=3, full_rank_steps=1,
                    cutoff=0.2, base_lr=0.1, ramp_steps=2, mode="ab", sync="full", orientation="rows",
                    unfactorized_scope="world", cut_first=True)
    stages = []
    for step in range(12):
        stages.append(ab.stage)
        run(ab, model, 1, step)
        if stages[-1] == "grouped" and ab.stage == "full-rank":
            w = model[0].weight.detach()
            assert all(torch.equal(w, o) for o in COMM.allgather(w))   # synced: the same W everywhere
    cycle = ["grouped"] * 3 + ["full-rank"]
    assert stages == ["warmup"] * 2 + cycle * 2 + ["grouped"] * 2
    rep = ab.communication_report()
    assert set(rep["bytes_by_stage"]) == {"warmup", "grouped", "sync", "full-rank"}
    assert rep["steps_by_stage"] == {"warmup": 2, "grouped": 8, "full-rank": 2}
    dense = 4 * sum(p.numel() for p in model.parameters())
    assert rep["bytes_by_stage"]["warmup"] == 2 * dense and rep["bytes_by_stage"]["full-rank"] == 2 * dense
    # two syncs of both weights (fp32), and three cuts agreeing 2 kept ranks (int64) each
    assert rep["bytes_by_stage"]["sync"] == 2 * 4 * (30 + 15) + 3 * 2 * 8
    assert rep["traffic_ratio"] == 12 * dense / sum(rep["bytes_by_stage"].values())


# ---- the authors' algorithm ---------------------------------------------------------------------
def check_orientation_every_cnn_layer():
    """Exact first factorisation of DigitsVGG and DigitsMLP: B is m x m with m = min(dims), A is
    n x m, and A·B reproduces the weight."""
    for model in (DigitsVGG(32), DigitsMLP(64)):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        ab = ABTraining(model, sgd, warmup_steps=0, full_rank=type(model).FULL_RANK)
        assert {f.name for f in ab.factorized} == {n for n, p in weights.items()
                                                   if p.dim() >= 2 and n not in type(model).FULL_RANK}
        for f in ab.factorized:
            w = weights[f.name]
            n, m = max(w.shape[0], w[0].numel()), min(w.shape[0], w[0].numel())
            assert f.b.shape == (m, m) and f.a.shape == (n, m), (f.name, f.a.shape, f.b.shape)
            view, flipped = matrix_view(w)
            assert view.shape == (n, m) and flipped == (w.shape[0] < w[0].numel())
            assert torch.allclose(f.a @ f.b, view, atol=1e-5), f.name
            assert torch.allclose(f.param.detach(), w, atol=1e-5), f.name


def check_cut_keeps_large_singular_values():
    """cut_first with no warm-up cuts the initial weight: its designed spectrum decides the rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    u, _ = torch.linalg.qr(torch.randn(8, 6, generator=torch.Generator().manual_seed(3)))
    v, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(4)))
    s = torch.tensor([4.0, 2.0, 1.3, 1.1, 0.5, 0.1])
    with torch.no_grad():
        model[0].weight.copy_(u @ torch.diag(s) @ v.t())            # 8 x 6: tall as it is
    ab = ABTraining(model, sgd, warmup_steps=0, cutoff=0.3, cut_first=True, full_rank=["2.weight"])
    assert ab.ranks_kept == {"0.weight": 3} == {"0.weight": kept_rank(s, 0.3)}   # 4, 2, 1.3 > 1.2
    f = ab.factorized[0]
    assert f.b.shape == (3, 6) and f.a.shape == (8, 3)
    assert torch.allclose(f.a @ f.b, u[:, :3] @ torch.diag(s[:3]) @ v[:, :3].t(), atol=1e-5)


def check_only_b_updates_no_a():
    model = three_layer()
    ab = ABTraining(model, sgd, rank_groups=2, warmup_steps=1, steps_between_syncs=4, full_rank_steps=1,
                    cutoff=0.0, full_rank=["4.weight"], ramp_steps=0)
    assert ab.mode == "only-b" and ab.sync_mode == "b" and ab.trains() == "B"
    run(ab, model, 1)
    assert ab.stage == "grouped"
    a0 = [f.a.detach().clone() for f in ab.factorized]
    b0 = [f.b.detach().clone() for f in ab.factorized]
    for step in range(1, 4):
        ab.zero_grad()
        loss_of(model, step).backward()
        local = {f.name: f.a.detach().t() @ f.view(f.param.grad) for f in ab.factorized}
        local_full = {n: p.grad.clone() for n, p in ab.always_full}
        ab.synchronize()
        group = [r for r in range(COMM.size) if r * 2 // COMM.size == ab.rank_group_index]
        for f in ab.factorized:
            assert f.a.grad is None and f.param.grad is None
            assert torch.allclose(f.b.grad, mean_over(local[f.name], group), atol=1e-6)
        for n, p in ab.always_full:   # 1-D and full-rank layers: inside the group too
            assert torch.allclose(p.grad, mean_over(local_full[n], group), atol=1e-6), n
        assert {id(p) for p in ab.parameters()} == {id(p) for _, p in ab.always_full} | {id(f.b) for f in ab.factorized}
        ab.step()
        for f, a in zip(ab.factorized, a0):
            assert torch.equal(f.a.detach(), a), f.name                       # A frozen
            assert torch.allclose(f.view(f.param.detach()), f.a.detach() @ f.b.detach(), atol=1e-6)
    assert all(not torch.equal(f.b.detach(), b) for f, b in zip(ab.factorized, b0))


def _spy_sync(ab, box):
    """Record every rank's B, A, W and unfactorised parameters just before and after each sync."""
    inner = ab._sync

    def snap():
        return {"b": [f.b.detach().clone() for f in ab.factorized], "a": [f.a.detach().clone() for f in ab.factorized],
                "w": [f.param.detach().clone() for f in ab.factorized],
                "u": [p.detach().clone() for _, p in ab.always_full]}

    def spy():
        before = snap()
        inner()
        box.append((before, snap()))
    ab._sync = spy


def check_sync_values():
    """only-b: B averaged over all ranks, W = A·mean(B); unfactorised parameters are rank 0's.
    ab: with-stale W = mean(A)·mean(B); only-learned W = A of the A-trainers · B of the B-trainers;
    unfactorised parameters averaged. Every rank ends with the same weights."""
    everyone = range(COMM.size)
    for kwargs in ({}, {"mode": "ab", "sync": "with-stale"}, {"mode": "ab", "sync": "only-learned"},
                   {"mode": "ab", "sync": "full"}):
        model, box = three_layer(), []
        ab = ABTraining(model, sgd, rank_groups=2, warmup_steps=1, steps_between_syncs=2, full_rank_steps=1,
                        cutoff=0.0, full_rank=["4.weight"], ramp_steps=0, **kwargs)
        _spy_sync(ab, box)
        run(ab, model, 3)
        assert ab.stage == "full-rank" and len(box) == 1, kwargs
        before, after = box[0]
        a_ranks = [r for r in everyone if r < COMM.size // 2]
        b_ranks = [r for r in everyone if r >= COMM.size // 2]
        for i, f in enumerate(ab.factorized):
            if ab.sync_mode == "b":
                want_b, want_a = mean_over(before["b"][i], everyone), before["a"][i]
            elif ab.sync_mode == "with-stale":
                want_b, want_a = mean_over(before["b"][i], everyone), mean_over(before["a"][i], everyone)
            elif ab.sync_mode == "only-learned":
                want_a, want_b = COMM.allgather(before["a"][i])[a_ranks[0]], COMM.allgather(before["b"][i])[b_ranks[0]]
            if ab.sync_mode == "full":
                want_w = mean_over(f.view(before["w"][i]), everyone)
            else:
                assert torch.allclose(after["b"][i], want_b, atol=1e-6)
                assert torch.allclose(after["a"][i], want_a, atol=1e-6)
                want_w = want_a @ want_b
            assert torch.allclose(f.view(after["w"][i]), want_w, atol=1e-5), (kwargs, f.name)
            assert all(torch.equal(after["w"][i], o) for o in COMM.allgather(after["w"][i]))
        for j, u in enumerate(before["u"]):
            want = COMM.allgather(u)[0] if ab.mode == "only-b" else mean_over(u, everyone)
            assert torch.allclose(after["u"][j], want, atol=1e-6), kwargs
            assert all(torch.equal(after["u"][j], o) for o in COMM.allgather(after["u"][j]))


def closed_form(kwargs, ranks_per_node):
    """Per-rank bytes by stage, all and between nodes, of 12 steps of :func:`three_layer` (warm-up
    2, then cycles of 3 grouped + 1 full-rank; cutoff 0 keeps every rank), from the shapes, the
    node layout and the rank-group rule alone."""
    P, U, B, A, W = 107, 27, 6 * 6 + 4 * 4, 8 * 6 + 8 * 4, 6 * 8 + 4 * 8
    S, r = COMM.size, COMM.rank
    R = ranks_per_node or S
    node = [q // R for q in range(S)]
    rank_groups = kwargs.get("rank_groups", "node")
    group = node if rank_groups == "node" else [q * rank_groups // S for q in range(S)]
    n_groups = len(set(group))
    mode, sync = kwargs.get("mode", "only-b"), kwargs.get("sync", "b")
    factor = ["A" if mode == "ab" and group[q] < n_groups // 2 else "B" for q in range(S)]
    size = {"A": A, "B": B}
    peers = [q for q in range(S) if factor[q] == factor[r]]
    spans = {"world": len(set(node)) > 1, "rank-group": len({node[q] for q in range(S) if group[q] == group[r]}) > 1,
             "trainers": len({node[q] for q in peers}) > 1}
    parts = [("warmup", 2 * 4 * P, "world"), ("grouped", 8 * 4 * (size[factor[r]] + U), "rank-group"),
             ("full-rank", 2 * 4 * P, "world"), ("sync", 2 * 2 * 8, "world")]   # two cuts agree 2 ranks
    if sync == "only-learned":
        first = {f: min(q for q in range(S) if factor[q] == f) for f in "AB"}
        per_sync = [(4 * size[factor[r]], "trainers")] if len({group[q] for q in peers}) > 1 else []
        per_sync += [(4 * A if r == first["A"] else 0, "world"), (4 * B if r == first["B"] else 0, "world")]
    else:
        per_sync = [({"b": 4 * B, "with-stale": 4 * (A + B), "full": 4 * W}[sync], "world")]
    if n_groups > 1:
        per_sync.append((4 * U if r == 0 else 0, "world") if mode == "only-b" else (4 * U, "world"))
    parts += [("sync", 2 * b, scope) for b, scope in per_sync]
    want, between = {}, {}
    for stage, b, scope in parts:
        want[stage] = want.get(stage, 0) + b
        if spans[scope]:
            between[stage] = between.get(stage, 0) + b
    return want, {k: v for k, v in between.items() if v}, len(set(node))


def _check_bytes(kwargs, ranks_per_node, label):
    model = three_layer()
    ab = ABTraining(model, sgd, warmup_steps=2, steps_between_syncs=3, full_rank_steps=1, cutoff=0.0,
                    full_rank=["4.weight"], ramp_steps=0, ranks_per_node=ranks_per_node, **kwargs)
    run(ab, model, 12)
    rep = ab.communication_report()
    want, between, nodes = closed_form(kwargs, ranks_per_node)
    got_between = {k: v for k, v in rep["internode_bytes_by_stage"].items() if v}
    assert rep["steps_by_stage"] == {"warmup": 2, "grouped": 8, "full-rank": 2}, label
    assert rep["bytes_by_stage"] == want, (label, COMM.rank, rep["bytes_by_stage"], want)
    assert got_between == between, (label, COMM.rank, got_between, between)
    assert rep["dense_bytes"] == 12 * 4 * 107 and rep["nodes"] == nodes
    summary = traffic_summary(COMM.allgather(rep))
    mean_sent = sum(COMM.allgather(sum(want.values()))) / COMM.size
    mean_between = sum(COMM.allgather(sum(between.values()))) / COMM.size
    assert abs(summary["bytes_sent_mean"] - mean_sent) < 1e-9 and summary["ratio_mean"] == 12 * 4 * 107 / mean_sent
    if nodes > 1:
        assert summary["ratio_between_nodes"] == 12 * 4 * 107 / mean_between, label
    else:
        assert summary["ratio_between_nodes"] is None and mean_between == 0


def check_closed_form_bytes():
    """4 ranks: one node (the machine), 2 x 2 nodes (rank groups = nodes), 4 nodes of one rank
    (rank groups of 2 then span nodes), and the A/B modes."""
    _check_bytes({}, None, "one node")
    _check_bytes({}, 2, "2x2, rank_groups=node")
    _check_bytes({"rank_groups": 2}, 1, "4 nodes, 2 rank groups")
    for sync in ("full", "with-stale", "only-learned"):
        _check_bytes({"mode": "ab", "sync": sync}, 2, f"2x2 ab {sync}")
    _check_bytes({"mode": "ab", "sync": "only-learned", "rank_groups": 4}, 1, "4 nodes, ab only-learned, 4 rank groups")


def check_closed_form_bytes_2x4():
    """8 ranks in the emulated 2 x 4 cluster's layout: rank groups are the nodes."""
    _check_bytes({}, 4, "2x4, rank_groups=node")
    _check_bytes({"mode": "ab", "sync": "only-learned", "rank_groups": 4}, 4, "2x4 ab only-learned, 4 rank groups")


def check_optimizer_state_and_rebound():
    """AdamW state is carried across switches (truncated to the new rank); reset_optimizer clears
    it; the learning rate follows the authors' rebound."""
    for reset in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        ab = ABTraining(model, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), rank_groups=2,
                        warmup_steps=2, steps_between_syncs=3, full_rank_steps=1, cutoff=0.9,
                        full_rank=["2.weight"], ramp_steps=3, ramp_start_lr=0.001, base_lr=0.01,
                        reset_optimizer=reset)
        f, lrs = ab.factorized[0], []
        run(ab, model, 5, hook=lambda s: lrs.append(ab.current_lr()))
        assert ab.stage == "full-rank" and f.b.shape == (6, 6)
        b_state = {k: v.clone() for k, v in ab.optimizer.state[f.b].items()}
        run(ab, model, 1, 5, hook=lambda s: lrs.append(ab.current_lr()))
        w_state = ab.optimizer.state[model[0].weight]
        if reset:                                                    # cleared at the switch
            assert len(w_state) == 0
        else:
            assert float(w_state["step"]) == 3                       # warm-up 2 + full-rank 1
        assert ab.stage == "grouped" and f.b.shape[0] == ab.ranks_kept["0.weight"] < 6
        k = f.b.shape[0]
        if reset:
            assert len(ab.optimizer.state[f.b]) == 0
        else:
            state = ab.optimizer.state[f.b]
            assert float(state["step"]) == 3 and state["exp_avg"].shape == (k, 6)
            assert torch.equal(state["exp_avg"], b_state["exp_avg"][:k])
            assert torch.equal(state["exp_avg_sq"], b_state["exp_avg_sq"][:k])
        def lower_base(s):
            if s == 7:
                ab.base_lr = 0.004        # a schedule below the rebound's line: min() takes it
            lrs.append(ab.current_lr())
        run(ab, model, 2, 6, hook=lower_base)
        # switches after steps 1, 4 and 5, slope (0.01 − 0.001)/3: the first step after one runs at
        # min(0.001, slope) (the authors' trainer), the k-th at min(base, k·slope)
        want = [0.01, 0.01, 0.001, 0.006, 0.009, 0.001, 0.001, 0.004]
        assert all(abs(a - b) < 1e-12 for a, b in zip(lrs, want)) and len(lrs) == len(want), lrs


def check_process_set():
    """Two process sets {0, 1} and {2, 3}: each averages only inside itself, in warm-up and
    grouped steps."""
    mine = SETS["low"] if COMM.rank < 2 else SETS["high"]
    members = [0, 1] if COMM.rank < 2 else [2, 3]
    model = three_layer()
    ab = ABTraining(model, sgd, warmup_steps=1, steps_between_syncs=3, full_rank_steps=1, cutoff=0.0,
                    full_rank=["4.weight"], process_set=mine)
    assert ab.world.Get_size() == 2 and ab.n_rank_groups == 1
    for step in range(2):
        ab.zero_grad()
        loss_of(model, step).backward()
        if ab.stage == "warmup":
            local = [p.grad.clone() for _, p in ab.named]
            ab.synchronize()
            for (n, p), g in zip(ab.named, local):
                assert torch.allclose(p.grad, mean_over(g, members), atol=1e-6), n
                assert not torch.allclose(p.grad, mean_over(g, range(4)), atol=1e-6), n
        else:
            local = {f.name: f.a.detach().t() @ f.view(f.param.grad) for f in ab.factorized}
            ab.synchronize()
            for f in ab.factorized:
                assert torch.allclose(f.b.grad, mean_over(local[f.name], members), atol=1e-6)
                assert not torch.allclose(f.b.grad, mean_over(local[f.name], range(4)), atol=1e-6)
        ab.step()
    assert ab.communication_report()["bytes_by_stage"]["warmup"] == 4 * 107


def check_deprecated_spellings():
    """The spellings before the stage / rank-group rename still work for one release, each with a
    DeprecationWarning, and train exactly as the new ones: same weights and the same report."""
    kwargs = dict(warmup_steps=1, steps_between_syncs=2, full_rank_steps=1, cutoff=0.0, full_rank=["4.weight"])
    model, old_model = three_layer(), three_layer()
    ab = ABTraining(model, sgd, rank_groups=2, unfactorized_scope="rank-group", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = ABTraining(old_model, sgd, groups=2, unfactorized_scope="group", **kwargs)
        run(ab, model, 4)
        run(old, old_model, 4)
        rep, old_rep = ab.communication_report(), old.communication_report()
        assert old.phase == old.stage == "grouped" and old.phase_at(3) == ab.stage_at(3) == ("full-rank", 0)
        assert old.groups == old.rank_groups == 2 and old.n_groups == old.n_rank_groups == 2
        assert old.group_index == old.rank_group_index and old.unfactorized_scope == "rank-group"
        assert old.bytes_by_phase is old.bytes_by_stage and old.steps_by_phase is old.steps_by_stage
        assert old.internode_bytes_by_phase is old.internode_bytes_by_stage and old.PHASES == ab.STAGES
        assert old_rep["bytes_by_phase"] == rep["bytes_by_stage"] and old_rep["group"] == rep["rank_group"]
        assert old.describe()["groups"] == 2 and old.describe()["n_groups"] == 2
    assert sum(issubclass(w.category, DeprecationWarning) for w in caught) == 14, [str(w.message) for w in caught]
    assert dict(old_rep) == dict(rep) and old.describe() == ab.describe()
    for a, b in zip(model.parameters(), old_model.parameters()):
        assert torch.equal(a, b)
    try:
        ABTraining(three_layer(), sgd, rank_groups=2, groups=2)
    except ValueError as exc:
        assert "not both" in str(exc)
    else:
        raise AssertionError("rank_groups and groups together must raise")


CHECKS_4 = ("group_averaging", "full_rank_matches_data_parallel", "schedule_and_sync", "orientation_every_cnn_layer",
            "cut_keeps_large_singular_values", "only_b_updates_no_a", "sync_values", "closed_form_bytes",
            "optimizer_state_and_rebound", "process_set", "deprecated_spellings")

if __name__ == "__main__":
    names = sys.argv[1:] or list(CHECKS_4)
    if COMM.size == 4:
        SETS["low"], SETS["high"] = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
        hvd.init(process_sets=[SETS["low"], SETS["high"]])
    else:
        hvd.init()
    for name in names:
        globals()[f"check_{name}"]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
