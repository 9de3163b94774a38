"""``topk``: magnitude top-k sparsification.

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018. The memory (error
feedback) is not part of this module: :func:`hvdcomp.get_compressor` wraps top-k in
:class:`hvdcomp.ErrorFeedback` by default (``ef=False`` turns it off).
"""
from __future__ import annotations

import math

import torch

from .sparse import SparseCompressor
from .registry import register


def check_density(density: float) -> float:
    """Validate a density ρ = k/n; raises ``ValueError`` unless ``0 < ρ <= 1``."""
    try:
        density = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not (0.0 < density <= 1.0):
        raise ValueError(f"density must be in (0, 1] (e.g. density=0.01 keeps 1 %), got {density}")
    return density


def num_kept(numel: int, density: float) -> int:
    """k = max(1, ceil(ρ·n)), capped at n (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel)))


@register("topk")
class TopKCompressor(SparseCompressor):
    """Keep the k = max(1, ceil(ρ·n)) entries of largest magnitude.

    Args:
        density: ρ in (0, 1]; 0.01 keeps 1 % ("50x" in the seed study's convention).

    Payload: ``[values (k,) float32, indices (k,) int32]`` (int64 when n ≥ 2^31), i.e. 8 bytes
    per kept element. Payloads of different ranks are gathered and scatter-added into zeros
    (indices chosen by several ranks add up), then divided by the world size.

    Raises:
        ValueError: if ``density`` is not in (0, 1].
    """

    name = "topk"
    default_error_feedback = True

    def __init__(self, density: float = 0.01):
        self.density = check_density(density)

    def describe(self):
        return {"name": self.name, "density": self.density}

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    def select(self, flat, name=None):
        n = flat.numel()
        k = num_kept(n, self.density)
        if k == n:
            return torch.arange(n, device=flat.device)
        return torch.topk(flat.abs(), k, sorted=False).indices
