"""``signsgd``: signSGD with majority vote.

Bernstein, Wang, Azizzadenesheli and Anandkumar, "signSGD: Compressed Optimisation for
Non-Convex Problems", ICML 2018; Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD with
Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019.

Each rank sends sign(g) ∈ {−1, +1} (sign(0) = +1); the aggregate is sign(Σ_ranks sign(g_r)), again
with sign(0) = +1 — the elementwise majority, ties going to +1. The optimizer then steps by
``lr · vote``.
"""
from __future__ import annotations

import torch

from .base import Compressor
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register


def _sign(x: torch.Tensor) -> torch.Tensor:
    """+1 where x >= 0, else -1 (float32)."""
    return torch.where(x >= 0, 1.0, -1.0).to(torch.float32)


@register("signsgd")
class SignSGDCompressor(Compressor):
    """Majority-vote signSGD.

    Args:
        vote: ``"allreduce"``: votes ±1 summed by Horovod allreduce in int32 (Horovod 0.28's
            smallest integer allreduce type, so 4 bytes per element travel); ``"allgather"``:
            signs packed at 1 bit per element, gathered, and summed locally (n/8 bytes sent,
            N·n/8 received). Both give the same result.

    Raises:
        ValueError: unknown ``vote``.
    """

    name = "signsgd"
    # aggregate_is_mean stays False: a majority vote, not a mean of decodes

    def __init__(self, vote: str = "allreduce"):
        if vote not in ("allreduce", "allgather"):
            raise ValueError(f"vote must be 'allreduce' or 'allgather', got {vote!r}")
        self.vote = vote
        self.summable = vote == "allreduce"
        self.allreduce_op = "sum"

    def describe(self):
        return {"name": self.name, "vote": self.vote}

    def nominal_ratio(self, numel):
        return 32.0

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        if self.summable:
            return [torch.where(flat >= 0, 1, -1).to(torch.int32)], (tensor.shape, tensor.dtype)
        return [pack_bits((flat >= 0).to(torch.int32), 1)], (tensor.shape, tensor.dtype)

    def _votes(self, payload, ctx):
        shape, _ = ctx
        if self.summable:
            return payload[0]
        return unpack_bits(payload[0], 1, torch.Size(shape).numel()) * 2 - 1

    def decode(self, payload, ctx):
        """Sign of the vote(s) in ``payload`` (the summed votes after an allreduce)."""
        shape, dtype = ctx
        return _sign(self._votes(payload, ctx)).reshape(shape).to(dtype)

    def aggregate(self, payloads, ctx):
        shape, dtype = ctx
        total = sum(self._votes(p, ctx) for p in payloads)
        return _sign(total).reshape(shape).to(dtype)


@register("efsignsgd")
class ScaledSignCompressor(Compressor):
    """EF-signSGD: ``(‖p‖₁/n)·sign(p)`` with error feedback (on by default).

    Karimireddy, Rebjock, Stich and Jaggi, "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML 2019.

    Payload: ``[scale (1,) float32, signs (ceil(n/8),) uint8]`` (1 bit per element,
    sign(0) = +1). The scale differs per rank, so payloads are gathered and the decoded
    ``scale_r·sign_r`` averaged.
    """

    name = "efsignsgd"
    summable = False
    aggregate_is_mean = True
    default_error_feedback = True

    def nominal_ratio(self, numel):
        return 4 * numel / (4 + packed_nbytes(numel, 1))

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1).to(torch.float32)
        # mean |p| in float64: the fp32 sum of large values can overflow although the mean cannot
        scale = (flat.abs().to(torch.float64).sum() / max(1, flat.numel())).to(torch.float32).reshape(1)
        return [scale, pack_bits((flat >= 0).to(torch.int32), 1)], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        scale, packed = payload
        shape, dtype = ctx
        n = torch.Size(shape).numel()
        return (scale * (unpack_bits(packed, 1, n) * 2 - 1).to(torch.float32)).reshape(shape).to(dtype)
