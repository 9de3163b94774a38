"""Every training mode under torchrun (torch.distributed over gloo, no Horovod) ends with the same
parameters as under mpirun (Horovod), bit for bit at 2 ranks (a sum of two values is exact in
either collective library): tests/mpi/launcher_parity.py runs each mode a few steps under both."""
import os
import random
import re
import sys

import pytest

from tests.mpirun import ROOT, check
from tests.test_ddp import TORCHRUN, run

WORKER = os.path.join("tests", "mpi", "launcher_parity.py")

#: mode -> whether its payloads are gathered (torch.distributed pads each rank's row to 8-byte
#: multiples, so its bytes per step may exceed MPI's exact Allgatherv)
MODES = {"diloco-topk": True, "diloco-fp16": False, "co2-none": False, "sparseloco": True, "adaalter": False,
         "onebit-adam": False, "zeroone-adam": False, "onebit-lamb": False, "amsgrad": False,
         "choco-topk": False, "choco-sign": False, "dcd": False, "ecd": False, "powergossip": False,
         "ab-only-b": False, "ab-ab": False}


def params(out):
    return {m.group(1): m.groups()[1:] for m in re.finditer(r"^PARAMS (\S+) (\S+) (\S+) (\S+)$", out, re.M)}


@pytest.fixture(scope="module")
def both():
    modes = list(MODES)
    under_mpirun = params(check(2, [WORKER, *modes], timeout=300))
    port = str(random.Random().randint(20000, 40000))
    under_torchrun = params(run([TORCHRUN, "--nproc_per_node", "2", "--master_port", port, WORKER, *modes], 300))
    return under_mpirun, under_torchrun


@pytest.mark.parametrize("mode", list(MODES))
def test_torchrun_ends_where_mpirun_ends(both, mode):
    under_mpirun, under_torchrun = both
    assert mode in under_mpirun and mode in under_torchrun, (under_mpirun, under_torchrun)
    (h1, s1, b1), (h2, s2, b2) = under_mpirun[mode], under_torchrun[mode]
    assert (h1, s1) == (h2, s2), f"{mode}: mpirun {s1} ({h1}), torchrun {s2} ({h2})"
    if MODES[mode]:
        assert float(b1) <= float(b2) <= float(b1) * 1.1 + 8, (b1, b2)
    else:
        assert b1 == b2, (b1, b2)


@pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(ROOT), "shared", "data", "tinyshakespeare",
                                                    "input.txt")), reason="../shared/data not present")
def test_train_lm_local_update_under_torchrun_equals_mpirun(tmp_path):
    """train_lm.py with DiLoCo (H = 2, top-k Δ) ends at the same perplexities under torchrun
    (--frontend ddp: torch.distributed, no Horovod) as under mpirun."""
    import json

    from tests.mpirun import TINY_SHAKESPEARE
    args = ["mpi_scripts/train_lm.py", "--local-steps", "2", "--compressor", "topk:density=0.05", "--epochs", "1",
            "--max-steps", "4", "--no-progress", "--data", TINY_SHAKESPEARE, "--cost-model", "off"]
    check(2, [*args, "--output", str(tmp_path / "mpirun")], timeout=300)
    port = str(random.Random().randint(20000, 40000))
    run([TORCHRUN, "--nproc_per_node", "2", "--master_port", port, *args, "--frontend", "ddp",
         "--output", str(tmp_path / "torchrun")], 300)
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("mpirun", "torchrun"))
    assert a["launcher"] == "openmpi" and b["launcher"] == "torchrun"
    assert a["best_val_ppl"] == b["best_val_ppl"] and a["test_ppl"] == b["test_ppl"], (a["test_ppl"], b["test_ppl"])
