"""Hand-worked recipe cases, restores, agreement, low precision and failures (tests/mpi/recipe_checks.py)."""
import os

import pytest

from mpirun import check, mpirun

WORKER = os.path.join(os.path.dirname(__file__), "mpi", "recipe_checks.py")
PASSING = ["amp_overflow_then_steps", "amp_scale_change_rescales_residual", "clip_without_skip_synchronize",
           "discard_leaves_no_trace", "zero_grad_between_accumulated_passes_refused", "resume_rank0_only",
           "resume_every_rank_bit_identical", "restore_mid_training_on_one_rank_fails_loudly",
           "backward_passes_mismatch_raises_everywhere", "disagreeing_settings",
           "compressor_shared_between_optimizers_refused", "adasum_refused", "low_precision_every_method",
           "fp16_sums_never_overflow", "bf16_dense_route"]


@pytest.mark.parametrize("np_", [2, 4])
def test_recipe_checks(np_):
    out = check(np_, [WORKER, *PASSING], timeout=900)
    for name in PASSING:
        assert f"OK {name}" in out, out[-3000:]


def test_failed_allgather_thread_ends_every_rank_quickly():
    """Rank 1's background allgather thread fails: MPI_Abort ends the job within seconds (rank 0
    would otherwise wait in the collective forever, or sleep 30 s and fail the check itself)."""
    res = mpirun(2, [WORKER, "allgather_thread_failure_aborts_the_job"], timeout=120)
    assert res.returncode != 0, res.stdout[-3000:]
    assert "allgather thread failed on rank 1" in res.stdout, res.stdout[-3000:]
    assert "injected failure on the allgather thread" in res.stdout
    assert "the job survived" not in res.stdout  # rank 0 was ended during its 30 s wait
