"""PowerSGD: low-rank recovery, orthonormal P, error feedback, exact uncompressed tensors (single
process), and a match with PyTorch's DDP powerSGD_hook at 2 and 4 ranks (gloo, CPU)."""
import contextlib
import random

import pytest
import torch

import hvdcomp
from hvdcomp.lowrank import orthogonalize
from hvdcomp.metrics import PhaseTimer
from tests.mpirun import check


def identity(x, name):  # allreduce_mean of a single rank
    return x.clone()


def run(comp, named, steps=1):
    timer = PhaseTimer(cuda_sync=False)
    for _ in range(steps):
        out = comp.reduce_batch([(n, g.clone()) for n, g in named], identity, timer)
    return out


def test_rank_r_matrix_recovered_after_warm_start():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(40, 3, generator=g) @ torch.randn(3, 25, generator=g)
    comp = hvdcomp.get_compressor("powersgd:matrix_rank=3")
    for _ in range(3):                                  # the same gradient each step, EF on
        out = run(comp, [("w", m)])[0]
    assert ((out - m).norm() / m.norm()).item() < 1e-5
    p = comp.p["w"]
    assert torch.allclose(p.t() @ p, torch.eye(3), atol=1e-5)   # P orthonormal


def test_error_feedback_telescopes_float64():
    gen = torch.Generator().manual_seed(1)
    comp = hvdcomp.get_compressor("powersgd:matrix_rank=1")
    grads = [torch.randn(12, 9, generator=gen, dtype=torch.float64) for _ in range(6)]
    sent = torch.zeros(12, 9, dtype=torch.float64)
    for grad in grads:
        sent += run(comp, [("w", grad.float())])[0].double()
    total = sum(grads)
    assert torch.allclose(sent + comp.error["w"].double(), total, atol=1e-4)


def test_uncompressed_tensors_are_exact():
    comp = hvdcomp.get_compressor("powersgd:matrix_rank=4")
    bias, small = torch.randn(7), torch.randn(3, 4)            # 1-D, and (3+4)*3 >= 12
    out = run(comp, [("b", bias), ("s", small)])
    assert torch.equal(out[0], bias) and torch.equal(out[1], small)
    assert not comp.compressible((3, 4)) and comp.compressible((30, 40)) and not comp.compressible((7,))
    assert comp.compressible((8, 3, 3, 3))                     # conv: 8 x 27


def test_orthogonalize_gram_schmidt_and_qr():
    for r in (1, 2, 5):
        a = torch.randn(20, r)
        q = orthogonalize(a.clone())
        assert torch.allclose(q.t() @ q, torch.eye(r), atol=1e-5)
        # same column space
        assert torch.allclose(q @ (q.t() @ a), a, atol=1e-4)
    z = orthogonalize(torch.zeros(5, 2))
    assert torch.isfinite(z).all()
    with pytest.raises(ValueError):
        orthogonalize(torch.zeros(2, 5))


def test_powersgd_refuses_per_tensor_use_and_bad_rank():
    comp = hvdcomp.get_compressor("powersgd")
    with pytest.raises(TypeError, match="reduce_batch"):
        comp.encode(torch.ones(3, 3), "w")
    with pytest.raises(ValueError, match="rank"):
        hvdcomp.get_compressor("powersgd:matrix_rank=0")


@pytest.mark.parametrize("ranks", [2, 4])
def test_matches_pytorch_ddp_powersgd_hook(ranks):
    port = str(random.Random().randint(20000, 40000))
    out = check(ranks, ["tests/mpi/powersgd_checks.py"], timeout=240, env={"MASTER_PORT": port})
    assert "OK powersgd matches DDP hook" in out, out[-3000:]


def test_a_step_allocates_two_model_sized_tensors():
    """Per-step work against powerSGD_hook (issue 59): with error feedback, a compressed step
    allocates M = stacked gradient + error and the approximation P·Qᵀ, and nothing else of the
    gradient's size (the error is added and the new error M − P·Qᵀ formed in place; PyTorch's
    hook allocates one model-sized copy of its bucket). Counted by the profiler's allocations, the
    factors (P, Q: (n + m)·r floats) aside."""
    from torch.profiler import ProfilerActivity, profile

    n, m = 512, 256
    comp = hvdcomp.get_compressor("powersgd:matrix_rank=1")
    grads = [torch.randn(n, m, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    run(comp, [("w", grads[0])])                            # step 1 leaves an error to add
    g = grads[1].clone()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        comp.reduce_batch([("w", g)], identity, PhaseTimer(cuda_sync=False))
    allocated = sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)
    matrix = 4 * n * m
    assert 2 * matrix <= allocated <= 2 * matrix + 64 * 4 * (n + m), (allocated, matrix)


def _step_operations(layers):
    """Torch operations (the profiler's, nested ones included) of the third step of
    ``reduce_step`` over ``layers`` × (64 × 64 weight, 64 bias), results copied into the gradients."""
    from torch.profiler import profile

    from hvdcomp.transports.stepwide import reduce_step
    comp = hvdcomp.get_compressor("powersgd:matrix_rank=2")
    grads = [torch.randn(shape) for shape in [(64, 64), (64,)] * layers]
    names = [f"p{i}" for i in range(2 * layers)]
    for step in range(3):
        with profile() if step == 2 else contextlib.nullcontext() as prof:
            reduce_step(comp, names, grads, identity, PhaseTimer(cuda_sync=False))
    return len(prof.events())


def test_a_step_makes_few_operations_per_repeated_layer():
    """Per repeated layer (its weight in the batch of its shape, its bias sent uncompressed), the
    operations a step adds, from 20 to 200 layers (issue 58). What stays per gradient: the views
    of the weight's Q, error and result and the copy into ``.grad``; the bias's view and copy.
    Before: 17.4 a layer (every P unbound for inspection each step, the bias views by
    ``unflatten_dense_tensors``: four operations each); after: 12.4."""
    assert (_step_operations(200) - _step_operations(20)) / 180 <= 12.5
