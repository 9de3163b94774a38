"""Several gradients compressed in one call, each by its own rules ("segments" of a flat buffer).

Under :class:`hvdcomp.DistributedOptimizer` with ``granularity="tensor"`` (the default), the
gradients of one bucket are copied into one flat buffer and a *segmentable* compressor compresses
the buffer in one vectorised call while keeping per-tensor semantics: each segment (one
parameter's gradient) gets its own top-k, its own fp16 scale, its own residual. The result is the
one per-tensor calls would give; what changes is the cost (a few tensor operations per bucket
instead of per gradient: the per-tensor fixed cost of issue 17) and the wire (one payload per
bucket, see each method's docstring).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["Segments"]


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
        self.offsets: List[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.numel = total
        self._classes: Dict[torch.device, list] = {}

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

    def amax(self, flat: torch.Tensor) -> torch.Tensor:
        """``max |segment|`` per segment: float32 ``(len(self),)``, 0 for an empty segment; NaN
        propagates."""
        mags = flat.abs()
        out = torch.zeros(len(self), dtype=mags.dtype, device=flat.device)
        for n, positions, index, _ in self.size_classes(flat.device):
            out[index] = self.rows(mags, positions, n).amax(dim=1)
        return out

    def __repr__(self) -> str:
        return f"Segments({len(self)} tensors, {self.numel} elements)"
