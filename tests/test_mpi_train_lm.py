"""The main job end to end: a short LM run at 4 ranks on Tiny Shakespeare (under a timeout)."""
import json
import math
import os

import pytest

from tests.mpirun import TINY_SHAKESPEARE, check

pytestmark = pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")


def kept(n, density):
    return min(n, max(1, math.ceil(density * n)))


def test_topk_lm_run_4_ranks(tmp_path):
    out = check(4, ["mpi_scripts/train_lm.py", "--compressor", "topk:density=0.01", "--epochs", "2",
                    "--max-steps", "6", "--no-progress", "--data", TINY_SHAKESPEARE,
                    "--output", str(tmp_path)], timeout=400)
    assert "SUMMARY method=topk:density=0.01 ranks=4" in out
    r = json.loads((tmp_path / "results.json").read_text())
    # perplexity falls: from ~vocab size (untrained) and from epoch to epoch
    assert r["initial_val_ppl"] > 5000
    assert r["epochs"][0]["val_ppl"] < 0.5 * r["initial_val_ppl"]
    assert r["epochs"][1]["val_ppl"] < r["epochs"][0]["val_ppl"]
    assert r["config"]["world_size"] == 4 and r["config"]["transport"] == "mpi4py-allgather (1 bucket(s))"
    # bytes per step match the tensor sizes: 8 bytes per kept element (each tensor's own top-k) +
    # 8-byte counts (2 per payload: the 9 gradients of the one bucket are one fused payload)
    h = 100
    sizes = [10000 * h] + [4 * h * h] * 4 + [4 * h] * 4
    sent = sum(8 * kept(n, 0.01) for n in sizes) + 16
    assert r["per_step"]["bytes_sent"]["min"] == r["per_step"]["bytes_sent"]["max"] == sent
    assert r["per_step"]["bytes_received"]["mean"] == 4 * sent
    assert r["per_step"]["dense_bytes"]["mean"] == 4 * sum(sizes)
    for phase in ("compute", "compress", "communicate", "decompress", "wall"):
        assert r["per_step"][phase]["min"] > 0
    assert r["nominal_ratio"] == pytest.approx(50.0, rel=0.01)
    assert r["measured_ratio"] == pytest.approx(4 * sum(sizes) / sent)


def test_bucket_granularity_lm_run_sends_one_payload(tmp_path):
    """--granularity bucket: the whole model (9 gradients, 4.3 MB < --bucket-mb 25) is one bucket
    compressed as one tensor: one top-k of the concatenation, one counts header."""
    out = check(2, ["mpi_scripts/train_lm.py", "--compressor", "topk:density=0.01", "--granularity", "bucket",
                    "--epochs", "1", "--max-steps", "3", "--no-progress", "--data", TINY_SHAKESPEARE,
                    "--output", str(tmp_path)], timeout=400)
    assert "SUMMARY method=topk:density=0.01 ranks=2" in out
    r = json.loads((tmp_path / "results.json").read_text())
    h = 100
    total = 10000 * h + 4 * (4 * h * h) + 4 * (4 * h)
    assert r["config"]["granularity"] == "bucket"
    assert r["per_step"]["bytes_sent"]["min"] == r["per_step"]["bytes_sent"]["max"] == 8 * kept(total, 0.01) + 16
    assert r["epochs"][0]["val_ppl"] < r["initial_val_ppl"]


def test_transformer_lm_run_fused_topk(tmp_path):
    """--arch transformer: 26 gradients of one bucket, each with its own top-k (fused into one
    payload): bytes = 8 per kept entry of each tensor + one counts header; perplexity falls."""
    from hvdcomp.lm import make_lm

    out = check(2, ["mpi_scripts/train_lm.py", "--arch", "transformer", "--compressor", "topk:density=0.01",
                    "--epochs", "1", "--max-steps", "4", "--no-progress", "--data", TINY_SHAKESPEARE,
                    "--output", str(tmp_path)], timeout=400)
    assert "SUMMARY method=topk:density=0.01 ranks=2" in out
    r = json.loads((tmp_path / "results.json").read_text())
    sizes = [p.numel() for p in make_lm("transformer", r["corpus"]["vocab_size"], "small").parameters()]
    assert r["config"]["arch"] == "transformer" and len(sizes) == 26
    assert r["per_step"]["bytes_sent"]["min"] == r["per_step"]["bytes_sent"]["max"] == \
        sum(8 * kept(n, 0.01) for n in sizes) + 16
    assert r["epochs"][0]["val_ppl"] < r["initial_val_ppl"] and math.isfinite(r["test_ppl"])


def test_schedule_warms_up_anneals_and_stops_early(tmp_path):
    """--warmup-steps/--anneal/--early-stop/--min-improvement, replayed by hand from the recorded
    validation perplexities (the study's schedule: lr / 4 after an epoch < 1 % better than the best,
    stop after 2 such epochs in a row)."""
    check(2, ["mpi_scripts/train_lm.py", "--epochs", "6", "--max-steps", "2", "--lr", "60",
              "--warmup-steps", "3", "--early-stop", "2", "--min-improvement", "0.01", "--no-progress",
              "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=400)
    r = json.loads((tmp_path / "results.json").read_text())
    vals, lrs = [e["val_ppl"] for e in r["epochs"]], [e["lr"] for e in r["epochs"]]
    assert lrs[0] == pytest.approx(40.0)        # epoch 1 ends at step 2 of a 3-step warm-up: 60 * 2/3
    best, lr, bad, expect_lr, stop_at = math.inf, 60.0, 0, [], None
    for i, v in enumerate(vals):
        expect_lr.append(lr if i else 40.0)
        if v < best * 0.99:
            bad = 0
        else:
            bad += 1
            lr /= 4
        best = min(best, v)
        if bad == 2:
            stop_at = i + 1
            break
    assert lrs == pytest.approx(expect_lr)
    assert len(vals) == (stop_at or 6) and r["stopped_early"] == (len(vals) < 6)
    assert r["best_val_ppl"] == min(vals) and r["best_epoch"] == vals.index(min(vals)) + 1
    assert r["epochs"][-1]["elapsed_steps"] == 2 * len(vals)


def test_transport_auto_records_the_choice(tmp_path):
    """--transport auto with a latency-bound cost model: top-k's payloads go by gtopk's sparse
    allreduce (one message against top-k's two per bucket), recorded with every prediction."""
    out = check(2, ["mpi_scripts/train_lm.py", "--compressor", "topk:density=0.01", "--transport", "auto",
                    "--cost-model", "1e-3,1e-9", "--epochs", "1", "--max-steps", "2", "--no-progress",
                    "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=300)
    assert "SUMMARY method=topk:density=0.01 ranks=2" in out
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["transport_choice"]["chosen"] == {"name": "gtopk", "density": 0.01}
    assert set(r["transport_choice"]["predicted_s"]) == {"topk (allgather)", "gtopk (sparse-allreduce)",
                                                         "cltk (broadcast+allreduce)"}
    assert r["config"]["compressor"]["name"] == "gtopk" and "sparse-allreduce" in r["config"]["transport"]
