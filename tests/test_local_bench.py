"""benchmarks/netem_local.py without running it: the cells and commands it would launch, and its
report's arithmetic (time to target, speed-ups, bytes ratio, the targets' verdicts) on
hand-made cell results."""
import os
import sys

import pytest

from tests.mpirun import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netem_local  # noqa: E402


def test_cells_and_commands():
    args = netem_local.parse_args(["--output", "/tmp/unused", "--dry-run", "--seeds", "1", "2", "--rates", "10mbit",
                                   "--contenders", "sync|fp16@ring", "co2|32|topk:density=0.01"])
    driver = netem_local.LocalDriver(args)
    cells = driver.cells()
    assert [c["name"] for c in cells] == ["sync_fp16_ring-seed1", "sync_fp16_ring-seed2",
                                          "co2_32_topk_density-0.01-seed1", "co2_32_topk_density-0.01-seed2"]
    ring, co2 = (" ".join(driver.mpirun_command(c, "X.json")) for c in (cells[0], cells[2]))
    assert "OMPI_MCA_coll_tuned_allreduce_algorithm=4" in ring and "--compressor fp16 --seed 1" in ring
    assert "OMPI_MCA_coll_tuned" not in co2
    assert "--local-steps 32 --outer-opt co2 --compressor topk:density=0.01 --seed 1" in co2
    with pytest.raises(SystemExit):
        netem_local.parse_args(["--contenders", "diloco|0|none"])


def cell(contender, seed, best, curve, sent, step=1.0, compute=0.9, rate="10mbit"):
    lu = {"bytes_sent_per_step": sent} if "|" in contender and not contender.startswith("sync") else None
    return {"status": "ok", "contender": contender, "driver": {"rate": rate},
            "train_lm": {"best_val_ppl": best, "test_ppl": best + 1, "config": {"parameters": 1000},
                         "epochs": [{"steps": 10, "elapsed_seconds": t, "val_ppl": p} for t, p in curve],
                         "per_step": {"bytes_sent": {"mean": sent}, "wall": {"mean": step}, "compute": {"mean": compute}},
                         **({"local_update": lu} if lu else {})}}


def test_report_arithmetic():
    base, vs, local = "sync|fp16@ring", "sync|topk:density=0.01", "diloco|8|none"
    cells = [cell(base, 1, 100.0, [(50, 300), (100, 120), (150, 100)], sent=2000, step=10.0),
             cell(base, 2, 110.0, [(60, 300), (120, 115), (180, 110)], sent=2000, step=10.0),
             cell(vs, 1, 116.0, [(20, 200), (40, 118), (60, 116)], sent=80),
             cell(local, 1, 104.0, [(5, 200), (10, 114), (15, 104)], sent=30, step=0.95, compute=0.9),
             cell(local, 2, 108.0, [(6, 200), (12, 130), (18, 108)], sent=30, step=0.95, compute=0.9)]
    rows = netem_local.summarize(cells, base, vs, 1.1)["10mbit"]
    target = 1.1 * 105.0  # 1.1 x the baseline's mean best (100, 110)
    assert rows[local]["target_ppl"] == pytest.approx(target)
    # the first epoch end at or below 115.5: baseline seeds at 150 and 120 s; local at 10 and 18 s
    assert rows[base]["time_to_target_s"] == pytest.approx(135.0)
    assert rows[local]["time_to_target_s"] == pytest.approx(14.0)
    assert rows[vs]["time_to_target_s"] is None and rows[vs]["reached_target"] == "0/1"  # never at or below 115.5
    assert rows[local]["speedup_vs_baseline"] == pytest.approx(135.0 / 14.0)
    assert rows[local]["ratio_vs_dense_fp32"] == pytest.approx(4000 / 30)
    assert rows[local]["best_val_ppl"]["mean"] == 106.0 and rows[local]["best_val_ppl"]["max"] == 108.0
    lines = "\n".join(netem_local.targets(rows, base, "10mbit"))
    assert "perplexity 106.0 no worse than the baseline's 105.0 + its seed spread (10.0): met" in lines  # 106 <= 115
    assert "fewer bytes per step than dense fp32 (133x): met" in lines
    assert "step within 1.1x of its compute (1.06x): met" in lines
    assert "time to target >= 5x less than the baseline (9.6x): met" in lines
    assert "less than synchronous top-k (n/a): missed" in lines
    assert "| diloco|8|none | 2 |" in netem_local.report_markdown({"10mbit": rows}, base, vs)


def test_perplexity_verdict_is_one_sided_and_needs_baseline_seeds():
    base, vs = "sync|fp16@ring", "sync|topk:density=0.01"
    runs = [cell(base, 1, 100.0, [(10, 100)], sent=2000), cell(base, 2, 110.0, [(10, 110)], sent=2000),
            cell("diloco|8|none", 1, 80.0, [(5, 80)], sent=30),          # better than the baseline: met
            cell("co2|8|none", 1, 115.5, [(5, 115.5)], sent=30)]         # 115.5 > 105 + 10: missed
    lines = "\n".join(netem_local.targets(netem_local.summarize(runs, base, vs, 1.1)["10mbit"], base, "10mbit"))
    assert "perplexity 80.0 no worse than the baseline's 105.0 + its seed spread (10.0): met" in lines
    assert "perplexity 115.5 no worse than the baseline's 105.0 + its seed spread (10.0): missed" in lines
    one = netem_local.summarize([runs[0], runs[2]], base, vs, 1.1)["10mbit"]
    assert "(0.0): not judged (the baseline has one seed)" in "\n".join(netem_local.targets(one, base, "10mbit"))
