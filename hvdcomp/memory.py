"""Error feedback (residual memory): the one implementation, used by every method that keeps one.

Seide et al., "1-bit SGD", Interspeech 2014; Stich et al., "Sparsified SGD with Memory",
NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019; the moving average
of Xie et al., "LoCo", 2024 (``beta``).

Per parameter name, with residual ``e`` (zeros at first) and a compressor C::

    p = g + e                      (Residuals.compensate)
    payload = C(p)
    e = β·e + (1 − β)·(p − decode(payload))     (Residuals.keep; β = 0: e = p − decode(payload))

so that ``sum_t sent_t == sum_t g_t − (e_T − e_0)/(1 − β)``: nothing is lost, only delayed.

:class:`Residuals` is that memory, staged with its owner's step
(:class:`hvdcomp.compressors.state.StagedState`): :class:`ErrorFeedback` wraps any per-tensor
compressor with it; ``lowbit`` (β), DGC (the accumulated velocity), the step-wide methods of
:mod:`hvdcomp.transports` (global top-k, CLT-k, two-phase worker and server residuals, PowerSGD's
error) keep theirs in it too.

float16 and bfloat16 gradients are upcast to float32 before ``p = g + e`` (their residual is
float32) and decoded results cast back, saturating; the part of a result beyond the dtype's range
is added to every rank's residual alike, so it is sent later, never dropped; ±inf stays ±inf
(docs/numerics.md, "any method, result cast to a float16/bfloat16 gradient").
"""
from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Sequence

import torch

from .compressors.base import Compressor, cast_saturating, copy_saturating_
from .compressors.state import StagedState

__all__ = ["ErrorFeedback", "Residuals"]

_HALF = (torch.float16, torch.bfloat16)


class Residuals:
    """Residuals by parameter name, kept in ``owner``'s dict attribute ``store`` and staged with
    the owner's step (see the module docstring for the update).

    Args:
        owner: the method that holds the residuals (a
            :class:`~hvdcomp.compressors.state.StagedState`; its ``recycled_stores`` should name
            ``store`` so a step allocates no full-size tensor on CPU).
        store: the attribute name of the ``{name: tensor}`` dict (created empty if absent).
        beta: β in [0, 1): weight of the previous residual in the new one (0: classic error
            feedback).

    Raises:
        ValueError: ``beta`` outside [0, 1).
    """

    __slots__ = ("owner", "store", "beta")

    def __init__(self, owner: StagedState, store: str = "residuals", beta: float = 0.0):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.owner, self.store, self.beta = owner, store, float(beta)
        if not isinstance(getattr(owner, store, None), dict):
            setattr(owner, store, {})

    @property
    def committed(self) -> Dict[str, torch.Tensor]:
        """The committed residuals (name → tensor)."""
        return getattr(self.owner, self.store)

    def get(self, name: str) -> Optional[torch.Tensor]:
        """``name``'s residual as this step sees it (staged value first), or None."""
        return self.owner._get(self.store, name)

    def compensate(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """``g + e`` in memory the caller owns and may overwrite (a recycled tensor on CPU);
        a copy of ``g`` when ``name`` has no residual yet. ``g`` is not modified."""
        e = self.get(name)
        if e is None:
            return g.detach().clone()
        out = self.owner._spare(self.store, name, e) if e.shape == g.shape and e.dtype == g.dtype else None
        if out is not None:
            return torch.add(g, e, out=out)
        return g + e

    def compensate_flat_(self, flat: torch.Tensor, names: Sequence[str], sizes: Sequence[int]) -> torch.Tensor:
        """Add each name's residual into its slice of ``flat`` (1-D; slices of ``sizes`` back to
        back, in ``names`` order), in place; returns ``flat``."""
        start = 0
        for name, n in zip(names, sizes):
            e = self.get(name)
            if e is not None:
                flat[start:start + n] += e.reshape(-1)
            start += n
        return flat

    def compensate_segments_(self, flat: torch.Tensor, segments) -> torch.Tensor:
        """:meth:`compensate_flat_` for the gradients of a fused unit (``segments``: a
        :class:`~hvdcomp.compressors.segments.Segments`): one addition of the previous residual
        buffer when the residuals are still the views :meth:`keep_segments` stored, else one per
        segment. In place; returns ``flat``."""
        e = self.owner._get_segments(self.store, segments)
        if e is not None and e.dtype == flat.dtype:
            return flat.add_(e)
        return self.compensate_flat_(flat, segments.names, segments.sizes)

    def keep_segments(self, r: torch.Tensor, segments, flat_shapes: bool = False) -> None:
        """:meth:`keep` for each segment of the 1-D ``r`` at once: the residuals are views of
        ``r`` (each in its gradient's shape, or 1-D with ``flat_shapes``), so that the next
        :meth:`compensate_segments_` adds ``r`` in one operation (no per-step concatenation)."""
        if self.beta:
            e = self.owner._get_segments(self.store, segments)
            r.mul_(1.0 - self.beta)
            if e is not None:
                r.add_(e, alpha=self.beta)
            else:
                for part, prev in zip(segments.split(r), self.owner._get_many(self.store, segments.names)):
                    if prev is not None:
                        part.add_(prev.reshape(-1), alpha=self.beta)
        self.owner._put_segments(self.store, segments, r, flat_shapes)

    def keep(self, name: str, r: torch.Tensor) -> torch.Tensor:
        """Stage ``name``'s new residual from ``r = p − decode(payload)`` (``r``'s memory is
        reused): ``r`` itself for β = 0 (or without a previous residual: ``(1 − β)·r``), else
        ``(1 − β)·r + β·e``. Returns it."""
        if self.beta:
            e = self.get(name)
            r = r.mul_(1.0 - self.beta) if e is None else r.mul_(1.0 - self.beta).add_(e, alpha=self.beta)
        self.owner._put(self.store, name, r)
        return r

    def add(self, name: str, delta: torch.Tensor) -> None:
        """Stage ``e + delta`` for ``name`` (a correction outside the step's own update, e.g. what
        a resend or a saturated delivery moved; a new tensor, in the residual's dtype)."""
        e = self.get(name)
        self.owner._put(self.store, name, e + delta.reshape(e.shape).to(e.dtype))

    def keep_flat(self, flat: torch.Tensor, names: Sequence[str], shapes: Sequence[torch.Size]) -> None:
        """:meth:`keep` for each slice of ``flat`` (views of it, in ``shapes``)."""
        start = 0
        for name, shape in zip(names, shapes):
            n = shape.numel()
            self.keep(name, flat[start:start + n].view(shape))
            start += n

    def rescale(self, factor: float) -> None:
        """Multiply every committed residual by ``factor`` (gradient units: AMP loss scale)."""
        for e in self.committed.values():
            e.mul_(factor)

    def zero(self, name: Optional[str] = None) -> None:
        """Zero the committed residual of ``name`` (all of them when None)."""
        for key, e in self.committed.items():
            if name is None or key == name:
                e.zero_()

    def state(self) -> Dict[str, torch.Tensor]:
        """Copies of the committed residuals."""
        return {k: v.detach().clone() for k, v in self.committed.items()}

    def load(self, residuals: Dict[str, torch.Tensor]) -> None:
        """Replace the committed residuals by copies of ``residuals`` (spares are dropped)."""
        setattr(self.owner, self.store, {k: v.detach().clone() for k, v in residuals.items()})
        self.owner._clear_spares()


class _Context(NamedTuple):
    inner: Any            # the inner method's context
    dtype: torch.dtype    # the gradient's dtype (decoded outputs are cast back to it)
    names: tuple = ()     # the residuals the decoded result belongs to (one, or a bucket's segments)
    shapes: tuple = ()    # their shapes, in the order of the (flat) result


class Wrapper(Compressor):
    """A compressor around another (``inner``): what the payloads are, and the other properties
    of the method, are the inner method's (one place that forwards them)."""

    inner: Compressor

    name = property(lambda self: self.inner.name)  # type: ignore[assignment]
    payload_kind = property(lambda self: self.inner.payload_kind)  # type: ignore[assignment]
    aggregate_is_mean = property(lambda self: self.inner.aggregate_is_mean)  # type: ignore[assignment]
    owns_momentum = property(lambda self: self.inner.owns_momentum)  # type: ignore[assignment]
    segmentable = property(lambda self: self.inner.segmentable)  # type: ignore[assignment]
    draws_per_call = property(lambda self: getattr(self.inner, "draws_per_call", False))

    def staged_children(self):
        return (self.inner,)

    def bind_group(self, size):
        super().bind_group(size)
        self.inner.bind_group(size)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def bind_draw_order(self, order) -> None:
        """The inner method's ``bind_draw_order`` (:class:`hvdcomp.compressors.rng.DrawOrder`),
        where it has one."""
        bind = getattr(self.inner, "bind_draw_order", None)
        if bind is not None:
            bind(order)

    def expected_payload_bytes(self, numel):
        return self.inner.expected_payload_bytes(numel)

    def nominal_ratio(self, numel):
        return self.inner.nominal_ratio(numel)


class ErrorFeedback(Wrapper):
    """Wraps ``inner`` so that what it drops is added to the next gradient of the same parameter.

    Args:
        inner: any :class:`hvdcomp.Compressor`.

    State: one residual per parameter name, same shape as the gradient, float32 for float16 and
    bfloat16 gradients and the gradient's dtype otherwise, kept on the gradient's device. On CPU
    the previous step's residual is kept as a spare buffer (about twice the residual memory) so
    that a step allocates no full-size tensor. :meth:`state_dict` returns
    ``{"residuals": {name: tensor}, "inner": ...}``.

    Raises:
        TypeError: ``inner`` is not a :class:`hvdcomp.Compressor`.
        ValueError: ``inner`` keeps its own residual; from :meth:`encode` when no parameter name
            is given (residuals are per parameter; pass ``named_parameters`` to
            :class:`hvdcomp.DistributedOptimizer`).
    """

    recycled_stores = ("residuals",)
    has_scaled_state = True  # the residual

    def __init__(self, inner: Compressor):
        if not isinstance(inner, Compressor):
            raise TypeError(f"ErrorFeedback wraps an hvdcomp.Compressor, got {type(inner).__name__}")
        if isinstance(inner, ErrorFeedback) or inner.builtin_error_feedback:
            raise ValueError(f"'{inner.name}' already applies error feedback; do not wrap it again (ef=false)")
        self.inner = inner
        self.memory = Residuals(self)

    def rescale_state(self, factor):
        """Multiply the residuals (gradient units) and the inner method's state by ``factor``."""
        self.memory.rescale(factor)
        self.inner.rescale_state(factor)

    def shared_state(self):
        """Residuals are per rank; only the inner method's shared state."""
        return {"inner": self.inner.shared_state()}

    def load_shared_state(self, shared):
        self.inner.load_shared_state(shared.get("inner", {}))

    def describe(self):
        return {**self.inner.describe(), "ef": True}

    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("error feedback keeps one residual per parameter and needs its name: "
                             "use hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        dtype = tensor.dtype
        if dtype in _HALF:
            tensor = tensor.to(torch.float32)  # (a copy: compensate may use it as p)
            p = tensor if self.memory.get(name) is None else self.memory.compensate(name, tensor)
        else:
            p = self.memory.compensate(name, tensor)
        payload, ctx = self.inner.encode(p, name)
        self.memory.keep(name, self.inner.residual_(p, payload, ctx))  # p is ours: may be reused in place
        return payload, _Context(ctx, dtype, (name,), (tensor.shape,))

    def _encode_segments(self, flat, segments):
        """Several gradients in one call: ``p = g + e`` per segment on a copy of the flat buffer,
        the inner method on the segments, and each segment's residual kept under its name (a view
        of this step's compensated buffer, in the gradient's shape)."""
        dtype = flat.dtype
        p = flat.to(torch.float32) if dtype in _HALF else flat.clone()
        self.memory.compensate_segments_(p, segments)
        payload, ctx = self.inner.encode(p, None, segments)
        self.memory.keep_segments(self.inner.residual_(p, payload, ctx), segments)
        return payload, _Context(ctx, dtype, segments.names, segments.shapes)

    def saturation(self, payload, ctx):
        """The inner method's saturation check (:meth:`hvdcomp.compressors.fp16.FP16Compressor.saturation`;
        ``None`` for methods without one), with this rank's residuals following a resend: each
        resent parameter's residual loses what the replacement sends in addition (``delta``), so
        what this rank sent plus its new residual is still its gradient plus its old residual."""
        check = getattr(self.inner, "saturation", None)
        action = None if check is None else check(payload, ctx.inner)
        if action is None or action.payload is None:
            return action
        for name, delta in action.delta.items():
            self.memory.add(name, -delta)
        return action._replace(ctx=ctx._replace(inner=action.ctx))

    def _deliver(self, value: torch.Tensor, ctx) -> torch.Tensor:
        """``value`` (the averaged result, float32) cast to the gradient's dtype, saturating; for
        a half-precision gradient the finite part beyond its range is added to the residuals of
        ``ctx.names`` (see the module docstring; one host read)."""
        if ctx.dtype in _HALF and ctx.names and value.dtype != ctx.dtype:
            limit = torch.finfo(ctx.dtype).max
            excess = torch.where(value.isfinite(), value - value.clamp(-limit, limit), torch.zeros_like(value))
            if bool(excess.any()):
                flat, start = excess.reshape(-1), 0
                for name, shape in zip(ctx.names, ctx.shapes):
                    n = math.prod(shape)
                    self.memory.add(name, flat[start:start + n])
                    start += n
        return cast_saturating(value, ctx.dtype)

    def decode(self, payload, ctx):
        return self._deliver(self.inner.decode(payload, ctx.inner), ctx)

    def aggregate(self, payloads, ctx):
        return self._deliver(self.inner.aggregate(payloads, ctx.inner), ctx)

    def decode_into(self, out, payload, ctx):
        if out.dtype in _HALF and ctx.names:  # through float32: the excess goes to the residual
            return copy_saturating_(out, self.decode(payload, ctx).view(out.shape))
        return self.inner.decode_into(out, payload, ctx.inner)

    def aggregate_into(self, out, payloads, ctx):
        if out.dtype in _HALF and ctx.names:
            return copy_saturating_(out, self.aggregate(payloads, ctx).view(out.shape))
        return self.inner.aggregate_into(out, payloads, ctx.inner)

    def reset(self, name: str | None = None) -> None:
        """Zero the residual of ``name`` (all residuals when ``None``)."""
        self.memory.zero(name)

    def state_dict(self):
        return {"residuals": self.memory.state(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        self.memory.load(state.get("residuals", {}))
        self.inner.load_state_dict(state.get("inner", {}))
