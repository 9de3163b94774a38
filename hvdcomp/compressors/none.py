"""``none``: the uncompressed baseline (dense fp32 allreduce)."""
from __future__ import annotations


from .base import Compressor
from .registry import register


@register("none")
class NoneCompressor(Compressor):
    """Sends the gradient as it is; Horovod allreduce averages it.

    Payload: one tensor, same dtype and number of elements as the gradient
    (4 bytes per element for fp32).
    """

    name = "none"
    summable = True

    def _encode(self, tensor, name=None):
        return [tensor.reshape(-1)], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].reshape(shape).to(dtype)
