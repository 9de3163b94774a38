"""``fp16``: half-precision transport with division by the world size before the cast."""
from __future__ import annotations

import torch

from .base import Compressor
from .registry import register


@register("fp16")
class FP16Compressor(Compressor):
    """Cast to float16 for the wire, after dividing by the world size N in float32.

    A sum of N fp16 values overflows at 65504 even when the mean does not; dividing by N first
    keeps the allreduce in range (two ranks of ``[40000.]`` average to exactly ``40000.0``).
    :meth:`decode` multiplies by N again, so it is linear in the payload and
    ``decode(average of payloads)`` is the averaged gradient, both under hvdcomp and under stock
    ``hvd.DistributedOptimizer(compression=FP16Compressor())`` (Horovod's default ``op=Average``).

    Payload: one float16 tensor of ``numel`` elements (2 bytes each). Values beyond
    N·65504 in magnitude saturate at ±N·65504 instead of becoming ±inf (NaN stays NaN).
    """

    name = "fp16"
    summable = True
    wire_prescaled = True
    wire_dtype = torch.float16

    def _encode(self, tensor, name=None):
        n = self.group_size()
        limit = torch.finfo(self.wire_dtype).max
        wire = tensor.reshape(-1).to(torch.float32).div(n).clamp(-limit, limit).to(self.wire_dtype)
        return [wire], (tensor.shape, tensor.dtype, n)

    def decode(self, payload, ctx):
        shape, dtype, n = ctx
        return payload[0].to(torch.float32).mul_(n).reshape(shape).to(dtype)

    def nominal_ratio(self, numel):
        return 2.0
