"""AB-training's CNN on scikit-learn's digits (mpi_scripts/train_cnn.py) and its report: the model's
size in closed form, the bytes of each phase against the schedule, under mpirun with a timeout."""
import json
import os

import pytest

pytest.importorskip("sklearn")
from mpi_scripts import report_ab  # noqa: E402
from mpi_scripts.train_cnn import DigitsVGG, load_digits_split  # noqa: E402
from tests.mpirun import check  # noqa: E402

AB = "groups=2,warmup_steps=5,steps_between_syncs=6,full_rank_steps=2,ramp_steps=2,cutoff=0.3"


def test_model_size_and_shapes_in_closed_form():
    m = DigitsVGG(width=32)
    convs = (1 * 32 + 32 * 32 + 32 * 64 + 64 * 64) * 9 + 32 + 32 + 64 + 64
    linears = 256 * 128 + 128 + 128 * 10 + 10
    assert sum(p.numel() for p in m.parameters()) == convs + linears == 99178
    x_train, y_train, x_test, y_test = load_digits_split()
    assert x_train.shape == (1397, 1, 8, 8) and x_test.shape == (400, 1, 8, 8)
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) == 1.0
    assert sorted(set(y_test.tolist())) == list(range(10))
    assert m(x_test[:3]).shape == (3, 10)


def test_ab_training_bytes_per_phase_follow_the_schedule(tmp_path):
    # 2 epochs of 1397 // 64 = 21 steps: 5 warm-up, then 37 = 4 cycles of (6 grouped + 2 full-rank) + 5 grouped
    out = check(4, ["mpi_scripts/train_cnn.py", "--epochs", "2", "--ab-training", AB,
                    "--output", str(tmp_path / "ab")], timeout=300)
    assert "SUMMARY method=ab-training" in out
    r = json.loads((tmp_path / "ab" / "results.json").read_text())
    c, dense_step = r["communication"], 4 * 99178
    assert r["steps"] == 42 and c["steps_by_phase"] == {"warmup": 5, "grouped": 4 * 6 + 5, "full-rank": 4 * 2}
    assert c["bytes_by_phase"]["warmup"] == 5 * dense_step           # every fp32 gradient
    assert c["bytes_by_phase"]["full-rank"] == 8 * dense_step
    assert c["dense_bytes"] == 42 * dense_step
    assert c["bytes_sent"] == sum(c["bytes_by_phase"].values())
    assert c["compression_ratio"] == pytest.approx(c["dense_bytes"] / c["bytes_sent"])
    assert c["compression_ratio"] > 1.0                               # grouped steps send factors
    assert r["test_accuracy"] > 0.5                                   # 10 classes: chance is 0.1
    full = check(4, ["mpi_scripts/train_cnn.py", "--epochs", "1", "--output", str(tmp_path / "full")], timeout=300)
    f = json.loads((tmp_path / "full" / "results.json").read_text())
    assert "method=none" in full and f["communication"]["compression_ratio"] == pytest.approx(1.0)


def fake(seed, acc, phases, dense):
    return {"config": {"seed": seed, "parameters": 99178, "data": "digits", "world_size": 4, "epochs": 2,
                       "batch_size": 64},
            "epochs": [{"test_accuracy": acc - 0.1}, {"test_accuracy": acc}], "test_accuracy": acc,
            "communication": {"bytes_by_phase": phases, "bytes_sent": sum(phases.values()), "dense_bytes": dense,
                              "compression_ratio": dense / sum(phases.values()),
                              "ranks_kept": {"features.2.weight": 7}}}


def test_report_means_and_ratios(tmp_path):
    for seed, acc in ((1, 0.96), (2, 0.98)):
        for label, phases in (("full-rank", {"full-rank": 4e6}), ("ab-cutoff-0.3", {"warmup": 1e6, "grouped": 1e6})):
            d = tmp_path / "cells" / f"digits-vgg-np4-{label}-seed{seed}"
            os.makedirs(d)
            (d / "results.json").write_text(json.dumps(fake(seed, acc, phases, 4e6)))
    assert report_ab.main([str(tmp_path), "--command", "make study"]) == 0
    text = (tmp_path / "report.md").read_text()
    # accuracy 97.00 ± 1.41 (sd of 96, 98); AB: 1 + 1 MB of 4 MB -> 2:1
    assert "| ab-cutoff-0.3 | 1, 2 | 97.00 ± 1.41 | 1.0 ± 0.0 | 1.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 2.0 ± 0.0 | 2.00 ± 0.00:1 |" in text
    assert "| full-rank | 1, 2 | 97.00 ± 1.41 | 0.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 4.0 ± 0.0 | 4.0 ± 0.0 | 1.00 ± 0.00:1 |" in text
    assert "44.14:1" in text and (tmp_path / "ab_accuracy.png").stat().st_size > 1000
