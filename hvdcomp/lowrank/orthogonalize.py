"""Column orthonormalisation used by PowerSGD (Vogels et al., NeurIPS 2019)."""
from __future__ import annotations

import torch

__all__ = ["orthogonalize"]


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of ``matrix`` in place and return it: an n × r matrix (r ≤ n,
    floating), or a batch of them (..., n, r), each orthonormalised on its own.

    Gram–Schmidt for r ≤ 2 or half precision, Householder QR otherwise (faster for larger r).
    Gram–Schmidt projects each column against the finished ones twice: once is not enough when a
    column is (nearly) a combination of them, e.g. P = M·Q for a gradient M of rank 1 < r. The
    remainder is then rounding noise that is not orthogonal to them, and P·Pᵀ stops being a
    projection (PowerSGD at r = 2 sent up to twice a rank-1 gradient).

    Scale-safe: each Gram–Schmidt column is divided by its largest magnitude before its norm is
    taken, so columns of any finite magnitude (1e-30 or 1e30 in float32, whose squares under- or
    overflow) come out orthonormal; QR (LAPACK) scales internally. A zero column stays zero under
    Gram–Schmidt (never NaN); QR returns some orthonormal column in its place. With
    ``epsilon > 0`` a column is divided by ``‖column‖ + epsilon`` (PyTorch DDP's
    ``orthogonalization_epsilon``), which is not scale-invariant: columns of norm far below
    ``epsilon`` shrink towards zero. A batch costs the same number of kernel calls as one matrix
    (PowerSGD batches matrices of equal shape).

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
