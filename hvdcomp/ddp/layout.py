"""What the compressor sees in one DDP gradient bucket: its *units* (a pure function of the
bucket's parameters, the method and the granularity; the same on every rank; docs/ddp.md,
"Granularity").

A DDP bucket (``torch.distributed.GradBucket``) is one flat 1-D buffer of several gradients
(``bucket.parameters()`` in buffer order, one dtype and device), always one unit of
communication. With ``granularity="tensor"`` each gradient is compressed by its own rules, keyed
by its parameter's name: in one call for the whole buffer where the method fuses
(:func:`hvdcomp.plan.fuses`; :class:`~hvdcomp.compressors.segments.Segments`), else one call per
gradient in the expected backward order (the reverse of ``model.parameters()``, so stochastic
methods draw what the Horovod front-end draws). With ``"bucket"`` the whole buffer is one tensor
named ``bucket<k>``; the layouts compressed are recorded (:class:`Layouts`) and a later change
raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..compressors.segments import Segments
from ..config import GRANULARITIES, name_parameters

__all__ = ["Unit", "BucketLayout", "plan_bucket", "Layouts", "GRANULARITIES"]


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
        names, shapes: the bucket's parameters in buffer order (other names at the same index:
            DDP rebuilt its buckets).
        numel: elements in the buffer.
        units: compression calls, in compression order.
        segments: the :class:`Segments` of all the bucket's parameters (buffer order).
    """

    index: int
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    numel: int
    units: List[Unit]
    segments: Segments

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's gradient in the 1-D ``buffer``: views in its shape, buffer order."""
        return [flat.view(shape) for flat, shape in zip(self.segments.split(buffer), self.segments.shapes)]


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
    whole = Segments(list(names), shapes)
    numel = whole.numel
    if granularity == "bucket":
        units = [Unit(f"bucket{index}", 0, numel, (numel,))]
    elif segmentable and len(names) > 1:
        units = [Unit(None, 0, numel, (numel,), whole)]
    else:
        order = sorted(range(len(names)), key=lambda j: positions[j])
        units = [Unit(names[j], whole.offsets[j], whole.offsets[j] + whole.sizes[j], shapes[j]) for j in order]
    return BucketLayout(index, tuple(names), shapes, numel, units, whole)


class Layouts:
    """One DDP model's parameters as the hook sees them, and the layout of every bucket seen
    (built once per hook, for every method it runs: :meth:`of`).

    Args:
        module: the model DDP wraps (``ddp_model.module``); its parameters that require a
            gradient are the ones DDP's buckets hold.
        named_parameters: ``(name, parameter)`` pairs naming them (compressor state is keyed by
            these names), or None for ``module.named_parameters()``.
        granularity: ``"tensor"`` or ``"bucket"`` (see the module docstring).

    Attributes:
        params: the parameters that require a gradient, in ``module.parameters()`` order.
        order: ``(name, parameter)`` in the expected backward order (the reverse of
            ``module.parameters()``, the Horovod front-end's).
        recorded: granularity ``"bucket"``: per bucket index, the parameter names its compressor state
            was built for (saved in checkpoints).

    Raises:
        ValueError: ``named_parameters`` leaves a parameter unnamed, or repeats a name
            (:func:`hvdcomp.config.name_parameters`).
    """

    def __init__(self, module: torch.nn.Module, named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]],
                 granularity: str):
        params = [p for p in module.parameters() if p.requires_grad]
        by_param = name_parameters([{"params": params}],
                                   module.named_parameters() if named_parameters is None else named_parameters)
        self.params = params
        self.order: List[Tuple[str, torch.nn.Parameter]] = [(by_param[p], p) for p in reversed(params)]
        self._names: Dict[int, str] = {id(p): n for n, p in self.order}
        self._position: Dict[int, int] = {id(p): i for i, (_, p) in enumerate(self.order)}
        self.granularity = granularity
        self._layouts: Dict[Tuple[int, bool], BucketLayout] = {}  # (index, segmentable) -> layout
        self._seen: Dict[int, Tuple[str, ...]] = {}
        self.recorded: Dict[int, Tuple[str, ...]] = {}

    def seen(self) -> Dict[int, Tuple[str, ...]]:
        """The buckets seen so far: index -> parameter names in buffer order."""
        return dict(sorted(self._seen.items()))

    def of(self, bucket, segmentable: bool) -> BucketLayout:
        """The units of a ``torch.distributed.GradBucket`` for a method that does (``segmentable``)
        or does not compress several gradients in one call, planned once per bucket layout (DDP
        rebuilds its buckets once)."""
        index = bucket.index()
        params = bucket.parameters()
        key = self._seen[index] = tuple(self._names[id(p)] for p in params)
        layout = self._layouts.get((index, segmentable))
        if layout is None or layout.names != key:
            layout = self._layouts[index, segmentable] = plan_bucket(
                index, key, [tuple(p.shape) for p in params], [self._position[id(p)] for p in params],
                segmentable, self.granularity)
        return layout

    def check_recorded(self, layout: BucketLayout) -> None:
        """Granularity ``"bucket"``: record the layout a bucket's state is built for at its first
        compression, and refuse a later change.

        Raises:
            RuntimeError: bucket ``layout.index`` now holds other parameters.
        """
        recorded = self.recorded.setdefault(layout.index, layout.names)
        if recorded != layout.names:
            raise RuntimeError(
                f"DDP bucket {layout.index} now holds other parameters than the ones its compressor "
                f"state (granularity='bucket', kept per bucket) was built for: {list(layout.names)[:4]}... "
                f"instead of {list(recorded)[:4]}... Use granularity='tensor' (state per parameter), or "
                "keep DDP's bucket layout fixed (same model, bucket_cap_mb and parameter order).")

    def state_dict(self) -> Dict[str, List[str]]:
        """:attr:`recorded`, for a checkpoint (strings only)."""
        return {str(k): list(v) for k, v in self.recorded.items()}

    def load_state_dict(self, state: Dict[str, List[str]]) -> None:
        """Inverse of :meth:`state_dict` (a new process's DDP model rebuilds its buckets after its
        first backward, which is again uncompressed; the layouts compressed after it must be these)."""
        self.recorded = {int(k): tuple(v) for k, v in state.items()}
