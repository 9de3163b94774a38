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
