"""hvdcomp.adaptive_opt over Horovod and MPI (each run under a timeout): the warm-up equals
torch's Adam/AdamW over hvdcomp 'none' bit for bit and the switch step the reference simulation;
resumes before, at and after freeze_step continue exactly; Horovod's rank-0 recipe; refusals on
every rank; 0/1 Adam's bytes per step; AMSGrad on the two-way compressed gradient; the compressed
allreduce over MPI at 3 ranks (uneven chunks); train_lm.py --optimizer onebit-adam."""
import json
import os

import pytest

from tests.mpirun import TINY_SHAKESPEARE, check

WORKER = "tests/mpi/adaptive_optimizer_checks.py"


def test_warmup_switch_and_zeroone_bytes_at_2_ranks():
    out = check(2, [WORKER, "warmup_equals_adam_then_switch", "zeroone_bytes", "compressed_amsgrad"], timeout=300)
    assert out.count("OK ") == 3, out[-3000:]


def test_resume_and_rank0_recipe_at_2_ranks():
    out = check(2, [WORKER, "resume_before_at_after_freeze", "rank0_recipe", "refusals"], timeout=300)
    assert out.count("OK ") == 3, out[-3000:]


def test_rebuilt_optimizers_keep_their_arguments_at_2_ranks():
    """Issue 57, item 6: a user optimizer's constructor-set attribute and defaults survive
    hvdcomp.DistributedOptimizer's rebuild (and stock Horovod's, for Adasum); 1-bit LAMB with
    freeze_step=20 and coeff_beta=0.5 equals DeepSpeed's formulas (tests/onebit_reference.py)."""
    out = check(2, [WORKER, "rebuilt_optimizer_keeps_its_arguments", "onebit_lamb_against_deepspeed_formulas"],
                timeout=300)
    assert out.count("OK ") == 2, out[-3000:]


def test_nonfinite_names_and_disagreeing_parameters_at_2_ranks():
    """Issue 57, item 8: the warm-up's non-finite error names only the rank that had the NaN (or
    none, where the gradients were averaged in place); ranks that start from different
    parameters, and frozen parameters, are refused on every rank."""
    out = check(2, [WORKER, "nonfinite_warmup_names_the_right_rank", "ranks_that_disagree_on_parameters"],
                timeout=300)
    assert out.count("OK ") == 2, out[-3000:]


def test_compressed_allreduce_over_mpi_at_3_ranks():
    out = check(3, [WORKER, "compressed_allreduce_over_mpi"], timeout=300)
    assert "OK compressed_allreduce_over_mpi" in out


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_onebit_adam_transformer(tmp_path):
    """The transformer LM with 1-bit Adam: 3 warm-up steps at 4 bytes per parameter, then 1-bit
    steps; every step's bytes are in the run total; perplexity falls."""
    out = check(2, ["mpi_scripts/train_lm.py", "--arch", "transformer", "--optimizer", "onebit-adam",
                    "--freeze-step", "3", "--lr", "1e-3", "--batch-size", "32", "--epochs", "1", "--max-steps", "6",
                    "--no-progress", "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=400)
    assert "SUMMARY method=onebit-adam ranks=2" in out
    r = json.loads((tmp_path / "results.json").read_text())
    n = r["config"]["parameters"]
    sent = r["run_bytes"]["bytes_sent"]["mean"]
    assert r["run_bytes"]["dense_bytes"]["mean"] == 6 * 4 * n
    assert 3 * 4 * n + 3 * n / 8 < sent < 3 * 4 * n + 3 * n / 4  # warm-up fp32, then ~1 bit per parameter
    assert r["config"]["transport"] == "alltoall+allgather (batched)"
    assert r["epochs"][0]["val_ppl"] < r["initial_val_ppl"]
