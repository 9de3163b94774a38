"""The report generator on fixture results with known numbers, and a 2-cell sweep under mpirun."""
import json
import os
import subprocess
import sys

import pytest

from mpi_scripts import report
from tests.mpirun import MPI_ENV, ROOT, TINY_SHAKESPEARE


def fake(model, workers, compressor, test_ppl, val, comm=0.1, compress=0.01, steps=10, sent=1000, seed=1,
         epochs=None, stopped_early=False, compute=1.0):
    return {"config": {"model": model, "world_size": workers, "compressor": compressor, "seed": seed,
                       "compressor_spec": compressor["name"], "lr": 20.0, "transport": "x", "env": {},
                       "epochs": epochs or len(val)}, "stopped_early": stopped_early,
            "epochs": [{"val_ppl": v, "steps": steps, "elapsed_seconds": 30.0 * (i + 1)} for i, v in enumerate(val)],
            "test_ppl": test_ppl, "best_val_ppl": min(val), "best_epoch": val.index(min(val)) + 1,
            "per_step": {"compute": {"mean": compute}, "compress": {"mean": compress},
                         "communicate": {"mean": comm}, "decompress": {"mean": 0.002},
                         "wall": {"mean": 1.2}, "bytes_sent": {"mean": sent},
                         "bytes_received": {"mean": 2 * sent}, "dense_bytes": {"mean": 50 * sent}},
            "measured_ratio": 50.0, "nominal_ratio": 50.0, "seconds_total": 100.0}


def write(root, name, obj):
    os.makedirs(root / name, exist_ok=True)
    (root / name / "results.json").write_text(json.dumps(obj))


@pytest.fixture
def fixture_dir(tmp_path):
    """Three seeds per method (test perplexity mean ± 1, so a pair's spread is sqrt(2)), except
    random-k without EF (one seed)."""
    t = lambda d: {"name": "topk", "density": d, "ef": True}          # noqa: E731
    g = lambda d: {"name": "dgc", "density": d}                        # noqa: E731
    q = lambda s: {"name": "qsgd", "levels": s, "bucket": 512}         # noqa: E731
    r = lambda d, ef: {"name": "randomk", "density": d, "ef": ef}      # noqa: E731
    cells = {  # name: (compressor, mean test ppl, val curve, other fields)
        "none": ({"name": "none"}, 100.0, [300, 200, 150], dict(comm=0.5, compress=0.0, sent=50000)),
        "t50": (t(0.01), 97.0, [250, 140, 120], dict(comm=0.04, compress=0.05)),
        "t5000": (t(0.0001), 130.0, [400, 300, 250], dict(comm=0.02, compress=0.04)),
        "d50": (g(0.01), 101.0, [260, 180, 149], dict(comm=0.04, compress=0.02)),
        "d5000": (g(0.0001), 125.0, [420, 320, 260], dict(comm=0.03, compress=0.02)),
        "q64": (q(64), 101.5, [300, 200, 151], dict(comm=0.2, compress=0.01)),
        "q4": (q(4), 104.0, [300, 210, 160], dict(comm=0.1, compress=0.01)),
        "r": (r(0.01, True), 140.0, [500, 400, 300], dict(comm=0.04, compress=0.01)),
    }
    for name, (comp, ppl, val, kw) in cells.items():
        for seed, delta in ((1, -1.0), (2, 0.0), (3, 1.0)):
            write(tmp_path / "cells", f"{name}-seed{seed}", fake("small", 2, comp, ppl + delta, val, seed=seed, **kw))
    write(tmp_path / "cells", "rn-seed1", fake("small", 2, r(0.01, False), 400.0, [900, 800, 700], comm=0.04))
    return tmp_path


def test_tables_hold_the_fixture_numbers(fixture_dir):
    rows = report.load_results(str(fixture_dir))
    assert len(rows) == 25
    table = report.ppl_table(rows)
    assert "| small / 2 | 100.0 ± 1.0 (n=3) (115.1) |" in table      # ours, then the study's value
    assert "97.0 ± 1.0 (n=3) (114.4)" in table and "| 400.0 |" in table
    assert report.ordered_columns(rows)[:3] == ["none", "rand-k 50x", "rand-k 50x no-EF"]
    times = report.time_table(rows)
    # per step x 10 steps; then compress and communicate over the 1 s compute step
    assert "| small / 2 | none | 10.00 | 0.00 | 5.00 | 0.02 | 15.02 | 1.200 | 0.0 | 50.0 |" in times
    assert report.epochs_to([300, 200, 150], 150) == 3 and report.epochs_to([300], 100) is None
    # target 1.1 x 150 = 165: none reaches it in epoch 3 (90 s), top-k 50x in epoch 2 (60 s)
    target = report.target_table(rows, None)
    assert "| small / 2 | 165.0 | none | 3.0 (3/3) | 90 |" in target
    assert "| small / 2 | 165.0 | top-k 50x | 2.0 (3/3) | 60 |" in target
    assert "| small / 2 | 165.0 | rand-k 50x | never in 3 | – |" in target


def test_column_labels_of_the_scale_out_sparsifiers():
    """Density 1 % is 50x in the study's convention (32-bit value + 32-bit index per entry)."""
    assert report.column_of({"name": "gtopk", "density": 0.01}) == "gTop-k 50x"
    hierarchical = {"name": "gtopk", "density": 0.001, "hierarchical": True}
    assert report.column_of(hierarchical) == "gTop-k 500x (hierarchical)"
    assert report.column_of({"name": "cltk", "density": 0.0001}) == "CLT-k 5000x"


def test_convergence_column_and_line_from_hand_worked_curves(fixture_dir):
    assert report.last_epoch_gain([300, 200, 150]) == pytest.approx(25.0)   # 1 - 150/200
    assert report.last_epoch_gain([300, 150, 160]) == 0.0                   # no new best
    assert report.last_epoch_gain([300]) is None
    inf = float("inf")
    runs = [{"val": [300, 200, 150], "epochs_cap": 3, "stopped_early": False},     # cap, 25 %
            {"val": [300, 200, 180], "epochs_cap": 3, "stopped_early": False},     # cap, 10 %
            {"val": [300, 200, 199, 199], "epochs_cap": 10, "stopped_early": True},  # plateau
            {"val": [300, inf], "epochs_cap": 10, "stopped_early": True},          # diverged
            {"val": [300, 200], "stopped_early": False}]                           # no cap recorded
    assert [report._stop_reason(r) for r in runs] == ["cap", "cap", "plateau", "diverged", "?"]
    assert report.convergence_line(runs) == (
        "Convergence: 1 of 5 training runs ended at a validation plateau, 2 at the epoch cap (their "
        "last epoch still lowered the best validation perplexity by a median 17.5 %, range 10.0-25.0 %), "
        "1 diverged, 1 ended for a reason the results do not record.")
    # loaded from results.json files: the cap from the config, plateau from stopped_early
    write(fixture_dir / "cells", "early-seed1", fake("small", 2, {"name": "none"}, 90.0, [300, 200, 199, 199],
                                                     epochs=10, stopped_early=True))
    rows = report.load_results(str(fixture_dir))
    table = report.method_table([r for r in rows if r["variant"] in ("none", "early")])
    assert "| 3, 3, 3 | cap, cap, cap | 25.0 %, 25.0 %, 25.0 % |" in table      # none: [300, 200, 150]
    assert "| 4 | plateau | 0.0 % |" in table, table


def test_a_plateau_in_the_last_allowed_epoch_reads_plateau_not_cap(tmp_path):
    """train_lm.py records stopped_early only for a stop before the cap; the report replays the
    run's schedule. Hand-worked with early_stop 2, min_improvement 1 %: 200 -> 199 -> 199 are two
    epochs in a row without a 1 % gain (stop at epoch 4 = the cap); 200 -> 150 is still improving."""
    sched = dict(anneal=4.0, anneal_patience=0, early_stop=2, min_improvement=0.01, min_epochs=0, warmup_steps=0)
    for name, val in (("flat", [300, 200, 199, 199]), ("falling", [300, 250, 200, 150]),
                      ("flat-min5", [300, 200, 199, 199])):
        run = fake("small", 4, {"name": "none"}, 100.0, val, epochs=4)
        run["config"].update(sched, min_epochs=5 if name == "flat-min5" else 0)
        write(tmp_path / "cells", name, run)
    # flat-min5: the same curve, but the schedule may not stop before epoch 5: the cap ended it
    rows = {r["variant"]: r for r in report.load_results(str(tmp_path))}
    assert {n: report._stop_reason(r) for n, r in rows.items()} == {
        "flat": "plateau", "falling": "cap", "flat-min5": "cap"}
    assert report.plateau_at_end({}, [300, 200]) is None            # no schedule settings: unknown
    assert report.plateau_at_end(dict(sched, early_stop=0), [300, 300, 300]) is False   # never stops


def test_compare_judges_a_difference_against_the_seed_spread():
    # means 11 and 10, sds 1 and 1: spread sqrt(2) = 1.41 > 1
    assert report.compare([10, 11, 12], [9, 10, 11])[2] == "~"
    d, spread, direction = report.compare([13, 14, 15], [9, 10, 11])
    assert (d, round(spread, 4), direction) == (4.0, 1.4142, ">")
    assert report.compare([5.0], [9, 10, 11])[2] == "?"


def test_claim_verdicts_computed_from_numbers(fixture_dir):
    verdicts = {c.split(".")[0]: (v, e) for c, v, e in report.check_claims(report.load_results(str(fixture_dir)))}
    # top-k 97 vs 100: -3 beyond the spread 1.41; DGC 101 vs 100: within it
    assert verdicts["1"][0] == "partly supported (1 supported, 1 not distinguishable)"
    assert "top-k 50x 97.0 ± 1.0 (n=3) vs none 100.0 ± 1.0 (n=3): -3.0 (-3.0 %), spread 1.4 → supported" in verdicts["1"][1]
    # both degrade, but DGC (125) < top-k (130) by more than the spread
    assert verdicts["2"][0] == "partly supported (2 supported, 1 contradicted)"
    # s=64 is +1.5 (within 2.5); s=4 is +4.0, outside 2.5 by more than the spread
    assert verdicts["3"][0] == "partly supported (1 supported, 1 contradicted)"
    assert "QSGD s=4 104.0 ± 1.0 (n=3) vs none 100.0 ± 1.0 (n=3): +4.0, spread 1.4 → contradicted" in verdicts["3"][1]
    # no-EF has one seed: not judged; EF 140 vs none 100: supported
    assert verdicts["4"][0] == "partly supported (1 supported, 1 single seed)"
    assert verdicts["5"][0] == "partly supported (7 supported, 1 single seed)"
    # each top-k density against DGC at the same density and against each QSGD setting (6 pairs,
    # seeds of one setting each; no pooling of densities): top-k 50 / 40 ms, DGC 20 ms, QSGD 10 ms,
    # each over a compute step of 1 s
    assert verdicts["6"][0] == "supported"
    notes6 = verdicts["6"][1].split("; ")
    assert len(notes6) == 6
    assert ("small/2: top-k 5000x 4.0 ± 0.0 % of compute (n=3) vs DGC 5000x 2.0 ± 0.0 % of compute "
            "(n=3): +2.0 % of compute (+100.0 %), spread 0.0 % of compute → supported") in notes6
    assert not any("top-k 50x" in n and "DGC 5000x" in n for n in notes6)
    assert sum("vs QSGD" in n for n in notes6) == 4
    # target 165: top-k 50x at epoch 2 vs none at 3 in every seed; DGC 50x also at 3
    assert verdicts["7"][0] == "partly supported (1 supported, 1 not distinguishable)"


def test_lr_search_table_and_budget_line(fixture_dir):
    (fixture_dir / "lr_search.json").write_text(json.dumps({
        "small-np2-none": {"values": {"10": 320.5, "20": 300.25, "40": float("inf")}, "chosen": 20.0},
        "small-np2-sbc": {"values": {"10": float("nan"), "20": float("nan"), "40": float("nan")}, "chosen": None}}))
    table = report.lr_search_table(str(fixture_dir))
    assert "| small-np2-none | 320.5 | **300.2** | diverged | 20 |" in table
    assert "| small-np2-sbc | diverged | diverged | diverged | none (every value failed) |" in table
    for name, secs in (("a", 1800.0), ("b", 1800.0)):
        os.makedirs(fixture_dir / "search" / name)
        (fixture_dir / "search" / name / "sweep.json").write_text(json.dumps({"wall_seconds": secs}))
    rows = report.load_results(str(fixture_dir))   # 25 cells x 100 s (no sweep.json: the run's own)
    line = report.budget_line(str(fixture_dir), rows, 8)
    assert line == ("Compute spent: **1.69 h** of wall time as the sweep measured it (25 training runs 0.69 h, "
                    "learning-rate search 2 runs 1.00 h), against a budget of 8 h (within budget).")


def test_report_written_with_plots(fixture_dir):
    assert report.main([str(fixture_dir), "--command", "python mpi_scripts/sweep.py x", "--budget-hours", "8"]) == 0
    text = (fixture_dir / "report.md").read_text()
    assert "python mpi_scripts/sweep.py x" in text and "![val_ppl.png](val_ppl.png)" in text
    assert "against a budget of 8 h" in text
    for png in ("val_ppl.png", "time_breakdown.png", "time_to_target.png", "frontier.png"):
        assert (fixture_dir / png).stat().st_size > 1000


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_two_cell_sweep_under_mpirun_and_resume(tmp_path):
    cmd = [sys.executable, "mpi_scripts/sweep.py", "--methods", "none", "topk:density=0.01", "--workers", "2",
           "--epochs", "1", "--max-steps", "3", "--data", TINY_SHAKESPEARE, "--output", str(tmp_path),
           "--cell-timeout", "240", "--report"]
    env = dict(os.environ, **MPI_ENV)
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 cells: 2 run, 0 already done, 0 failed" in first.stderr
    rows = report.load_results(str(tmp_path))
    assert sorted(r["column"] for r in rows) == ["none", "top-k 50x"]
    assert (tmp_path / "report.md").is_file()
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "2 cells: 0 run, 2 already done, 0 failed" in again.stderr


def test_missing_cells_listed(fixture_dir, tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("models: [small]\nworkers: [2, 8]\nepochs: 1\nnotes: cut X to fit\nmethods:\n  - spec: none\n")
    os.makedirs(fixture_dir / "cells" / "small-np2-none")
    (fixture_dir / "cells" / "small-np2-none" / "results.json").write_text(
        (fixture_dir / "cells" / "none-seed1" / "results.json").read_text())
    assert report.missing_cells(str(fixture_dir), [str(grid)]) == ["small-np8-none"]
    assert report.grid_notes([str(grid)]) == ["cut X to fit"]


def test_partial_report_shows_the_search_before_any_training_run(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("workers: [4]\nseeds: [1, 2]\nlr_search: {values: [10, 20], epochs: 2}\n"
                    "notes: cut Y\nmethods:\n  - spec: none\n  - spec: topk:density=0.01\n")
    for lr, best in (("10", 500.0), ("20", 450.5)):
        d = tmp_path / "search" / f"small-np4-none-lr{lr}"
        os.makedirs(d)
        (d / "results.json").write_text(json.dumps({"best_val_ppl": best}))
        (d / "sweep.json").write_text(json.dumps({"wall_seconds": 900.0}))
    assert report.main([str(tmp_path), "--grid", str(grid), "--budget-hours", "8", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "No training run has finished yet." in text and "cut Y" in text
    assert "| small-np4-none | 500.0 | **450.5** | 20 |" in text      # top-k's search is incomplete
    assert "small-np4-topk" not in text.split("## Cells not run yet")[0]
    assert "learning-rate search 2 runs 0.50 h" in text and "`small-np4-none-seed2`" in text


def test_time_claims_compare_shares_of_compute_across_machines_of_different_speed(tmp_path):
    """Seed 3 of top-k ran on a machine twice as fast. In seconds its communication (98 ms) would
    pull top-k's mean below none's 180 ms; as shares of each run's own compute step top-k spends
    14 % in every seed against none's 12 %: the claim that communication falls is contradicted."""
    t = {"name": "topk", "density": 0.01, "ef": True}
    for seed in (1, 2, 3):
        write(tmp_path / "cells", f"none-seed{seed}",
              fake("small", 4, {"name": "none"}, 100.0, [300, 200], seed=seed, compute=1.5, comm=0.18))
        compute = 0.7 if seed == 3 else 1.5
        write(tmp_path / "cells", f"t-seed{seed}",
              fake("small", 4, t, 100.0, [300, 200], seed=seed, compute=compute, comm=0.14 * compute))
    rows = report.load_results(str(tmp_path))
    topk_row = next(line for line in report.time_table(rows).splitlines() if "| top-k 50x |" in line)
    assert topk_row.endswith("| 14.0 |")      # communicate % of compute, whatever the machine
    verdicts = {c.split(".")[0]: (v, e) for c, v, e in report.check_claims(rows)}
    assert verdicts["5"] == ("not supported", "small/4: top-k 50x 14.0 ± 0.0 % of compute (n=3) vs none "
                             "12.0 ± 0.0 % of compute (n=3): +2.0 % of compute (+16.7 %), spread 0.0 % "
                             "of compute → contradicted")


def test_variants_sharing_a_column_stay_apart_and_early_stops_count_as_never(tmp_path):
    """Two cells with the same compressor but other settings (labels a, b) are two rows, not six
    seeds of one; a run stopped early without reaching the target counts as max epochs + 1."""
    t = {"name": "topk", "density": 0.01, "ef": True}
    for seed in (1, 2, 3):
        none = fake("small", 4, {"name": "none"}, 100.0 + seed, [300, 200, 150, 140], seed=seed)
        write(tmp_path / "cells", f"none-seed{seed}", none)
        for label, ppl in (("a", 90.0), ("b", 110.0)):
            run = fake("small", 4, t, ppl + seed, [250, 200], seed=seed)   # stopped after 2 epochs
            run["config"]["epochs"] = 15
            write(tmp_path / "cells", f"{label}-seed{seed}", run)
    rows = report.load_results(str(tmp_path))
    cols = report.groups(rows)[("small", 4)]
    assert sorted(cols) == ["none", "top-k 50x [a]", "top-k 50x [b]"]
    assert cols["top-k 50x [a]"]["n"] == 3 and cols["top-k 50x [a]"]["test_ppl"] == 92.0
    verdicts = {c.split(".")[0]: (v, e) for c, v, e in report.check_claims(rows)}
    # target 1.1 x 140 = 154: none at epoch 3; the top-k runs never (counted as 16 epochs)
    assert verdicts["7"][0] == "not supported"
    assert "top-k 50x [b] (target 154.0) 16.0 ± 0.0 epochs (n=3) vs none 3.0 ± 0.0 epochs (n=3)" in verdicts["7"][1]
