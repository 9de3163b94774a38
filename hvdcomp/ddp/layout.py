"""What the compressor sees in one DDP gradient bucket: its *units* (a pure function of the bucket's
parameters, the method and the granularity; the same on every rank).

A DDP bucket (``torch.distributed.GradBucket``) is one flat 1-D buffer holding several gradients
back to back (``bucket.parameters()`` in buffer order, one dtype and device). It is always the
unit of *communication*: one payload exchange per bucket. What is *compressed* as one tensor
depends on ``granularity``:

* ``"tensor"`` (default): each gradient by its own rules (its own top-k, fp16 scale, residual,
  keyed by the parameter's name), as the Horovod front-end does. A method that can
  (``segmentable``: top-k ``select=exact``, threshold, fp16, bf16, with or without error
  feedback) compresses the whole buffer in one vectorised call with per-tensor results
  (:class:`hvdcomp.compressors.segments.Segments`); other methods get one call per gradient, on a
  view of the buffer in the gradient's shape, in the expected backward order (the reverse of
  ``model.parameters()``, the order in which the Horovod front-end's hooks fire on a plain
  feed-forward model), so stochastic methods draw their random numbers in that order whatever
  DDP's bucket layout is. State is keyed by parameter name, so it does not care which bucket a
  gradient lands in: DDP rebuilding its buckets after the first iteration changes nothing.
* ``"bucket"``: the whole buffer as one 1-D tensor named ``bucket<k>`` (k = ``bucket.index()``),
  as PyTorch's own comm hooks compress: top-k keeps the largest entries of the bucket, not of each
  layer; state is kept per bucket. See :mod:`hvdcomp.ddp.hook` for how the bucket rebuild is handled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..compressors.segments import Segments

__all__ = ["Unit", "BucketLayout", "plan_bucket", "GRANULARITIES"]

GRANULARITIES = ("tensor", "bucket")


@dataclass(frozen=True)
class Unit:
    """One compression call of a bucket.

    Attributes:
        name: the name its state is kept under (a parameter's, or ``bucket<k>``); None for a
            segmented unit (each segment has its own name).
        start, stop: its elements in the bucket buffer (``buffer[start:stop]``).
        shape: the tensor shape it is compressed in (a gradient's, or ``(stop - start,)``).
        segments: the :class:`Segments` of a unit holding several gradients, else None.
    """

    name: Optional[str]
    start: int
    stop: int
    shape: Tuple[int, ...]
    segments: Optional[Segments] = None

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The unit's tensor: a view of the 1-D ``buffer`` (read it, and write results into it)."""
        return buffer[self.start:self.stop].view(self.shape)


@dataclass
class BucketLayout:
    """The units of one bucket, in the order they are compressed (see the module docstring).

    Attributes:
        index: ``bucket.index()``.
        names, shapes: the bucket's parameters in buffer order.
        numel: elements in the buffer.
        units: compression calls, in compression order.
        key: identifies the layout (parameter names in buffer order): a changed key at the same
            index means DDP rebuilt its buckets.
    """

    index: int
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    numel: int
    units: List[Unit]

    @property
    def key(self) -> Tuple[str, ...]:
        return self.names


def plan_bucket(index: int, names: Sequence[str], shapes: Sequence[Sequence[int]], positions: Sequence[int],
                segmentable: bool, granularity: str = "tensor") -> BucketLayout:
    """The units of bucket ``index``.

    Args:
        index: the bucket's index.
        names: its parameters' names, in buffer order (unique).
        shapes: their shapes.
        positions: their positions in the expected backward order (the reverse of
            ``model.parameters()``); per-gradient units are compressed in increasing position.
        segmentable: whether the method compresses several gradients in one call
            (``Compressor.segmentable``).
        granularity: ``"tensor"`` or ``"bucket"`` (see the module docstring).

    Raises:
        ValueError: unknown ``granularity``, or ``names``/``shapes``/``positions`` of different
            lengths.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be 'tensor' or 'bucket', got {granularity!r}")
    if not (len(names) == len(shapes) == len(positions)):
        raise ValueError("plan_bucket needs one shape and one position per name")
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    numel = offsets[-1]
    if granularity == "bucket":
        units = [Unit(f"bucket{index}", 0, numel, (numel,))]
    elif segmentable and len(names) > 1:
        units = [Unit(None, 0, numel, (numel,), Segments(list(names), shapes))]
    else:
        order = sorted(range(len(names)), key=lambda j: positions[j])
        units = [Unit(names[j], offsets[j], offsets[j + 1], shapes[j]) for j in order]
    return BucketLayout(index, tuple(names), shapes, numel, units)
