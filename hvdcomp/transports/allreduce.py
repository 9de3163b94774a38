"""The allreduce transport: Horovod ``allreduce_async`` of summable payloads (``allreduce``
route), and of densely decoded ones where the cost model prefers it (``decoded-allreduce``)."""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ..comm.group import HOROVOD_ALLREDUCE_DTYPES
from .units import Units

__all__ = ["AllreduceTransport"]


class AllreduceTransport:
    """Carries units whose payloads are averaged by Horovod's allreduce.

    A payload that is the gradient itself (``none`` on float32/float64) is reduced in place, as
    stock Horovod does: no copy, no decode. Other payloads travel as their tensors (bfloat16 as
    float32: Horovod's allreduce has no bfloat16) and are decoded into the unit's target; a
    ``decoded-allreduce`` unit is decoded locally and its fp32 result averaged densely.

    Args:
        group: the :class:`hvdcomp.comm.group.Group` the gradients are averaged over.
        timer: the optimizer's :class:`hvdcomp.metrics.PhaseTimer` (phases and bytes).
        compression: the optimizer's :class:`hvdcomp.Compressor`.
        units: the optimizer's :class:`Units`.
        reduce_args: ``(op, prescale, postscale)`` for a summable payload (Horovod's ``op`` and
            ``gradient_predivide_factor``).
        dense_op: the op of a decoded payload's dense allreduce (Horovod Sum or Average).
        sum_votes: the payload is summed (signSGD's votes) and ``op`` is Sum: results are scaled
            by ``scale`` after decoding.
        scale: the group size for ``op=Sum``, else 1.
    """

    def __init__(self, group, timer, compression, units: Units, reduce_args: tuple, dense_op,
                 sum_votes: bool, scale: float):
        self.group, self.timer, self.compression, self.units = group, timer, compression, units
        self.reduce_args, self.dense_op, self.sum_votes, self.scale = reduce_args, dense_op, sum_votes, scale
        self.inflight: Dict[int, tuple] = {}  # unit -> (kind, handles, ctx, bytes sent, payload dtypes)
        self.overflowed: List[int] = []  # units of the last finish() reported overflowed (NaN)

    @property
    def busy(self) -> bool:
        """Whether allreduces are in flight."""
        return bool(self.inflight)

    def reset(self) -> None:
        """Forget the step in progress (its results will not be used)."""
        self.inflight = {}
        self.overflowed = []

    def in_place_units(self) -> List[int]:
        """Units reduced in place this step (their inputs are gone once reduced)."""
        return [u for u, work in self.inflight.items() if work[0] == "in-place"]

    def start_in_place(self, u: int, tensor: torch.Tensor) -> None:
        """Start the in-place allreduce of ``tensor`` (unit ``u``'s float32/float64 gradient)."""
        handle = self.group.allreduce_async_(tensor, self.units.wire_name[u] + ".0", *self.reduce_args)
        self.inflight[u] = ("in-place", [handle], None, self.units.grad_bytes[u], None)

    def start(self, u: int, payload: Sequence[torch.Tensor], ctx) -> None:
        """Start the allreduce of unit ``u``'s summable ``payload`` (in place where it is the
        gradient itself)."""
        op, pre, post = self.reduce_args
        wire_name = self.units.wire_name[u]
        target = self.units.target(u)
        if (self.compression.payload_is_gradient and len(payload) == 1
                and payload[0].dtype in HOROVOD_ALLREDUCE_DTYPES and target.is_contiguous()
                and payload[0].data_ptr() == target.data_ptr() and payload[0].numel() == target.numel()):
            handles = [self.group.allreduce_async_(payload[0], wire_name + ".0", op, pre, post)]
            self.inflight[u] = ("in-place", handles, ctx, self.units.grad_bytes[u], None)
            return
        wire = [t if t.dtype in HOROVOD_ALLREDUCE_DTYPES else t.float() for t in payload]
        handles = [self.group.allreduce_async(t, f"{wire_name}.{k}", op, pre, post) for k, t in enumerate(wire)]
        nbytes = sum(t.numel() * t.element_size() for t in wire)
        self.inflight[u] = ("allreduce", handles, ctx, nbytes, [t.dtype for t in payload])

    def start_decoded(self, u: int, payload: Sequence[torch.Tensor], ctx) -> None:
        """Decode unit ``u``'s payload locally (timed as ``decompress``) and start the dense fp32
        allreduce of the result (``communicate``): the same mean as aggregating the payloads."""
        target = self.units.target(u)
        with self.timer.phase("decompress"):
            dense = self.compression.decode_into(
                torch.empty(target.shape, dtype=torch.float32, device=target.device), payload, ctx)
        with self.timer.phase("communicate"):
            handle = self.group.allreduce_async(dense, self.units.wire_name[u] + ".dense", self.dense_op)
        self.inflight[u] = ("dense", [handle], ctx, dense.numel() * 4, None)

    def finish(self, units: Sequence[int]) -> None:
        """Wait for the allreduces of ``units`` (one ``communicate`` slice), then write each
        averaged result into its target (one ``decompress`` slice); counts the bytes."""
        done, nbytes, dense = [], 0, 0
        self.overflowed = []
        with self.timer.phase("communicate"):
            for u in units:
                kind, handles, ctx, sent, dtypes = self.inflight.pop(u)
                outputs = [self.group.synchronize(h) for h in handles]
                nbytes += sent
                dense += self.units.dense_bytes[u]
                done.append((u, kind, outputs, ctx, dtypes))
            nbytes += self.resend_saturated(done)
        with self.timer.phase("decompress"):
            for u, kind, outputs, ctx, dtypes in done:
                if kind == "overflow":  # a saturated payload the method reports as overflowed
                    self.units.target(u).fill_(float("nan"))
                elif kind == "allreduce":
                    target = self.units.target(u)
                    outputs = [o if o.dtype == dt else o.to(dt) for o, dt in zip(outputs, dtypes)]
                    self.compression.decode_into(target, outputs, ctx)
                    if self.sum_votes:
                        target.mul_(self.scale)
                elif kind == "dense":
                    self.units.target(u).copy_(outputs[0])
                self.units.write_back(u)  # (an in-place result is in its target already)
        self.timer.add_bytes(sent=nbytes, received=nbytes, dense=dense)

    def resend_saturated(self, done: List[tuple]) -> int:
        """After the first allreduce of a step: payloads whose method can saturate (fp16's scaled
        steps) are checked, and a saturated one is never decoded as is.

        The method reads from the reduced payload whether some rank's values left its scale's
        window (``compression.saturation``: identical on every rank) and decides: a replacement
        payload is allreduced now (same op, prescale and postscale; one blocking collective per
        such unit, in unit order, so every rank runs the same ones) and replaces the first in
        ``done``; no replacement (fp16's ``on_saturation="skip"``) marks the unit overflowed: its
        target reads NaN and it is listed in :attr:`overflowed`, for the optimizer's non-finite
        guard to skip the step on every rank.

        Args:
            done: ``(unit, kind, reduced outputs, ctx, payload dtypes)`` per finished unit;
                updated in place.

        Returns:
            Bytes this rank sent (and received) in the extra allreduces.
        """
        check = getattr(self.compression, "saturation", None)
        if check is None:
            return 0
        op, pre, post = self.reduce_args
        extra = 0
        for i, (u, kind, outputs, ctx, dtypes) in enumerate(done):
            if kind != "allreduce":
                continue
            outputs = [o if o.dtype == dt else o.to(dt) for o, dt in zip(outputs, dtypes)]
            action = check(outputs, ctx)
            if action is None:
                continue
            if action.payload is None:
                done[i] = (u, "overflow", None, None, None)
                self.overflowed.append(u)
                continue
            name = self.units.wire_name[u]
            handles = [self.group.allreduce_async(t, f"{name}.resend.{k}", op, pre, post)
                       for k, t in enumerate(action.payload)]
            done[i] = (u, kind, [self.group.synchronize(h) for h in handles], action.ctx,
                       [t.dtype for t in action.payload])
            extra += sum(t.numel() * t.element_size() for t in action.payload)
        return extra
