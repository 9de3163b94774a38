"""Error feedback (residual memory), composable with any compressor.

Seide et al., "1-bit SGD", Interspeech 2014; Stich et al., "Sparsified SGD with Memory",
NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019.

Per parameter name, with residual ``e`` (zeros at first)::

    p = g + e ;  payload = C(p) ;  e = p - decode(payload)

so that ``sum_t sent_t + e_T == sum_t g_t`` (the residual telescopes).

float16 and bfloat16 gradients are upcast to float32 before ``p = g + e``: the residual of a
half-precision gradient is kept in float32 (a float16 residual would itself round away what the
compressor dropped), the inner method compresses the float32 ``p``, and decoded gradients are
cast back to the gradient's dtype, saturating at its largest finite value. ``p`` may exceed that
range (a float16 gradient plus its residual); the averaged result then cannot be delivered in
full, and the part beyond the range is added to the residual on every rank alike (each rank
decodes the same average), so the mean over ranks of ``delivered + residual`` still equals the
mean of ``g + e``: the excess is sent at later steps, never dropped. ±inf stays ±inf.
"""
from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple

import torch

from .compressors.base import Compressor, cast_saturating, copy_saturating_

__all__ = ["ErrorFeedback"]

_HALF = (torch.float16, torch.bfloat16)


class _Context(NamedTuple):
    inner: Any            # the inner method's context
    dtype: torch.dtype    # the gradient's dtype (decoded outputs are cast back to it)
    names: tuple = ()     # the residuals the decoded result belongs to (one, or a bucket's segments)
    shapes: tuple = ()    # their shapes, in the order of the (flat) result


class ErrorFeedback(Compressor):
    """Wraps ``inner`` so that what it drops is added to the next gradient of the same parameter.

    Args:
        inner: any :class:`hvdcomp.Compressor`.

    State: one residual per parameter name, same shape as the gradient, float32 for float16 and
    bfloat16 gradients and the gradient's dtype otherwise, kept on the gradient's device. On CPU
    the previous step's residual is kept as a spare buffer (about twice the residual memory) so
    that a step allocates no full-size tensor. :meth:`state_dict` returns
    ``{"residuals": {name: tensor}, "inner": ...}``.

    Raises:
        ValueError: from :meth:`encode` when no parameter name is given (residuals are per
            parameter; pass ``named_parameters`` to :class:`hvdcomp.DistributedOptimizer`).
    """

    def __init__(self, inner: Compressor):
        if not isinstance(inner, Compressor):
            raise TypeError(f"ErrorFeedback wraps an hvdcomp.Compressor, got {type(inner).__name__}")
        if isinstance(inner, ErrorFeedback) or inner.builtin_error_feedback:
            raise ValueError(f"'{inner.name}' already applies error feedback; do not wrap it again (ef=false)")
        self.inner = inner
        self.residuals: Dict[str, torch.Tensor] = {}
        self._spares: Dict[str, torch.Tensor] = {}  # CPU: memory of the previous residual, reused

    @property
    def name(self):  # type: ignore[override]
        return self.inner.name

    @property
    def summable(self):  # type: ignore[override]
        return self.inner.summable

    @property
    def allreduce_op(self):  # type: ignore[override]
        return self.inner.allreduce_op

    @property
    def owns_momentum(self):  # type: ignore[override]
        return self.inner.owns_momentum

    @property
    def aggregate_is_mean(self):  # type: ignore[override]
        return self.inner.aggregate_is_mean

    has_scaled_state = True  # the residual

    @property
    def segmentable(self):  # type: ignore[override]
        return self.inner.segmentable

    def bind_group(self, size):
        super().bind_group(size)
        self.inner.bind_group(size)

    def rescale_state(self, factor):
        """Multiply the residuals (gradient units) and the inner method's state by ``factor``."""
        for e in self.residuals.values():
            e.mul_(factor)
        self.inner.rescale_state(factor)

    def shared_state(self):
        """Residuals are per rank; only the inner method's shared state."""
        return {"inner": self.inner.shared_state()}

    def load_shared_state(self, shared):
        self.inner.load_shared_state(shared.get("inner", {}))

    def expected_payload_bytes(self, numel):
        return self.inner.expected_payload_bytes(numel)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def describe(self):
        return {**self.inner.describe(), "ef": True}

    def nominal_ratio(self, numel):
        return self.inner.nominal_ratio(numel)

    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("error feedback keeps one residual per parameter and needs its name: "
                             "use hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        dtype = tensor.dtype
        if dtype in _HALF:
            tensor = tensor.to(torch.float32)
        e = self._get("residuals", name)
        spare = self._spares.pop(name, None)
        if e is None:  # a half-precision gradient was already copied by the cast
            p = tensor.detach().clone() if tensor.dtype == dtype else tensor
        elif spare is not None and spare.shape == e.shape and spare.dtype == e.dtype and spare.device == e.device:
            p = torch.add(tensor, e, out=spare)  # no allocation: the previous step's residual memory
        else:
            p = tensor + e
        payload, ctx = self.inner.encode(p, name)
        residual = self.inner.residual_(p, payload, ctx)  # p is ours: may be reused in place
        self._put("residuals", name, residual)
        if self._pending is None and e is not None:
            self._keep_spare(name, e)
        return payload, _Context(ctx, dtype, (name,), (tensor.shape,))

    def _encode_segments(self, flat, segments):
        """Several gradients in one call: ``p = g + e`` per segment on the flat buffer, the inner
        method on the segments, and each segment's residual kept under its name (a view of this
        step's compensated buffer, in the gradient's shape)."""
        dtype = flat.dtype
        if dtype in _HALF:
            flat = flat.to(torch.float32)
        residuals = [self._get("residuals", name) for name in segments.names]
        if all(e is None for e in residuals):
            p = flat.clone() if flat.dtype == dtype else flat
        else:
            p = flat + torch.cat([torch.zeros(n, dtype=flat.dtype, device=flat.device) if e is None
                                  else e.reshape(-1) for e, n in zip(residuals, segments.sizes)])
        payload, ctx = self.inner.encode(p, None, segments)
        kept = self.inner.residual_(p, payload, ctx)
        for name, shape, view in zip(segments.names, segments.shapes, segments.split(kept)):
            self._put("residuals", name, view.view(shape))
        return payload, _Context(ctx, dtype, segments.names, segments.shapes)

    def _keep_spare(self, name: str, tensor) -> None:
        """Keep a no-longer-needed residual's memory for the next step (CPU only: CUDA's caching
        allocator already reuses memory, and large fresh CPU tensors page-fault on first use)."""
        if tensor is not None and tensor.device.type == "cpu" and tensor._base is None:  # (a view
            # of a fused bucket's buffer would pin the whole buffer and is never reused)
            self._spares[name] = tensor

    def _staged_residuals(self):
        return [(name, value) for (store, name), value in (self._pending or {}).items() if store == "residuals"]

    def begin_step(self):
        super().begin_step()
        self.inner.begin_step()

    def commit(self):
        replaced = [(name, self.residuals.get(name)) for name, _ in self._staged_residuals()]
        super().commit()
        self.inner.commit()
        for name, old in replaced:
            self._keep_spare(name, old)

    def rollback(self):
        dropped = self._staged_residuals()
        super().rollback()
        self.inner.rollback()
        for name, value in dropped:
            self._keep_spare(name, value)

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
            old = self._get("residuals", name)
            self._put("residuals", name, old - delta.to(old.dtype))
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
                    old = self._get("residuals", name)
                    self._put("residuals", name, old + flat[start:start + n].view(old.shape).to(old.dtype))
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
        for key, e in self.residuals.items():
            if name is None or key == name:
                e.zero_()

    def state_dict(self):
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._spares = {}
        self.inner.load_state_dict(state.get("inner", {}))
