"""The simulated-world override, the model of Horovod's CPU allreduce used by the numerics tests,
and the saturating casts (hand-worked values)."""
import pytest
import torch

import hvdcomp
from hvdcomp.compressors import rank, simulated_world, world_size
from hvdcomp.compressors.base import cast_saturating, copy_saturating_
from hvdcomp.compressors.rng import RankGenerators
from tests.simworld import SimulatedRanks, fp16_sequential_sum, horovod_allreduce


def test_simulated_world_overrides_and_nests():
    assert (world_size(), rank()) == (1, 0)          # no Horovod initialised in unit tests
    with simulated_world(64, 5):
        assert (world_size(), rank()) == (64, 5)
        with simulated_world(2, 1):
            assert (world_size(), rank()) == (2, 1)
        assert (world_size(), rank()) == (64, 5)
    assert (world_size(), rank()) == (1, 0)


@pytest.mark.parametrize("size,r", [(0, 0), (4, 4), (4, -1), (2.0, 0)])
def test_simulated_world_rejects_bad_values(size, r):
    with pytest.raises(ValueError, match="simulated_world"):
        with simulated_world(size, r):
            pass


def test_rank_generators_differ_per_simulated_rank():
    draws = []
    for r in range(3):
        with simulated_world(3, r):
            draws.append(torch.rand(4, generator=RankGenerators(seed=1).get("cpu")))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_fp16_sum_rounds_every_addition():
    # 2048 + 1 is a tie between 2048 and 2050 in float16 (spacing 2): rounds to even, 2048
    ranks = [torch.tensor([2048.0], dtype=torch.float16)] + [torch.tensor([1.0], dtype=torch.float16)] * 2
    assert fp16_sequential_sum(ranks).item() == 2048.0                  # float32 would give 2050
    # average: 2048 * float32(1/3) = 682.666..., float16 spacing 0.5 in [512, 1024): 682.5
    assert horovod_allreduce(ranks, "average").item() == 682.5
    big = [torch.tensor([40000.0], dtype=torch.float16)] * 2
    assert torch.isinf(horovod_allreduce(big, "sum")).all()           # the overflow fp16 must avoid


def test_float32_allreduce_is_sequential_then_scaled():
    ranks = [torch.tensor([1.0]), torch.tensor([2.0**-24]), torch.tensor([2.0**-24])]
    # (1 + 2^-24) rounds to 1 (tie to even), twice: 1.0, then * float32(1/3)
    assert horovod_allreduce(ranks, "sum").item() == 1.0
    assert horovod_allreduce(ranks, "average").item() == torch.tensor(1.0 / 3, dtype=torch.float32).item()
    with pytest.raises(ValueError):
        horovod_allreduce(ranks, "max")


def test_simulated_ranks_match_a_dense_mean():
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor("topk", density=0.5, ef=False), 3)
    grads = [torch.tensor([1.0, -4.0, 0.5, 2.0]), torch.tensor([3.0, 0.0, -1.0, 0.25]), torch.zeros(4)]
    # top-2 of each rank: {-4 @1, 2 @3}, {3 @0, -1 @2}, zeros -> (3, -4, -1, 2) / 3
    assert torch.allclose(sim.step(grads), torch.tensor([1.0, -4.0 / 3, -1.0 / 3, 2.0 / 3]))


def test_cast_saturating():
    x = torch.tensor([1e5, -1e5, 3.0, float("nan")])
    out = cast_saturating(x, torch.float16)
    assert out.dtype == torch.float16 and out[:3].tolist() == [65504.0, -65504.0, 3.0] and torch.isnan(out[3])
    assert cast_saturating(x, torch.float64).tolist()[:3] == [1e5, -1e5, 3.0]           # widening: unchanged
    wide = torch.tensor([1e39], dtype=torch.float64)
    assert cast_saturating(wide, torch.bfloat16).item() == torch.finfo(torch.bfloat16).max
    out = torch.empty(2, dtype=torch.float16)
    copy_saturating_(out, torch.tensor([7e4, -2.0]))
    assert out.tolist() == [65504.0, -2.0]
