"""``bf16``: bfloat16 transport (8-bit exponent: no overflow, 8-bit mantissa)."""
from __future__ import annotations

import torch

from .base import Compressor, ErrorBound, PayloadKind
from .registry import register


@register("bf16")
class BF16Compressor(Compressor):
    """Cast to bfloat16 for the wire.

    bfloat16 has fp32's range, so no pre-division is needed, but Horovod 0.28's PyTorch
    allreduce has no bfloat16 support: the payload goes through the allgather path (raw bytes) and
    the mean is taken in fp32 after decoding. 2 bytes per element sent, ``N·2`` received.

    Payload: one bfloat16 tensor of ``numel`` elements.
    """

    name = "bf16"
    payload_kind = PayloadKind.GATHERED
    aggregate_is_mean = True
    elementwise = True  # a cast: a bucket of gradients is cast as one tensor

    def _encode(self, tensor, name=None):
        return [tensor.reshape(-1).to(torch.bfloat16)], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].to(torch.float32).reshape(shape).to(dtype)

    def aggregate(self, payloads, ctx):
        shape, dtype = ctx
        stacked = torch.stack([p[0].to(torch.float32) for p in payloads])
        return stacked.mean(0).reshape(shape).to(dtype)

    @property
    def error_bound(self):
        """Round to nearest bfloat16: relative error ≤ 2⁻⁸ per entry, so δ = 1 − 2⁻¹⁶."""
        return ErrorBound("contraction", "rounding to bfloat16 (relative error ≤ 2⁻⁸): δ = 1 − 2⁻¹⁶",
                          delta=lambda n: 1.0 - 2.0**-16)

    def nominal_ratio(self, numel):
        return 2.0
