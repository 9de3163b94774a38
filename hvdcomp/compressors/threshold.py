"""``threshold``: send every element whose magnitude is at least a fixed threshold λ.

Strom, "Scalable distributed DNN training using commodity GPU cloud computing", Interspeech 2015
(with error feedback, on by default here as in that paper). The number of elements sent varies by
rank and step (possibly zero), so the payload goes through the allgather path.
"""
from __future__ import annotations


import torch

from ..checks import check_range
from .registry import register
from .selection import indices_at_least
from .segments import SegmentsContext
from .base import ErrorBound
from .sparse import SparseCompressor


@register("threshold")
class ThresholdCompressor(SparseCompressor):
    """Keep entries with ``|x| >= threshold``.

    Args:
        threshold: λ > 0, in the gradient's units.

    Payload: ``[values (m,) float32, indices (m,) int32]`` with m varying per rank, 0 ≤ m ≤ n
    (``values=fp16`` or ``int2`` / ``index=compact`` shrink it, see :mod:`hvdcomp.compressors.sparse`).

    Raises:
        ValueError: if ``threshold`` is not a positive finite number.
    """

    name = "threshold"
    default_error_feedback = True
    elementwise = True  # the same λ for every gradient: a bucket compresses as one tensor

    def __init__(self, threshold: float = 1e-3):
        self.threshold = check_range(threshold, "threshold", 0.0, low_open=True, hint=" (e.g. threshold=0.001)")

    def describe(self):
        return {"name": self.name, "threshold": self.threshold, **self.wire_options()}

    def _exact_values_bound(self):
        """A fixed threshold may keep nothing: δ = 0."""
        return ErrorBound("none", "a fixed threshold sends nothing once every entry is below it (δ = 0): use topk")

    def nominal_ratio(self, numel):
        """None: how many elements pass the threshold depends on the data (see measured bytes)."""
        return None

    def _encode_segments(self, flat, segments):
        """Several gradients: one selection over the buffer (the same λ for each), and with
        ``values=int2`` one scale per gradient, as one call per gradient sends; the context
        carries the layout (:class:`~hvdcomp.compressors.segments.SegmentsContext`)."""
        idx = self.select(flat)
        values = flat.index_select(0, idx).to(torch.float32)
        return (self.pack(values, idx, flat.numel(), overflow="inf", segments=segments),
                SegmentsContext(flat.shape, flat.dtype, segments))

    def select(self, flat, name=None):
        """Ascending indices with ``|flat| >= threshold`` (one fused scan on CPU)."""
        return indices_at_least(flat, torch.tensor(self.threshold, dtype=flat.dtype), magnitudes=False)
