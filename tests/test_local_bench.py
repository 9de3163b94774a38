"""benchmarks/netem_local.py without running it: the cells and commands it would launch, and its
report's arithmetic (mpi_scripts/report.py local: time to target, speed-ups, bytes ratio, the targets' verdicts) on
hand-made cell results."""
import os
import sys

import pytest

from tests.mpirun import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netem_local  # noqa: E402
from mpi_scripts import report  # noqa: E402


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


def verdict_block(lines, contender):
    """The report's target lines of one contender (its "- name:" line and the indented ones after)."""
    blocks = "\n".join(lines).split("\n- ")
    return next(b for b in blocks if b.lstrip("- ").startswith(contender + ":"))


def test_report_arithmetic():
    base, vs, local = "sync|fp16@ring", "sync|topk:density=0.01", "diloco|8|none"
    cells = [cell(base, 1, 100.0, [(50, 300), (100, 120), (150, 100)], sent=2000, step=10.0),
             cell(base, 2, 110.0, [(60, 300), (120, 115), (180, 110)], sent=2000, step=10.0),
             cell(vs, 1, 116.0, [(20, 200), (40, 118), (60, 116)], sent=80),
             cell(local, 1, 104.0, [(5, 200), (10, 114), (15, 104)], sent=30, step=0.95, compute=0.9),
             cell(local, 2, 108.0, [(6, 200), (12, 130), (18, 108)], sent=30, step=0.95, compute=0.9)]
    rows = report.local_summary(cells, base, vs, 1.1)["10mbit"]
    target = 1.1 * 105.0  # 1.1 x the baseline's mean best (100, 110)
    assert rows[local]["target_ppl"] == pytest.approx(target)
    # the first epoch end at or below 115.5: baseline seeds at 150 and 120 s; local at 10 and 18 s
    assert rows[base]["time_to_target_s"] == pytest.approx(135.0)
    assert rows[local]["time_to_target_s"] == pytest.approx(14.0)
    assert rows[vs]["time_to_target_s"] is None and rows[vs]["reached_target"] == "0/1"  # never at or below 115.5
    assert rows[local]["speedup_vs_baseline"] == pytest.approx(135.0 / 14.0)
    assert rows[local]["ratio_vs_dense_fp32"] == pytest.approx(4000 / 30)
    assert rows[local]["best_val_ppl"]["mean"] == 106.0 and rows[local]["best_val_ppl"]["max"] == 108.0
    lines = "\n".join(report.local_targets(rows, base, "10mbit", vs))
    assert "perplexity 106.0 no worse than the baseline's 105.0 + its seed spread (10.0): met" in lines  # 106 <= 115
    assert "fewer bytes per step than dense fp32 (133x): met" in lines
    assert "step within 1.1x of its compute (1.06x): met" in lines
    assert "time to target >= 5x less than the baseline (9.6x): met" in lines
    # top-k never reached 115.5 in its 60 s run: its time is > 60 s, so the speed-up is > 60 / 14
    assert rows[local]["speedup_vs_versus"] is None
    assert rows[local]["speedup_vs_versus_at_least"] == pytest.approx(60.0 / 14.0)
    assert "less than synchronous top-k (at least 4.3x): met" in lines
    assert "| diloco|8|none | 2 |" in report.local_markdown({"10mbit": rows}, base, vs)



def test_local_report_from_cell_files_leaves_loaded_cells_out(tmp_path):
    """``mpi_scripts/report.py local`` over cell files written here: the baseline's two seeds (time to
    the target 1.1 x 105 = 115.5: 150 s and 120 s, mean 135 s), a local-update cell started on a
    loaded machine (load 3.5 on 2 cores: left out, named) and a quiet one (10 s: 13.5x)."""
    import json

    base, local = "sync|fp16@ring", "diloco|8|none"
    cells = {"b1": cell(base, 1, 100.0, [(50, 300), (100, 120), (150, 100)], sent=2000),
             "b2": cell(base, 2, 110.0, [(60, 300), (120, 115), (180, 110)], sent=2000),
             "l1": cell(local, 1, 104.0, [(5, 200), (10, 114), (15, 104)], sent=30),
             "l2": cell(local, 2, 90.0, [(1, 90)], sent=30)}
    for name, c in cells.items():
        load = 3.5 if name == "l2" else 1.0
        c["driver"]["machine"] = {"before": {"load_1min": load, "cores": 2}, "loaded": load > 2}
        (tmp_path / "cells" / "10mbit").mkdir(parents=True, exist_ok=True)
        (tmp_path / "cells" / "10mbit" / f"{name}.json").write_text(json.dumps(c))
    assert report.main(["local", "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["10mbit"]
    assert rows[local]["seeds"] == 1 and rows[local]["time_to_target_s"] == 10.0
    assert rows[base]["time_to_target_s"] == pytest.approx(135.0)
    assert rows[local]["speedup_vs_baseline"] == pytest.approx(13.5)
    text = (tmp_path / "report.md").read_text()
    assert "1-minute load average before each cell: 1.00-3.50 (4 cells)." in text
    assert f"Left out, started on a loaded machine: 10mbit/{local}." in text
    with pytest.raises(SystemExit):
        report.main(["local", "--output", str(tmp_path), "--target-factor", "0.9"])

def test_perplexity_verdict_is_one_sided_and_needs_baseline_seeds():
    base, vs = "sync|fp16@ring", "sync|topk:density=0.01"
    runs = [cell(base, 1, 100.0, [(10, 100)], sent=2000), cell(base, 2, 110.0, [(10, 110)], sent=2000),
            cell("diloco|8|none", 1, 80.0, [(5, 80)], sent=30),          # better than the baseline: met
            cell("co2|8|none", 1, 115.5, [(5, 115.5)], sent=30)]         # 115.5 > 105 + 10: missed
    lines = "\n".join(report.local_targets(report.local_summary(runs, base, vs, 1.1)["10mbit"], base, "10mbit", vs))
    assert "perplexity 80.0 no worse than the baseline's 105.0 + its seed spread (10.0): met" in lines
    assert "perplexity 115.5 no worse than the baseline's 105.0 + its seed spread (10.0): missed" in lines
    one = report.local_summary([runs[0], runs[2]], base, vs, 1.1)["10mbit"]
    assert "(0.0): not judged (the baseline has one seed)" in "\n".join(report.local_targets(one, base, "10mbit", vs))


def test_time_to_target_verdicts_where_a_seed_missed_the_target():
    base, vs = "sync|fp16@ring", "sync|topk:density=0.01"
    runs = [cell(base, 1, 100.0, [(100, 120), (150, 100)], sent=2000),   # target 1.1 x 105 = 115.5: at 150 s
            cell(base, 2, 110.0, [(90, 130), (180, 110)], sent=2000),    # reached at 180 s
            cell(base, 3, 105.0, [(100, 130), (200, 120)], sent=2000),   # never: > 200 s
            cell("diloco|8|none", 1, 100.0, [(30, 110)], sent=30),       # 30 s on both seeds
            cell("diloco|8|none", 2, 100.0, [(30, 112)], sent=30),
            cell("co2|8|none", 1, 100.0, [(10, 110)], sent=30),          # 10 s and never
            cell("co2|8|none", 2, 100.0, [(10, 120)], sent=30),
            cell("diloco|32|none", 1, 100.0, [(45, 110)], sent=30)]      # 45 s
    rows = report.local_summary(runs, base, vs, 1.1)["10mbit"]
    assert rows[base]["time_to_target_s"] is None
    assert rows[base]["time_to_target_at_least_s"] == pytest.approx((150 + 180 + 200) / 3)
    lines = "\n".join(report.local_targets(rows, base, "10mbit", vs))
    # (150 + 180 + 200) / 3 / 30 = 5.9 >= 5 even if the third baseline seed had reached it at 200 s
    assert "- diloco|8|none:" in lines and "baseline (at least 5.9x): met" in lines
    # 176.7 / 45 = 3.9: the bound cannot tell
    assert "baseline (at least 3.9x): not judged (sync|fp16@ring missed the target on 1 of 3 seeds)" in lines
    # co2 missed the target on seed 2 and the baseline on seed 3: both times are only bounded
    # below, so the speed-up is bounded neither way
    co2 = verdict_block(lines.split("\n"), "co2|8|none")
    assert ("baseline (n/a): not judged (neither it nor sync|fp16@ring reached the target on every seed)"
            in co2)
    assert "less than synchronous top-k (n/a): not judged (no sync|topk:density=0.01 cell)" in co2


def test_time_to_target_upper_bound_where_the_contender_missed_the_target():
    base, vs = "sync|fp16@ring", "sync|topk:density=0.01"
    runs = [cell(base, 1, 100.0, [(100, 120), (150, 100)], sent=2000),   # target 115.5: 150 s
            cell(base, 2, 110.0, [(90, 130), (150, 110)], sent=2000),    # 150 s
            cell(vs, 1, 100.0, [(40, 110)], sent=80),                    # 40 s
            cell("diloco|32|none", 1, 100.0, [(20, 130), (40, 120)], sent=30),  # never, in a 40 s run
            cell("diloco|8|none", 1, 100.0, [(10, 130), (20, 125)], sent=30),   # never, in a 20 s run
            cell("diloco|8|none", 2, 100.0, [(10, 115)], sent=30)]              # 10 s
    rows = report.local_summary(runs, base, vs, 1.1)["10mbit"]
    # diloco|32: its time is > 40 s, so it is < 150 / 40 = 3.75x faster than the baseline (missed),
    # and < 40 / 40 = 1x faster than top-k (missed: it cannot be faster)
    assert rows["diloco|32|none"]["speedup_vs_baseline_at_most"] == pytest.approx(150 / 40)
    d32 = verdict_block(report.local_targets(rows, base, "10mbit", vs), "diloco|32|none")
    assert "baseline (at most 3.75x): missed" in d32
    assert "less than synchronous top-k (at most 1.00x): missed" in d32
    # diloco|8: its mean time is > (20 + 10) / 2 = 15 s, so < 10x the baseline and < 2.7x top-k:
    # a longer run of seed 1 could still clear both
    assert rows["diloco|8|none"]["speedup_vs_baseline_at_most"] == pytest.approx(150 / 15)
    d8 = verdict_block(report.local_targets(rows, base, "10mbit", vs), "diloco|8|none")
    assert "baseline (at most 10.00x): not judged (its run ended before the target" in d8
    assert "less than synchronous top-k (at most 2.67x): not judged (its run ended" in d8


def test_time_targets_are_judged_at_10mbit_only():
    base, vs = "sync|fp16@ring", "sync|topk:density=0.01"
    runs = [cell(base, s, 100.0, [(100, 100)], sent=2000, rate="100mbit") for s in (1, 2)]
    runs.append(cell("diloco|8|none", 1, 100.0, [(40, 100)], sent=30, rate="100mbit"))
    lines = "\n".join(report.local_targets(report.local_summary(runs, base, vs, 1.1)["100mbit"], base, "100mbit", vs))
    assert "speed-up to the target over the baseline: 2.5x, over synchronous top-k: n/a (no verdict" in lines
    assert "step within" not in lines and ">= 5x" not in lines


def test_run_local_script_launches_the_committed_one_sitting_grids(tmp_path):
    """docs/results/local-update/run.sh (`make speed-local`) through a fake interpreter: per workload and
    rate, one launch whose arguments (parsed by netem_local's own parser) are the settings the
    committed one-sitting grids of docs/results/local-update ran with (their run.json), then
    that directory's report."""
    import json
    import subprocess

    log = tmp_path / "argv.jsonl"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    subprocess.run(["bash", os.path.join(ROOT, "docs", "results", "local-update", "run.sh"), str(out)], check=True,
                   env={**os.environ, "PYTHON": str(fake)}, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    cells = [(w, r) for w in ("lstm", "transformer") for r in ("10mbit", "100mbit")]
    assert len(calls) == 2 * len(cells)
    keys = ("workload", "contenders", "rates", "seeds", "train_args", "timeout", "max_wait_quiet")
    for (workload, rate), launch, report in zip(cells, calls[0::2], calls[1::2]):
        committed = os.path.join(ROOT, "docs", "results", "local-update", f"{workload}-{rate}-one-sitting", "run.json")
        with open(committed) as f:
            ran = json.load(f)["settings"]
        args = vars(netem_local.parse_args(launch[1:]))
        assert {k: args[k] for k in keys} == {k: ran[k] for k in keys}, (workload, rate)
        assert args["output"] == str(out / f"{workload}-{rate}")
        assert report == ["mpi_scripts/report.py", "local", "--output", args["output"]]


def test_auto_targets_against_the_best_static_contender(tmp_path):
    """Issue 59's verdicts for ``sync|auto``, worked by hand: target 1.1 x mean(100, 110) = 115.5;
    times to it: fp16 ring 150 and 120 s (135), PowerSGD 20 and 24 s (22, the best static; best
    perplexities 104 and 108: mean 106, spread 4), top-k 40 s, auto 23 and 24 s (23.5): 23.5 / 22 =
    1.07x (within 1.1x: met), 135 / 23.5 = 5.7x (>= 5x: met), perplexity 108 <= 106 + 4 (met). Through
    ``report.py local --include-loaded``: a loaded cell is kept and named, and auto's decisions shown."""
    import json

    base, psgd, topk = "sync|fp16@ring", "sync|powersgd:matrix_rank=2", "sync|topk:density=0.01"
    cells = {"b1": cell(base, 1, 100.0, [(50, 300), (100, 120), (150, 100)], sent=2000),
             "b2": cell(base, 2, 110.0, [(60, 300), (120, 115), (180, 110)], sent=2000),
             "p1": cell(psgd, 1, 104.0, [(10, 200), (20, 114), (30, 104)], sent=50),
             "p2": cell(psgd, 2, 108.0, [(12, 200), (24, 112), (36, 108)], sent=50),
             "t1": cell(topk, 1, 112.0, [(20, 200), (40, 115), (60, 112)], sent=80),
             "a1": cell(report.AUTO, 1, 107.0, [(11, 200), (23, 113), (35, 107)], sent=50),
             "a2": cell(report.AUTO, 2, 109.0, [(12, 200), (24, 114), (36, 109)], sent=50)}
    decisions = [{"step": 0, "cause": "start", "chosen": "topk:density=0.001", "regime": "critical", "reason": "r0"},
                 {"step": 3, "cause": "probe", "chosen": psgd[5:], "regime": "critical", "compute_s": 1.9,
                  "predicted_step_s": 2.3, "measured_step_s": 2.4, "error": 0.06, "reason": "least error"}]
    for name, c in cells.items():
        c["train_lm"]["config"]["seed"] = int(name[1])
        if c["contender"] == report.AUTO:
            c["train_lm"]["auto"] = {"candidates": ["topk:density=0.001", psgd[5:]], "decisions": decisions,
                                     "cost_model": {"alpha_s": 2e-5, "beta_s_per_byte": 1e-6}}
        c["driver"]["machine"] = {"before": {"load_1min": 3.0 if name == "a2" else 1.0, "cores": 2},
                                  "loaded": name == "a2"}
        (tmp_path / "cells" / "10mbit").mkdir(parents=True, exist_ok=True)
        (tmp_path / "cells" / "10mbit" / f"{name}.json").write_text(json.dumps(c))
    assert report.main(["local", "--output", str(tmp_path), "--include-loaded"]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["10mbit"]
    assert rows[report.AUTO]["time_to_target_s"] == pytest.approx(23.5) and rows[psgd]["time_to_target_s"] == 22.0
    lines = "\n".join(report.auto_targets(rows, base, "10mbit"))
    assert f"best static contender's ({psgd}, 22 s): 1.07x: met" in lines
    assert "final perplexity 108.0 within its seed spread (106.0 + 4.0): met" in lines
    assert f"time to target >= 5x less than {base} (5.7x): met" in lines
    text = (tmp_path / "report.md").read_text()
    assert f"Kept (--include-loaded), started on a loaded machine: 10mbit/{report.AUTO}." in text
    assert "| 3 | probe | `powersgd:matrix_rank=2` |" in text and (tmp_path / "auto_choice.png").exists()
    rows[report.AUTO]["time_to_target_s"] = 25.0  # 25 / 22 = 1.14x
    assert "1.14x: missed" in "\n".join(report.auto_targets(rows, base, "10mbit"))
