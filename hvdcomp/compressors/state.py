"""Staged state: what a method changes while compressing a step is kept apart until the step is
applied, so that a skipped or discarded step leaves no trace.

A stateful method keeps per-name state in dictionaries (its *stores*, e.g. ``residuals``), in
counters and in random generators. Between :meth:`StagedState.begin_step` and
:meth:`StagedState.commit` (or :meth:`StagedState.rollback`), writes through
:meth:`StagedState._put` are staged (reads through :meth:`StagedState._get` see them) and
generator states are snapshotted; wrapped methods (:meth:`StagedState.staged_children`) follow
the same step. A store named in ``recycled_stores`` reuses, on CPU, the memory of the tensor it
no longer needs for the next step's value of the same name (:meth:`StagedState._spare`): a
committed tensor of such a store must not be held by the caller across steps (``state_dict``
returns copies).
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .rng import RankGenerators

__all__ = ["StagedState"]


class StagedState:
    """Base class of stateful methods: staged per-name stores, counters and generators (see the
    module docstring)."""

    #: stores whose replaced CPU tensors are kept as spares for the next step
    recycled_stores: Tuple[str, ...] = ()
    _pending: Optional[Dict[Tuple[str, str], Any]] = None  # while a step is open: {(store, name): value}
    _generator_snapshot: Optional[Dict[str, Any]] = None     # while a step is open

    def staged_children(self) -> Sequence["StagedState"]:
        """Wrapped methods whose state is part of this one's step (opened, committed and rolled
        back with it); none by default."""
        return ()

    # ---- per-name state ------------------------------------------------------------------------
    def _get(self, store: str, name: str, default=None):
        """Per-name state from dict attribute ``store``, seeing this step's staged updates."""
        if self._pending is not None and (store, name) in self._pending:
            return self._pending[(store, name)]
        return getattr(self, store).get(name, default)

    def _put(self, store: str, name: str, value) -> None:
        """Set per-name state; staged until :meth:`commit` while a step is open. Values must be
        new objects (never update committed tensors in place)."""
        if self._pending is not None:
            self._pending[(store, name)] = value
            return
        committed = getattr(self, store)
        self._recycle(store, name, committed.get(name))
        committed[name] = value

    def _get_many(self, store: str, names: Sequence[str]) -> List[Any]:
        """:meth:`_get` of each name (None where absent), in one pass."""
        pending, committed = self._pending, getattr(self, store)
        if not pending:
            return list(map(committed.get, names))
        return [pending[(store, n)] if (store, n) in pending else committed.get(n) for n in names]

    def _put_many(self, store: str, names: Sequence[str], values: Sequence[Any]) -> None:
        """:meth:`_put` of each ``(name, value)``."""
        if self._pending is not None:
            self._pending.update(zip([(store, n) for n in names], values))
            return
        for name, value in zip(names, values):
            self._put(store, name, value)

    def _put_segments(self, store: str, segments, flat: torch.Tensor, flat_shapes: bool = False) -> List[torch.Tensor]:
        """Set each segment's state (``segments``: a :class:`~hvdcomp.compressors.segments.Segments`)
        to its view of the 1-D ``flat``, in its shape (1-D with ``flat_shapes``), as :meth:`_put`
        does, and remember ``flat`` for :meth:`_get_segments`. Returns the views."""
        views = segments.views(flat, flat_shapes)
        self._put_many(store, segments.names, views)
        self.__dict__.setdefault("_flat_views", {})[(store, id(segments))] = (segments, views, flat)
        return views

    def _get_segments(self, store: str, segments) -> Optional[torch.Tensor]:
        """The segments' state as one 1-D tensor: the ``flat`` of the last :meth:`_put_segments`
        while every segment's state (as :meth:`_get` sees it) is still its view of it, else None
        (then read the names one by one)."""
        entry = self.__dict__.get("_flat_views", {}).get((store, id(segments)))
        if entry is None or entry[0] is not segments:
            return None
        if all(map(operator.is_, self._get_many(store, segments.names), entry[1])):
            return entry[2]
        return None

    def _spare(self, store: str, name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """A recycled tensor of ``like``'s shape, dtype and device for ``name`` in ``store``
        (see the module docstring), or None; its contents are arbitrary."""
        spare = self.__dict__.get("_spares", {}).pop((store, name), None)
        if (spare is not None and spare.shape == like.shape and spare.dtype == like.dtype
                and spare.device == like.device):
            return spare
        return None

    def _recycle(self, store: str, name: str, tensor) -> None:
        """Keep ``tensor``'s memory as the spare of ``(store, name)`` where that store recycles
        (CPU tensors that own their memory: a view of a fused bucket's buffer would pin the whole
        buffer and is never reused)."""
        if (store in self.recycled_stores and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
                and tensor._base is None):
            self.__dict__.setdefault("_spares", {})[(store, name)] = tensor

    def _clear_spares(self) -> None:
        """Forget every spare and remembered flat buffer (after loading state)."""
        self.__dict__.pop("_spares", None)
        self.__dict__.pop("_flat_views", None)

    # ---- the step ------------------------------------------------------------------------------
    def _generators(self) -> Dict[str, Any]:
        """Random generators among this method's attributes (per-rank or shared)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, (RankGenerators, torch.Generator))}

    def begin_step(self) -> None:
        """Open a step: state updates are staged and generator states remembered (see
        :meth:`rollback`); the same for :meth:`staged_children`."""
        self._pending = {}
        self._generator_snapshot = {
            k: (g.get_state() if isinstance(g, torch.Generator) else g.state_dict())
            for k, g in self._generators().items()}
        for child in self.staged_children():
            child.begin_step()

    def commit(self) -> None:
        """Apply the staged updates of the open step and close it (children too)."""
        stores: Dict[str, dict] = {}
        for (store, name), value in (self._pending or {}).items():
            committed = stores.get(store)
            if committed is None:
                committed = stores[store] = getattr(self, store)
            if store in self.recycled_stores:
                self._recycle(store, name, committed.get(name))
            committed[name] = value
        self._pending = None
        self._generator_snapshot = None
        for child in self.staged_children():
            child.commit()

    def rollback(self) -> None:
        """Drop the open step's staged updates and rewind its generators, so that a skipped or
        discarded step leaves no trace (children too)."""
        for key, state in (self._generator_snapshot or {}).items():
            gen = getattr(self, key)
            if isinstance(gen, torch.Generator):
                gen.set_state(state)
            else:
                gen.load_state_dict(state)
        for (store, name), value in (self._pending or {}).items():
            if store in self.recycled_stores:
                self._recycle(store, name, value)
        self._pending = None
        self._generator_snapshot = None
        for child in self.staged_children():
            child.rollback()
