"""AB-training: factorisation (single process), group averaging and schedule under mpirun -np 4,
and the LM job with AB-training at 4 ranks (2 groups of 2)."""
import json
import os

import pytest
import torch

from hvdcomp.lowrank import factorize, kept_rank
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


def test_group_averaging_schedule_and_full_rank_phase_on_4_ranks():
    out = check(4, ["tests/mpi/ab_checks.py"], timeout=240)
    for name in ("group_averaging", "full_rank_matches_data_parallel", "schedule_and_sync"):
        assert f"OK {name}" in out, out[-3000:]


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_with_ab_training_at_4_ranks(tmp_path):
    spec = "groups=2,warmup_steps=2,steps_between_syncs=2,full_rank_steps=1,cutoff=0.3,ramp_steps=2"
    check(4, ["mpi_scripts/train_lm.py", "--ab-training", spec, "--epochs", "1", "--max-steps", "6",
              "--no-progress", "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=300)
    r = json.loads((tmp_path / "results.json").read_text())
    ab = r["ab_training"]
    assert ab["steps_by_phase"] == {"warmup": 2, "grouped": 3, "full-rank": 1}   # 2 + [2 + 1] + 1
    assert set(ab["bytes_by_phase"]) == {"warmup", "grouped", "sync", "full-rank"}
    dense = 4 * 1_161_600
    assert ab["bytes_by_phase"]["warmup"] == 2 * dense and ab["dense_bytes"] == 6 * dense
    assert ab["compression_ratio"] == pytest.approx(ab["dense_bytes"] / ab["bytes_sent"])
    assert r["config"]["compressor"]["groups"] == 2 and r["config"]["compressor"]["cutoff"] == 0.3
