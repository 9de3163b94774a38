"""Reference simulation of the 1-bit compressed allreduce in plain tensors (test helper, used by
tests/test_adaptive_optimizers.py and tests/mpi/adaptive_optimizer_checks.py).

N simulated ranks, written from the algorithm (Tang et al., "1-bit Adam", ICML 2021: worker
residual, chunk scatter, server average and server residual, re-compression, gather), not from
hvdcomp's code: each rank adds its worker residual, cuts the vector into N contiguous chunks
(chunk j: elements [j·n//N, (j+1)·n//N)), and compresses each to ``scale·sign`` (scale: the mean
absolute value, summed in float64; sign(0) = +1); rank j averages the N compressed copies of
chunk j (added in rank order, then divided by N), adds its server residual and compresses
again; every rank gathers the N compressed chunks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """``mean|x| · sign(x)`` (float32; sign(0) = +1; an empty chunk stays empty)."""
    scale = (x.abs().sum(dtype=torch.float64) / max(1, x.numel())).to(torch.float32)
    return torch.where(x >= 0, scale, -scale)


def compressed_allreduce(inputs: Sequence[torch.Tensor], worker: Sequence[Optional[torch.Tensor]],
                         server: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, List[torch.Tensor], List]:
    """One step for N ranks.

    Args:
        inputs: per rank, the 1-D float32 vector (n,).
        worker: per rank, its worker residual (n,) or None (zero).
        server: per rank j, the server residual of chunk j or None (zero).

    Returns:
        ``(result, new worker residuals, new server residuals)``; with one rank there is no
        server side (its result is the compressed vector, computed as ``acc − residual``).
    """
    p, n = len(inputs), inputs[0].numel()
    bounds = [j * n // p for j in range(p + 1)]
    acc = [x.to(torch.float32) + (e if e is not None else 0) for x, e in zip(inputs, worker)]
    sent = [[scaled_sign(a[bounds[j]:bounds[j + 1]]) for j in range(p)] for a in acc]
    new_worker = [a - torch.cat(s) for a, s in zip(acc, sent)]
    if p == 1:
        return acc[0] - new_worker[0], new_worker, list(server)
    result, new_server = [], []
    for j in range(p):
        mean = torch.zeros(bounds[j + 1] - bounds[j])
        for r in range(p):
            mean += sent[r][j]
        mean /= p
        target = mean if server[j] is None else mean + server[j]
        q = scaled_sign(target)
        new_server.append(target - q)
        result.append(q)
    return torch.cat(result), new_worker, new_server
