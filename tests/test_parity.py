"""Parity with stock Horovod for the behaviours its optimizer tests check (tests/mpi/parity_checks.py),
under timeouts: every case at 2 ranks, process sets at 4 (two sets of two members).

Each case, with every torch.optim optimizer that accepts its parameters: hvdcomp ``none``'s final
parameters (and optimizer state where the case is about it) equal stock Horovod's bit for bit,
or the same exception type; the one exception, stated in the worker, is sparse gradients without
``sparse_as_dense`` under an optimizer that does not coalesce them (SGD: a few ulp).
"""
import os

from mpirun import check

WORKER = os.path.join(os.path.dirname(__file__), "mpi", "parity_checks.py")
ENV = {"HOROVOD_FUSION_THRESHOLD": "0", "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
       "OMPI_MCA_coll_tuned_allreduce_algorithm": "1", "HOROVOD_CYCLE_TIME": "1"}
DENSE = {"ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
         "Rprop", "SGD"}   # torch 2.13's optimizers that take dense 1-D and 2-D parameters
SPARSE = {"Adagrad", "SGD", "SparseAdam"}
CASES_2 = {"broadcast_state": DENSE, "force_allreduce": DENSE, "dynamic_requires_grad": DENSE,
           "gradient_clipping": DENSE, "synchronize_step_warning": DENSE, "no_named_parameters": DENSE,
           "missing_named_parameters": DENSE, "duplicate_names": DENSE, "sparse_embedding_sparse": SPARSE,
           "sparse_embedding_as_dense": SPARSE, "adasum_none": DENSE, "adasum_fp16": DENSE}


def passed(out):
    ok = {}
    for line in out.splitlines():
        if line.startswith("OK "):
            parts = line.split()
            ok.setdefault(parts[1], set()).add(parts[2])
    return ok


def test_every_case_at_two_ranks():
    out = check(2, [WORKER], timeout=600, env=ENV)
    assert "PARITY DONE" in out, out[-3000:]
    ok = passed(out)
    for case, optimizers in CASES_2.items():
        assert optimizers <= ok.get(case, set()), (case, sorted(optimizers - ok.get(case, set())), out[-3000:])
    assert ok["errors_before_init"] == {"ValueError"}
    assert "nonfinite" in ok and "adasum_refused" in ok
    # bit for bit except the stated case
    within = [line for line in out.splitlines() if "within" in line]
    assert all(line.startswith("OK sparse_embedding_sparse SGD") for line in within), within


def test_process_sets_at_four_ranks():
    out = check(4, [WORKER, "process_sets"], timeout=600, env=ENV)
    assert "PARITY DONE" in out, out[-3000:]
    assert DENSE <= passed(out).get("process_sets", set()), out[-3000:]
