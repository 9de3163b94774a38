"""AB-training's models on scikit-learn's digits (mpi_scripts/train_cnn.py) and its report: the
models' sizes in closed form, the bytes of each AB-training stage (mean over ranks and between the nodes of a
2 x 2 layout) and the model compression against the schedule, under mpirun with a timeout."""
import json
import os

import pytest

pytest.importorskip("sklearn")
from mpi_scripts import report  # noqa: E402
from mpi_scripts.train_cnn import DigitsMLP, DigitsVGG, learning_rate, load_digits_split  # noqa: E402
from tests.mpirun import check  # noqa: E402

AB = "warmup_steps=5,steps_between_syncs=6,full_rank_steps=2,ramp_steps=2,cutoff=0.3"
# factorised weights of DigitsVGG(32): name -> (n, m) of the tall view
VGG_FACTORS = {"features.2.weight": (288, 32), "features.5.weight": (288, 64), "features.7.weight": (576, 64),
               "classifier.1.weight": (256, 128)}


def test_model_sizes_and_shapes_in_closed_form():
    m = DigitsVGG(width=32)
    convs = (1 * 32 + 32 * 32 + 32 * 64 + 64 * 64) * 9 + 32 + 32 + 64 + 64
    linears = 256 * 128 + 128 + 128 * 10 + 10
    assert sum(p.numel() for p in m.parameters()) == convs + linears == 99178
    mlp = DigitsMLP(hidden=512)
    assert sum(p.numel() for p in mlp.parameters()) == 64 * 512 + 512 + 2 * (512 * 512 + 512) + 5120 + 10 == 563722
    assert set(DigitsMLP.FULL_RANK) <= {n for n, _ in mlp.named_parameters()}
    assert set(DigitsVGG.FULL_RANK) <= {n for n, _ in m.named_parameters()}
    x_train, y_train, x_test, y_test = load_digits_split()
    assert x_train.shape == (1397, 1, 8, 8) and x_test.shape == (400, 1, 8, 8)
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) == 1.0
    assert sorted(set(y_test.tolist())) == list(range(10))
    assert m(x_test[:3]).shape == (3, 10) and mlp(x_test[:3]).shape == (3, 10)


def test_learning_rate_schedule():
    # warm-up from 1e-5 over 10 steps to 1e-3, then a cosine to 1e-5 over the other 90
    assert learning_rate(0, 100, 10, 1e-3, 1e-5) == 1e-5
    assert learning_rate(5, 100, 10, 1e-3, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert learning_rate(10, 100, 10, 1e-3, 1e-5) == pytest.approx(1e-3)
    assert learning_rate(55, 100, 10, 1e-3, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert learning_rate(100, 100, 10, 1e-3, 1e-5) == pytest.approx(1e-5)


def test_ab_training_bytes_and_model_compression_follow_the_schedule(tmp_path):
    # 2 epochs of 1397 // 64 = 21 steps: 5 warm-up, then 37 = 4 cycles of (6 grouped + 2 full-rank) + 5 grouped
    opts = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1", "--clip", "1", "--init", "ortho-sigma",
            "--ranks-per-node", "2"]
    out = check(4, ["mpi_scripts/train_cnn.py", "--epochs", "2", "--ab-training", AB, *opts,
                    "--output", str(tmp_path / "ab")], timeout=300)
    assert "SUMMARY method=ab-training" in out
    r = json.loads((tmp_path / "ab" / "results.json").read_text())
    t, P, dense_step = r["traffic"], 99178, 4 * 99178
    U = P - sum(n * m for n, m in VGG_FACTORS.values())             # 1-D, first layer, classifier: 1,898
    assert U == 1898 and r["steps"] == 42 and t["nodes"] == 2 and t["ranks"] == 4
    assert r["steps_by_stage"] == {"warmup": 5, "grouped": 4 * 6 + 5, "full-rank": 4 * 2}
    hist = r["model_compression"]["history"]
    assert [h["step"] for h in hist] == [5, 13, 21, 29, 37]
    assert hist[0]["ranks"] == {k: m for k, (n, m) in VGG_FACTORS.items()}   # the first factorisation is exact
    b_size = [sum(h["ranks"][k] * m for k, (n, m) in VGG_FACTORS.items()) for h in hist]
    mean = t["bytes_by_stage_mean"]
    assert mean["warmup"] == 5 * dense_step and mean["full-rank"] == 8 * dense_step   # every fp32 gradient
    # grouped: B's gradient, the 1-D parameters and the full-rank layers inside the node, every step
    assert mean["grouped"] == sum(steps * 4 * (b + U) for steps, b in zip([6, 6, 6, 6, 5], b_size))
    # four syncs: B over all ranks; rank 0's unfactorised parameters broadcast (one rank of 4 sends);
    # four cuts agree 4 kept ranks (int64)
    assert mean["sync"] == sum(4 * b for b in b_size[:4]) + 4 * 4 * U / 4 + 4 * 4 * 8
    assert t["between_nodes_by_stage_mean"] == {k: mean[k] for k in ("warmup", "full-rank", "sync")}
    assert t["dense_bytes"] == 42 * dense_step
    assert t["ratio_mean"] == pytest.approx(42 * dense_step / sum(mean.values()))
    assert t["ratio_between_nodes"] == pytest.approx(42 * dense_step / (sum(mean.values()) - mean["grouped"]))
    # model compression: A + B of every factorised weight at its kept rank, the rest as it is
    for h in hist:
        params = P - sum(n * m for n, m in VGG_FACTORS.values()) + sum(
            h["ranks"][k] * (n + m) for k, (n, m) in VGG_FACTORS.items())
        assert h["parameters"] == params and h["ratio"] == pytest.approx(P / params)
    assert r["model_compression"]["final"]["ratio"] == hist[-1]["ratio"]
    assert r["test_accuracy"] > 0.5                                   # 10 classes: chance is 0.1
    assert set(r["singular_values"]) == {n for n in VGG_FACTORS} | {"features.0.weight", "classifier.4.weight"}
    full = check(4, ["mpi_scripts/train_cnn.py", "--epochs", "1", "--ranks-per-node", "2",
                     "--output", str(tmp_path / "full")], timeout=300)
    f = json.loads((tmp_path / "full" / "results.json").read_text())
    assert "method=none" in full and f["traffic"]["ratio_mean"] == pytest.approx(1.0)
    assert f["traffic"]["ratio_between_nodes"] == pytest.approx(1.0) and f["model_compression"]["final"]["ratio"] == 1.0


def fake(seed, acc, ab, old_keys=False):
    """A results.json of train_cnn.py: 1,000 parameters, one factorised 40 x 10 weight "w"; with
    ``old_keys``, as written before the stage rename (bytes_by_phase_mean, steps_by_phase, groups)."""
    cfg = {"seed": seed, "model": "vgg", "weight_decay": 0.1, "parameters": 1000, "data": "digits", "world_size": 4,
           "nodes": 2, "batch_size": 64, "epochs": 2, "optimizer": "adamw", "lr": 3e-3, "clip": 1.0,
           "label_smoothing": 0.1, "init": "ortho-sigma", "lr_warmup_epochs": 0.0, "min_lr": 1e-5,
           "ab_training": "x" if ab else None}
    sv = {"w": {"view": [40, 10], "sigma": [4.0, 2.0, 0.5] + [0.1] * 7}}
    if ab:
        cfg["ab"] = {"factorized": ["w"], "cutoff": 0.15, "full_rank": ["first"], "mode": "only-b", "sync": "b",
                     "orientation": "tall", "rank_groups": "node", "n_rank_groups": 2, "warmup_steps": 10,
                     "steps_between_syncs": 5, "full_rank_steps": 1, "ramp_steps": 2, "cut_first": False}
        stages = {"warmup": 1e6, "grouped": 2e6, "sync": 0.1e6, "full-rank": 0.4e6}
        traffic = {"bytes_by_stage_mean": stages, "bytes_sent_mean": 3.5e6, "ratio_mean": 6 / 3.5,
                   "bytes_between_nodes_mean": 1.5e6, "ratio_between_nodes": 4.0, "reduction_between_nodes": 0.75}
        steps = {"warmup": 10, "grouped": 25, "full-rank": 5}
        hist = [{"step": 10, "ratio": 1000 / 1100, "ranks": {"w": 10}},
                {"step": 16, "ratio": 1000 / 700, "ranks": {"w": 2}}]
        comp = {"final": {"ratio": 1000 / 700}, "history": hist, "ranks_kept": {"w": 2}}
    else:
        traffic = {"bytes_by_stage_mean": {"full-rank": 6e6}, "bytes_sent_mean": 6e6, "ratio_mean": 1.0,
                   "bytes_between_nodes_mean": 6e6, "ratio_between_nodes": 1.0, "reduction_between_nodes": 0.0}
        steps = {"full-rank": 40}
        comp = {"final": {"ratio": 1.0}, "history": [], "ranks_kept": {}}
    out = {"config": cfg, "epochs": [{"test_accuracy": acc - 0.1}, {"test_accuracy": acc}], "test_accuracy": acc,
           "steps": 40, "steps_by_stage": steps, "traffic": traffic, "model_compression": comp,
           "singular_values": sv, "adamw_decay_factor": 0.9}
    if old_keys:
        out["steps_by_phase"] = out.pop("steps_by_stage")
        traffic["bytes_by_phase_mean"] = traffic.pop("bytes_by_stage_mean")
        for new, old in (("rank_groups", "groups"), ("n_rank_groups", "n_groups")) if ab else ():
            cfg["ab"][old] = cfg["ab"].pop(new)
    return out


@pytest.mark.parametrize("old_keys", [False, True], ids=["stage-keys", "phase-keys-before-the-rename"])
def test_report_keeps_traffic_and_model_compression_apart(tmp_path, old_keys):
    for seed, (acc_ab, acc_full) in ((1, (0.96, 0.97)), (2, (0.98, 0.99))):
        for label, r in (("vgg-ab", fake(seed, acc_ab, True, old_keys)),
                         ("vgg-full-rank", fake(seed, acc_full, False, old_keys))):
            d = tmp_path / "cells" / f"digits-np4-{label}-seed{seed}"
            os.makedirs(d)
            (d / "results.json").write_text(json.dumps(r))
    assert report.main(["ab", str(tmp_path), "--command", "make study"]) == 0
    text = (tmp_path / "report.md").read_text()
    # accuracy 97.00 ± 1.41 against 98.00 ± 1.41: -1.00 pp, spread sqrt(2) * 1.41 = 2.00
    assert ("| vgg | vgg-ab | 0.1 | 1, 2 | 97.00 ± 1.41 | -1.00 (spread 2.00) | "
            "within the seed spread of vgg-full-rank |") in text
    # traffic: 3.5 of 6 MB per rank (1.71:1), 1.5 between nodes (4:1, 75 %); 15 of 40 steps full rank
    assert ("| vgg | vgg-ab | 1.0 ± 0.0 | 2.0 ± 0.0 | 0.1 ± 0.0 | 0.4 ± 0.0 | 3.5 ± 0.0 | 1.71 ± 0.00:1 | "
            "1.5 ± 0.0 | "
            "4.00 ± 0.00:1 | 75.0 ± 0.0 % | 37.5 % | 2.67:1 |") in text
    # model compression: 600 + 2 * (40 + 10) = 700 of 1,000; rank 1: 650 -> 1.5:1
    assert "| vgg | vgg-ab | 1, 2 | 1.43 ± 0.00:1 | w 2/10; w 2/10 | 1.5:1 |" in text
    assert "| 16 | 1.43:1 | 2 |" in text
    assert "| vgg | vgg-ab | 75.0 % (4.00:1) | above | within the seed spread of vgg-full-rank | met | 1.43:1 |" in text
    assert "44.14:1" in text and "70.31 %" in text
    assert "rank groups node (2 rank groups)" in text                 # the configuration, either spelling
    assert "| vgg | vgg-ab | 0.1 | 0.90 | w (40 x 10) | 4.00 | 2 / 10 | 0.025 |" in text   # 4, 2 > 0.6; 0.1 / 4
    for png in ("ab_accuracy.png", "ab_compression.png", "ab_spectra.png"):
        assert (tmp_path / png).stat().st_size > 1000
