"""Smoke test of benchmarks/kernels.py: it runs, writes its JSON and markdown, and every row has
positive times (no timing assertions: timings depend on the machine)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_benchmark_smoke(tmp_path):
    specs = ["topk:density=0.01", "topk:density=0.01,select=sample", "qsgd:levels=16"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--sizes", "4096",
         "--repeat", "1", "--world", "2", "--threads", "1", "--methods", " ".join(specs),
         "--output", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert result["machine"]["threads"] == 1 and result["machine"]["torch"]
    assert result["settings"]["sizes"] == [4096] and result["settings"]["world"] == 2
    assert result["stream"]["4096"]["median_s"] > 0
    rows = result["rows"]
    assert [r["spec"] for r in rows] == specs
    for row in rows:
        assert row["size"] == 4096 and "error" not in row
        for key in ("compress", "decompress", "aggregate"):
            assert row[key]["median_s"] > 0 and row[key + "_x_stream"] > 0
        assert 0 < row["payload_bytes"] < row["dense_bytes"] == 4 * 4096
        assert row["compression_ratio"] == row["dense_bytes"] / row["payload_bytes"]
    topk = rows[0]
    assert topk["error_feedback"] and topk["select_pack"]["median_s"] > 0 and "targets" in topk
    assert not rows[2]["error_feedback"] and "targets" not in rows[2]
    table = (tmp_path / "kernels.md").read_text()
    for spec in specs:
        assert f"`{spec}`" in table
    assert "≤ 3× stream" in table and table in proc.stdout


def _e2e_cell(contender, family, step, compute, wait=None, wait_last=None, curve=None):
    timing = {"step": {"median": step}, "compute_reference": {"median": compute},
              "comm_critical_seconds": step - compute, "parts": {}, "phases": {}}
    if family == "hvdcomp":
        timing["phases"]["communicate"] = {"median": wait, "median_of_rank_min": wait_last}
    elif family == "horovod":
        timing["parts"]["sync"] = {"median": wait, "median_of_rank_min": wait_last}
    return {"status": "ok", "bench": "e2e", "contender": contender, "family": family, "world_size": 4,
            "hostnames": ["h1", "h2", "h3", "h4"], "env": {"HOROVOD_CYCLE_TIME": "20"},
            "config": {"parameters": 1000}, "timing": timing,
            "bytes": {"measured": None, "payload_per_step_est": 100},
            "val_ppl_curve": curve or [[0, 100.0], [5, 50.0]]}


def test_speed_report_verdicts_from_hand_made_cells(tmp_path):
    """Targets computed from known numbers: Horovod none waits 2.0 s (last rank 1.0 s) at 100 Mbit/s,
    top-k 0.05 s (0.04 s): 40x and 25x, met; top-k's step 3.3 s at 100 Mbit/s vs 3.0 s unlimited:
    1.10x, met; steps to the target ppl 50 (what `none` reached at step 10 of 15): top-k 15."""
    cells = tmp_path / "e2e" / "cells"
    curve_none = [[0, 100.0], [5, 70.0], [10, 50.0], [15, 40.0]]
    curve_topk = [[0, 100.0], [5, 80.0], [10, 60.0], [15, 45.0]]
    spec = {("none", "hvdcomp:none"): _e2e_cell("hvdcomp:none", "hvdcomp", 2.9, 2.8, 0.1, 0.05, curve_none),
            ("none", "hvdcomp:topk:density=0.01"): _e2e_cell("hvdcomp:topk:density=0.01", "hvdcomp", 3.0,
                                                             2.8, 0.05, 0.04, curve_topk),
            ("none", "horovod:none"): _e2e_cell("horovod:none", "horovod", 3.0, 2.8, 0.2, 0.1),
            ("100mbit", "hvdcomp:topk:density=0.01"): _e2e_cell("hvdcomp:topk:density=0.01", "hvdcomp",
                                                                3.3, 2.8, 0.05, 0.04),
            ("100mbit", "horovod:none"): _e2e_cell("horovod:none", "horovod", 5.0, 2.8, 2.0, 1.0)}
    for (rate, contender), cell in spec.items():
        os.makedirs(cells / rate, exist_ok=True)
        (cells / rate / (contender.replace(":", "_").replace("=", "-") + ".json")).write_text(json.dumps(cell))
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report_speed.py"), "--e2e",
                           str(tmp_path / "e2e"), "--comm", str(tmp_path / "none"), "--output", str(out)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = (out / "report.md").read_text()
    assert "1.000 s vs 0.040 s = 25.0x | met" in report      # last-arriving rank
    assert "2.000 s vs 0.050 s = 40.0x | met" in report      # slowest rank
    assert "3.30 / 3.00 s = 1.10x | met" in report
    summary = json.loads((out / "summary.json").read_text())
    ttt = summary["e2e"]["time_to_target"]
    assert ttt["target"] == 50.0 and ttt["target_step"] == 10
    assert ttt["rows"]["hvdcomp:topk:density=0.01"]["steps"] == 15
    assert ttt["rows"]["hvdcomp:topk:density=0.01"]["100mbit"] == 15 * 3.3


def test_kernels_benchmark_compare_and_quantizer_verdicts(tmp_path):
    """--compare times the plain reference beside each method; quantizer rows get verdicts."""
    specs = ["qsgd:levels=127", "efsignsgd", "dgc:density=0.01", "topk:density=0.01"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--sizes", "8192",
         "--repeat", "1", "--threads", "1", "--compare", "--methods", " ".join(specs),
         "--output", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert result["settings"]["compare"] and "native" in result["machine"]["kernels"]
    rows = {r["spec"]: r for r in result["rows"]}
    for spec in specs:
        ref = rows[spec]["reference"]
        for key in ("compress", "decompress", "aggregate"):
            assert ref[key]["median_s"] > 0 and ref[key + "_x_stream"] > 0
        assert set(rows[spec]["verdicts"]) == ({"compress", "decompress", "aggregate"}
                                               if spec.startswith(("qsgd", "efsignsgd"))
                                               else {"select_pack", "decompress", "aggregate"})
    assert rows["qsgd:levels=127"]["reference"]["payload"][1]["dtype"] == "int8"
    assert rows["dgc:density=0.01"]["select_pack"]["median_s"] > 0
    table = (tmp_path / "kernels.md").read_text()
    assert "ref compress ×" in table and "≤ 8×" in table


def test_overhead_benchmark_smoke_and_report(tmp_path):
    """benchmarks/overhead.py at 2 ranks on tiny settings: every contender has a median step and
    the ratios to stock Horovod; the speed report renders its section and the stack's targets."""
    import json
    import os
    import sys

    from mpirun import check

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "overhead" / "np2"
    check(2, [os.path.join(root, "benchmarks", "overhead.py"), "--models", "stack", "--stack-blocks", "4",
              "--steps", "1", "--rounds", "2", "--warmup", "1", "--output", str(out),
              "--contenders", "local", "horovod:none", "hvdcomp:none", "hvdcomp:topk:density=0.01@bucket"],
          timeout=300)
    run = json.loads((out / "overhead.json").read_text())
    rows = run["models"]["stack"]["contenders"]
    assert run["ranks"] == 2 and run["models"]["stack"]["tensors"] == 8
    assert rows["horovod:none"]["step_vs_horovod"] == 1.0
    for name, row in rows.items():
        assert len(row["samples_s"]) == 2 and row["median_step_s"] > 0, name
        assert abs(row["overhead_s"] - (row["median_step_s"] - rows["local"]["median_step_s"])) < 1e-12
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    import report_speed

    lines = report_speed.overhead_section(str(tmp_path / "overhead"))
    text = "\n".join(lines)
    assert "| 2 | hvdcomp:none | step ≤ 1.05× stock Horovod |" in text
    assert "### stack: 8 tensors, 2 ranks" in text
