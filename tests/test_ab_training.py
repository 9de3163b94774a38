"""AB-training: factorisation, orientation, the model-compression and traffic metrics (single
process), the algorithm under mpirun (4 ranks; 8 ranks for the 2 x 4 node layout), and the LM job
with AB-training at 4 ranks (2 rank groups of 2)."""
import json
import os

import pytest
import torch

from hvdcomp.lowrank import factorize, kept_rank, matrix_view, model_compression, traffic_summary, unit_singular_values_
from hvdcomp.lowrank.layout import RankLayout
from hvdcomp.lowrank.weights import pad_or_truncate as _pad_or_truncate
from tests.mpirun import TINY_SHAKESPEARE, check


def test_no_cutoff_reproduces_w():
    w = torch.randn(12, 7, generator=torch.Generator().manual_seed(0))
    a, b = factorize(w, cutoff=0.0)
    assert a.shape == (12, 7) and b.shape == (7, 7)
    assert torch.allclose(a @ b, w, atol=1e-5)


def test_cutoff_keeps_count_of_large_singular_values():
    u, _ = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(1)))
    v, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(2)))
    s = torch.tensor([5.0, 2.0, 0.9, 0.4, 0.1, 0.05, 0.01, 0.0])
    w = u[:, :8] @ torch.diag(s) @ v.t()
    for cutoff, expected in ((0.1, 3), (0.05, 4), (0.5, 1), (0.004, 6)):  # count of s_i > cutoff * 5
        assert kept_rank(torch.linalg.svdvals(w), cutoff) == expected
        a, b = factorize(w, cutoff=cutoff)
        assert a.shape == (10, expected) and b.shape == (expected, 8)
    a, b = factorize(w, rank=2)
    best2 = u[:, :2] @ torch.diag(s[:2]) @ v[:, :2].t()          # Eckart-Young: the best rank-2 approximation
    assert torch.allclose(a @ b, best2, atol=1e-5)


@pytest.mark.parametrize("shape", [(32, 1, 3, 3), (32, 32, 3, 3), (64, 32, 3, 3), (64, 64, 3, 3), (128, 256),
                                   (10, 128), (512, 64), (512, 512), (10, 512)])
def test_tall_view_makes_b_the_small_factor(shape):
    """Every weight shape of train_cnn.py's two models: the view is n x m with n >= m = min(dims),
    exactly factorised B is m x m, A is n x m, and A·B, turned back, is the weight."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    out, rest = shape[0], w[0].numel()
    view, flipped = matrix_view(w)
    assert flipped == (out < rest) and view.shape == (max(out, rest), min(out, rest))
    a, b = factorize(view, rank=min(out, rest))
    assert b.shape == (min(out, rest),) * 2 and a.shape == (max(out, rest), min(out, rest))
    back = (a @ b).t() if flipped else a @ b
    assert torch.allclose(back.reshape(shape), w, atol=1e-4)
    rows, flipped_rows = matrix_view(w, "rows")                   # hvdcomp's earlier layout
    assert rows.shape == (out, rest) and not flipped_rows
    with pytest.raises(ValueError, match="orientation"):
        matrix_view(w, "wide")


def test_model_compression_equals_a_hand_count():
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 6),
                                torch.nn.Linear(6, 3))
    # conv 8 x 36 at rank 3: 3 * (8 + 36) = 132 instead of 288; Linear(8, 6) (6 x 8) at rank 2:
    # 2 * 14 = 28 instead of 48; the biases (8 + 6 + 3) and Linear(6, 3) (18) as they are
    full = 288 + 8 + 48 + 6 + 18 + 3
    got = model_compression(model.named_parameters(), {"0.weight": 3, "2.weight": 2})
    assert got == {"full_parameters": full, "parameters": 132 + 8 + 28 + 6 + 18 + 3,
                   "ratio": full / (132 + 8 + 28 + 6 + 18 + 3)}
    assert full == 371 and model_compression(model.named_parameters(), {})["ratio"] == 1.0
    with pytest.raises(ValueError, match="outside"):
        model_compression(model.named_parameters(), {"2.weight": 7})
    with pytest.raises(ValueError, match="not parameters"):
        model_compression(model.named_parameters(), {"9.weight": 1})


def test_traffic_summary_mean_over_ranks_and_between_nodes():
    dense = 1000
    reports = [{"dense_bytes": dense, "nodes": 2, "bytes_sent": 500, "internode_bytes_sent": 300,
                "bytes_by_stage": {"warmup": 300, "grouped": 200}, "internode_bytes_by_stage": {"warmup": 300}},
               {"dense_bytes": dense, "nodes": 2, "bytes_sent": 300, "internode_bytes_sent": 100,
                "bytes_by_stage": {"warmup": 100, "grouped": 200}, "internode_bytes_by_stage": {"warmup": 100}}]
    s = traffic_summary(reports)
    assert s["bytes_sent_mean"] == 400 and s["bytes_between_nodes_mean"] == 200
    assert s["ratio_mean"] == 2.5 and s["ratio_between_nodes"] == 5.0 and s["reduction_between_nodes"] == 0.8
    assert s["bytes_by_stage_mean"] == {"warmup": 200, "grouped": 200}
    assert s["between_nodes_by_stage_mean"] == {"warmup": 200}
    one = traffic_summary([{**r, "nodes": 1, "internode_bytes_sent": 0} for r in reports])
    assert one["ratio_between_nodes"] is None and one["ratio_mean"] == 2.5
    with pytest.raises(ValueError, match="disagree"):
        traffic_summary([reports[0], {**reports[1], "dense_bytes": 7}])


def test_traffic_summary_reads_results_written_before_the_stage_rename():
    """Reports with the old keys (bytes_by_phase, ...) give the same summary; the summary answers
    the old keys with a DeprecationWarning and holds only the new ones."""
    new = [{"dense_bytes": 1000, "nodes": 2, "bytes_sent": 500, "internode_bytes_sent": 300,
            "bytes_by_stage": {"warmup": 300, "sync": 200}, "internode_bytes_by_stage": {"warmup": 300}},
           {"dense_bytes": 1000, "nodes": 2, "bytes_sent": 100, "internode_bytes_sent": 100,
            "bytes_by_stage": {"warmup": 100}, "internode_bytes_by_stage": {"warmup": 100}}]
    before = {"bytes_by_stage": "bytes_by_phase", "internode_bytes_by_stage": "internode_bytes_by_phase"}
    old = [{before.get(k, k): v for k, v in r.items()} for r in new]
    s = traffic_summary(new)
    assert traffic_summary(old) == s and s["bytes_by_stage_mean"] == {"warmup": 200, "sync": 100}
    assert s["between_nodes_by_stage_mean"] == {"warmup": 200}
    with pytest.warns(DeprecationWarning, match="renamed 'bytes_by_stage_mean'"):
        assert s["bytes_by_phase_mean"] == {"warmup": 200, "sync": 100}
    with pytest.warns(DeprecationWarning):
        assert s.get("between_nodes_by_phase_mean") == {"warmup": 200}
    assert "bytes_by_phase_mean" not in json.loads(json.dumps(s)) and s.get("no_such_key", 7) == 7
    with pytest.raises(KeyError):
        s["no_such_key"]


def test_rank_layout_of_2x4_nodes():
    """8 ranks on 2 nodes of 4: rank groups "node" are the nodes; 4 rank groups of 2 in mode ab:
    rank groups 0, 1 (ranks 0-3) train A, rank groups 2, 3 (ranks 4-7) train B."""
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    by_node = RankLayout.build(nodes, 5, "node", "only-b")
    assert by_node.rank_group_of == nodes and by_node.trainer_of == ["B"] * 8
    assert by_node.rank_group_members() == [4, 5, 6, 7] and by_node.n_rank_groups == 2 and by_node.n_nodes == 2
    ab = RankLayout.build(nodes, 2, 4, "ab")
    assert ab.rank_group_of == [0, 0, 1, 1, 2, 2, 3, 3] and ab.trainer_of == ["A"] * 4 + ["B"] * 4
    assert ab.rank_group_members() == [2, 3] and ab.trainers() == [0, 1, 2, 3] and ab.trainer_rank_groups() == 2
    assert ab.first_trainer() == {"A": 0, "B": 4} and ab.trains == "A"
    with pytest.raises(ValueError, match="must divide"):
        RankLayout.build(nodes, 0, 3, "only-b")
    with pytest.raises(ValueError, match="rank_groups >= 2"):
        RankLayout.build([0, 0], 0, "node", "ab")


def test_optimizer_state_padded_or_truncated():
    t = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(_pad_or_truncate(t, (2, 3)), t[:2])
    grown = _pad_or_truncate(t, (5, 3))
    assert torch.equal(grown[:4], t) and torch.equal(grown[4], torch.zeros(3))
    assert torch.equal(_pad_or_truncate(t, (4, 2)), t[:, :2])


def test_unit_singular_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    bias = model[0].bias.detach().clone()
    names = unit_singular_values_(model)
    assert names == ["0.weight", "2.weight"] and torch.equal(model[0].bias, bias)
    for p in (model[0].weight, model[2].weight):
        s = torch.linalg.svdvals(p.detach().reshape(p.shape[0], -1))
        assert torch.allclose(s, torch.ones_like(s), atol=1e-5)


def test_algorithm_on_4_ranks():
    out = check(4, ["tests/mpi/ab_checks.py"], timeout=300)
    for name in ("group_averaging", "full_rank_matches_data_parallel", "schedule_and_sync",
                 "orientation_every_cnn_layer", "cut_keeps_large_singular_values", "only_b_updates_no_a",
                 "sync_values", "closed_form_bytes", "optimizer_state_and_rebound", "process_set"):
        assert f"OK {name}" in out, out[-3000:]
    assert "OK deprecated_spellings" in out, out[-3000:]


def test_closed_form_bytes_on_2x4_node_groups():
    out = check(8, ["tests/mpi/ab_checks.py", "closed_form_bytes_2x4"], timeout=300)
    assert "OK closed_form_bytes_2x4" in out, out[-3000:]


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_with_ab_training_at_4_ranks(tmp_path):
    spec = "rank_groups=2,warmup_steps=2,steps_between_syncs=2,full_rank_steps=1,cutoff=0.3,ramp_steps=2"
    check(4, ["mpi_scripts/train_lm.py", "--ab-training", spec, "--epochs", "1", "--max-steps", "6",
              "--no-progress", "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=300)
    r = json.loads((tmp_path / "results.json").read_text())
    ab = r["ab_training"]
    assert ab["steps_by_stage"] == {"warmup": 2, "grouped": 3, "full-rank": 1}   # 2 + [2 + 1] + 1
    assert set(ab["bytes_by_stage"]) == {"warmup", "grouped", "sync", "full-rank"}
    dense = 4 * 1_161_600
    assert ab["bytes_by_stage"]["warmup"] == 2 * dense and ab["dense_bytes"] == 6 * dense
    assert ab["traffic_ratio"] == pytest.approx(ab["dense_bytes"] / ab["bytes_sent"])
    assert r["config"]["compressor"]["rank_groups"] == 2 and r["config"]["compressor"]["cutoff"] == 0.3


# ---- the learning-rate rebound against the authors' trainer ------------------------------------
def _authors_rates(schedule, switches_after, n_steps, ramp_steps, warmup_lr=1e-5):
    """The rate each step runs at in the authors' trainer (madonna/trainers/ab_lowrank.py and
    base_trainer.py, one parameter group, per-update schedule), simulated as it runs: before
    each step `_pre_forward` lowers the set rate to k·factor while the rebound lasts; after the
    step the scheduler sets the next update's rate; then `_post_train_step`, at a switch, takes
    factor = (that rate − warmup_lr) / ramp_steps and sets the rate to warmup_lr."""
    lr, in_rebound, k, factor, used = schedule(0), False, 0, 0.0, []
    for step in range(n_steps):
        if in_rebound:                                   # _pre_forward
            k += 1
            if factor * k < lr:
                lr = factor * k
            if k >= ramp_steps:
                in_rebound = False
        used.append(lr)                                  # optimizer step
        lr = schedule(step + 1)                          # lr_scheduler.step_update
        if step in switches_after:                       # _post_train_step -> _setup_lr_rebound
            in_rebound, k = True, 0
            factor = (lr - warmup_lr) / ramp_steps
            lr = warmup_lr
    return used


def _hvdcomp_rates(schedule, switches_after, n_steps, ramp_steps, ramp_start_lr=1e-5):
    """hvdcomp's Rebound driven as ABTraining.step drives it."""
    from hvdcomp.lowrank.schedule import Rebound
    rebound, used = Rebound(ramp_steps, ramp_start_lr), []
    for step in range(n_steps):
        base = schedule(step)
        used.append(rebound.lr(base))
        rebound.advance(base)
        if step in switches_after:
            rebound.restart()
    return used


@pytest.mark.parametrize("ramp_steps", [1, 3, 15, 267])
def test_rebound_follows_the_authors_trainer(ramp_steps):
    """Every step's rate equals the authors' trainer's, under a per-update cosine schedule with
    switches closer together than the ramp (a new switch restarts it) and far apart; the first
    step after a switch runs at 1e-5 (before the fix: at the slope, 3.3e-3 at lr 1e-2 and 3
    ramp steps)."""
    import math
    n = 3 * ramp_steps + 40
    schedule = lambda t: 1e-5 + 0.5 * (1e-2 - 1e-5) * (1 + math.cos(math.pi * t / n))   # noqa: E731
    switches = {4, 5, 9 + ramp_steps, 10 + 2 * ramp_steps}
    want = _authors_rates(schedule, switches, n, ramp_steps)
    got = _hvdcomp_rates(schedule, switches, n, ramp_steps)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[5] == 1e-5 and got[6] == 1e-5            # the first step after each switch
    assert got[0] == schedule(0) and got[-1] == schedule(n - 1)


def test_rebound_hand_worked():
    """lr 0.01 held, ramp 3 from 0.001, a switch after step 1: 0.001, then 2·0.003, 3·0.003,
    then 0.01 again; no switch, no rebound; ramp_steps 0, no rebound."""
    from hvdcomp.lowrank.schedule import Rebound
    got = _hvdcomp_rates(lambda t: 0.01, {1}, 7, 3, ramp_start_lr=0.001)
    assert got == pytest.approx([0.01, 0.01, 0.001, 0.006, 0.009, 0.01, 0.01], abs=1e-15)
    assert _hvdcomp_rates(lambda t: 0.01, set(), 4, 3) == [0.01] * 4
    r = Rebound(0, 1e-5)
    r.restart()
    assert r.lr(0.02) == 0.02
    r = Rebound(2, 0.1)                                  # schedule below the start: rate 0 (theirs: negative)
    r.restart()
    assert r.lr(0.05) == 0.0


def test_default_cutoff_is_the_authors():
    """The authors' VGG16/CIFAR-10 configuration cuts at 0.15 (configs/cifar10/vgg16/common.yaml)."""
    import inspect
    from hvdcomp.lowrank import ABTraining
    assert inspect.signature(ABTraining).parameters["cutoff"].default == 0.15
