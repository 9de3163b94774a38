"""CUDA paths against the CPU reference (skipped without a GPU): sparse coding, selection,
in-place aggregation, error feedback, and the pinned, non-blocking staging of payloads."""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.comm.allgather import _split, _stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SPECS = ["topk:density=0.01", "topk:density=0.01,select=sample,index=compact",
         "topk:density=0.001,values=fp16", "dgc:density=0.01", "threshold:threshold=2.5",
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


def _horovod_gpu():
    import horovod.torch as hvd
    return hvd.cuda_built() or hvd.nccl_built()


@pytest.mark.skipif(not torch.cuda.is_available() or not _horovod_gpu(),
                    reason="needs a GPU and Horovod built with GPU operations (HOROVOD_GPU_OPERATIONS=NCCL)")
@pytest.mark.parametrize("spec", ["none", "topk:density=0.3", "dgc:density=0.3", "powersgd:rank=1"])
def test_optimizer_end_to_end_on_cuda_matches_cpu(spec):
    """2 ranks on the GPU(s) train 3 steps; parameters match the same run on the CPU, and the
    phase timer used CUDA events (no synchronisation inside the gradient hooks)."""
    import os

    from mpirun import check

    out = check(2, [os.path.join(os.path.dirname(__file__), "mpi", "cuda_checks.py"), spec], timeout=600)
    assert "OK cuda" in out, out[-3000:]
