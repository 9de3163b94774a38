"""Tiles: top-k within each tile of a gradient, SparseLoCo's released selection
(``topk:tile=64``, :class:`hvdcomp.compressors.topk.TopKCompressor`).

Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
2025. What the authors' released code (``one-covenant/SparseLoCo``, ``src/tplr/sparseloco.py``:
``ChunkingTransform``, ``TopKCompressor``, ``SparseLoCo.step``; read through the unchanged copy in
the public fork ``QErywan/RobustDiLoCo``, the original repository could not be fetched here) does
with one tensor of the error-feedback buffer, and what ``topk:density=ρ,tile=T`` does alike:

* **tiles**: a matrix (m, n) is cut into tiles of h × w, h the largest divisor of m that is at
  most T (their ``chunk_size``, 64) and w the same for n; a vector of n elements into chunks of
  the largest divisor of n that is at most T. A dimension with no divisor near T gets narrow
  tiles (a prime n > 64: tiles of width 1, so every entry is sent, as in their code);
* **k per tile**: max(1, round(ρ·h·w)) (Python's round, half to even), at most h·w; theirs is
  max(1, round(h·w·top_k / chunk_size²)), so ρ = top_k / chunk_size² (128 / 64² = 1/32 in their
  released configuration: 128 of each full 64 × 64 tile, 2 of each 64-element chunk);
* **selection**: the k entries of largest magnitude in each tile (``torch.topk``).

Their values travel at 2 bits through their statistical quantizer (``values=stat2``, one header
per tensor) and the receivers average each index over the ranks that sent it
(``average=senders``): :mod:`hvdcomp.compressors.sparse`; :class:`hvdcomp.local.SparseLoCo`
sets all three.

Extension: their chunking handles 1-D and 2-D tensors only; here a tensor of more dimensions is
tiled as the matrix (shape[0], the product of the rest), and a 0-d tensor as a vector of one.
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
