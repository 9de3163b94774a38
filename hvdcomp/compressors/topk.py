"""``topk``: magnitude top-k sparsification.

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018. The memory (error
feedback) is :class:`hvdcomp.ErrorFeedback`, on by default (``ef=False`` turns it off).
"""
from __future__ import annotations

import math

import torch

from .registry import register
from .rng import DrawsPerCall, RankGenerators
from .selection import (
    check_sample_ratio,
    check_select,
    exact_topk,
    sample_draws,
    sampled_threshold_topk,
    select_segments,
)
from ..checks import check_count, check_optional, check_range, check_seed
from .segments import SegmentsContext
from .base import ErrorBound
from .sparse import SparseCompressor
from .tiles import select_tiles

DEFAULT_SAMPLE_RATIO = 0.01


def check_density(density: float, what: str = "density") -> float:
    """Validate a density ρ = k/n (:func:`hvdcomp.checks.check_range`); raises ``ValueError``
    unless ρ is a real number (not a bool) with ``0 < ρ <= 1``."""
    return check_range(density, what, 0.0, 1.0, low_open=True, hint=f" (e.g. {what}=0.01 keeps 1 %)")


def num_kept(numel: int, density: float) -> int:
    """k = max(1, ceil(ρ·n)), capped at n (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel)))


@register("topk")
class TopKCompressor(DrawsPerCall, SparseCompressor):
    """Keep the k = max(1, ceil(ρ·n)) entries of largest magnitude.

    Args:
        density: ρ in (0, 1]; 0.01 keeps 1 % ("50x" in the seed study's convention).
        select: how the entries are found:

            * ``"exact"`` (default, the reference): exactly k entries (the set of ``torch.topk``);
            * ``"sample"``: DGC's sampled threshold (:func:`~hvdcomp.compressors.selection.
              sampled_threshold_topk`), O(n), 0.8k to 1.3k entries.
        sample_ratio: fraction of the entries sampled by ``select=sample``, in (0, 1] (0.01).
        seed: base seed of the per-rank sampling generator (``select=sample``).
        tile: None (default: the top k of the whole gradient), or the tile side T: each tile
            keeps its own max(1, round(ρ·h·w)) largest entries (:mod:`hvdcomp.compressors.tiles`;
            with ``select=exact`` only).

    Payload: ``[values (k,) float32, indices (k,) int32]`` (:mod:`hvdcomp.compressors.sparse`:
    other codings, how ranks combine). Several gradients in one call (``segments``): each keeps
    its own selection; one ``[values, indices]`` pair over the flat buffer.

    State (``select=sample`` only): the sampling generator's state, ``state_dict()["rng"]``.

    Raises:
        ValueError: ``density`` not in (0, 1]; ``select`` not one of exact, sample;
            ``sample_ratio`` not in (0, 1], or set while ``select=exact`` (where it does nothing);
            ``tile`` not an integer >= 1, or given with ``select=sample``.
    """

    name = "topk"
    default_error_feedback = True

    def __init__(self, density: float = 0.01, select: str = "exact",
                 sample_ratio: float = DEFAULT_SAMPLE_RATIO, seed: int = 0, tile=None):
        self.density = check_density(density)
        # not ``self.select``: that is the method SparseCompressor calls
        self.select_mode = check_select(select)
        self.sample_ratio = check_sample_ratio(sample_ratio)
        if self.select_mode == "exact" and self.sample_ratio != DEFAULT_SAMPLE_RATIO:
            raise ValueError(f"sample_ratio={sample_ratio} only applies to select=sample: use "
                             f"'topk:density={self.density},select=sample,sample_ratio={sample_ratio}' "
                             "or drop sample_ratio")
        self.seed = check_seed(seed)
        self.rng = RankGenerators(self.seed)
        tile = check_optional(tile, check_count, "tile (the tile side, elements)", 1, ", or None")
        if tile is not None and self.select_mode != "exact":
            raise ValueError("tile selects each tile's top entries exactly: use select=exact with tile")
        self.tile = tile

    def describe(self):
        out = {"name": self.name, "density": self.density}
        if self.select_mode != "exact":
            out.update(select=self.select_mode, sample_ratio=self.sample_ratio)
            if self.seed:
                out["seed"] = self.seed
        if self.tile is not None:
            out["tile"] = self.tile
        return {**out, **self.wire_options()}

    def _exact_values_bound(self):
        """Keeps the k largest entries exactly: ‖C(v) − v‖² = ‖v‖² − ‖v_top-k‖² ≤ (1 − k/n)‖v‖²
        (Stich, Cordonnier and Jaggi, 2018); ``select=sample`` keeps about k, at least the largest."""
        density, sampled = self.density, self.select_mode == "sample"
        if sampled:
            return ErrorBound("contraction", "keeps the entries above a sampled threshold exactly, at least the largest: "
                                             "δ ≥ 1/n (about k/n)", delta=lambda n: 1.0 / max(1, n))
        return ErrorBound("contraction", "keeps the k = max(1, ⌈ρn⌉) largest entries exactly: δ = k/n",
                          delta=lambda n: num_kept(n, density) / max(1, n))

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    def expected_payload_bytes(self, numel):
        """As :class:`SparseCompressor`'s; ``None`` with ``tile`` (the kept count then depends on
        the gradient's shape, not only its size)."""
        return None if self.tile is not None else super().expected_payload_bytes(numel)

    def _encode(self, tensor, name=None):
        if self.tile is None:
            return super()._encode(tensor, name)
        flat = tensor.reshape(-1)
        idx = select_tiles(tensor, self.tile, self.density)
        values = flat.index_select(0, idx).to(torch.float32)
        return self.pack(values, idx, flat.numel(), overflow="inf"), (tensor.shape, tensor.dtype)

    def _encode_segments(self, flat, segments):
        """Each segment's own selection (:func:`~hvdcomp.compressors.selection.select_segments`:
        small gradients of one size by one ``torch.topk`` over their rows, the sampled thresholds
        segment by segment); indices ascending over the flat buffer, as :meth:`select` gives
        them."""
        sample = self.select_mode == "sample"
        if self.tile is not None:  # each gradient tiled by its own shape
            parts = [select_tiles(view, self.tile, self.density) + offset
                     for view, offset in zip(segments.views(flat), segments.offsets)]
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)
        else:
            draws = self._draws(segments.names, [(n, flat.device) for n in segments.sizes]) if sample else None
            idx = select_segments(flat, segments, lambda n: num_kept(n, self.density),
                                  self.sample_ratio if sample else None, draws, key=("topk", self.density))
        values = flat.index_select(0, idx).to(torch.float32)
        return (self.pack(values, idx, flat.numel(), overflow="inf", segments=segments),
                SegmentsContext(flat.shape, flat.dtype, segments))

    @property
    def draws_per_call(self) -> bool:
        """``select=sample`` draws its sample from the per-rank generator at each call."""
        return self.select_mode == "sample"

    def select(self, flat, name=None):
        if self.tile is not None:  # (the shape is not known here: a vector)
            return select_tiles(flat.reshape(-1), self.tile, self.density)
        k = num_kept(flat.numel(), self.density)
        if self.select_mode == "sample":
            positions = self._draws([name], [(flat.numel(), flat.device)])[0]
            return sampled_threshold_topk(flat, k, self.sample_ratio, self.rng, magnitudes=False,
                                          positions=positions)
        return exact_topk(flat, k, magnitudes=False)

    def _draw(self, items):
        """The sampled positions of ``items`` (``select=sample``)."""
        counts = self.__dict__.setdefault("_sample_counts", {})
        return sample_draws(self.rng, items, lambda n: num_kept(n, self.density), self.sample_ratio, counts=counts)

    def state_dict(self):
        return {"rng": self.rng.state_dict()} if self.select_mode == "sample" else {}

    def load_state_dict(self, state):
        self._check_state_keys(state, "rng", hint=" (select=sample)")
        self.rng.load_state_dict(state.get("rng", {}))
