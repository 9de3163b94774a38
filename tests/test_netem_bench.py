"""The bandwidth-limited benchmark harness end to end, small: 4 emulated hosts at 100 Mbit/s, top-k
(hvdcomp) and DDP's fp16 hook, 2 timed steps each. Checks that the cells finish, that every rank
saw the same settings, that the namespaces are gone afterwards, and that top-k's bytes on the
link match its payload: an allgather must transmit at least (p-1)·m bytes per rank (m = the
payload this rank contributes); TCP/IP headers, acknowledgements and the per-step flags add
a few per cent on a quiet machine (2.3 % in docs/results/speed), the bound here allows 30 % for
retransmissions on a loaded one."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, SHARED, TINY_SHAKESPEARE

NETEM = os.path.join(SHARED, "tools", "netem_mpi.sh")
PREFIX = "hvdtest"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None
    or not os.path.isfile(NETEM) or not os.path.isfile(TINY_SHAKESPEARE),
    reason="needs root, iproute2 (ip, tc), ../shared/tools/netem_mpi.sh and ../shared/data")


def test_netem_harness_small(tmp_path):
    out = tmp_path / "e2e"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "netem_e2e.py"), "--output", str(out),
           "--model", "small", "--rates", "100mbit", "--steps", "2", "--warmup", "1",
           "--compute-ref-steps", "1", "--netem-prefix", PREFIX, "--netem", NETEM, "--python", sys.executable,
           "--contenders", "hvdcomp:topk:density=0.01", "ddp:fp16", "--timeout", "600",
           "--load-limit", "1000"]  # (the harness, not a speed figure: no waiting for a quiet machine)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    topk = json.loads((out / "cells" / "100mbit" / "hvdcomp_topk_density-0.01.json").read_text())
    ddp = json.loads((out / "cells" / "100mbit" / "ddp_fp16.json").read_text())
    for cell in (topk, ddp):
        assert cell["status"] == "ok" and cell["env_same_on_all_ranks"]
        assert cell["env"]["OMPI_MCA_mpi_yield_when_idle"] == "1" and cell["world_size"] == 4
        assert sorted(set(cell["hostnames"])) == ["h1", "h2", "h3", "h4"]
        assert cell["timing"]["step"]["median"] > 0
    sent = topk["bytes"]["measured"]["bytes_sent"]["median"]
    assert sent == 92944  # 11,616 kept of 1,161,600 elements x 8 B + one fused payload's 16 B of counts
    lower = 3 * sent
    for tx in topk["timing"]["parts"]["nic_tx_bytes"]["per_rank_median"]:
        assert lower <= tx <= 1.3 * lower, (tx, lower)  # the report: +2.3 % on a quiet machine
