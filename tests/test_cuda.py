"""CUDA paths against the CPU reference (skipped without a GPU): sparse coding, selection,
in-place aggregation, error feedback, and the pinned, non-blocking staging of payloads."""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.comm.allgatherv import _split, _stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SPECS = ["topk:density=0.01", "topk:density=0.01,select=sample,index=compact",
         "topk:density=0.001,values=fp16", "topk:density=0.01,values=int2,index=compact", "dgc:density=0.01",
         "threshold:threshold=2.5",
         "qsgd:levels=16", "terngrad", "efsignsgd", "fp16", "bf16", "randomk:density=0.01"]


@pytest.mark.parametrize("spec", SPECS)
def test_cuda_matches_cpu(spec):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    results = []
    for device in ("cpu", "cuda"):
        comp = hvdcomp.get_compressor(spec)
        payload, ctx = comp.encode(x.to(device), "w")
        assert all(t.device.type == device for t in payload)
        out = torch.empty(x.shape, device=device)
        comp.aggregate_into(out, [payload, payload], ctx)
        results.append((comp.decode(payload, ctx).cpu(), out.cpu()))
    if spec.startswith(("qsgd", "terngrad", "randomk")):  # stochastic: generators differ per device
        assert results[1][0].shape == results[0][0].shape
        return
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6), spec


def test_stage_and_split_on_cuda():
    payload = [torch.arange(5, dtype=torch.float16, device="cuda"),
               torch.tensor([7, 8, 9], dtype=torch.int32, device="cuda")]
    buf, ready = _stage(payload)
    assert ready is not None
    ready.synchronize()
    counts = np.array([[5, 3]])
    back = _split(torch.from_numpy(buf.copy()), counts, [t.dtype for t in payload], payload[0].device)
    for a, b in zip(back[0], payload):
        assert a.device.type == "cuda" and torch.equal(a, b)


# ---- issue 16's kernels: the CUDA path is the torch kernels; the CPU reference is native ----------
DECODE_SPECS = ["qsgd:levels=127", "qsgd:levels=16,block=100", "qsgd:levels=4,scale=max", "terngrad",
                "efsignsgd", "signsgd", "signsgd:vote=allgather", "topk:density=0.01",
                "topk:density=0.01,select=sample", "dgc:density=0.01", "randomk:density=0.01"]


@pytest.mark.parametrize("spec", DECODE_SPECS)
def test_cuda_aggregate_of_cpu_payloads_equals_cpu(spec):
    """The same payloads (encoded on the CPU) aggregated on CUDA (torch kernels) and on the CPU
    (native kernels where available): the same numbers."""
    n = 3 * 8192 + 17
    g = torch.Generator().manual_seed(1)
    comp = hvdcomp.get_compressor(spec)
    payloads, ctx = [], None
    for r in range(3):
        payload, ctx = comp.encode(torch.randn(n, generator=g), f"w{r}" if spec.startswith("dgc") else "w")
        payloads.append([t.clone() for t in payload])
    cpu = comp.aggregate_into(torch.empty(n), payloads, ctx)
    cuda_ctx = ctx
    if spec.startswith("randomk"):                  # its context holds the shared indices
        cuda_ctx = (ctx[0], ctx[1], ctx[2].cuda())
    gpu = comp.aggregate_into(torch.empty(n, device="cuda"), [[t.cuda() for t in p] for p in payloads], cuda_ctx)
    assert torch.allclose(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6), spec


@pytest.mark.parametrize("spec", ["qsgd:levels=16,block=64", "qsgd:levels=127,block=64", "terngrad"])
def test_cuda_quantizers_unbiased(spec):
    v = torch.randn(256, generator=torch.Generator().manual_seed(2)).cuda()
    comp = hvdcomp.get_compressor(spec)
    outs = torch.stack([comp.decode(*comp.encode(v, "w")) for _ in range(2000)]).double()
    target = v.double()
    if spec == "terngrad":
        c = 2.5 * v.std()
        target = v.clamp(-c, c).double()
    se = outs.std(0) / 2000 ** 0.5 + 1e-12
    assert ((outs.mean(0) - target).abs() <= 3.5 * se + 1e-9).float().mean() >= 0.97


def test_cuda_exact_topk_is_the_topk_set():
    from hvdcomp.compressors import selection

    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3)).cuda()
    idx = selection.exact_topk(x, 655, magnitudes=False)
    assert idx.device.type == "cuda" and idx.numel() == 655 and bool((idx[1:] > idx[:-1]).all())
    assert set(idx.tolist()) == set(torch.topk(x.abs(), 655).indices.tolist())


def _horovod_gpu():
    import horovod.torch as hvd
    return hvd.cuda_built() or hvd.nccl_built()


@pytest.mark.skipif(not torch.cuda.is_available() or not _horovod_gpu(),
                    reason="needs a GPU and Horovod built with GPU operations (HOROVOD_GPU_OPERATIONS=NCCL)")
@pytest.mark.parametrize("spec", ["none", "topk:density=0.3", "dgc:density=0.3", "powersgd:matrix_rank=1"])
def test_optimizer_end_to_end_on_cuda_matches_cpu(spec):
    """2 ranks on the GPU(s) train 3 steps; parameters match the same run on the CPU, and the
    phase timer used CUDA events (no synchronisation inside the gradient hooks)."""
    import os

    from mpirun import check

    out = check(2, [os.path.join(os.path.dirname(__file__), "mpi", "cuda_checks.py"), spec], timeout=600)
    assert "OK cuda" in out, out[-3000:]


def test_local_update_host_copy_on_cuda_matches_cpu():
    """Issue 32's host copy: a CUDA model's θ_start and Δ live on the host, the reduction runs
    there, and DiLoCo and CO2 end where the same runs on the CPU end (2 ranks)."""
    import os

    from mpirun import check

    out = check(2, [os.path.join(os.path.dirname(__file__), "mpi", "cuda_local_checks.py")], timeout=600)
    assert "OK cuda local" in out, out[-3000:]
