"""Column orthonormalisation used by PowerSGD."""
from __future__ import annotations

import torch

__all__ = ["orthogonalize"]


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of ``matrix`` (n × r, r ≤ n) in place and return it.

    Gram–Schmidt for r ≤ 2 or half precision, Householder QR otherwise (faster for larger r).
    A zero column stays zero (its norm is clamped by ``epsilon`` or a tiny floor), never NaN.

    Raises:
        ValueError: not a 2-D matrix with at most as many columns as rows.
    """
    if matrix.dim() != 2 or matrix.shape[1] > matrix.shape[0]:
        raise ValueError(f"expected an n x r matrix with r <= n, got shape {tuple(matrix.shape)}")
    r = matrix.shape[1]
    if r <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        tiny = torch.finfo(matrix.dtype).tiny
        for i in range(r):
            col = matrix[:, i:i + 1]
            col /= (col.norm() + epsilon) if epsilon else col.norm().clamp_min(tiny)
            if i + 1 < r:
                rest = matrix[:, i + 1:]
                rest -= (col * rest).sum(0, keepdim=True) * col
        return matrix
    q, _ = torch.linalg.qr(matrix)
    return matrix.copy_(q)
