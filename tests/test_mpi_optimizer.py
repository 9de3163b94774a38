"""hvdcomp.DistributedOptimizer under real MPI ranks (mpirun -np 2 and 4, each under a timeout)."""
import pytest

from tests.mpirun import check

CHECKS = ["none_matches_horovod", "topk", "threshold_with_empty_rank",
          "horovod_allgather_fallback", "fp16_predivide", "sparse_refused_by_stock_horovod",
          "buckets_and_wire", "cost_model_routes", "threaded_and_inline_exchange_agree",
          "fused_equals_unfused", "scaleout_methods", "transport_auto", "hierarchical_allgather", "close"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_optimizer_checks(ranks):
    out = check(ranks, ["tests/mpi/optimizer_checks.py", *CHECKS], timeout=180)
    for name in CHECKS:
        assert f"OK {name}" in out, out[-3000:]


def test_scaleout_methods_8_ranks():
    """gtopk, cltk and twophase at 8 ranks (oversubscribed; three merge rounds)."""
    out = check(8, ["tests/mpi/optimizer_checks.py", "scaleout_methods"], timeout=240)
    assert "OK scaleout_methods" in out, out[-3000:]


def test_host_reads_per_step_do_not_grow_with_gradients():
    """No host read (on CUDA: a synchronisation) per gradient or per shape, for every default
    method (tests/mpi/optimizer_checks.py::check_host_reads)."""
    out = check(2, ["tests/mpi/optimizer_checks.py", "host_reads"], timeout=240)
    assert "OK host_reads" in out, out[-3000:]
    print("\n".join(line for line in out.splitlines() if line.startswith("host reads")))
