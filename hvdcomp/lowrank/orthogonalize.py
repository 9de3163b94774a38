"""Column orthonormalisation used by PowerSGD (Vogels et al., NeurIPS 2019)."""
from __future__ import annotations

import torch

__all__ = ["orthogonalize"]


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of ``matrix`` in place and return it: an n × r matrix (r ≤ n,
    floating), or a batch of them (..., n, r), each orthonormalised on its own.

    Gram–Schmidt for r ≤ 2 or half precision (each column projected against the finished ones
    twice, so a column that is nearly their combination, as P = M·Q for a rank-1 M, still comes
    out orthogonal), Householder QR otherwise. Scale-safe: a column of any finite magnitude comes
    out orthonormal. A zero column stays zero under Gram–Schmidt (never NaN); QR returns some
    orthonormal column in its place. With ``epsilon > 0`` a column is divided by
    ``‖column‖ + epsilon`` (PyTorch DDP's ``orthogonalization_epsilon``; not scale-invariant).

    Raises:
        ValueError: fewer than 2 dimensions, or more columns than rows.
    """
    if matrix.dim() < 2 or matrix.shape[-1] > matrix.shape[-2]:
        raise ValueError(f"expected n x r matrices with r <= n, got shape {tuple(matrix.shape)}")
    r = matrix.shape[-1]
    if r <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        tiny = torch.finfo(matrix.dtype).tiny
        whole = (-2, -1)
        for i in range(r):
            col = matrix[..., i:i + 1]
            if i:  # project out the finished columns again ("twice is enough", see above)
                done = matrix[..., :i]
                col -= done @ (done.transpose(-2, -1) @ col)
            largest = col.abs().amax(dim=whole, keepdim=True).clamp_min(tiny)
            if epsilon:
                col /= largest * torch.linalg.vector_norm(col / largest, dim=whole, keepdim=True) + epsilon
            else:
                col /= largest                      # entries in [-1, 1]: the norm cannot under/overflow
                col /= torch.linalg.vector_norm(col, dim=whole, keepdim=True).clamp_min(tiny)
            if i + 1 < r:
                rest = matrix[..., i + 1:]
                rest -= (col * rest).sum(-2, keepdim=True) * col
        return matrix
    q, _ = torch.linalg.qr(matrix)
    return matrix.copy_(q)
