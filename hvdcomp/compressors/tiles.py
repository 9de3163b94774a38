"""Tiles: top-k within each tile of a gradient, SparseLoCo's released selection
(``topk:tile=64``, :class:`hvdcomp.compressors.topk.TopKCompressor`).

Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
2025. A matrix (m, n) (a tensor of more dimensions: (shape[0], the rest); a vector: one row) is
cut into h × w tiles, h and w the largest divisors of its dimensions not above T, and each tile
keeps its max(1, round(ρ·h·w)) entries of largest magnitude. How this follows the authors'
released code: docs/methods.md, "Top-k within tiles".
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Tuple

import torch

__all__ = ["largest_divisor_at_most", "tile_layout", "select_tiles"]


@lru_cache(maxsize=None)
def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` (≥ 1) that is at most ``limit`` (``n`` itself when n ≤ limit)."""
    if n <= limit:
        return n
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= limit:
                    best = c
    return best


@lru_cache(maxsize=None)
def tile_layout(shape: Tuple[int, ...], tile: int, density: float) -> Tuple[int, int, int, int, int]:
    """How a tensor of ``shape`` is tiled: ``(m, n, h, w, kept)``: the matrix (m, n) it is seen as,
    the tile h × w, and the entries kept per tile, ``min(h·w, max(1, round(density·h·w)))`` (see
    the module docstring)."""
    if len(shape) <= 1:
        m, n = 1, (shape[0] if shape else 1)
    else:
        m, n = shape[0], math.prod(shape[1:])
    h, w = largest_divisor_at_most(m, tile), largest_divisor_at_most(n, tile)
    kept = min(h * w, int(max(1, round(h * w * density))))
    return m, n, h, w, kept


def select_tiles(x: torch.Tensor, tile: int, density: float) -> torch.Tensor:
    """Indices (int64, ascending) into ``x.reshape(-1)`` of the entries of largest magnitude of
    each tile of ``x`` (:func:`tile_layout`: ``max(1, round(density·h·w))`` per h × w tile,
    ``torch.topk`` within each)."""
    if x.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    m, n, h, w, kept = tile_layout(tuple(x.shape), tile, density)
    if kept >= h * w:
        return torch.arange(x.numel(), device=x.device)
    tiles = x.reshape(m // h, h, n // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)
    local = torch.topk(tiles.abs(), kept, dim=1, sorted=False).indices      # (tiles, kept)
    t = torch.arange(tiles.shape[0], device=x.device).unsqueeze(1)
    row = (t // (n // w)) * h + local // w
    col = (t % (n // w)) * w + local % w
    return torch.sort((row * n + col).reshape(-1)).values
