"""Horovod recipe conformance (tests/mpi/recipes.py) at 1, 2 and 4 ranks, under timeouts.

Every recipe: hvdcomp ``none`` bit-identical to stock Horovod; every compressor bit-identical to
the test's reference model of "compressed once per synchronized step, state follows what is
applied". A size-independent MPI allreduce algorithm (basic linear) keeps Horovod's tensor
fusion from changing the order of any sum, for both contenders alike.
"""
import importlib.util
import os

import pytest

from mpirun import check

WORKER = os.path.join(os.path.dirname(__file__), "mpi", "recipes.py")
ENV = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "1",
       "HOROVOD_CYCLE_TIME": "1"}


def recipe_names():
    spec = importlib.util.spec_from_file_location("recipes", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.RECIPES)


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_every_recipe_matches_stock_horovod_and_the_reference(np_):
    out = check(np_, [WORKER], timeout=1200, env=ENV)
    for name in recipe_names():
        assert f"OK {name}" in out, out[-3000:]
