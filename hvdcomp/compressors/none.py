"""``none``: the uncompressed baseline (dense allreduce in float32 or wider)."""
from __future__ import annotations

import torch

from .base import Compressor, ErrorBound, cast_saturating
from .registry import register

_HALF = (torch.float16, torch.bfloat16)


@register("none")
class NoneCompressor(Compressor):
    """Sends the gradient as it is; Horovod allreduce averages it.

    Payload: one tensor of ``numel`` elements: the gradient itself for float32 / float64
    gradients; float16 and bfloat16 gradients travel as float32 (4 bytes per element). Horovod's
    float16 allreduce sums in float16, so N ranks of a float16 gradient overflow to inf once
    N·|g| > 65504 (N = 64: |g| > 1023) and lose values below 2^-24 at the 1/N step; Horovod
    0.28 has no bfloat16 allreduce at all. In float32 the mean is exact to (N + 1)·2^-24 relative
    (then rounded to the gradient's dtype, saturating at its largest finite value).
    """

    name = "none"
    payload_is_gradient = True  # float32/float64 gradients travel as they are

    @property
    def error_bound(self):
        """Exact: C(v) = v (see :class:`hvdcomp.compressors.base.ErrorBound`)."""
        return ErrorBound("exact", "C(v) = v")

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        if flat.dtype in _HALF:
            flat = flat.to(torch.float32)
        return [flat], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        shape, dtype = ctx
        return cast_saturating(payload[0].reshape(shape), dtype)
