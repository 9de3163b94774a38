"""The report generator on fixture results with known numbers, and a 2-cell sweep under mpirun."""
import json
import os
import subprocess
import sys

import pytest

from mpi_scripts import report
from tests.mpirun import MPI_ENV, ROOT, TINY_SHAKESPEARE


def fake(model, workers, compressor, test_ppl, val, comm=0.1, compress=0.01, steps=10, sent=1000):
    return {"config": {"model": model, "world_size": workers, "compressor": compressor,
                       "compressor_spec": compressor["name"], "lr": 20.0, "transport": "x", "env": {}},
            "epochs": [{"val_ppl": v, "steps": steps} for v in val], "test_ppl": test_ppl,
            "per_step": {"compute": {"mean": 1.0}, "compress": {"mean": compress},
                         "communicate": {"mean": comm}, "decompress": {"mean": 0.002},
                         "wall": {"mean": 1.2}, "bytes_sent": {"mean": sent},
                         "bytes_received": {"mean": 2 * sent}, "dense_bytes": {"mean": 50 * sent}},
            "measured_ratio": 50.0, "nominal_ratio": 50.0}


def write(root, name, obj):
    os.makedirs(root / name, exist_ok=True)
    (root / name / "results.json").write_text(json.dumps(obj))


@pytest.fixture
def fixture_dir(tmp_path):
    t = lambda d: {"name": "topk", "density": d, "ef": True}          # noqa: E731
    g = lambda d: {"name": "dgc", "density": d}                        # noqa: E731
    q = lambda s: {"name": "qsgd", "levels": s, "bucket": 512}         # noqa: E731
    r = lambda d, ef: {"name": "randomk", "density": d, "ef": ef}      # noqa: E731
    cells = {
        "none": fake("small", 2, {"name": "none"}, 100.0, [300, 200, 150], comm=0.5, compress=0.0, sent=50000),
        "t50": fake("small", 2, t(0.01), 98.0, [250, 140, 120], comm=0.04, compress=0.05),
        "t5000": fake("small", 2, t(0.0001), 130.0, [400, 300, 250], comm=0.02, compress=0.04),
        "d50": fake("small", 2, g(0.01), 101.0, [260, 180, 149], comm=0.04, compress=0.02),
        "d5000": fake("small", 2, g(0.0001), 125.0, [420, 320, 260], comm=0.03, compress=0.02),
        "q64": fake("small", 2, q(64), 101.5, [300, 200, 151], comm=0.2, compress=0.01),
        "q4": fake("small", 2, q(4), 104.0, [300, 210, 160], comm=0.1, compress=0.01),
        "r": fake("small", 2, r(0.01, True), 140.0, [500, 400, 300], comm=0.04, compress=0.01),
        "rn": fake("small", 2, r(0.01, False), 400.0, [900, 800, 700], comm=0.04, compress=0.01),
    }
    for name, obj in cells.items():
        write(tmp_path, name, obj)
    return tmp_path


def test_tables_hold_the_fixture_numbers(fixture_dir):
    rows = report.load_results(str(fixture_dir))
    assert len(rows) == 9
    table = report.ppl_table(rows)
    assert "| small / 2 | 100.0 (115.1) |" in table          # ours, then the study's published value
    assert "98.0 (114.4)" in table and "130.0 (151.7)" in table and "104.0 (115.1)" in table
    assert report.ordered_columns(rows)[:3] == ["none", "rand-k 50x", "rand-k 50x no-EF"]
    times = report.time_table(rows)
    assert "| small / 2 | none | 10.00 | 0.00 | 5.00 | 0.02 | 15.02 | 1.200 |" in times  # per step x 10 steps
    assert report.epochs_to([300, 200, 150], 150) == 3 and report.epochs_to([300], 100) is None


def test_claim_verdicts_computed_from_numbers(fixture_dir):
    verdicts = {c.split(".")[0]: (v, e) for c, v, e in report.check_claims(report.load_results(str(fixture_dir)))}
    assert verdicts["1"][0] == "partly supported"       # top-k 98.0 <= 100.0, DGC 101.0 is not
    assert "top-k 50x 98.0 vs none 100.0" in verdicts["1"][1]
    assert verdicts["2"][0] == "not supported"          # both degrade, but DGC (125) < top-k (130)
    assert verdicts["3"][0] == "partly supported"       # s=64 is +1.5, s=4 is +4.0
    assert "QSGD s=4 +4.0 around none 100.0" in verdicts["3"][1]
    assert verdicts["4"][0] == "supported"              # 400 > 140 > 100
    assert verdicts["5"][0] == "supported"              # all < 0.5 s; top-k/DGC 5000x < 0.05 s
    assert verdicts["6"][0] == "supported"              # top-k 45 ms > DGC 20 ms, QSGD 10 ms
    assert verdicts["7"][0] == "partly supported"       # top-k 50x reaches 150 at epoch 2, DGC 50x at 3
    assert "target 150.0: top-k 50x 2 vs none 3 epochs" in verdicts["7"][1]
    assert "DGC 50x 3 vs none 3 epochs" in verdicts["7"][1]


def test_report_written_with_plots(fixture_dir):
    assert report.main([str(fixture_dir), "--command", "python mpi_scripts/sweep.py x"]) == 0
    text = (fixture_dir / "report.md").read_text()
    assert "python mpi_scripts/sweep.py x" in text and "![val_ppl.png](val_ppl.png)" in text
    for png in ("val_ppl.png", "time_breakdown.png", "bytes_per_step.png"):
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
    grid.write_text("models: [small]\nworkers: [2, 8]\nepochs: 1\nmethods:\n  - spec: none\n")
    os.makedirs(fixture_dir / "cells" / "small-np2-none")
    (fixture_dir / "cells" / "small-np2-none" / "results.json").write_text(
        (fixture_dir / "none" / "results.json").read_text())
    assert report.missing_cells(str(fixture_dir), [str(grid)]) == ["small-np8-none"]
