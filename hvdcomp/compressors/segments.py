"""Several gradients compressed in one call, each by its own rules ("segments" of a flat buffer).

A *segmentable* compressor compresses a bucket's flat buffer in one call while keeping
per-tensor semantics (each segment its own top-k, scale, residual and random draw): the result
is the one per-tensor calls would give. What each method does over a bucket, and how the draws
keep their order (:class:`hvdcomp.compressors.rng.DrawOrder`, :func:`needs_draw_order`):
docs/fused-compression.md.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Tuple

import torch

__all__ = ["Segments", "SegmentsContext", "needs_draw_order"]


def needs_draw_order(method) -> bool:
    """Whether ``method`` draws from a per-rank generator at each call (``draws_per_call``), so
    that its fused units need the step's order of one call per gradient
    (:class:`hvdcomp.compressors.rng.DrawOrder`) to draw what one call per gradient draws."""
    return bool(getattr(method, "draws_per_call", False))


class SegmentsContext(NamedTuple):
    """The context of a segmented payload (several gradients in one call): the flat buffer's
    shape ``(numel,)`` and dtype first (as every per-tensor context), the
    :class:`Segments`, and what the method keeps besides (its layout, scales)."""

    shape: torch.Size
    dtype: torch.dtype
    segments: "Segments"
    extra: Any = None


class Segments:
    """The layout of a flat buffer holding several gradients, in order.

    Args:
        names: parameter name of each segment (state is kept per name).
        shapes: each gradient's shape; segment ``j`` holds ``prod(shapes[j])`` elements.

    Attributes:
        names, shapes: as given (tuples).
        sizes: elements per segment; ``offsets``: where each segment starts; ``numel``: the total.

    Raises:
        ValueError: ``names`` and ``shapes`` differ in length, or a name repeats.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]):
        if len(names) != len(shapes):
            raise ValueError(f"Segments needs one shape per name; got {len(names)} names and {len(shapes)} shapes")
        if len(set(names)) != len(names):
            raise ValueError("Segments: segment names must be unique")
        self.names: Tuple[str, ...] = tuple(names)
        self.shapes: Tuple[torch.Size, ...] = tuple(torch.Size(s) for s in shapes)
        self.sizes: List[int] = [s.numel() for s in self.shapes]
        *self.offsets, self.numel = accumulate(self.sizes, initial=0)
        #: each segment's shape as a 1-D tensor, ``(n,)``: for state kept flat (DGC's momenta)
        self.flat_shapes: Tuple[torch.Size, ...] = tuple(torch.Size([n]) for n in self.sizes)
        self._classes: Dict[torch.device, list] = {}
        self._cache: Dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self.names)

    def check(self, flat: torch.Tensor) -> None:
        """Raises ``ValueError`` unless ``flat`` is 1-D with :attr:`numel` elements."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"a segmented tensor must be 1-D with {self.numel} elements (the sum of its "
                             f"segments' sizes); got shape {tuple(flat.shape)}")

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat`` (1-D), one per segment, flat (not reshaped)."""
        return list(flat.split(self.sizes))

    def cached(self, key, make: Callable[["Segments"], Any]):
        """``make(self)``, computed once per ``key``: a method's layout of these segments (where
        each segment's scales and codes start in a payload, its k, ...)."""
        if key not in self._cache:
            self._cache[key] = make(self)
        return self._cache[key]

    def sizes_tensor(self) -> torch.Tensor:
        """The segments' sizes as an int64 CPU tensor (cached): what the native kernels take."""
        return self.cached("sizes", lambda s: torch.tensor(s.sizes, dtype=torch.int64))

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one per segment) repeated over each segment's elements: ``(numel,)``."""
        sizes = self.cached(("sizes", values.device), lambda s: s.sizes_tensor().to(values.device))
        return torch.repeat_interleave(values, sizes, output_size=self.numel)

    def views(self, flat: torch.Tensor, flat_shapes: bool = False) -> List[torch.Tensor]:
        """Views of the 1-D ``flat``, one per segment, in its shape (``flat_shapes``: 1-D), made
        in one call."""
        shapes = self.flat_shapes if flat_shapes else self.shapes
        templates = self.cached(("templates", flat_shapes),
                                lambda s: [torch.empty(shape, device="meta") for shape in shapes])
        return list(torch._C._nn.unflatten_dense_tensors(flat, templates))

    def size_classes(self, device: torch.device) -> List[Tuple[int, List[int], torch.Tensor, torch.Tensor]]:
        """Segments grouped by size, for row-wise kernels: ``(n, positions, index, offsets)`` per
        distinct size n > 0: ``index`` the positions and ``offsets`` the segments' starts, int64
        tensors of shape ``(len(positions),)`` and ``(len(positions), 1)`` on ``device`` (cached)."""
        if device not in self._classes:
            by_size: Dict[int, List[int]] = {}
            for j, n in enumerate(self.sizes):
                if n:
                    by_size.setdefault(n, []).append(j)
            self._classes[device] = [
                (n, pos, torch.tensor(pos, dtype=torch.int64, device=device),
                 torch.tensor([self.offsets[j] for j in pos], dtype=torch.int64, device=device).view(-1, 1))
                for n, pos in by_size.items()]
        return self._classes[device]

    def rows(self, flat: torch.Tensor, positions: List[int], n: int) -> torch.Tensor:
        """The segments at ``positions`` (all of ``n`` elements) as the rows of a ``(len, n)``
        tensor: a copy, or a view of ``flat`` for a single segment (read it, do not write it)."""
        if len(positions) == 1:
            return flat[self.offsets[positions[0]]:self.offsets[positions[0]] + n].unsqueeze(0)
        return torch.stack([flat[self.offsets[j]:self.offsets[j] + n] for j in positions])

    def segment_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The segment holding each flat position: int64, ``positions``' shape and device (a
        position in ``[offset_j, offset_j + size_j)`` gives j; empty segments hold none)."""
        starts = self.cached(("starts", positions.device), lambda s: torch.tensor(
            s.offsets[1:], dtype=torch.int64, device=positions.device))
        return torch.bucketize(positions, starts, right=True)

    def __repr__(self) -> str:
        return f"Segments({len(self)} tensors, {self.numel} elements)"
